"""OpenAI's chat-completions wire format: a request body -> ChatRequest (or a 400 naming the field),
and answers -> a chat.completion object or chat.completion.chunk events.

A video is a content part of the last user message that has one:
    {"type": "video_url", "video_url": {"url": "file:///videos/a.mp4"}}    (also "url" as a bare string)
    {"type": "file", "file": {"file_id": "file-..."}}                        (an upload, POST /v1/files)
The question is that message's text (string content, or its "text" parts). Extensions in the body:
"every": answer windows of this many seconds (default: the server's --every, else the whole video).
Sampling fields (temperature, max_tokens, ...) are the server's: the VLM's config decides them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ..config import PipelineConfig
from ..runtime.answer_words import shown
from .engine import Completion
from .errors import ApiError
from .limits import answer_period, check_message_count

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatRequest:
    video: str
    question: str
    stream: bool = False
    include_usage: bool = False
    every_s: float | None = None


def parse_chat(body: Any, model_id: str, cfg: PipelineConfig) -> ChatRequest:
    """The request, or a 4xx naming the field at fault (linear in the body's size: call it off the
    event loop for large ones)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"model {model!r} is not served here; GET /v1/models lists {model_id!r}",
                       param="model", code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    check_message_count(messages)
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{k}] must be an object with a role of {', '.join(ROLES)}",
                           param=f"messages[{k}]")
    users = [k for k, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ApiError(400, "no user message: the question and the video come in a user message", param="messages")
    question = " ".join(_texts(messages[users[-1]], users[-1])).strip()
    if not question:
        raise ApiError(400, "no question: the last user message has no text (add a text content part)",
                       param="messages", code="missing_question")
    videos = []
    for k in reversed(users):     # a follow-up question may refer to a video sent earlier
        videos = _videos(messages[k], k)
        if videos:
            break
    if not videos:
        raise ApiError(400, "no video: add a content part {\"type\": \"video_url\", \"video_url\": {\"url\": ...}} "
                            "or {\"type\": \"file\", \"file\": {\"file_id\": ...}}", param="messages",
                       code="missing_video")
    if len(videos) > 1:
        raise ApiError(400, f"{len(videos)} videos in one message; send one video per request", param="messages")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if body.get("n", 1) != 1:
        raise ApiError(400, f"n={body.get('n')!r}: one choice per request is supported", param="n")
    every = body.get("every")
    return ChatRequest(video=videos[0], question=question, stream=stream,
                       include_usage=bool(options.get("include_usage", False)),
                       every_s=None if every is None else answer_period(cfg, every))


def _parts(message: dict[str, Any], k: int) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise ApiError(400, f"messages[{k}].content must be a string or a list of content parts",
                       param=f"messages[{k}].content")
    return content


def _texts(message: dict[str, Any], k: int) -> list[str]:
    texts = []
    for part in _parts(message, k):
        if part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{k}]: a text part needs a string \"text\"", param=f"messages[{k}]")
            texts.append(part["text"])
    return texts


def _videos(message: dict[str, Any], k: int) -> list[str]:
    found = []
    for part in _parts(message, k):
        kind = part.get("type")
        if kind == "video_url":
            value = part.get("video_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url.strip():
                raise ApiError(400, f"messages[{k}]: a video_url part needs {{\"url\": \"...\"}}",
                               param=f"messages[{k}]")
            found.append(url.strip())
        elif kind == "file":
            value = part.get("file")
            file_id = value.get("file_id") if isinstance(value, dict) else None
            if not isinstance(file_id, str):
                raise ApiError(400, f"messages[{k}]: a file part needs {{\"file_id\": \"file-...\"}}",
                               param=f"messages[{k}]")
            found.append(file_id)
        elif kind in ("image_url", "input_audio", "input_image"):
            raise ApiError(400, f"messages[{k}]: {kind} parts are not supported; send a video_url",
                           param=f"messages[{k}]")
        elif kind != "text":
            raise ApiError(400, f"messages[{k}]: unknown content part type {kind!r}; use text, video_url or file",
                           param=f"messages[{k}]")
    return found


def content(answers: list[dict[str, Any]], windowed: bool) -> str:
    """The assistant message: the answer, or with windows, one "[t0-t1 s] answer" line per window."""
    if not windowed:
        return "\n".join(answer_text(a) for a in answers)
    return "\n".join(window_line(a) for a in answers)


def answer_text(answer: dict[str, Any]) -> str:
    """The answer as a person reads it: its text, or "no answer (why)" (the text stays in `arrcoc.answers`)."""
    return shown(answer["text"], answer.get("no_answer", ""))


def window_line(answer: dict[str, Any]) -> str:
    return f"[{answer['t_start']:.1f}-{answer['t_end']:.1f} s] {answer_text(answer)}"


def extension(completion: Completion) -> dict[str, Any]:
    """ARR-COC's additions to a response: the answers' windows and where the homunculus is."""
    return {"stream_id": completion.request_id, "homunculus": f"/v1/homunculus/{completion.request_id}",
            "frames": completion.frames, "answers": completion.answers, "notes": completion.notes}


def completion_body(completion: Completion, model_id: str, windowed: bool) -> dict[str, Any]:
    return {
        "id": completion.request_id, "object": "chat.completion", "created": int(time.time()), "model": model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content(completion.answers, windowed)},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": completion.usage(),
        "arrcoc": extension(completion),
    }


def chunk(request_id: str, model_id: str, created: int, delta: dict[str, Any] | None,
          finish_reason: str | None = None, **extra: Any) -> str:
    """One server-sent event carrying a chat.completion.chunk (delta None: no choices, as the usage chunk)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
            "choices": choices, **extra}
    return sse(body)


def sse(data: Any, event: str | None = None, event_id: int | None = None) -> str:
    head = (f"id: {event_id}\n" if event_id is not None else "") + (f"event: {event}\n" if event else "")
    return f"{head}data: {json.dumps(data)}\n\n"


DONE = "data: [DONE]\n\n"
