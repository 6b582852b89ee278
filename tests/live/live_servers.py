"""Loopback stream servers for the live tests (imported by tests/sources and tests/pipeline).

`RTSPServer` runs tests/live/rtsp_server.py under the system Python, which has GStreamer's
bindings (see that file); `rtsp_or_skip` skips a test with the reason when they are missing.
`http_ts_server` serves an HTTP MPEG-TS stream from this process (benchmarks/loopback.py), on any
machine; `FlappingServer`, one that opens and fails at its first read, every time.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: benchmarks/
from benchmarks.loopback import TSServer, encode_clip  # noqa: E402

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


def http_ts_server(tmp: Path, *, size: tuple[int, int] = (160, 120), fps: int = 30,
                   seconds: float = 2.0) -> TSServer:
    """A started loopback HTTP MPEG-TS server (benchmarks/loopback.py: bench_live's cameras) of a
    clip encoded into `tmp`: a network stream on any machine, GStreamer-free; a context manager."""
    return TSServer(encode_clip(Path(tmp) / "clip.ts", *size, fps, seconds))


class FlappingServer(TSServer):
    """An HTTP MPEG-TS server whose stream opens and then fails at its first read: every GET gets the
    head of a clip, enough for FFmpeg to open the stream (codec, size) but not to decode a frame,
    and then the connection closes. `gets` holds each request's time (time.monotonic()), a context
    manager. The head's length is found by trying (`_calibrate`): what FFmpeg needs depends on its
    version, and a head that opens nothing, or that holds a frame, would test something else."""

    def __init__(self, tmp: Path) -> None:
        self.head = b""
        self.gets: list[float] = []
        super().__init__(encode_clip(Path(tmp) / "flap.ts", 160, 120, 30, 1.0))
        self._calibrate(self.clip.read_bytes())
        self.gets.clear()

    def send(self, wfile) -> None:
        self.gets.append(time.monotonic())
        wfile.write(self.head)

    def url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.port}/flapping.ts"

    def _calibrate(self, clip: bytes) -> None:
        from sources.live import LiveConfig, parse_source
        from sources.live_connections import Lost, NetworkConnection, OpenError, Stalled

        config = LiveConfig(open_timeout_s=2.0, read_timeout_s=2.0)
        for packets in range(4, 200):                       # MPEG-TS packets are 188 bytes
            self.head = clip[:188 * packets]
            try:
                conn = NetworkConnection(parse_source(self.url()), config, None)
            except OpenError:
                continue
            try:
                frames = sum(1 for _ in conn.frames())
            except (Lost, Stalled):
                frames = 0
            else:
                frames = -1                                 # frames() ends only by raising
            finally:
                conn.close()
            if frames == 0:
                return
            break
        raise RuntimeError("no head of the clip opens without a frame in it")
