"""The live graph's stages: capture from several live sources, the front end per stream, one
batched VLM, and a sink that writes every stream (graph wired in core/compose.py: compose_live).

Where things drop: only the capture buffers (newest `live.buffer_frames` frames per source, drops
counted per source). The capture stage hands a batch on only when the texture queue has room, so
a slow GPU or VLM makes the capture buffers overflow (more drops) instead of queues growing (more
latency, more memory). A reconnect (a `Gap` on the batch) resets the texture's last frame and the
realizer's temporal state of that stream, so the first frame after it is a new fixation; the sink
records the gap.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from arr_coc._validate import ConfigError, check_range
from sources.frame import Frame
from sources.live import Gap, LiveSource

from ..config import PipelineConfig, validate_every
from ..runtime.cuda import FIRST_FRAME, LEDGER, pins_frames, window_frames
from ..runtime.requests import AnswerRequest
from .graph import Channel, Stage
from .items import AllocationBatch, AnswerItem, FrameBatch, Outcome
from .stages import RealizeStage, TextureStage, stack_frames
from .warmup import WarmUpReport, warm_up

_LATENCY_WINDOW = 512   # recent latencies kept per stream for p50 / p95
_POLL_S = 0.002         # capture stage poll when no source has a frame
_GOLDEN = (5 ** 0.5 - 1) / 2   # LiveOptions.stagger's phase step
# --duration: a year at most (longer is a typo; from ~1e10 s the timer's wait overflows in its thread,
# a traceback, and the run then ignored --duration); the server's `duration` has the same bound
DURATION_MAX_S = 365 * 86_400.0
# --metrics-every: a status line at most 10 times a second (its rates are measured over 2 s), at
# least once a day (a longer wait overflows like --duration's)
METRICS_EVERY_S = (0.1, 86_400.0)


@dataclass(frozen=True)
class LiveOptions:
    every_s: float = 2.0               # one answer per this many seconds over the latest window
    on_scene_change: bool = False      # answer at each scene change instead of every `every_s`
    duration_s: float | None = None    # stop after this long (None: until Ctrl-C / SIGTERM)
    metrics_every_s: float = 5.0       # JSON metrics period when stderr is not a terminal
    window_frames: int = 32            # most VLM frames per answer window
    # the interpreter's thread switch interval while live runs (sys.setswitchinterval; None: leave
    # Python's 5 ms): the VLM thread releases the GIL at every CUDA sync and, with the capture and
    # stage threads busy, waits up to this long to get it back each time
    switch_interval_ms: float | None = None
    # the VLM in a process of its own (pipeline/vlm/remote.py), so that the capture, front-end and
    # sink threads do not share the interpreter lock with it (run_live loads it there from the config)
    vlm_process: bool = False
    # spread the streams' answer times over the `every_s` period, so that streams started together
    # do not all fall due at once and queue behind each other's batch: the k-th stream seen answers
    # (k mod n) / n of a period later, n the VLM frames per period (a due time on a VLM frame: the
    # window ends at it), each still every `every_s` after that (LiveVLMStage._open). On by default:
    # it cuts the answer latency's p95 of many streams started together (docs/performance.md)
    stagger: bool = True
    # capture every graph answering will replay before the first frame (core/warmup.py); None: where
    # graphs are captured (CUDA, vlm.cuda_graphs); True off CUDA records the shapes (coverage tests)
    warm_up: bool | None = None

    def __post_init__(self) -> None:
        validate_every(self.every_s, name="--every")
        if self.duration_s is not None:
            if isinstance(self.duration_s, (int, float)) and not math.isfinite(self.duration_s):
                raise ConfigError(f"--duration must be a finite number of seconds, got {self.duration_s!r} "
                                  f"(leave it out to run until stopped)")
            check_range("--duration", self.duration_s, 0.0, None, lo_open=True)
            if self.duration_s > DURATION_MAX_S:
                raise ConfigError(f"--duration={self.duration_s!r} s is out of range: at most {DURATION_MAX_S:g} s "
                                  f"(a year; leave it out to run until stopped)")
        check_range("--metrics-every", self.metrics_every_s, *METRICS_EVERY_S)
        check_range("window_frames", self.window_frames, 1, 4096)
        if self.warm_up is not None and not isinstance(self.warm_up, bool):
            raise ConfigError(f"warm_up must be true, false or null, got {self.warm_up!r}")
        for name in ("vlm_process", "stagger"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.switch_interval_ms is not None:
            check_range("switch_interval_ms", self.switch_interval_ms, 0.01, 1000.0)


class RunEnding:
    """Why a live run stops, for each stream's `stopped_by` (stream_ending): the first reason given
    ("duration", "interrupt") wins and sets the stop event; the event set by anyone else (the Python
    API, the server) is "stop"; a run whose sources all ended by themselves, "end"."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self._reason: str | None = None
        self._lock = threading.Lock()

    def end(self, reason: str) -> None:
        with self._lock:
            if self._reason is None:
                self._reason = reason
        self.stop.set()

    @property
    def reason(self) -> str:
        return self._reason or ("stop" if self.stop.is_set() else "end")


