"""What the server runs: one loaded VLM (behind one batcher) and one ARR-COC model, shared by every
request. A request's front end is `runners.run.run_video` (files) or `runners.live.run_live` (live
sources), each writing its homunculus into the server's store under the request id; only its
answers leave the graph, through `RequestVLM`, into the shared batcher, so answers of requests
from many clients are decoded together.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sinks import SinkError, ZarrStore
from sources import SourceError
from sources.live import LiveConfig

from ..config import PipelineConfig
from ..configio import to_dict
from ..core.compose import frontend_graphs
from ..core.frontend_graphs import FrontendGraphsPool
from ..core.graph import StageError
from ..core.items import AnswerItem, RunStatus
from ..core.live_stages import LiveOptions
from ..core.setup import build_model, runtime_device
from ..runners.live import run_live
from ..runners.run import run_video
from .admission import Deadline
from .answering import RequestVLM, answer_row, item_row, result_row
from .errors import ApiError
from .fetch_policy import live_error, live_open_failed
from .limits import check_question_chars, check_question_tokens
from .media import Media, VideoRef
from .metrics import Metrics
from .options import ServeOptions
from .retention import Retention

OnAnswer = Callable[[dict[str, Any]], None]
STREAM_ID = r"(chatcmpl|live)-[0-9a-f]{24}"
log = logging.getLogger("pipeline.serve")


@dataclass
class Completion:
    """One answered request: its answers (one per window), token counts, and the stored homunculus."""

    request_id: str
    answers: list[dict[str, Any]]
    frames: int
    prompt_tokens: int
    completion_tokens: int
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_kept(self) -> int:
        return sum(a["tokens_kept"] for a in self.answers)

    @property
    def tokens_full(self) -> int:
        return sum(a["tokens_full"] for a in self.answers)

    @property
    def tokens_spent(self) -> int:
        return sum(a["tokens_spent"] for a in self.answers)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "tokens_kept": self.tokens_kept, "tokens_full": self.tokens_full, "tokens_spent": self.tokens_spent}


class Engine:
    """Everything a request needs, built once: the VLM service, the ARR-COC model, the store, the
    media rules, the live streams and the metrics. `answer` runs one request (blocking)."""

    def __init__(self, cfg: PipelineConfig, options: ServeOptions, service: Any) -> None:
        from .streams import LiveStreams

        self.cfg, self.options, self.service = cfg, options, service
        self.device = runtime_device(cfg)
        self.model_id = options.model_id or cfg.runtime.vlm   # what --vlm named
        self.model = build_model(cfg, self.device, answering=True)
        ZarrStore.open(options.store, config=to_dict(cfg))    # created (or refused) now, not on a request
        self.media = Media(options)
        self.metrics = Metrics()
        self.streams = LiveStreams(self)
        self.metrics.vlm_pending = service.pending
        self.metrics.batch_sizes = service.batch_sizes
        self.metrics.live_streams = self.streams.running
        self._slots = threading.BoundedSemaphore(options.max_concurrent)
        self._active: set[str] = set()              # requests answering now: retention keeps their streams
        # one pool for the front-end graphs of every request and live stream (a set per shape in use)
        self.frontends = FrontendGraphsPool(options.frontend_graph_sets, frontend_graphs)
        self.retention = Retention(self.media.uploads, options.store, retention_s=options.retention_s,
                                   max_bytes=options.max_storage_bytes, busy=self.busy).start()
        self.media.room = self.retention.room

    def close(self) -> None:
        self.retention.close()
        self.streams.stop_all()
        self.service.close()

    def busy(self) -> set[str]:
        """Stream ids being written now: requests answering and live streams running."""
        return set(self._active) | {s.id for s in self.streams.list() if s.status in ("starting", "running")}

    def check_question(self, question: str, param: str) -> None:
        """413 past --max-question-chars, 400 past the model's context: before any video is opened, so
        that no question holds the shared VLM in a prefill it cannot finish (tokenizes: call it off
        the event loop)."""
        check_question_chars(question, self.options.max_question_chars, param)
        check_question_tokens(self.service.prefix_length(question, 0), self.service.config.max_new_tokens,
                              self.service.context_length(), param)

    def answer(self, ref: VideoRef, question: str, request_id: str, *, every_s: float | None = None,
               on_answer: OnAnswer | None = None, deadline: Deadline | None = None) -> Completion:
        """Run one request's front end and return its answers (blocking: call it from a worker thread).
        At most max_concurrent run at once (the app's admission refuses more). The deadline, when it
        fires or is cancelled (the client left), aborts the run: 504."""
        deadline = deadline or Deadline()
        self.metrics.queued(1)
        try:
            self._slots.acquire()
        finally:
            self.metrics.queued(-1)
        self.metrics.started(1)
        self._active.add(request_id)
        try:
            deadline.check(lambda: request_timeout(request_id))
            if ref.kind == "live":
                completion = self._answer_live(ref, question, request_id, on_answer, deadline)
            else:
                completion = self._answer_file(ref, question, request_id, every_s, on_answer, deadline)
            deadline.check(lambda: request_timeout(request_id))
        finally:
            self._active.discard(request_id)
            self.retention.note("stored", request_id)     # its homunculus counts against the cap now
            self.metrics.started(-1)
            self._slots.release()
            ref.discard()
        self.metrics.tokens(completion.tokens_kept, completion.tokens_full)
        return completion

    def _answer_file(self, ref: VideoRef, question: str, request_id: str, every_s: float | None,
                     on_answer: OnAnswer | None, deadline: Deadline) -> Completion:
        cfg = self.cfg if every_s is None else replace(self.cfg, runtime=replace(self.cfg.runtime, every_s=every_s))

        def answered(request: Any, result: Any) -> None:
            if on_answer is not None:
                on_answer(result_row(request.t_start, request.t_end, result, self.service.name))
        status, undo = RunStatus(), [lambda: None]

        def on_graph(graph: Any) -> None:
            undo[0] = deadline.on_cancel(lambda: (setattr(status, "stopped", True), graph.abort()))
        try:
            result = run_video(ref.target, question, self.options.store, cfg, progress=False,
                               vlm=RequestVLM(self.service, answered), model=self.model, stream_id=request_id,
                               status=status, on_graph=on_graph, frontends=self.frontends)
        finally:
            undo[0]()
        answers = [item_row(a) for a in result.answers]
        notes = list(result.notes) + ([self._damage_note(request_id)] if result.truncated else [])
        return self._completion(request_id, question, answers, result.frames, notes)

    def _damage_note(self, stream_id: str) -> str:
        """What a client must know of an answer from a damaged video (core/damage.py): where it stops."""
        attrs = ZarrStore.open(self.options.store, mode="r").read(stream_id, frame_arrays=["pts"])["attrs"]
        at = attrs.get("truncated_at_s")
        where = f"at {at:.1f} s" if isinstance(at, (int, float)) else "before its first frame"
        return (f"the video is damaged or truncated: decoding stopped {where}, so the answers cover only the "
                f"video before that (the store marks the stream damaged=true, truncated_at_s={at})")

    def _answer_live(self, ref: VideoRef, question: str, request_id: str, on_answer: OnAnswer | None,
                     deadline: Deadline) -> Completion:
        """A live URL in a chat request: watch it for one answer window (live_window_s), answer, stop."""
        window = self.options.live_window_s
        stop = threading.Event()

        def answered(item: AnswerItem) -> None:
            if on_answer is not None:
                on_answer(item_row(item))
            stop.set()
        live = LiveConfig(open_timeout_s=min(10.0, self.options.fetch_timeout_s), max_reconnects=2,
                          connect=self.options.fetch_policy.route)
        undo = deadline.on_cancel(stop.set)
        options = LiveOptions(every_s=window, duration_s=window + 2 * self.options.fetch_timeout_s)
        try:
            result = run_live([ref.target], question, self.options.store, self.cfg, live=live, options=options,
                              status_out=Discard(), stop=stop, vlm=RequestVLM(self.service), model=self.model,
                              stream_ids=[request_id], on_answer=answered, frontends=self.frontends)
        except (SourceError, StageError) as e:
            error = e.error if isinstance(e, StageError) else e
            if not isinstance(error, SourceError):
                raise
            # why it did not open, and at which address, stays in the server's log (fetch_policy.py)
            log.info("live source %s: %s", ref.source, error)
            raise live_open_failed(ref.source, live_error(str(error), "unreachable"), param="messages",
                                   code="url_unreachable") from None
        finally:
            undo()
        deadline.check(lambda: request_timeout(request_id))
        if not result.answers:
            if result.errors:
                log.info("live source %s: %s", ref.source, result.errors[0])
            raise ApiError(504, f"no answer from the live source {ref.source!r} within "
                                f"{options.duration_s:g} s", code="live_timeout")
        answers = [item_row(result.answers[0])]
        frames = sum(s.get("frames_out", 0) for s in result.streams.values()) if result.streams else 0
        return self._completion(request_id, question, answers, frames, result.notes)

    def _completion(self, request_id: str, question: str, answers: list[dict[str, Any]], frames: int,
                    notes: list[str]) -> Completion:
        # prompt: the chat template, the question and the visual tokens kept, per window asked;
        # completion: the answer's tokens, counted by the VLM's own tokenizer
        prompt = sum(self.service.prefix_length(question, a["tokens_kept"]) for a in answers)
        completion = sum(self.service.count_tokens(a["text"]) for a in answers)
        return Completion(request_id, answers, frames, prompt, completion, notes)

    def homunculus(self, stream_id: str) -> dict[str, Any]:
        """A request's (or live stream's) stored homunculus as the viewer draws it."""
        if not re.fullmatch(STREAM_ID, stream_id):
            raise ApiError(404, f"no homunculus {stream_id!r}: ids are the `id` of a chat completion or a "
                                f"live stream", code="not_found")
        try:
            data = ZarrStore.open(self.options.store, mode="r").read(stream_id)
        except SinkError:
            raise ApiError(404, f"no homunculus {stream_id!r} in the server's store", code="not_found") from None
        return homunculus_json(stream_id, data)


def homunculus_json(stream_id: str, data: dict[str, Any]) -> dict[str, Any]:
    """Per frame: pts, the token map (row-major gh x gw), tokens kept and full; scene changes;
    answers with their windows; gaps of a live stream."""
    attrs = data["attrs"]
    gh, gw = attrs["grid"]
    tokens = data["tokens"].reshape(len(data["tokens"]), gh * gw).astype(np.int64)     # (T, gh*gw)
    answers = data["answers"]
    gaps = data.get("gaps", {})
    return {
        # a file's name only: the server's own directories are not the client's business
        "id": stream_id, "object": "homunculus", "source": shown_source(attrs["source"]), "question": attrs["query"],
        "fps": attrs["fps"], "width": attrs["width"], "height": attrs["height"], "grid": [gh, gw],
        "vlm": attrs["vlm"], "complete": bool(attrs["complete"]), "frames": int(len(tokens)),
        "pts": [round(float(p), 4) for p in data["pts"]],
        "frame_index": [int(i) for i in data["frame_index"]],
        "tokens": tokens.tolist(),
        "tokens_kept": tokens.sum(1).tolist(),
        "tokens_full": gh * gw,
        "scene_changes": [round(float(p), 4) for p in data["pts"][data["scene_change"]]],
        "answers": [answer_row(s, e, str(t), k, f, lat, n, spent, str(why)) for s, e, t, k, f, lat, n, spent, why in
                    zip(answers["t_start"], answers["t_end"], answers["text"], answers["tokens_kept"],
                        answers["tokens_full"], answers["latency_s"], answers["passes"], answers["tokens_spent"],
                        answers["no_answer"])],
        "gaps": [{"start_pts": float(s), "end_pts": float(e), "reason": str(r)}
                 for s, e, r in zip(gaps.get("start_pts", []), gaps.get("end_pts", []), gaps.get("reason", []))],
    }


def request_timeout(request_id: str) -> ApiError:
    return ApiError(504, f"{request_id} was stopped: it ran past its deadline (--request-timeout-s) or its "
                         f"client went away", code="request_timeout")


def shown_source(source: str) -> str:
    return source if "://" in source else Path(source).name


class Discard:
    """A text stream that keeps nothing: live status lines of the server's streams (the metrics and
    GET /v1/streams/{id} report them instead)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

