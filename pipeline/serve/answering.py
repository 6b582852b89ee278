"""How answers leave a request: the runners take a VLM; the server hands each request a RequestVLM
whose answers go through the one shared batcher (LocalVLM in this process; ray_app.RemoteVLM on
Ray Serve), so answers of requests from many clients are decoded together."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable


from ..core.items import AnswerItem


class LocalVLM:
    """The server's VLM in this process: every answer request goes through one VLMBatcher."""

    def __init__(self, vlm: Any) -> None:
        from ..vlm.batcher import VLMBatcher
        from ..vlm.hf_forward import model_card

        self.vlm = vlm
        self.batcher = VLMBatcher(vlm)
        self.name, self.geometry, self.config, self.warning = vlm.name, vlm.geometry, vlm.config, vlm.warning
        self.card = model_card(vlm)            # family, architecture, engine: what /v1/models says
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, request: Any) -> Future:
        with self._lock:
            self._pending += 1
        future = self.batcher.submit(request)
        future.add_done_callback(lambda _: self._done())
        return future

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1

    def pending(self) -> int:
        return self._pending

    def batch_sizes(self) -> list[int]:
        return self.batcher.batch_sizes

    def count_tokens(self, text: str) -> int:
        return len(self.vlm.tokenizer(text).input_ids)

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        return self.vlm.prefix_length(question, visual_tokens)

    def context_length(self) -> int | None:
        return context_length(self.vlm)

    def close(self) -> None:
        self.batcher.close()


class RequestVLM:
    """The VLM interface the runners take (geometry, config, warning, answer, prefix_length,
    warm_up) for one request: answers are asked through the server's shared
    batcher, and each one is handed to `on_answer` (request, result) as soon as it is back."""

    def __init__(self, service: Any, on_answer: Callable[[Any, Any], None] | None = None) -> None:
        self.service, self.on_answer = service, on_answer
        self.name, self.geometry, self.config, self.warning = (service.name, service.geometry, service.config,
                                                               service.warning)

    def answer(self, requests: list[Any]) -> list[Any]:
        futures = [self.service.submit(r) for r in requests]
        results = [f.result() for f in futures]
        if self.on_answer is not None:
            for request, result in zip(requests, results):
                self.on_answer(request, result)
        return results

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        return self.service.prefix_length(question, visual_tokens)

    def warm_up(self, *args: Any, **kwargs: Any) -> list:
        # a live stream's setup would capture CUDA graphs from this request's thread while the
        # shared VLM answers other requests in the batcher's: the VLM captures each shape itself,
        # in its one thread, the first time it meets it
        return []


def context_length(vlm: Any) -> int | None:
    """The most tokens the VLM's language model takes (prompt and answer); None if it does not say."""
    config = getattr(getattr(vlm, "model", None), "config", None)
    text = getattr(config, "text_config", None) or config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def answer_row(t_start: float, t_end: float, text: str, tokens_kept: int, tokens_full: int,
               latency_s: float, passes: int = 1, tokens_spent: int | None = None,
               no_answer: str = "") -> dict[str, Any]:
    """One answer as the API shows it; passes and tokens_spent as the store keeps them (tempering);
    no_answer: why `text` is no answer ("": an answer; pipeline/runtime/answer_words.py)."""
    return {"t_start": round(float(t_start), 3), "t_end": round(float(t_end), 3), "text": text,
            "no_answer": str(no_answer),
            "tokens_kept": int(tokens_kept), "tokens_full": int(tokens_full), "latency_s": round(float(latency_s), 4),
            "passes": int(passes), "tokens_spent": int(tokens_kept if tokens_spent is None else tokens_spent)}


def result_row(t_start: float, t_end: float, result: Any, model: str | None = None) -> dict[str, Any]:
    """answer_row of a VLM's AnswerResult for the window [t_start, t_end]; model: the VLM's name."""
    from ..runtime.answer_words import no_answer

    return answer_row(t_start, t_end, result.text, result.tokens_kept, result.tokens_full, result.latency_s,
                      result.passes, result.tokens_spent, no_answer(result.text, model))


def item_row(item: AnswerItem) -> dict[str, Any]:
    return answer_row(item.t_start, item.t_end, item.text, item.tokens_kept, item.tokens_full, item.latency_s,
                      item.passes, item.tokens_spent, item.no_answer)
