"""`python -m pipeline serve`: the security defaults refuse before anything loads; the command serves
and stops cleanly on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.commands.cli import main
from pipeline.serve.options import ServeOptions, is_loopback, resolve_api_key

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402


class TestRefusals:
    @pytest.mark.parametrize("argv, words", [
        (["--host", "0.0.0.0"], "refusing to serve on 0.0.0.0 without an API key"),
        (["--host", "192.168.1.5"], "without an API key"),
        (["--vlm", "none"], "name a VLM with --vlm"),
        (["--allow-dir", "/no/such/dir"], "--allow-dir /no/such/dir: not a directory"),
        (["--overlay", "x.mp4"], "--overlay is not supported"),
        (["--port", "70000"], "--port=70000 is out of range"),
        (["--max-upload-mb", "0"], "--max-upload-mb=0.0 is out of range"),
        (["--api-key", "a", "--api-key", "a"], "each --api-key must be non-empty and different from the others"),
        (["--max-question-chars", "0"], "--max-question-chars=0 is out of range"),
        (["--header-timeout-s", "inf"], "--header-timeout-s=inf is out of range"),
    ])
    def test_one_line_and_exit_2(self, argv, words, capsys, monkeypatch, tmp_path):
        monkeypatch.delenv("ARRCOC_API_KEY", raising=False)
        vlm = [] if "--vlm" in argv else ["--vlm", "tiny-random"]
        assert main(["serve", *vlm, "--device", "cpu", "--out", str(tmp_path / "s.zarr"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err

    def test_other_addresses_with_a_key(self, monkeypatch):
        assert ServeOptions(host="0.0.0.0", api_key="k").api_key == "k"
        monkeypatch.setenv("ARRCOC_API_KEY", "from-env")
        assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
        assert ServeOptions(host="0.0.0.0", api_key=resolve_api_key(None)).host == "0.0.0.0"
        assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"))
        assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))


def test_a_taken_port_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("ARRCOC_API_KEY", raising=False)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["serve", "--vlm", "tiny-random", "--device", "cpu", "--port", str(port),
                     "--out", str(tmp_path / "s.zarr")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: cannot listen on http://127.0.0.1:{port}/: ") and "in use" in err[0]


@pytest.mark.parametrize("host, shown", [("127.0.0.1", "127.0.0.1"), ("[::1]", "[::1]")])
def test_the_command_serves_until_sigterm(tmp_path, host, shown):
    if host == "[::1]" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ARRCOC_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--vlm", "tiny-random", "--device", "cpu",
                             "--host", host, "--port", str(port), "--out", str(tmp_path / "serve.zarr"),
                             "--set", "runtime.model_weights=none"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, health = time.monotonic() + 60, None
        while health is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://{shown}:{port}/health", timeout=2) as r:
                    health = json.loads(r.read())
            except OSError:
                time.sleep(0.2)
        assert health == {"status": "ok", "model": "tiny-random", "device": "cpu", "live_streams": 0, "auth": False}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"on http://{shown}:{port}/" in err and err.rstrip().endswith("server stopped")