def stream_ending(source: LiveSource, run_reason: str) -> tuple[Outcome, dict[str, Any]]:
    """How a live stream ended: its outcome ("complete" only when the store holds all of it, see
    docs/guarantees.md) and the attrs that say why: `stopped_by` and `outage_s`. A file is whole
    when it played to its last frame; a camera or a network stream, which has no last frame, when
    it ran until the run was ended as asked (--duration, the API's stop). Either way, not with an
    outage in it (a gap): those seconds are missing."""
    stats = source.stats()
    if source.error is not None:
        stopped_by = "gave_up"
    elif source.reached_end:
        stopped_by = "end"
    else:
        stopped_by = run_reason
    attrs = {"stopped_by": stopped_by, "outage_s": round(stats.outage_s, 3)}
    if source.truncated and source.error is None:
        return "damaged", attrs   # core/damage.py: done up to the damage
    whole = stopped_by == "end" if source.spec.kind == "file" else stopped_by in ("end", "duration", "stop")
    return ("complete" if whole and stats.gaps == 0 else "incomplete"), attrs


@dataclass
class LiveBatch(FrameBatch):
    gap: Gap | None = None             # the stream was cut off just before frames[0]


@dataclass
class StreamCounters:
    """What the status line shows for one source (written by the sink thread, read by the reporter)."""

    frames_out: int = 0
    out_times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_WINDOW))
    frame_latency: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_WINDOW))
    answer_latency: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_WINDOW))
    answers: int = 0
    gaps: int = 0


class CaptureStage(Stage):
    """Source stage: batches of the newest frames of every live source, round-robin."""

    name = "capture"

    def __init__(self, sources: list[LiveSource], batch_size: int, pin: bool, stop: threading.Event) -> None:
        self.sources, self.batch_size, self.pin, self.stop = sources, batch_size, pin, stop
        self.outlet: Channel | None = None   # set by compose_live: batches wait for room there
        # (stream id, gap) of outages no frame ends: a source that gave up, or one still down when the
        # run stops; the sink stores them as the graph finishes (it has no frames to carry them)
        self.final_gaps: list[tuple[str, Gap]] = []

    def produce(self) -> Iterator[LiveBatch]:
        for source in self.sources:   # the graph takes frames from now on: files start playing
            source.begin()
        turn, first = 0, True
        while not self.stop.is_set() and not all(s.finished for s in self.sources):
            if self.outlet is not None and self.outlet.depth >= self.outlet.capacity:
                self.stop.wait(_POLL_S)   # downstream is busy: frames wait (and drop) in the capture buffers
                continue
            for k in range(len(self.sources)):
                source = self.sources[(turn + k) % len(self.sources)]
                frames, gap = source.take(self.batch_size, timeout_s=0.0)
                if frames:
                    if first:                        # warm-up is over: no graph should be captured from here
                        LEDGER.mark(FIRST_FRAME)
                        first = False
                    turn = (turn + k + 1) % len(self.sources)
                    yield LiveBatch(source.stream_id, frames, stack_frames(frames, self.pin), gap=gap)
                    break
                if gap is not None:                  # the source's last outage: no frame came after it
                    self.final_gaps.append((source.stream_id, gap))
            else:
                self.stop.wait(_POLL_S)
        self._close_and_collect()

    def _close_and_collect(self) -> None:
        """Stop the sources; an outage still open becomes each one's last gap (taken here, frames
        that arrived since the stop are not processed)."""
        for source in self.sources:
            source.close()
            while not source.finished:
                frames, gap = source.take(self.batch_size, timeout_s=0.05)
                if gap is not None and not frames:
                    self.final_gaps.append((source.stream_id, gap))

    def close(self) -> None:
        for source in self.sources:
            source.close()


