"""When an answer is no answer, and why.

A model may say which answers it can give: a snapshot's `answer_words.json` lists them (the
shipped arrcoc-synth-qa writes one: it was trained on generated QA whose every answer is one of a
few words, evaluation/synth_qa.py: ANSWER_WORDS). An empty generation, or one outside that list, is
not an answer a user can act on: the store keeps the text as generated and records the reason in
`answers/no_answer`, and every way an answer is shown (run, live, the API, the web page) says
"no answer" with that reason. Models without the file answer free text: only an empty one is none.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

WORDS_FILE = "answer_words.json"
EMPTY = "the model generated nothing"


@functools.lru_cache(maxsize=16)
def answer_words(model: str | None) -> frozenset[str] | None:
    """The answers the model named `model` (its snapshot directory, as VLM.name holds it) was
    trained to give, or None when its snapshot lists none (free text)."""
    if not model:
        return None
    path = Path(model) / WORDS_FILE
    try:
        words = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return frozenset(str(w).strip().lower() for w in words)


def no_answer(text: str, model: str | None = None) -> str:
    """Why `text` is no answer of `model` ('' when it is an answer)."""
    said = text.strip().lower()
    if not said:
        return EMPTY
    words = answer_words(model)
    if words is not None and said not in words:
        return f"{text.strip()!r} is not one of the {len(words)} answers {Path(model).name} was trained to give"
    return ""


def shown(text: str, reason: str) -> str:
    """How an answer reads for a person: the text, or "no answer (reason)"."""
    return f"no answer ({reason})" if reason else text
