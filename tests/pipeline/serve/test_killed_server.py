"""A serve process killed (kill -9) while it fetches a video leaves the half-written file in
`<store>.uploads/tmp`; the next server on that store clears it at start (issue 41, item 11: they
used to stay there for good). The kill is a real process's, mid-fetch from an upstream that drips a
byte at a time; the next server's start is its Media (what `serve` builds first, before the model),
in this process: a second real server on a store is tests/pipeline/serve/test_retention.py's."""
from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

from pipeline.serve.media import Media
from pipeline.serve.options import ServeOptions

from serve_client import chat_body
from serve_process import ServeProcess, media_server

FLAGS = ("--allow-media-host", "drip.test", "--media-resolve", "drip.test=127.0.0.1")


def partial_fetches(proc: ServeProcess) -> list:
    return sorted((proc.uploads / "tmp").glob("fetch-*"))


def test_a_fetch_cut_by_kill_9_is_cleared_by_the_next_server(tmp_path, videos):
    media = media_server(videos.allowed)
    try:
        body = json.dumps(chat_body(f"http://drip.test:{media.server_address[1]}/drip")).encode()
        with ServeProcess(tmp_path, *FLAGS) as first, socket.create_connection(("127.0.0.1", first.port)) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           + f"Authorization: Bearer {first.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                           + body)
            deadline = time.monotonic() + 30
            while not (partial_fetches(first) and media.handler.drips) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)                                # the fetch is writing its file, a byte at a time
            first.proc.kill()
            first.proc.wait(30)
            left = partial_fetches(first)
        assert first.proc.returncode == -9
        assert len(left) == 1, left                        # what the kill left behind
        media_of_the_next = Media(ServeOptions(store=str(first.store)))
        try:
            assert media_of_the_next.uploads == first.uploads and partial_fetches(first) == []
        finally:
            media_of_the_next.owner.close()
    finally:
        media.shutdown()
