"""Every bad request gets a clear 4xx in OpenAI's error shape, and the server keeps answering."""
from __future__ import annotations

import base64
import os
import urllib.error
import urllib.request

import pytest

from serve_client import API_KEY, call, chat_body

openai = pytest.importorskip("openai", reason="the API tests speak through OpenAI's client (pip install openai)")


def assert_error(status: int, body: dict, expected: int, *words: str) -> None:
    assert status == expected, (status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    for word in words:
        assert word in error["message"], (word, error["message"])


def multipart(name: str, data: bytes) -> tuple[bytes, str]:
    boundary = "arrcocboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nuser_data\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


class TestBadRequests:
    def test_malformed_json(self, server):
        status, body = call(server, "POST", "/v1/chat/completions", raw=b'{"messages": [',
                            headers={"Content-Type": "application/json"})
        assert_error(status, body, 400, "malformed JSON")

    @pytest.mark.parametrize("content, words", [
        ([{"type": "video_url", "video_url": {"url": "file-000000000000000000000000"}}], ("no question",)),
        ([{"type": "text", "text": "what moves?"}], ("no video",)),
        ([{"type": "image_url", "image_url": {"url": "http://x/a.png"}}, {"type": "text", "text": "q"}], ("image_url",
                                                                                                          )),
    ])
    def test_missing_parts(self, server, content, words):
        body = {"model": "tiny-random", "messages": [{"role": "user", "content": content}]}
        assert_error(*call(server, "POST", "/v1/chat/completions", body), 400, *words)

    @pytest.mark.parametrize("url", ["ftp://example.com/a.mp4", "gopher://x/y", "/just/a/path.mp4", "s3://b/k.mp4"])
    def test_unsupported_url_scheme(self, server, url):
        assert_error(*call(server, "POST", "/v1/chat/completions", chat_body(url)), 400, "unsupported video")

    def test_paths_outside_the_allowed_directories(self, server, videos):
        outside = videos.outside / "secret.mp4"
        dotdot = f"file://{videos.allowed}/../outside/secret.mp4"
        for url in (outside.as_uri(), dotdot, (videos.allowed / "link.mp4").as_uri(), "file:///etc/hostname"):
            status, body = call(server, "POST", "/v1/chat/completions", chat_body(url))
            assert_error(status, body, 403, "outside the allowed directories")
            assert body["error"]["type"] == "permission_error"
        # through OpenAI's client: its PermissionDeniedError
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.PermissionDeniedError):
            api.chat.completions.create(model="tiny-random", messages=chat_body(dotdot)["messages"])

    def test_a_missing_file_inside_is_404_and_a_text_file_is_not_a_video(self, server, videos):
        status, body = call(server, "POST", "/v1/chat/completions", chat_body((videos.allowed / "nope.mp4").as_uri()))
        assert_error(status, body, 404, "no such file")
        status, body = call(server, "POST", "/v1/chat/completions", chat_body(videos.text.as_uri()))
        assert_error(status, body, 400, "not a readable video")

    def test_a_non_video_upload(self, server):
        raw, kind = multipart("notes.mp4", b"this is text, whatever the name says\n" * 10)
        status, body = call(server, "POST", "/v1/files", raw=raw, headers={"Content-Type": kind})
        assert_error(status, body, 400, "notes.mp4", "not a readable video")
        assert server.engine.media.uploads_list() == [] or all(u.filename != "notes.mp4"
                                                               for u in server.engine.media.uploads_list())
        status, body = call(server, "POST", "/v1/files", raw=b"plain body", headers={"Content-Type": "text/plain"})
        assert_error(status, body, 400, "multipart/form-data")

    def test_an_upload_over_the_size_limit(self, server):
        raw, kind = multipart("big.mp4", os.urandom(600 * 1024))        # the test server's limit: 0.5 MB
        status, body = call(server, "POST", "/v1/files", raw=raw, headers={"Content-Type": kind})
        assert_error(status, body, 413, "over the server's limit", "--max-upload-mb")
        # sent in chunks without a Content-Length, it is cut off at the limit as it arrives
        request = urllib.request.Request(f"{server.url}/v1/files", data=iter([raw[i:i + 65536]
                                                                             for i in range(0, len(raw), 65536)]),
                                         method="POST", headers={"Content-Type": kind,
                                                                 "Authorization": f"Bearer {API_KEY}",
                                                                 "Transfer-Encoding": "chunked"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 413
        assert list(server.engine.media.uploads.glob("file-*")) == [] or \
            all(p.stat().st_size < 600 * 1024 for p in server.engine.media.uploads.glob("file-*"))

    def test_a_data_url_over_the_limit_and_a_bad_one(self, server):
        big = "data:video/mp4;base64," + base64.b64encode(os.urandom(600 * 1024)).decode()
        assert_error(*call(server, "POST", "/v1/chat/completions", chat_body(big)), 413, "over the server's limit")
        huge = "data:video/mp4;base64," + base64.b64encode(os.urandom(2 << 20)).decode()   # refused unread
        assert_error(*call(server, "POST", "/v1/chat/completions", chat_body(huge)), 413, "the request body")
        assert_error(*call(server, "POST", "/v1/chat/completions", chat_body("data:text/plain,hi")), 400, "data:video")

    @pytest.mark.parametrize("key, words", [(None, "missing API key"), ("wrong-key", "wrong API key")])
    def test_a_missing_or_wrong_api_key(self, server, videos, key, words):
        for method, path, body in (("POST", "/v1/chat/completions", chat_body(videos.small.as_uri())),
                                   ("GET", "/v1/models", None), ("GET", "/v1/streams", None),
                                   ("POST", "/v1/files", None), ("GET", "/v1/homunculus/x", None)):
            status, reply = call(server, method, path, body, key=key)
            assert_error(status, reply, 401, words)
            assert reply["error"]["code"] == "invalid_api_key"
        if key is not None:   # (OpenAI's client refuses to send no key at all)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0).models.list()
        assert call(server, "GET", "/health", key=key)[0] == 200         # outside /v1: open

    @pytest.mark.parametrize("body, status, words", [
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, ("not served here",)),
        ({"messages": "hello"}, 400, ("messages must be",)),
        ([1, 2], 400, ("JSON object",)),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, ("role",)),
    ])
    def test_other_malformed_requests(self, server, body, status, words):
        assert_error(*call(server, "POST", "/v1/chat/completions", body), status, *words)

    @pytest.mark.parametrize("body, words", [
        ({"source": "rtsp://127.0.0.1:1/x"}, ("no question",)),
        ({"question": "q"}, ("no source",)),
        ({"source": "0", "question": "q"}, ("cameras",)),
        ({"source": "ftp://x/y", "question": "q"}, ("unsupported source",)),
        ({"source": "file:///etc/hostname", "question": "q"}, ("outside the allowed directories",)),
        ({"source": "rtsp://127.0.0.1:9/x", "question": "q", "every": -1}, ("every",)),
    ])
    def test_bad_live_streams(self, server, body, words):
        status, reply = call(server, "POST", "/v1/streams", body)
        assert 400 <= status < 500
        assert_error(status, reply, status, *words)

    def test_unknown_routes_and_ids(self, server):
        assert_error(*call(server, "GET", "/v1/nothing"), 404, "Not Found")
        assert_error(*call(server, "GET", "/v1/homunculus/chatcmpl-000000000000000000000000"), 404, "no homunculus")
        assert_error(*call(server, "GET", "/v1/homunculus/..%2F..%2Fetc"), 404)
        assert_error(*call(server, "GET", "/v1/files/file-000000000000000000000000"), 404, "no uploaded file")
        assert_error(*call(server, "GET", "/v1/streams/live-x/events"), 404, "no live stream")


def test_the_server_still_answers_after_all_that(server, videos):
    # one of each refusal here too, so that the test holds alone or on any worker (pytest -n)
    assert call(server, "GET", "/v1/models", key="wrong-key")[0] == 401
    assert call(server, "POST", "/v1/chat/completions", chat_body(videos.outside.joinpath("secret.mp4").as_uri()))[0] \
        == 403
    raw, kind = multipart("big.mp4", os.urandom(600 * 1024))
    assert call(server, "POST", "/v1/files", raw=raw, headers={"Content-Type": kind})[0] == 413
    reply = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model="tiny-random", messages=chat_body(videos.small.as_uri())["messages"])
    assert reply.choices[0].finish_reason == "stop" and reply.usage.tokens_kept > 0
    status, text = call(server, "GET", "/metrics")
    assert 'status="401"' in text and 'status="403"' in text and 'status="413"' in text

