"""Strings that are not text (issue 41, item 10: a client's mistake is a 4xx, never a 500). JSON lets
a lone UTF-16 surrogate through (`"\\ud800"` decodes to a str that no encoder takes): in a chat's
question or video URL, or a live stream's source or question, it reached the tokenizer or the store
and came back 500. It is a 400 `invalid_json` now; a surrogate pair (an emoji) is text."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the serve tests need the serve extra (fastapi)")

from pipeline.serve.errors import ApiError
from pipeline.serve.limits import parse_json

from serve_client import call, chat_body

JSON = {"Content-Type": "application/json"}


def escaped(body: dict, text: str, escape: str) -> bytes:
    """body as JSON with `text` (a placeholder in one of its strings) replaced by a raw JSON escape."""
    return json.dumps(body).replace(text, escape).encode()


@pytest.mark.parametrize("where", ["question", "url"])
def test_a_chat_with_a_lone_surrogate_is_400(server, videos, where):
    body = chat_body(videos.small.as_uri() if where == "question" else "file:///PLACE.mp4",
                     "what PLACE moves?" if where == "question" else "q")
    status, reply = call(server, "POST", "/v1/chat/completions", raw=escaped(body, "PLACE", "\\ud800"), headers=JSON)
    assert status == 400 and reply["error"]["code"] == "invalid_json", reply
    assert "lone UTF-16 surrogate" in reply["error"]["message"]


@pytest.mark.parametrize("field", ["question", "source"])
def test_a_stream_with_a_lone_surrogate_is_400_and_leaves_no_record(server, videos, field):
    before = call(server, "GET", "/v1/streams")[1]["data"]
    body = {"source": videos.small.as_uri(), "question": "q", field: "PLACE"}
    status, reply = call(server, "POST", "/v1/streams", raw=escaped(body, "PLACE", "\\udfff"), headers=JSON)
    assert status == 400 and reply["error"]["code"] == "invalid_json", reply
    assert call(server, "GET", "/v1/streams")[1]["data"] == before


def test_pairs_and_escaped_backslashes_are_text():
    assert parse_json(b'{"q": "\\ud83d\\ude00 moves?"}') == {"q": "\U0001F600 moves?"}
    assert parse_json(b'{"q": "\\\\ud800"}') == {"q": "\\ud800"}          # a backslash, then "ud800"
    for raw in (b'{"\\ud800": 1}', b'[["\\udc00"]]', b'{"q": "\\ud83d"}'):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json"
