"""Loopback stream servers for the live tests (imported by tests/sources and tests/pipeline).

`RTSPServer` runs tests/live/rtsp_server.py under the system Python, which has GStreamer's
bindings (see that file); `rtsp_or_skip` skips a test with the reason when they are missing.
"""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("rtsp_server.py")
SYSTEM_PYTHON = "/usr/bin/python3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RTSPServer:
    """A GStreamer RTSP server on 127.0.0.1 serving a moving ball as H.264 at `fps`."""

    def __init__(self, *, mounts: tuple[str, ...] = ("cam",), size: str = "160x120", fps: int = 20,
                 port: int | None = None) -> None:
        self.mounts, self.size, self.fps = mounts, size, fps
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.ready_at = 0.0

    def url(self, mount: str | None = None) -> str:
        return f"rtsp://127.0.0.1:{self.port}/{mount or self.mounts[0]}"

    def start(self, timeout_s: float = 15.0) -> "RTSPServer":
        """Start and wait until it listens; RuntimeError naming the reason if it cannot."""
        if not Path(SYSTEM_PYTHON).exists():
            raise RuntimeError(f"{SYSTEM_PYTHON} not found")
        cmd = [SYSTEM_PYTHON, str(SCRIPT), "--port", str(self.port), "--size", self.size, "--fps", str(self.fps)]
        for mount in self.mounts:
            cmd += ["--mount", mount]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(self.proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(line.startswith("READY") for line in lines) >= len(self.mounts):
                self.ready_at = time.monotonic()
                return self
            if self.proc.poll() is not None:
                reader.join(1.0)
                err = self.proc.stderr.read().strip().splitlines()
                why = (lines + err)[-1] if lines + err else f"exit code {self.proc.returncode}"
                raise RuntimeError(f"RTSP server did not start: {why.strip()}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"RTSP server did not start within {timeout_s} s")

    def kill(self) -> None:
        """Die abruptly, as a crashed camera or server does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "RTSPServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rtsp_or_skip(**kwargs) -> RTSPServer:
    """A started server, or skip the test saying why (CI installs GStreamer: see .ci/run)."""
    try:
        return RTSPServer(**kwargs).start()
    except RuntimeError as e:
        pytest.skip(f"needs GStreamer's RTSP server (python3-gi, gir1.2-gst-rtsp-server-1.0, "
                    f"gstreamer1.0-plugins-ugly): {e}")


class SilentServer:
    """Accepts TCP connections and never answers: a stream that hangs while opening."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def __enter__(self) -> "SilentServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


class HTTPTSServer:
    """http://127.0.0.1:PORT/<name>.ts: an H.264 clip (a moving square, a keyframe every second)
    as one endless MPEG-TS stream per client, each packet sent at its frame's time, looped.
    In-process and GStreamer-free (PyAV encodes and remuxes), for tests that need a network stream
    on any machine."""

    def __init__(self, tmp: Path, *, size: tuple[int, int] = (160, 120), fps: int = 30, seconds: float = 2.0) -> None:
        import av
        import numpy as np
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        w, h = size
        clip = Path(tmp) / "clip.ts"
        with av.open(str(clip), "w", format="mpegts") as out:
            stream = out.add_stream("libx264", rate=fps, options={"preset": "veryfast", "g": str(fps), "bf": "0"})
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            for t in range(int(seconds * fps)):
                img = np.zeros((h, w, 3), np.uint8)
                x = (t * 3) % (w - 16)
                img[h // 3:h // 3 + 16, x:x + 16] = (255, 40, 40)
                for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode(None):
                out.mux(packet)
        self.stopping = threading.Event()
        stopping = self.stopping

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Type", "video/mp2t")
                self.end_headers()
                try:
                    _serve_paced(clip, self.wfile, stopping)
                except (OSError, av.FFmpegError):
                    pass   # the client went away

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, name: str = "cam") -> str:
        return f"http://127.0.0.1:{self.port}/{name}.ts"

    def __enter__(self) -> "HTTPTSServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _serve_paced(clip: Path, wfile, stopping: threading.Event) -> None:
    import av

    src = av.open(str(clip))          # open while serving: its stream is the output's template
    ins = src.streams.video[0]
    packets = [p for p in src.demux(ins) if p.dts is not None]
    first, tb = packets[0].pts, float(ins.time_base)
    period = round((packets[-1].pts - first) / max(1, len(packets) - 1) * len(packets))
    out = av.open(wfile, "w", format="mpegts", options={"flush_packets": "1"})
    try:
        ost = out.add_stream_from_template(ins)
        start, loop = time.monotonic(), 0
        while not stopping.is_set():
            for p in packets:
                delay = start + (p.pts - first + loop * period) * tb - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pkt = av.Packet(bytes(p))
                pkt.pts, pkt.dts = p.pts + loop * period, p.dts + loop * period
                pkt.time_base, pkt.stream, pkt.is_keyframe = ins.time_base, ost, p.is_keyframe
                out.mux(pkt)
                if stopping.is_set():
                    return
            loop += 1
    finally:
        try:
            out.close()
        except (OSError, av.FFmpegError):
            pass
        src.close()
