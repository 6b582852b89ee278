"""What one request may ask of the server, checked before any model runs: how many messages, how
long a question (characters, then the model's context), what answer period; and the JSON body,
parsed off the event loop so that a large one never stalls the other connections.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from arr_coc._validate import ConfigError

from ..config import PipelineConfig, validate_every
from ..core.live_stages import DURATION_MAX_S
from .errors import ApiError

# a chat's messages: only the last user message's text and the newest video are used; a history
# longer than this is a client's mistake (or an attack on the parser), not a conversation
MAX_MESSAGES = 1024
MAX_DURATION_S = DURATION_MAX_S     # a live stream's `duration`, as live's --duration: longer is a typo


def parse_json(raw: bytes) -> Any:
    """A request body -> its JSON value; malformed or absurdly nested JSON is a 400, and so is a
    string with a lone UTF-16 surrogate ("\\ud800": JSON lets it through, but it is no text and
    fails wherever it is encoded, the tokenizer or the store). CPU-bound on large bodies: call it
    off the event loop."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):    # a pair decodes to one character
        raise ApiError(400, "malformed JSON body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            "which is not text", code="invalid_json")
    return value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _has_lone_surrogate(value: Any) -> bool:
    """Any string (key or value) of a decoded JSON value that is not valid Unicode text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def check_message_count(messages: list[Any]) -> None:
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"{len(messages)} messages: at most {MAX_MESSAGES} per request (only the last user "
                            f"message's question and the newest video are answered)", param="messages",
                       code="too_many_messages")


def check_question_chars(question: str, max_chars: int, param: str) -> None:
    """413 for a question longer than --max-question-chars (cheap: before it is tokenized)."""
    if len(question) > max_chars:
        raise ApiError(413, f"the question has {len(question)} characters; the server's limit is {max_chars} "
                            f"(--max-question-chars)", param=param, code="question_too_long")


def check_question_tokens(prompt_tokens: int, max_new_tokens: int, context: int | None, param: str) -> None:
    """400 when the prompt around the question (before any visual token) and the answer's tokens do
    not fit in the model's context: no window of video could be answered."""
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise ApiError(400, f"the question takes {prompt_tokens} prompt tokens and the answer up to {max_new_tokens}: "
                            f"more than the model's context of {context} tokens", param=param,
                       code="context_length_exceeded")


def answer_period(cfg: PipelineConfig, value: Any, param: str = "every") -> float:
    """A request's answer period (seconds): finite, at least one of the frames the VLM sees
    (1 / vlm.fps: a shorter window holds no frame of its own) and at most a day; else 400."""
    try:
        return validate_every(value, cfg.vlm.fps, name=param)
    except ConfigError as e:
        raise ApiError(400, str(e), param=param, code="invalid_period") from None


def duration_s(value: Any, param: str = "duration") -> float:
    """A live stream's duration (seconds): finite, positive, at most a year; else 400."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_DURATION_S:
        raise ApiError(400, f"{param} must be a number of seconds in (0, {MAX_DURATION_S:g}], got {value!r}",
                       param=param, code="invalid_duration")
    return float(value)