class LiveTextureStage(TextureStage):
    def process(self, item: LiveBatch) -> Iterable[Any]:
        if item.gap is not None:
            self.reset(item.stream_id)
        return super().process(item)


class LiveRealizeStage(RealizeStage):
    def process(self, item: Any) -> Iterable[AllocationBatch]:
        if item.batch.gap is not None:
            self.reset(item.batch.stream_id)
        return super().process(item)


@dataclass
class _Window:
    rgb: collections.deque = field(default_factory=collections.deque)     # (pts, arrival_s, rgb, lod, relevance)
    next_due: float | None = None
    pending: Future | None = None
    pending_meta: tuple[float, float] | None = None
    seen: bool = False     # a frame of this stream has been through; the first one is no scene change
    phase: float = 0.0     # LiveOptions.stagger: the share of every_s this stream's answers come later
    cut: bool = True       # a scene change (or a gap) since the last request: the VLM drops its cached features
    last_end: float | None = None   # t_end of the last window asked for


def warm_vlm(vlm: Any, question: str, sizes: list[tuple[int, int]], cfg: PipelineConfig,
             options: LiveOptions) -> WarmUpReport:
    """Capture every graph live answering will replay, now, during setup (core/warmup.py): each
    capture takes a few hundred ms that would otherwise land on an answer's latency (and, under
    CAPTURE_LOCK, stall the stages' page-locked allocations). A window holds `every_s` seconds at
    the VLM's frame rate (one frame more: its ends may both fall on a frame), at most
    window_frames; answering at scene changes, up to window_frames."""
    frames = round(options.every_s * cfg.vlm.fps) + 1
    frames = options.window_frames if options.on_scene_change else max(1, min(options.window_frames, frames))
    return warm_up(vlm, question, sizes, cfg, frames)


def next_due_after(due: float, pts: float, every_s: float) -> float:
    """The first time on the grid due + k * every_s (k >= 0) after `pts`: answers stay on their
    grid, and a stream whose VLM fell behind skips the periods it missed. Computed, not stepped
    one period at a time: that takes lag / every_s steps a frame, and never ends where rounding
    makes due + every_s == due."""
    if pts < due:
        return due
    later = due + (math.floor((pts - due) / every_s) + 1) * every_s
    return later if later > pts else pts + every_s   # rounding put it on or before pts


