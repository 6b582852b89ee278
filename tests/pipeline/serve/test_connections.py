"""Slowloris against a real `python -m pipeline serve` process: connections that send their request
head a byte at a time are closed after --header-timeout-s, and past the connection cap the oldest of
them make room, so legitimate requests keep being answered (issue 41, item 5)."""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402

OPEN_FILES = 128       # the server's open-file limit: slowloris would exhaust it (connection cap 64)
ATTACKERS = 200


def limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("slowloris")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ARRCOC_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--vlm", "tiny-random", "--device", "cpu",
                             "--port", str(port), "--out", str(tmp_path / "serve.zarr"), "--header-timeout-s", "2",
                             "--set", "runtime.model_weights=none"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit_open_files)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail(f"the server did not start: {proc.communicate()[1][-2000:]}")
    yield proc, port, url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


class Slowloris:
    """ATTACKERS connections that each send a request head one header line a second and never end
    it; any the server closes are opened again (an attacker that keeps trying)."""

    def __init__(self, port: int) -> None:
        self.port, self.socks, self.stop, self.opened = port, [], threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            sock.setblocking(False)
            self.opened += 1
            return sock
        except OSError:
            return None

    def run(self) -> None:
        self.socks = [s for s in (self.connect() for _ in range(ATTACKERS)) if s is not None]
        while not self.stop.wait(1.0):
            alive = []
            for sock in self.socks:
                try:
                    sock.send(b"X-Slow: a\r\n")
                    alive.append(sock)
                except OSError:
                    sock.close()
            alive += [s for s in (self.connect() for _ in range(ATTACKERS - len(alive))) if s is not None]
            self.socks = alive

    def __enter__(self) -> "Slowloris":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        for sock in self.socks:
            sock.close()


def server_sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:                         # closed since the listing (a slow head let go)
            pass
    return count


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts the server's sockets in /proc")
def test_legitimate_requests_are_answered_through_a_slowloris_flood(serve):
    proc, port, url = serve
    latencies, failures, most_sockets = [], [], 0
    with Slowloris(port) as attack:
        time.sleep(2.0)                                   # the flood is on: the heads are all open
        end = time.monotonic() + 8.0                      # past two header timeouts
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    assert json.loads(response.read())["status"] == "ok"
                latencies.append(time.perf_counter() - start)
            except OSError as e:
                failures.append(repr(e))
            most_sockets = max(most_sockets, server_sockets(proc.pid))
            time.sleep(0.2)
        opened = attack.opened
    assert not failures, failures[:3]
    assert len(latencies) >= 20 and max(latencies) < 2.0, latencies
    assert opened > ATTACKERS                             # the server closed slow heads, the attacker came back
    assert most_sockets <= OPEN_FILES // 2 + 8            # the cap (half the open files) and a few of its own


def test_a_slow_head_is_closed_after_the_header_timeout(serve):
    _, port, _ = serve
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        while True:                                       # a header line a second, never the blank line
            sock.settimeout(1.0)
            try:
                if sock.recv(1024) == b"":
                    break
            except TimeoutError:
                sock.sendall(b"X-Slow: a\r\n")
            except ConnectionResetError:
                break
            assert time.monotonic() - start < 10, "the slow head was never closed"
        assert 1.5 < time.monotonic() - start < 5.0
