"""`python -m pipeline serve` as a real process on a loopback port (uvicorn, the CLI's flags), and the
loopback servers the exposure tests point it at: a listener that records every connection made to
it, a media server (files, redirects, Basic auth), and an upstream that drips a byte at a time."""
from __future__ import annotations

import base64
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "live"))
from live_servers import free_port  # noqa: E402
from serve_client import exchange  # noqa: E402


class ServeProcess:
    """The serve command in a subprocess: `url` once /health answers; stop() sends SIGTERM."""

    def __init__(self, tmp: Path, *flags: str, api_key: str = "test-key") -> None:
        self.port, self.api_key, self.tmp = free_port(), api_key, tmp
        self.store = tmp / "serve.zarr"
        self.uploads = tmp / "serve.zarr.uploads"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("ARRCOC_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "serve", "--vlm", "tiny-random", "--device", "cpu", "--port",
             str(self.port), "--out", str(self.store), "--api-key", api_key, "--set", "runtime.model_weights=none",
             "--set", "vlm.max_new_tokens=4", *flags],
            cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServeProcess":
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start: {self.err}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, self.err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.err = self.proc.communicate()


class Recorder:
    """Listens on 127.0.0.1 and ::1 and records every connection anyone makes to it: a fetch the
    policy refused must leave it empty."""

    def __init__(self) -> None:
        self.connections: list[tuple[str, float]] = []
        self._sockets = []
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            s = socket.socket(family)
            s.bind((host, 0))
            s.listen(16)
            self._sockets.append(s)
            threading.Thread(target=self._accept, args=(s, host), daemon=True).start()
        self.port4 = self._sockets[0].getsockname()[1]
        self.port6 = self._sockets[1].getsockname()[1]

    def _accept(self, s: socket.socket, host: str) -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            self.connections.append((host, time.time()))
            conn.close()

    def close(self) -> None:
        for s in self._sockets:
            s.close()


class MediaHandler(http.server.SimpleHTTPRequestHandler):
    """Files of `directory`, plus /redirect?to=URL (302), /loop (redirects to itself), /auth/NAME
    (NAME behind Basic auth user:pw), /drip (a byte at a time; `drips` records each connection's
    start and when its client went away)."""

    drips: list[dict[str, float]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path, _, query = self.path.partition("?")
        if path == "/redirect":
            return self._redirect(query.removeprefix("to="))
        if path == "/loop":
            return self._redirect("/loop")
        if path.startswith("/auth/"):
            expected = "Basic " + base64.b64encode(b"user:pw").decode()
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.path = path.removeprefix("/auth")
        if path == "/drip":
            return self._drip()
        return super().do_GET()

    def _redirect(self, to: str) -> None:
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _drip(self) -> None:
        record = {"start": time.time(), "gone": 0.0}
        self.drips.append(record)
        self.send_response(200)
        self.send_header("Content-Type", "video/mp4")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(1000):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.25)
        except OSError:
            record["gone"] = time.time()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module", name="media")   # named apart from the tests' `media` parameter
def media_fixture(videos):
    """A media server of the test videos (MediaHandler) on a loopback port, for one test module."""
    server = media_server(videos.allowed)
    yield server
    server.shutdown()


def media_server(directory: Path) -> http.server.ThreadingHTTPServer:
    handler = type("Handler", (MediaHandler,), {"drips": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(directory)))
    server.daemon_threads = True
    server.handler = handler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def request(proc: ServeProcess, method: str, path: str, body: Any = None, *, key: str | None = "",
            **kwargs: Any) -> tuple[int, Any, Any]:
    """(status, JSON body, headers) of one request to the serve process (errors come back); key ""
    is the process' own."""
    return exchange(proc, method, path, body, key=proc.api_key if key == "" else key, **kwargs)
