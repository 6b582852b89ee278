"""A text file served over HTTP is not a live video either (issue 41, item 11: a 30-byte text file was
taken for "CD Graphics" video and answered; files and uploads are refused by sources/video_probe.py).
FFmpeg picks its CD Graphics or ANSI-art demuxer by the URL's name, so `live http://host/notes.cdg`
played a text file as frames, reconnecting at each end; it is one line and exit 2 now."""
from __future__ import annotations

import functools
import http.server
import threading

import pytest

from pipeline.commands.cli import main
from sources import SourceError
from sources.live import LiveConfig, open_live


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_files")
    (root / "notes.cdg").write_bytes(b"I" * 29 + b"\n")                 # FFmpeg: CD Graphics
    (root / "notes.nfo").write_bytes(b"not a video, just thirty bytes")   # FFmpeg: ANSI art
    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda self, *args: None})
    handler = functools.partial(quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("name", ["notes.cdg", "notes.nfo"])
def test_a_text_file_over_http_is_not_a_live_video(text_server, name):
    with pytest.raises(SourceError, match="not a video, FFmpeg would draw it as"):
        open_live(f"{text_server}/{name}", config=LiveConfig(open_timeout_s=3.0, read_timeout_s=3.0))


def test_live_says_so_in_one_line(text_server, capsys, tmp_path):
    code = main(["live", f"{text_server}/notes.cdg", "--query", "q", "--vlm", "none", "--device", "cpu",
                 "--duration", "3", "--timeout", "2", "--out", str(tmp_path / "o.zarr")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not a video" in err[0] and "CD Graphics" in err[0], err
    assert not (tmp_path / "o.zarr").exists()