class LiveVLMStage(Stage):
    """Per-stream answer windows over the latest `every_s` seconds, asked through one VLMBatcher.

    Requests are submitted, not awaited: a stream asks again only when its previous answer is back,
    so a slow VLM makes answers rarer, never later or queued without bound. Each names its stream
    (reuse_key) and whether a scene change or a gap came since the stream's last one: with
    `vlm.encode: kept` the VLM reuses the vision features of cells unchanged since, dropped at a cut.
    """

    name = "vlm"

    def __init__(self, batcher: Any, question: str, options: LiveOptions, vlm_fps: float | None = None) -> None:
        self.batcher, self.question, self.options = batcher, question, options
        self.vlm_fps = vlm_fps        # the VLM's frame rate (stagger: phases on its frames)
        self.pin = pins_frames(getattr(batcher, "vlm", None))
        self.windows: dict[str, _Window] = {}

    def process(self, item: AllocationBatch) -> Iterable[Any]:
        out: list[Any] = [item]
        allocation = item.wait()
        sid = item.batch.stream_id
        win = self.windows.get(sid)
        if win is None:
            win = self._open(sid)
        if getattr(item.batch, "gap", None) is not None:
            win.rgb.clear()   # frames from before the outage do not describe what is in view now
            win.next_due = None
            win.cut = True
        marks = item.vlm_frames or [True] * len(item.batch.frames)
        for frame, lod, relevance, take, cut in zip(item.batch.frames, allocation.lod.numpy(),
                                                    allocation.relevance.float().numpy(), marks,
                                                    allocation.scene_change.numpy()):
            win.cut |= bool(cut)
            if take or cut:
                self._add(win, frame, lod, relevance)
            if self.options.on_scene_change:
                # the first frame that reaches this stage opens the stream, whatever its index
                # (in realtime mode the first frames may have been dropped): no change to answer
                due = bool(cut) and win.seen
            else:
                if win.next_due is None:
                    win.next_due = frame.pts_s + self.options.every_s * (1.0 + win.phase)
                due = frame.pts_s >= win.next_due
            win.seen = True
            out += self._collect(sid, win)
            if due and win.pending is None and win.rgb:
                self._submit(sid, win)
                if not self.options.on_scene_change:
                    win.next_due = next_due_after(win.next_due, frame.pts_s, self.options.every_s)
        return out

    def _open(self, sid: str) -> _Window:
        """A stream's first batch: its window, and with stagger its phase. With the VLM's frame rate
        known, the k-th stream takes slot k mod n of the n VLM frames in a period (round robin: as
        even as n slots allow; the VLM samples frames from each stream's first one on, as its
        schedule counts, so a due time lands on a sampled frame and the window ends there); without
        it, the golden ratio's fractional multiples (any number of streams spread evenly)."""
        phase, k = 0.0, len(self.windows)
        if self.options.stagger:
            slots = round(self.options.every_s * self.vlm_fps) if self.vlm_fps else 0
            phase = (k % slots) / slots if slots >= 1 else (k * _GOLDEN) % 1.0
        self.windows[sid] = win = _Window(phase=phase)
        return win

    def finish(self) -> Iterable[Any]:
        """The answers still on their way, then each stream's last partial window: the frames since
        its last window (a 10 s file answered every 2 s ends with 8-10 s, as `run` answers it)."""
        out: list[Any] = []
        for sid, win in self.windows.items():
            if win.pending is not None:
                win.pending.exception()   # wait: an answer already asked for is still written
                out += self._collect(sid, win)
            tail = [f for f in win.rgb if win.last_end is None or f[0] > win.last_end]
            if tail and not self.options.on_scene_change:
                win.rgb = collections.deque(tail)
                self._submit(sid, win)
                win.pending.exception()
                out += self._collect(sid, win)
        return out

    def close(self) -> None:
        self.batcher.close()

    def _add(self, win: _Window, frame: Frame, lod: np.ndarray, relevance: np.ndarray) -> None:
        win.rgb.append((frame.pts_s, frame.arrival_s, frame.rgb, lod, relevance))
        while win.rgb and win.rgb[0][0] < frame.pts_s - self.options.every_s:
            win.rgb.popleft()
        if len(win.rgb) > self.options.window_frames:  # keep an even spread of a long window
            kept = list(win.rgb)[1::2]
            win.rgb.clear()
            win.rgb.extend(kept)

    def _submit(self, sid: str, win: _Window) -> None:
        frames = list(win.rgb)
        last_arrival = frames[-1][1] if frames[-1][1] is not None else time.time()
        # AnswerRequest.arrival_s is on the monotonic clock; the frame's arrival is wall-clock
        arrival_mono = time.monotonic() - (time.time() - last_arrival)
        request = AnswerRequest(stream_id=sid, frames=window_frames([f[2] for f in frames], self.pin),
                                keep=np.stack([f[3] for f in frames]), scores=np.stack([f[4] for f in frames]),
                                question=self.question,
                                t_start=float(frames[0][0]), t_end=float(frames[-1][0]), arrival_s=arrival_mono,
                                reuse_key=sid, scene_change=win.cut)   # cells unchanged since the last window: reused
        win.pending, win.pending_meta = self.batcher.submit(request), (request.t_start, request.t_end)
        win.cut, win.last_end = False, request.t_end

    def _collect(self, sid: str, win: _Window) -> list[AnswerItem]:
        if win.pending is None or not win.pending.done():
            return []
        future, (t_start, t_end) = win.pending, win.pending_meta
        win.pending = win.pending_meta = None
        result = future.result()   # a VLM error fails the stage, naming the stream
        return [AnswerItem.of(sid, t_start, t_end, self.question, result,
                              getattr(getattr(self.batcher, "vlm", None), "name", None))]
