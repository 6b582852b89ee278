"""HTTP helpers of the serve tests (plain urllib: what any client sends)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator

API_KEY = "test-key"
OTHER_KEY = "other-test-key"      # a second client of the same server


def call(server: Any, method: str, path: str, body: Any = None, *, key: str | None = API_KEY,
         headers: dict[str, str] | None = None, raw: bytes | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    """(status, parsed JSON body) of one HTTP request to the test server; errors come back, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(server.url + path, data=data, method=method, headers=dict(headers or {}))
    if body is not None and raw is None:
        request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def sse(server: Any, path: str, body: Any = None, *, key: str | None = API_KEY, headers: dict[str, str] | None = None,
        timeout: float = 60.0) -> Iterator[tuple[str, Any, str | None]]:
    """(event, data, id) of a server-sent event stream (GET, or POST of a JSON body), until the
    server closes it."""
    request = urllib.request.Request(server.url + path, headers=dict(headers or {}),
                                     data=None if body is None else json.dumps(body).encode())
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        event, data, number = "message", [], None
        for line in response:
            line = line.decode().rstrip("\n")
            if not line:
                if data:
                    text = "\n".join(data)
                    yield event, (text if text == "[DONE]" else json.loads(text)), number
                event, data, number = "message", [], None
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("id:"):
                number = line[3:].strip()


def chat_body(url: str, question: str = "what moves?", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-random", **extra,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": question}]}]}
