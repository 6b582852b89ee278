"""`python -m pipeline serve` over HTTP on loopback, with OpenAI's Python client where it speaks the
API (chat completions, files, models) and plain HTTP elsewhere: answers, streamed answers, usage,
the stored homunculus, live streams as server-sent events, metrics."""
from __future__ import annotations

import functools
import http.server
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_client import API_KEY, call, chat_body, sse

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import rtsp_or_skip  # noqa: E402

openai = pytest.importorskip("openai", reason="the API tests speak through OpenAI's client (pip install openai)")


def client(server, key: str = API_KEY):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def video_message(url: str, question: str = "what moves?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


class TestChat:
    def test_a_file_answer_with_usage_and_its_homunculus(self, server, videos):
        reply = client(server).chat.completions.create(model="tiny-random",
                                                       messages=video_message(videos.small.as_uri()))
        assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
        assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].finish_reason == "stop"
        usage = reply.usage
        assert usage.prompt_tokens > 0 and usage.completion_tokens >= 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        extension = reply.model_extra["arrcoc"]
        answers = extension["answers"]
        assert len(answers) == 1 and answers[0]["t_start"] == 0.0               # the whole video, one window
        assert usage.tokens_kept == answers[0]["tokens_kept"] and usage.tokens_full == answers[0]["tokens_full"]
        assert 0 < usage.tokens_kept < usage.tokens_full
        # one answering pass (no tempering): every visual token spent was kept
        assert (answers[0]["passes"], answers[0]["tokens_spent"]) == (1, answers[0]["tokens_kept"])
        assert usage.model_extra["tokens_spent"] == usage.tokens_kept
        # the prompt holds the kept visual tokens, not the stock model's
        assert usage.prompt_tokens < usage.tokens_full + 200 and usage.prompt_tokens > usage.tokens_kept

        status, h = call(server, "GET", extension["homunculus"])
        assert status == 200 and h["id"] == reply.id and h["complete"] and h["question"] == "what moves?"
        assert h["source"] == "small.mp4"                  # the file's name, not the server's directories
        gh, gw = h["grid"]
        tokens = np.array(h["tokens"])
        assert tokens.shape == (24, gh * gw) and h["frames"] == 24
        assert h["tokens_full"] == gh * gw and h["tokens_kept"] == tokens.sum(1).tolist()
        assert np.allclose(h["pts"], np.arange(24) / 10, atol=1e-3)
        assert h["scene_changes"][0] == 0.0 and len(h["answers"]) == 1
        assert h["answers"][0]["text"] == reply.choices[0].message.content

    def test_a_streamed_answer_one_chunk_per_window(self, server, videos):
        chunks = list(client(server).chat.completions.create(
            model="tiny-random", messages=video_message(videos.small.as_uri()), stream=True,
            stream_options={"include_usage": True}, extra_body={"every": 1.0}))
        assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
        assert chunks[0].choices[0].delta.role == "assistant"
        texts = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason == "stop"]
        assert len(finish) == 1
        answers = finish[0].model_extra["arrcoc"]["answers"]
        # 2.4 s of video in 1 s windows: three answers, each streamed as it was ready
        assert len(answers) == 3 and len(texts) == 3
        # (the last window ends at its last frame the VLM sampled, at vlm.fps 2: 2.0 s)
        assert [(a["t_start"], a["t_end"]) for a in answers] == [(0.0, 1.0), (1.0, 2.0), (2.0, 2.0)]
        assert texts[1].startswith("\n[1.0-2.0 s] ")
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
        assert usage.tokens_kept == sum(a["tokens_kept"] for a in answers)
        assert usage.tokens_full == sum(a["tokens_full"] for a in answers)

    def test_the_raw_event_stream_ends_with_done(self, server, videos):
        events = list(sse(server, "/v1/chat/completions", chat_body(videos.small.as_uri(), stream=True)))
        assert [e[0] for e in events] == ["message"] * len(events) and events[-1][1] == "[DONE]"
        chunks = [e[1] for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-1]  # not asked for

    def test_an_uploaded_video(self, server, videos):
        api = client(server)
        with open(videos.demo, "rb") as f:
            upload = api.files.create(file=f, purpose="user_data")
        assert re.fullmatch(r"file-[0-9a-f]{24}", upload.id) and upload.bytes == videos.demo.stat().st_size
        assert api.files.retrieve(upload.id).filename == "demo.mp4"
        reply = api.chat.completions.create(model="tiny-random", messages=video_message(upload.id))
        assert reply.model_extra["arrcoc"]["frames"] == 150
        # the same upload as OpenAI's `file` content part
        messages = [{"role": "user", "content": [{"type": "file", "file": {"file_id": upload.id}},
                                                 {"type": "text", "text": "and now?"}]}]
        assert client(server).chat.completions.create(model="tiny-random", messages=messages).choices
        status, h = call(server, "GET", f"/v1/homunculus/{reply.id}")
        assert h["source"] == upload.id
        cuts = h["scene_changes"][1:]
        assert np.allclose(cuts, videos.demo_cuts_s, atol=0.05), cuts

    def test_an_http_url_is_fetched_and_the_copy_removed(self, server, videos):
        handler = functools.partial(_QuietHandler, directory=str(videos.allowed))
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{httpd.server_address[1]}/small.mp4"
            reply = client(server).chat.completions.create(model="tiny-random", messages=video_message(url))
            assert reply.model_extra["arrcoc"]["frames"] == 24
            status, body = call(server, "POST", "/v1/chat/completions", chat_body(url.replace("small", "missing")))
            assert status == 400 and body["error"]["message"].endswith(": unreachable")   # no upstream detail
        finally:
            httpd.shutdown()
        assert list(server.engine.media.scratch.iterdir()) == []

    def test_concurrent_requests_share_one_batcher(self, server, videos):
        batcher = server.engine.service.batcher
        before = sum(batcher.batch_sizes)
        results: list = []

        def ask():
            results.append(client(server).chat.completions.create(model="tiny-random",
                                                                  messages=video_message(videos.small.as_uri())))
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 4 and len({r.id for r in results}) == 4
        assert sum(batcher.batch_sizes) - before == 4        # every answer went through the one batcher

    def test_models_health_and_metrics(self, server, videos):
        # its own answered request: under pytest-xdist this test may be its worker's first on the server
        client(server).chat.completions.create(model="tiny-random", messages=video_message(videos.small.as_uri()))
        assert [m.id for m in client(server).models.list()] == ["tiny-random"]
        status, health = call(server, "GET", "/health", key=None)
        assert status == 200 and health["status"] == "ok" and health["auth"] is True
        status, text = call(server, "GET", "/metrics")
        assert status == 200
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("arrcoc_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] >= 1
        assert samples[("arrcoc_tokens_kept_total", ())] > 0 and samples[("arrcoc_tokens_full_total", ())] > 0
        assert samples[("arrcoc_queue_depth", (("queue", "requests"),))] == 0
        assert samples[("arrcoc_queue_depth", (("queue", "vlm"),))] == 0
        chat_inf = (("le", "+Inf"), ("route", "/v1/chat/completions"))
        assert samples[("arrcoc_request_latency_seconds_bucket", chat_inf)] >= 1


class TestLiveStreams:
    def test_a_realtime_file_streams_answers_then_ends(self, server, videos):
        status, stream = call(server, "POST", "/v1/streams", {"source": videos.small.as_uri(),
                                                              "question": "what moves?",
                                                              "every": 1.0})
        assert status == 201 and stream["status"] == "running" and stream["id"].startswith("live-")
        events = list(sse(server, stream["events"]))
        kinds = [e[0] for e in events]
        assert kinds[-1] == "end" and events[-1][1]["reason"] == "source_ended"
        answers = [d for k, d, _ in events if k == "answer"]
        assert len(answers) >= 1 and all(d["stream"] == stream["id"] and d["question"] == "what moves?"
                                         for d in answers)
        assert all(0 < d["tokens_kept"] <= d["tokens_full"] and d["t_end"] > d["t_start"] for d in answers)
        assert [int(n) for _, _, n in events] == list(range(1, len(events) + 1))
        # a follower that reconnects with Last-Event-ID gets only what it missed
        again = list(sse(server, stream["events"], headers={"Last-Event-ID": "1"}))
        assert [n for _, _, n in again] == [n for _, _, n in events[1:]]
        status, info = call(server, "GET", f"/v1/streams/{stream['id']}")
        assert info["status"] == "ended" and info["metrics"]["streams"][stream["id"]]["frames_out"] > 0
        status, h = call(server, "GET", f"/v1/homunculus/{stream['id']}")
        assert status == 200 and h["frames"] > 0 and len(h["answers"]) == len(answers)

    def test_several_streams_at_once_and_delete(self, server, videos):
        ids = []
        for question in ("where is the red square?", "what changes?"):
            status, stream = call(server, "POST", "/v1/streams", {"source": videos.demo.as_uri(), "question": question,
                                                                  "every": 1.0})
            assert status == 201
            ids.append(stream["id"])
        status, listing = call(server, "GET", "/v1/streams")
        running = {s["id"] for s in listing["data"] if s["status"] == "running"}
        assert set(ids) <= running
        first = next(e for e in sse(server, f"/v1/streams/{ids[0]}/events") if e[0] == "answer")
        assert first[1]["question"] == "where is the red square?"
        for sid in ids:
            status, stopped = call(server, "DELETE", f"/v1/streams/{sid}")
            assert status == 200 and stopped["deleted"] and stopped["status"] == "stopped"
            assert list(sse(server, f"/v1/streams/{sid}/events"))[-1][1]["reason"] == "stopped"
        status, body = call(server, "DELETE", "/v1/streams/live-000000000000000000000000")
        assert status == 404 and body["error"]["type"] == "not_found_error"


class TestRTSP:
    def test_an_rtsp_question_and_a_drop_out(self, server):
        rtsp = rtsp_or_skip(fps=15)
        try:
            reply = client(server).chat.completions.create(model="tiny-random", messages=video_message(rtsp.url()))
            answers = reply.model_extra["arrcoc"]["answers"]
            # answered once --live-window (1 s) of live video had arrived, over the frames of that window
            assert len(answers) == 1 and answers[0]["t_end"] >= 0.95 and answers[0]["t_start"] < answers[0]["t_end"]
            status, stream = call(server, "POST", "/v1/streams", {"source": rtsp.url(), "question": "q", "every": 1.0})
            assert status == 201
            seen: list = []
            for event in sse(server, stream["events"]):
                seen.append(event)
                if event[0] == "answer" and not any(e[0] == "gap" for e in seen) and len(seen) == 1:
                    rtsp.kill()                         # a camera drops out ...
                    time.sleep(1.0)
                    rtsp.start()                        # ... and comes back
                if event[0] == "gap":
                    assert event[1]["seconds"] >= 0.9 and event[1]["end_pts"] > event[1]["start_pts"]
                    call(server, "DELETE", f"/v1/streams/{stream['id']}")
            assert [e[0] for e in seen].count("gap") == 1 and seen[-1][1]["reason"] == "stopped"
        finally:
            rtsp.stop()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

