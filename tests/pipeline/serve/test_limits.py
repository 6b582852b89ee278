"""What one request may ask of the server (issue 41): bounded message lists parsed off the event
loop, bounded questions, answer periods, videos only from --allow-dir, each API key's own files and
streams, 4xx for clients' mistakes, and what a damaged or fake video gets."""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

from pipeline.serve.limits import MAX_MESSAGES
from pipeline.serve.openai_api import parse_chat

from sources.synthetic import default_demo_clip, write_video

from serve_client import API_KEY, OTHER_KEY, call, chat_body

JSON = {"Content-Type": "application/json"}


def assert_error(status: int, body: dict, expected: int, *words: str) -> None:
    assert status == expected, (status, body)
    assert "\n" not in body["error"]["message"]
    for word in words:
        assert word in body["error"]["message"], (word, body["error"]["message"])


def raw_get(server, path: str, key: str = API_KEY) -> bytes:
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def long_chat(videos, n: int) -> dict:
    """n messages, each different, the video in the first: follow-up questions about it (the old
    parser looked each user message up with messages.index, comparing it with those before it)."""
    first = chat_body(videos.small.as_uri(), "what is this?")["messages"]
    history = [{"role": "assistant" if k % 2 else "user", "content": str(k)} for k in range(1, n - 1)]
    return {"model": "tiny-random", "messages": first + history + [{"role": "user", "content": "what moves?"}]}


class TestMessages:
    def test_a_long_list_is_refused_at_once_and_health_answers_meanwhile(self, server, videos):
        body = json.dumps(long_chat(videos, 32_000), separators=(",", ":")).encode()      # ~1.1 MB
        health: list[float] = []

        def poll() -> None:
            while len(health) < 5:
                start = time.perf_counter()
                assert call(server, "GET", "/health", key=None, timeout=30)[0] == 200
                health.append(time.perf_counter() - start)
                time.sleep(0.05)
        poller = threading.Thread(target=poll)
        start = time.perf_counter()
        poller.start()
        status, reply = call(server, "POST", "/v1/chat/completions", raw=body, headers=JSON, timeout=60)
        elapsed = time.perf_counter() - start
        poller.join(30)
        assert_error(status, reply, 400, "32000 messages", f"at most {MAX_MESSAGES}")
        assert elapsed < 5.0, elapsed
        assert max(health) < 1.0, health

    def test_the_body_is_decoded_and_parsed_off_the_event_loop(self, server, videos, monkeypatch):
        """Work that grows with the body (its JSON decode, the chat's parse) runs in threads: made
        to take 2 s each here, they hold one request while /health keeps answering at once (on the
        event loop they held every connection, as 32,000 messages did for 41.7 s)."""
        import pipeline.serve.app as app

        def slow(parse):
            def slowly(*args, **kwargs):
                time.sleep(2.0)
                return parse(*args, **kwargs)
            return slowly
        monkeypatch.setattr(app, "parse_json", slow(app.parse_json))
        monkeypatch.setattr(app, "parse_chat", slow(app.parse_chat))
        body = json.dumps(long_chat(videos, 2 * MAX_MESSAGES)).encode()
        done: list[tuple[int, dict]] = []
        asker = threading.Thread(target=lambda: done.append(
            call(server, "POST", "/v1/chat/completions", raw=body, headers=JSON, timeout=60)))
        health: list[float] = []
        start = time.perf_counter()
        asker.start()
        while asker.is_alive():
            begin = time.perf_counter()
            assert call(server, "GET", "/health", key=None, timeout=30)[0] == 200
            health.append(time.perf_counter() - begin)
            time.sleep(0.05)
        assert time.perf_counter() - start >= 4.0                  # both slow steps ran
        assert_error(*done[0], 400, f"{2 * MAX_MESSAGES} messages")
        assert len(health) >= 10 and max(health) < 1.0, health

    def test_parsing_is_linear_in_the_number_of_messages(self, server, videos, monkeypatch):
        monkeypatch.setattr("pipeline.serve.limits.MAX_MESSAGES", 100_000)
        body = long_chat(videos, 40_000)
        start = time.perf_counter()
        chat = parse_chat(body, "tiny-random", server.engine.cfg)
        assert time.perf_counter() - start < 1.0
        assert chat.question == "what moves?" and chat.video == videos.small.as_uri()

    def test_json_nested_50000_deep_is_a_400(self, server):
        raw = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        assert_error(*call(server, "POST", "/v1/chat/completions", raw=raw, headers=JSON), 400, "nested too deeply")
        raw = b'{"source": ' + b"[" * 25_000 + b"]" * 25_000 + b"}"          # within a stream body's size
        assert_error(*call(server, "POST", "/v1/streams", raw=raw, headers=JSON), 400, "nested too deeply")


