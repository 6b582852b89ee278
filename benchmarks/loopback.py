"""Loopback MPEG-TS streams over HTTP: an H.264 clip served to each client as one endless live
stream, every packet sent at its frame's time, looped (bench_live's cameras, and the live tests'
network streams on any machine: PyAV encodes and remuxes, no GStreamer).

Why not RTSP: the GPU machine has no GStreamer, and HTTP/MPEG-TS goes through exactly the same
client path as an RTSP camera (PyAV demux -> decode -> the capture thread's latest-frame buffer);
only the session protocol differs. Each client gets its own connection and its own paced copy.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self

import av
import numpy as np


def encode_clip(path: Path, width: int, height: int, fps: int, seconds: float) -> Path:
    """A moving textured scene with a bright square, H.264 in MPEG-TS, a keyframe every second."""
    rng = np.random.default_rng(0)
    tex = rng.integers(0, 255, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    tex = np.repeat(np.repeat(tex, 8, 0), 8, 1)[:height, :width]             # (H, W, 3)
    with av.open(str(path), "w", format="mpegts") as out:
        stream = out.add_stream("libx264", rate=fps, options={"preset": "veryfast", "tune": "zerolatency",
                                                              "g": str(fps), "bf": "0"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(int(seconds * fps)):
            img = np.roll(tex, 3 * t, axis=1).copy()                          # a slow pan
            y, x = (height // 3 + int(height / 4 * np.sin(t / 15))), (t * 11) % (width - 64)
            img[y:y + 64, x:x + 64] = (255, 40, 40)                           # a moving object
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def serve_ts(clip: Path, wfile, stop: threading.Event) -> None:
    """Send the clip as one endless MPEG-TS stream, paced at its frame rate, looping."""
    src = av.open(str(clip))
    ins = src.streams.video[0]
    out = av.open(wfile, "w", format="mpegts", options={"flush_packets": "1"})
    ost = out.add_stream_from_template(ins)
    tb = float(ins.time_base)
    packets = [p for p in src.demux(ins) if p.dts is not None]
    first = packets[0].pts
    loop_ticks = round((packets[-1].pts - first) / max(1, len(packets) - 1) * len(packets))
    start, loop = time.monotonic(), 0
    try:
        while not stop.is_set():
            for p in packets:
                due = start + (p.pts - first + loop * loop_ticks) * tb
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pkt = av.Packet(bytes(p))
                pkt.pts, pkt.dts = p.pts + loop * loop_ticks, p.dts + loop * loop_ticks
                pkt.time_base, pkt.stream, pkt.is_keyframe = ins.time_base, ost, p.is_keyframe
                out.mux(pkt)
                if stop.is_set():
                    break
            loop += 1
    finally:
        src.close()
        try:
            out.close()
        except (OSError, av.FFmpegError):
            pass


class LoopbackServer:
    """A server of the clip on a loopback port: its streams' URLs, close(), and a `with` block."""

    port: int

    def url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.port}/stream{i}.ts"

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TSServer(LoopbackServer):
    """http://127.0.0.1:PORT/<anything>.ts -> the clip, live. One thread per client; `send` is what
    each one gets (a subclass may send something else: tests/live/live_servers.py)."""

    def __init__(self, clip: Path) -> None:
        self.clip = clip
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Type", "video/mp2t")
                self.end_headers()
                try:
                    server.send(self.wfile)
                except (BrokenPipeError, ConnectionResetError, av.FFmpegError, OSError):
                    pass  # the client went away

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def send(self, wfile) -> None:
        serve_ts(self.clip, wfile, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class TSServerProcess(LoopbackServer):
    """TSServer in a process of its own (`python -m benchmarks.loopback CLIP`), as cameras are: its paced
    senders (Python work at every packet of every client) do not share the measured process's
    interpreter lock. The child serves until its stdin closes, so it ends with this process."""

    def __init__(self, clip: Path, start_timeout_s: float = 60.0) -> None:
        root = Path(__file__).resolve().parents[1]
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.loopback", str(clip)], cwd=root,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self._proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout_s)
        line = ready[0].strip() if ready else ""
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"the loopback server process did not start (said {line!r})")
        self.port = int(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()          # the child's cue to stop
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()


def _serve_until_stdin_closes(clip: Path) -> None:
    with TSServer(clip) as server:
        print(server.port, flush=True)
        sys.stdin.read()                          # EOF: the parent closed it or ended


if __name__ == "__main__":
    _serve_until_stdin_closes(Path(sys.argv[1]))
