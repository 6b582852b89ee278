"""`live http://user:password@host/...`: the credentials in the URL reach a camera that asks for them
(HTTP Basic, after its 401 challenge), and nothing the run writes or prints holds the password
(issue 41, item 11: credentials in URLs used; serve's fetches: tests/pipeline/serve/test_fetch_policy.py)."""
from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from benchmarks.loopback import encode_clip, serve_ts
from pipeline.commands.cli import main
from sinks import read_stream, validate_store
from sources.live import parse_source

PASSWORD = "s3cret-Pa55"


class BasicAuthCamera:
    """A loopback HTTP MPEG-TS camera behind Basic auth (user:PASSWORD): a 401 with its challenge
    until a request carries them; `authorizations` holds each request's Authorization header."""

    def __init__(self, tmp: Path) -> None:
        clip, stop, seen = encode_clip(tmp / "cam.ts", 160, 120, 25, 1.0), threading.Event(), []
        expected = "Basic " + base64.b64encode(f"user:{PASSWORD}".encode()).decode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                seen.append(self.headers.get("Authorization"))
                if seen[-1] != expected:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="camera"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "video/mp2t")
                self.end_headers()
                try:
                    serve_ts(clip, self.wfile, stop)
                except OSError:
                    pass                     # the client went away

            def log_message(self, *args: object) -> None:
                pass

        self.stop, self.authorizations = stop, seen
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, password: str = PASSWORD) -> str:
        return f"http://user:{password}@127.0.0.1:{self.httpd.server_address[1]}/cam.ts"

    def __enter__(self) -> "BasicAuthCamera":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def live(url: str, store: Path, capsys) -> tuple[int, str]:
    code = main(["live", url, "--query", "q", "--duration", "2", "--vlm", "none", "--device", "cpu", "--timeout", "3",
                 "--max-reconnects", "1", "--out", str(store), "--set", "runtime.model_weights=none"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def store_bytes(store: Path) -> bytes:
    return b"".join(f.read_bytes() for f in sorted(store.rglob("*")) if f.is_file())


def test_the_urls_credentials_reach_the_camera_and_nowhere_else(tmp_path, capsys):
    store = tmp_path / "o.zarr"
    with BasicAuthCamera(tmp_path) as camera:
        code, said = live(camera.url(), store, capsys)
        authorizations = list(camera.authorizations)
    assert code == 0, said
    assert authorizations[0] is None and authorizations[-1] is not None     # challenged, then answered
    data = read_stream(store, parse_source(camera.url()).stream_id)
    assert validate_store(store) == [] and len(data["pts"]) > 10
    assert data["attrs"]["source"] == camera.url().replace(PASSWORD, "***")
    assert PASSWORD not in said and PASSWORD.encode() not in store_bytes(store)


def test_wrong_credentials_are_one_line_without_the_password(tmp_path, capsys):
    with BasicAuthCamera(tmp_path) as camera:
        code, said = live(camera.url("wrong-Pa55"), tmp_path / "o.zarr", capsys)
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and "401" in errors[0], said
    assert "wrong-Pa55" not in said and "user:***@" in errors[0]