class TestQuestions:
    def test_a_question_past_the_character_cap_is_413_before_anything_runs(self, server, videos):
        question = "why" * 33_334                                    # 100 kB
        start = time.perf_counter()
        status, reply = call(server, "POST", "/v1/chat/completions", chat_body(videos.small.as_uri(), question))
        assert_error(status, reply, 413, "100002 characters", "--max-question-chars")
        assert reply["error"]["code"] == "question_too_long" and time.perf_counter() - start < 5.0
        status, reply = call(server, "POST", "/v1/streams", {"source": videos.small.as_uri(), "question": "why" * 3000})
        assert_error(status, reply, 413, "9000 characters", "--max-question-chars")

    def test_a_question_past_the_models_context_is_400(self, server, videos, monkeypatch):
        engine = server.engine
        monkeypatch.setattr(engine, "options", replace(engine.options, max_question_chars=100_000))
        context = engine.service.context_length()
        assert context == 32768                                       # tiny-random's config
        question = "x" * (context + 1000)                            # tiny-random's tokens are bytes
        status, reply = call(server, "POST", "/v1/chat/completions", chat_body(videos.small.as_uri(), question))
        assert_error(status, reply, 400, "context of 32768 tokens")
        assert reply["error"]["code"] == "context_length_exceeded"
        status, reply = call(server, "POST", "/v1/chat/completions", chat_body(videos.small.as_uri(), "w1 " * 100))
        assert status == 200, reply


class TestAnswerPeriods:
    @pytest.mark.parametrize("every", ["1e-20", "NaN", "Infinity", "-Infinity", "1e308", "0.01", "true", "\"2\""])
    def test_a_stream_with_an_absurd_every_is_400_and_leaves_no_record(self, server, videos, every):
        before = call(server, "GET", "/v1/streams")[1]["data"]
        raw = f'{{"source": "{videos.small.as_uri()}", "question": "q", "every": {every}}}'.encode()
        status, reply = call(server, "POST", "/v1/streams", raw=raw, headers=JSON)
        assert_error(status, reply, 400, "every")
        assert reply["error"]["param"] == "every"
        assert call(server, "GET", "/v1/streams")[1]["data"] == before

    @pytest.mark.parametrize("duration", ["NaN", "Infinity", "1e308", "0"])
    def test_a_stream_with_an_absurd_duration_is_400(self, server, videos, duration):
        raw = f'{{"source": "{videos.small.as_uri()}", "question": "q", "duration": {duration}}}'.encode()
        assert_error(*call(server, "POST", "/v1/streams", raw=raw, headers=JSON), 400, "duration")

    @pytest.mark.parametrize("every", ["1e-20", "NaN", "1e308"])
    def test_a_chat_with_an_absurd_every_is_400(self, server, videos, every):
        body = json.dumps(chat_body(videos.small.as_uri()))[:-1] + f', "every": {every}}}'
        assert_error(*call(server, "POST", "/v1/chat/completions", raw=body.encode(), headers=JSON), 400, "every")


class TestAllowedVideos:
    def test_content_serves_videos_only(self, server, videos):
        secret = videos.allowed / ".env"
        secret.write_text("API_TOKEN=hunter2\n")
        fake = videos.allowed / "fake.mp4"
        fake.write_text("not a video at all\n" * 4)
        for path, status, words in ((secret, 403, "not a video file"), (videos.text, 403, "not a video file"),
                                    (fake, 400, "not a readable video")):
            got, reply = call(server, "GET", f"/v1/videos/content?url={path.as_uri()}")
            assert_error(got, reply, status, *words)
            assert "hunter2" not in json.dumps(reply)
        assert raw_get(server, f"/v1/videos/content?url={videos.small.as_uri()}") == videos.small.read_bytes()

    def test_the_listing_leaves_out_symlinks_that_lead_outside(self, server, videos):
        status, listing = call(server, "GET", "/v1/videos")
        names = {v["name"] for v in listing["data"]}
        assert status == 200 and "small.mp4" in names and "link.mp4" not in names
        assert (videos.allowed / "link.mp4").is_symlink()

    def test_a_nul_byte_in_a_file_url_is_400(self, server, videos):
        url = f"{videos.allowed.as_uri()}/small.mp4%00.txt"
        assert_error(*call(server, "POST", "/v1/chat/completions", chat_body(url)), 400, "NUL")
        assert_error(*call(server, "GET", f"/v1/videos/content?url={url.replace('%', '%25')}"), 400, "NUL")
        assert_error(*call(server, "POST", "/v1/streams", {"source": url, "question": "q"}), 400, "NUL")


