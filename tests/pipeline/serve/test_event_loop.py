"""A long `messages` list against a real `python -m pipeline serve` process (issue 41, item 2):
32,000 messages (a 1.2 MB body) took 41.7 s to parse on the event loop, and `/health` waited as
long. The body is decoded and parsed off the loop, the parse is linear and the list is capped, so
it is refused at once while /health keeps answering. (In-process: tests/pipeline/serve/test_limits.py
::TestMessages, where a parse made slow must not hold /health either.)"""
from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

from pipeline.serve.limits import MAX_MESSAGES

from serve_client import chat_body
from serve_process import ServeProcess, request

JSON = {"Content-Type": "application/json"}


def long_chat(url: str, n: int) -> bytes:
    """n different messages, the video in the first, follow-up questions after it (~35 bytes each)."""
    first = chat_body(url, "what is this?")["messages"]
    history = [{"role": "assistant" if k % 2 else "user", "content": str(k)} for k in range(1, n - 1)]
    body = {"model": "tiny-random", "messages": first + history + [{"role": "user", "content": "what moves?"}]}
    return json.dumps(body, separators=(",", ":")).encode()


def test_32000_messages_to_a_real_server_leave_health_answering(tmp_path, videos):
    """The issue's request (32,000 messages, a 1.2 MB body) against the command itself: a 400 at once,
    /health answered in well under a second throughout."""
    with ServeProcess(tmp_path, "--max-upload-mb", "2", "--allow-dir", str(videos.allowed)) as proc:
        body = long_chat(videos.small.as_uri(), 32_000)
        assert len(body) > 1_000_000
        health: list[float] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set() or len(health) < 3:
                start = time.perf_counter()
                try:
                    answered = request(proc, "GET", "/health", key=None, timeout=30)[0] == 200
                except OSError:
                    answered = False
                health.append(time.perf_counter() - start if answered else float("inf"))
                time.sleep(0.05)
        poller = threading.Thread(target=poll)
        poller.start()
        start = time.perf_counter()
        try:
            status, reply, _ = request(proc, "POST", "/v1/chat/completions", raw=body, headers=JSON, timeout=60)
        finally:
            elapsed = time.perf_counter() - start
            done.set()
            poller.join(60)
    assert len(health) >= 3 and max(health) < 1.0, health
    assert status == 400 and reply["error"]["code"] == "too_many_messages", reply
    assert f"at most {MAX_MESSAGES}" in reply["error"]["message"] and elapsed < 5.0, elapsed
