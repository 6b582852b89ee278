"""Groups answer requests from several streams (or a batch job's videos) into batches for one VLM
(thread-safe)."""
from __future__ import annotations

import collections
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.runtime.requests import AnswerRequest, AnswerResult
from pipeline.vlm.model import VLM

_STOP = object()
_TIMINGS_KEPT = 4096      # recent batches whose timings are kept


@dataclass(frozen=True)
class BatchTiming:
    """Where one batch's time went (seconds, time.monotonic()): started, when the VLM call began;
    answer_s, the call; queued_s, per request the wait from submit to the call; ready_s, per request
    from its window being complete (AnswerRequest.arrival_s; NaN where unknown) to its submit."""

    started: float
    answer_s: float
    queued_s: tuple[float, ...]
    ready_s: tuple[float, ...]


class VLMBatcher:
    """``submit(request) -> Future[AnswerResult]`` from any thread. A worker thread waits for the first
    request, then gathers more until ``max_batch`` requests or ``max_wait_s`` after that first one,
    and answers them in one batched ``VLM.answer`` call. An error fails every future of its batch.

    ``answer``: what a batch is handed to instead, items -> one result per item, in order (batch
    mode: VLM.answer_windows over whole videos' questions, pipeline/runners/batch.py). The worker
    thread lives as long as the batcher, so CUDA libraries' per-thread state stays warm."""

    def __init__(self, vlm: VLM, *, max_batch: int | None = None, max_wait_s: float | None = None,
                 answer: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.vlm = vlm
        self._answer = vlm.answer if answer is None else answer
        self.max_batch = vlm.config.max_batch if max_batch is None else max_batch
        self.max_wait_s = vlm.config.max_wait_s if max_wait_s is None else max_wait_s
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self.batch_sizes: list[int] = []        # sizes of the batches answered so far (observability)
        self.timings: collections.deque[BatchTiming] = collections.deque(maxlen=_TIMINGS_KEPT)
        self._worker = threading.Thread(target=self._run, name="vlm-batcher", daemon=True)
        self._worker.start()

    def submit(self, request: AnswerRequest) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("VLMBatcher is closed")
            self._queue.put((request, future, time.monotonic()))
        return future

    def close(self) -> None:
        """Answer everything already submitted, then stop the worker."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._worker.join()

    def __enter__(self) -> "VLMBatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _gather(self, first) -> tuple[list, bool]:
        batch, deadline = [first], time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is _STOP:
                return batch, True
            batch.append(item)
        return batch, False

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                break
            batch, stop = self._gather(first)
            live = [(r, f, t) for r, f, t in batch if f.set_running_or_notify_cancel()]
            if not live:
                continue
            self.batch_sizes.append(len(live))
            started = time.monotonic()
            try:
                results: list[AnswerResult] = self._answer([r for r, _, _ in live])
            except BaseException as e:  # the caller sees it on its future, naming the streams
                for _, f, _ in live:
                    f.set_exception(e)
                continue
            self.timings.append(BatchTiming(
                started, time.monotonic() - started, tuple(started - t for _, _, t in live),
                tuple(_ready_s(r, t) for r, _, t in live)))
            for (_, f, _), res in zip(live, results):
                f.set_result(res)


def _ready_s(request: Any, submitted: float) -> float:
    """From the request's window being complete (its arrival_s, where it has one) to its submit."""
    arrival = getattr(request, "arrival_s", None)
    return submitted - arrival if arrival is not None else math.nan