def upload(server, path: Path, key: str) -> dict:
    boundary = "b0undary"
    raw = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path.name}\"\r\n"
           f"Content-Type: video/mp4\r\n\r\n").encode() + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    status, body = call(server, "POST", "/v1/files", raw=raw, key=key,
                        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, body
    return body


class TestKeys:
    def test_each_key_sees_only_its_own_uploads(self, server, videos):
        mine = upload(server, videos.small, API_KEY)["id"]
        theirs = upload(server, videos.small, OTHER_KEY)["id"]
        listed = {key: {f["id"] for f in call(server, "GET", "/v1/files", key=key)[1]["data"]}
                  for key in (API_KEY, OTHER_KEY)}
        assert mine in listed[API_KEY] and theirs not in listed[API_KEY]
        assert theirs in listed[OTHER_KEY] and mine not in listed[OTHER_KEY]
        for method, path in (("GET", f"/v1/files/{mine}"), ("GET", f"/v1/files/{mine}/content"),
                             ("DELETE", f"/v1/files/{mine}")):
            assert_error(*call(server, method, path, key=OTHER_KEY), 404, "no uploaded file")
        status, reply = call(server, "POST", "/v1/chat/completions", chat_body(mine), key=OTHER_KEY)
        assert_error(status, reply, 404, "no uploaded file")
        assert raw_get(server, f"/v1/files/{mine}/content") == videos.small.read_bytes()    # still its owner's
        assert call(server, "DELETE", f"/v1/files/{mine}")[0] == 200
        assert call(server, "DELETE", f"/v1/files/{theirs}", key=OTHER_KEY)[0] == 200

    def test_each_key_sees_only_its_own_streams(self, server, videos):
        status, stream = call(server, "POST", "/v1/streams", {"source": videos.demo.as_uri(), "question": "secret?",
                                                              "every": 1.0})
        assert status == 201
        try:
            others = call(server, "GET", "/v1/streams", key=OTHER_KEY)[1]["data"]
            assert stream["id"] not in {s["id"] for s in others} and "secret?" not in json.dumps(others)
            assert stream["id"] in {s["id"] for s in call(server, "GET", "/v1/streams")[1]["data"]}
            for method, path in (("GET", f"/v1/streams/{stream['id']}"), ("GET", f"/v1/streams/{stream['id']}/events"),
                                 ("DELETE", f"/v1/streams/{stream['id']}")):
                assert_error(*call(server, method, path, key=OTHER_KEY), 404, "no live stream")
            assert call(server, "GET", f"/v1/streams/{stream['id']}")[1]["status"] == "running"
        finally:
            assert call(server, "DELETE", f"/v1/streams/{stream['id']}")[0] == 200


class TestDamagedAndFakeVideos:
    def test_a_truncated_video_is_answered_with_a_note_saying_where_it_stops(self, server, videos):
        whole = write_video(videos.outside / "whole.mkv", default_demo_clip(height=120, width=160).frames, fps=25)
        truncated = videos.allowed / "truncated.mkv"
        truncated.write_bytes(whole.read_bytes()[:int(whole.stat().st_size * 0.6)])
        status, reply = call(server, "POST", "/v1/chat/completions", chat_body(truncated.as_uri()))
        assert status == 200, reply
        notes = reply["arrcoc"]["notes"]
        attrs = call(server, "GET", f"/v1/homunculus/{reply['id']}")[1]
        assert attrs["complete"] is False and 0 < attrs["frames"]
        last = attrs["pts"][-1]
        assert any("damaged or truncated" in n and f"at {last:.1f} s" in n for n in notes), notes

    @pytest.mark.parametrize("name, text", [("notes.cdg", b"I" * 29 + b"\n"),     # FFmpeg: CD Graphics
                                            ("notes.nfo", b"not a video, just thirty bytes")])   # ANSI art
    def test_a_30_byte_text_file_is_not_a_video(self, server, videos, name, text):
        fake = videos.allowed / name
        fake.write_bytes(text)
        status, reply = call(server, "POST", "/v1/chat/completions", chat_body(fake.as_uri()))
        assert_error(status, reply, 400, "not a video")
