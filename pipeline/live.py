"""`python -m pipeline live SOURCE [SOURCE ...] --query Q`: answer a question continuously over live video.

    capture ──▶ texture ──▶ realize ──▶ [vlm] ──▶ sink
    (one capture thread per source; every source shares the stages, one batched VLM, one store)

`compose_live` is the one place where the graph is wired. Where things drop: only the capture
buffers (newest `live.buffer_frames` frames per source, drops counted per source). The capture
stage hands a batch on only when the texture queue has room, so a slow GPU or VLM makes the
capture buffers overflow (more drops) instead of queues growing (more latency, more memory).
Downstream channels BLOCK: what was processed (allocations, answers) is never thrown away. The
capture->texture channel is DROP_OLDEST as a last guard; its drops show in the metrics.

A reconnect (a `Gap` on the batch) resets the texture's last frame and the realizer's temporal
state of that stream, so the first frame after it is a new fixation; the sink records the gap.
Answers go to stdout as JSON lines and to the store; the status goes to stderr (a live line on a
terminal, JSON metrics lines otherwise).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, TextIO

import numpy as np
import torch

from arr_coc._validate import ConfigError, check_range
from sinks import ZarrStore, store_location
from sources.frame import Frame
from sources.live import Gap, LiveConfig, LiveSource, open_live

from .config import PipelineConfig
from .configio import to_dict
from .graph import Channel, Graph, Policy, Stage
from .stages import AllocationBatch, AnswerItem, FrameBatch, RealizeStage, TextureStage, stack_frames
from .vlm.geometry import VLMGeometry

_LATENCY_WINDOW = 512   # recent latencies kept per stream for p50 / p95
_POLL_S = 0.002         # capture stage poll when no source has a frame


@dataclass(frozen=True)
class LiveOptions:
    every_s: float = 2.0               # one answer per this many seconds over the latest window
    on_scene_change: bool = False      # answer at each scene change instead of every `every_s`
    duration_s: float | None = None    # stop after this long (None: until Ctrl-C / SIGTERM)
    metrics_every_s: float = 5.0       # JSON metrics period when stderr is not a terminal
    window_frames: int = 32            # most VLM frames per answer window

    def __post_init__(self) -> None:
        check_range("--every", self.every_s, 0.0, None, lo_open=True)
        if self.duration_s is not None:
            check_range("--duration", self.duration_s, 0.0, None, lo_open=True)
        check_range("--metrics-every", self.metrics_every_s, 0.0, None, lo_open=True)
        check_range("window_frames", self.window_frames, 1, 4096)


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

    def produce(self) -> Iterator[LiveBatch]:
        turn = 0
        while not self.stop.is_set() and not all(s.finished for s in self.sources):
            if self.outlet is not None and self.outlet.depth >= self.outlet.capacity:
                self.stop.wait(_POLL_S)   # downstream is busy: frames wait (and drop) in the capture buffers
                continue
            for k in range(len(self.sources)):
                source = self.sources[(turn + k) % len(self.sources)]
                frames, gap = source.take(self.batch_size, timeout_s=0.0)
                if frames:
                    turn = (turn + k + 1) % len(self.sources)
                    yield LiveBatch(source.stream_id, frames, stack_frames(frames, self.pin), gap=gap)
                    break
            else:
                self.stop.wait(_POLL_S)

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
    rgb: collections.deque = field(default_factory=collections.deque)     # (pts, arrival_s, rgb, lod)
    next_due: float | None = None
    pending: Future | None = None
    pending_meta: tuple[float, float] | None = None
    seen: bool = False     # a frame of this stream has been through; the first one is no scene change


def warm_vlm(vlm: Any, question: str, sizes: list[tuple[int, int]], cfg: PipelineConfig,
             options: LiveOptions) -> None:
    """Capture the VLM's decoders and prefill graphs for the batches and prefix lengths live
    answering will ask for, now, during setup: each capture takes a few hundred ms that would
    otherwise land on an answer's latency (and, under CAPTURE_LOCK, stall the stages' page-locked
    allocations). Prefix lengths are estimated from each source's window: `every_s` seconds at the
    VLM's frame rate, frames paired by the temporal patch, each pair keeping between one frame's and
    two frames' share of the cells at the retention in use (fraction mode; other shapes get
    captured when they first occur)."""
    g = vlm.geometry
    frames = max(1, min(options.window_frames, round(options.every_s * cfg.vlm.fps)))
    pairs = -(-frames // g.temporal_patch_size)
    retention = cfg.model.attending.retention
    lengths = set()
    for height, width in sizes:
        gh, gw = g.grid(height, width)
        lo, hi = pairs * max(1, round(retention * gh * gw)), pairs * min(gh * gw, 2 * round(retention * gh * gw))
        for kept in range(lo, hi + 64, 64):                 # the prefill pads lengths to multiples of 64
            lengths.add(vlm.prefix_length(question, min(kept, hi)))
    largest = vlm.config.max_batch                           # the batcher's batches are 1..largest
    vlm.warm_up([1 << i for i in range(largest.bit_length())] + [largest], sorted(lengths))


class LiveVLMStage(Stage):
    """Per-stream answer windows over the latest `every_s` seconds, asked through one VLMBatcher.

    Requests are submitted, not awaited: a stream asks again only when its previous answer is back,
    so a slow VLM makes answers rarer, never later or queued without bound.
    """

    name = "vlm"

    def __init__(self, batcher: Any, question: str, options: LiveOptions) -> None:
        self.batcher, self.question, self.options = batcher, question, options
        self.windows: dict[str, _Window] = collections.defaultdict(_Window)

    def process(self, item: AllocationBatch) -> Iterable[Any]:
        out: list[Any] = [item]
        allocation = item.wait()
        sid = item.batch.stream_id
        win = self.windows[sid]
        if getattr(item.batch, "gap", None) is not None:
            win.rgb.clear()   # frames from before the outage do not describe what is in view now
            win.next_due = None
        marks = item.vlm_frames or [True] * len(item.batch.frames)
        for frame, lod, take, cut in zip(item.batch.frames, allocation.lod.numpy(), marks,
                                         allocation.scene_change.numpy()):
            if take or cut:
                self._add(win, frame, lod)
            if self.options.on_scene_change:
                # the first frame that reaches this stage opens the stream, whatever its index
                # (in realtime mode the first frames may have been dropped): no change to answer
                due = bool(cut) and win.seen
            else:
                win.next_due = frame.pts_s + self.options.every_s if win.next_due is None else win.next_due
                due = frame.pts_s >= win.next_due
            win.seen = True
            out += self._collect(sid, win)
            if due and win.pending is None and win.rgb:
                self._submit(sid, win)
                while not self.options.on_scene_change and win.next_due <= frame.pts_s:
                    win.next_due += self.options.every_s
        return out

    def finish(self) -> Iterable[Any]:
        out: list[Any] = []
        for sid, win in self.windows.items():
            if win.pending is not None:
                win.pending.exception()   # wait: an answer already asked for is still written
                out += self._collect(sid, win)
        return out

    def close(self) -> None:
        self.batcher.close()

    def _add(self, win: _Window, frame: Frame, lod: np.ndarray) -> None:
        win.rgb.append((frame.pts_s, frame.arrival_s, frame.rgb, lod))
        while win.rgb and win.rgb[0][0] < frame.pts_s - self.options.every_s:
            win.rgb.popleft()
        if len(win.rgb) > self.options.window_frames:  # keep an even spread of a long window
            kept = list(win.rgb)[1::2]
            win.rgb.clear()
            win.rgb.extend(kept)

    def _submit(self, sid: str, win: _Window) -> None:
        from .vlm import AnswerRequest

        frames = list(win.rgb)
        last_arrival = frames[-1][1] if frames[-1][1] is not None else time.time()
        # AnswerRequest.arrival_s is on the monotonic clock; the frame's arrival is wall-clock
        arrival_mono = time.monotonic() - (time.time() - last_arrival)
        request = AnswerRequest(stream_id=sid, frames=np.stack([f[2] for f in frames]),
                                keep=np.stack([f[3] for f in frames]), question=self.question,
                                t_start=float(frames[0][0]), t_end=float(frames[-1][0]), arrival_s=arrival_mono)
        win.pending, win.pending_meta = self.batcher.submit(request), (request.t_start, request.t_end)

    def _collect(self, sid: str, win: _Window) -> list[AnswerItem]:
        if win.pending is None or not win.pending.done():
            return []
        future, (t_start, t_end) = win.pending, win.pending_meta
        win.pending = win.pending_meta = None
        result = future.result()   # a VLM error fails the stage, naming the stream
        return [AnswerItem(stream_id=sid, t_start=t_start, t_end=t_end, question=self.question, text=result.text,
                           tokens_kept=result.tokens_kept, tokens_full=result.tokens_full,
                           latency_s=float(result.latency_s))]


class LiveSinkStage(Stage):
    """One StreamWriter per source: allocations, gaps and answers; answers also as JSON lines."""

    name = "sink"

    def __init__(self, writers: dict[str, Any], counters: dict[str, StreamCounters], answers_out: TextIO | None) -> None:
        self.writers, self.counters, self.answers_out = writers, counters, answers_out
        self.sources: dict[str, LiveSource] = {}   # set by run_live: a source that gave up is not complete
        self.interrupted = False                   # Ctrl-C / SIGTERM: no stream is complete
        self.answers: list[AnswerItem] = []
        self._closed = False

    def process(self, item: Any) -> Iterable[Any]:
        if isinstance(item, AnswerItem):
            self._answer(item)
            return ()
        sid = item.batch.stream_id
        writer, counters = self.writers[sid], self.counters[sid]
        gap: Gap | None = getattr(item.batch, "gap", None)
        if gap is not None:
            writer.add_gap(start_pts=gap.start_pts, end_pts=gap.end_pts, start_wall=gap.start_wall,
                           end_wall=gap.end_wall, reason=gap.reason)
            counters.gaps += 1
        allocation = item.wait()
        frames = item.batch.frames
        writer.append(pts=np.array([f.pts_s for f in frames], dtype=np.float64),
                      frame_index=np.array([f.index for f in frames], dtype=np.int64),
                      relevance=allocation.relevance.float().numpy(), tokens=allocation.tokens.numpy(),
                      scene_change=allocation.scene_change.numpy(), motion=allocation.motion.float().numpy())
        now = time.time()
        counters.frames_out += len(frames)
        counters.out_times.extend([now] * len(frames))
        counters.frame_latency.extend(now - f.arrival_s for f in frames if f.arrival_s is not None)
        return ()

    def _answer(self, item: AnswerItem) -> None:
        self.writers[item.stream_id].add_answers([item.row()])
        counters = self.counters[item.stream_id]
        counters.answers += 1
        counters.answer_latency.append(item.latency_s)
        self.answers.append(item)
        if self.answers_out is not None:
            self.answers_out.write(json.dumps({
                "stream": item.stream_id, "t_start": round(item.t_start, 3), "t_end": round(item.t_end, 3),
                "question": item.question, "text": item.text, "tokens_kept": item.tokens_kept,
                "tokens_full": item.tokens_full, "latency_s": round(item.latency_s, 4)}) + "\n")
            self.answers_out.flush()

    def finish(self) -> Iterable[Any]:
        self._close(failed=False)
        return ()

    def close(self) -> None:
        self._close(failed=True)   # only reached without finish() after a failure

    def _close(self, failed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        errors = []
        for sid, writer in self.writers.items():
            source = self.sources.get(sid)
            complete = not (failed or self.interrupted or (source is not None and source.error is not None))
            try:
                writer.close(complete=complete)
            except Exception as e:  # close every writer; report the first failure
                errors.append(e)
        if errors:
            raise errors[0]


def compose_live(sources: list[LiveSource], writers: dict[str, Any], model: Any, query: torch.Tensor,
                 grids: dict[str, tuple[int, int]], cfg: PipelineConfig, device: torch.device,
                 counters: dict[str, StreamCounters], stop: threading.Event, *, vlm_stage: Stage | None = None,
                 answers_out: TextIO | None = None) -> Graph:
    """Wire the live graph: capture -> texture -> realize -> [vlm] -> sink (see the module doc)."""
    # Live queues stay short: every batch queued is latency. One batch waits for the texture
    # stage (the capture buffers hold the newest frames meanwhile); processed batches block.
    capacity = min(2, cfg.runtime.queue_capacity)
    grid = next(iter(grids.values()))
    if any(g != grid for g in grids.values()):   # one texture stage holds one grid
        raise ConfigError(f"live sources of different sizes give different allocation grids {sorted(set(grids.values()))}; "
                          f"run them as separate `live` commands")
    capture = CaptureStage(sources, cfg.runtime.batch_size, pin=device.type == "cuda", stop=stop)
    from .run import add_answer_tail, frontend_graphs
    graphs = frontend_graphs(model, grid, query, cfg, device)  # one graph per batch size, all streams
    if graphs is not None:
        # every batch shape the capture stage can hand over (a source's buffer caps a batch),
        # captured now: a capture mid-run stalls the stream that needs it, and it races the other
        # threads' CUDA calls (two live runs on an H100 failed inside or just after one)
        largest = min(cfg.runtime.batch_size, max(s.config.buffer_frames for s in sources))
        for height, width in sorted({(s.height, s.width) for s in sources}):
            for batch in range(1, largest + 1):
                graphs.prepare(batch, height, width)
    texture = LiveTextureStage(model, device, grid, graphs)
    realize = LiveRealizeStage(model, device, query, vlm_fps=cfg.vlm.fps if vlm_stage is not None else None,
                               graphs=graphs)
    sink = LiveSinkStage(writers, counters, answers_out)
    graph = Graph()
    capture.outlet = graph.add_flow(capture, texture, Channel(1, Policy.DROP_OLDEST))
    graph.add_flow(texture, realize, Channel(capacity, Policy.BLOCK))
    add_answer_tail(graph, realize, vlm_stage, sink, capacity)
    return graph


@dataclass
class LiveResult:
    out: Path | str      # a local path or an fsspec URL
    stream_ids: list[str]
    complete: bool
    stopped: bool                       # ended by Ctrl-C / SIGTERM
    wall_s: float
    grid: tuple[int, int]
    streams: dict[str, dict[str, Any]]  # final per-source metrics (live_status.snapshot)
    answers: list[AnswerItem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # sources that gave up (one line each)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def open_sources(specs: list[str], config: LiveConfig) -> list[LiveSource]:
    """Open every source (one SourceError if any fails; the ones opened are closed again).
    Two sources with the same name get distinct stream ids (name, name_2, ...)."""
    from sources.live import parse_source

    seen: dict[str, int] = {}
    opened: list[LiveSource] = []
    try:
        for spec in specs:
            sid = parse_source(spec, realtime=config.realtime).stream_id
            seen[sid] = seen.get(sid, 0) + 1
            opened.append(open_live(spec, config=config, stream_id=sid if seen[sid] == 1 else f"{sid}_{seen[sid]}"))
    except BaseException:
        for source in opened:
            source.close()
        raise
    return opened


def run_live(specs: list[str], question: str, out: str | Path, cfg: PipelineConfig, *,
             live: LiveConfig | None = None, options: LiveOptions | None = None,
             answers_out: TextIO | None = None, status_out: TextIO | None = None, status_tty: bool | None = None,
             stop: threading.Event | None = None, on_graph: Any = None, slow_stage_s: float = 0.0,
             vlm: Any = None) -> LiveResult:
    """Watch the live sources and answer `question` until the duration ends, the sources end
    (realtime files), `stop` is set, or Ctrl-C / SIGTERM (KeyboardInterrupt, re-raised after the
    store is closed). Raises SourceError when a source cannot be opened at start.

    slow_stage_s: extra seconds the texture stage spends per batch (overload tests and benchmarks).
    vlm: an already loaded VLM to use instead of loading cfg.runtime.vlm (benchmarks reuse one).
    """
    from .live_status import StatusReporter, snapshot
    from .run import build_model, encode_query, load_answerer, resolve_device

    live, options = live or LiveConfig(), options or LiveOptions()
    stop = stop or threading.Event()
    device = resolve_device(cfg.runtime.device)
    sources = open_sources(specs, live)
    try:
        vlm = load_answerer(cfg, device) if vlm is None else vlm
        geometry = vlm.geometry if vlm is not None else VLMGeometry(min_pixels=cfg.vlm.min_pixels,
                                                                    max_pixels=cfg.vlm.max_pixels)
        grids = {s.stream_id: geometry.grid(s.height, s.width) for s in sources}
        store = ZarrStore.open(out, config={**to_dict(cfg), "live": _live_dict(live, options)})
        writers = {s.stream_id: store.stream(s.stream_id, source=s.name, query=question, fps=float(s.fps),
                                             width=s.width, height=s.height, grid=grids[s.stream_id],
                                             vlm=cfg.runtime.vlm, chunk_frames=cfg.output.chunk_frames, overwrite=True)
                   for s in sources}
        if vlm is not None:  # the VLM's own token embeddings: same space as its visual tokens
            query = vlm.text_embeddings(question).float()                   # (L, D)
        else:
            query = encode_query(question, device)                          # (384,)
        model = build_model(cfg, query.shape[-1], device)
    except BaseException:
        for source in sources:
            source.close()
        raise
    vlm_stage = None
    if vlm is not None:
        from .vlm.batcher import VLMBatcher
        if device.type == "cuda" and cfg.vlm.cuda_graphs:
            warm_vlm(vlm, question, [(s.height, s.width) for s in sources], cfg, options)
        vlm_stage = LiveVLMStage(VLMBatcher(vlm), question, options)
    counters = {s.stream_id: StreamCounters() for s in sources}
    graph = compose_live(sources, writers, model, query, grids, cfg, device, counters, stop,
                         vlm_stage=vlm_stage, answers_out=answers_out)
    sink: LiveSinkStage = graph.stages[-1]
    sink.sources = {s.stream_id: s for s in sources}
    if slow_stage_s > 0:
        _slow_down(graph.stages[1], slow_stage_s)
    if on_graph is not None:
        on_graph(graph)
    reporter = StatusReporter(sources, counters, every_s=options.metrics_every_s, stream=status_out,
                              tty=status_tty).start()
    timer = threading.Timer(options.duration_s, stop.set) if options.duration_s is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    start = time.perf_counter()
    try:
        graph.run(on_interrupt=lambda: (setattr(sink, "interrupted", True), stop.set()))
    finally:
        if timer is not None:
            timer.cancel()
        reporter.close()
    errors = [str(s.error) for s in sources if s.error is not None]
    return LiveResult(out=store_location(out), stream_ids=[s.stream_id for s in sources], complete=not errors,
                      stopped=False, wall_s=time.perf_counter() - start, grid=next(iter(grids.values())),
                      streams=snapshot(sources, counters)["streams"], answers=list(sink.answers), errors=errors,
                      metrics=graph.report(), notes=[vlm.warning] if vlm is not None and vlm.warning else [])


def _slow_down(stage: Stage, seconds: float) -> None:
    """Make `stage` take `seconds` longer per item: a deliberately slow GPU for overload tests."""
    process = stage.process

    def slow(item: Any) -> Iterable[Any]:
        time.sleep(seconds)
        return process(item)
    stage.process = slow


def _live_dict(live: LiveConfig, options: LiveOptions) -> dict[str, Any]:
    from dataclasses import asdict
    return {**asdict(live), **asdict(options)}


def add_live_parser(sub: Any, common: Any) -> None:
    """Register `live` on the CLI's subparsers (common: the shared options of run/demo/batch)."""
    p = sub.add_parser("live", help="answer a question continuously over live video (camera, RTSP/HTTP, --realtime file)")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="camera index (0), device (/dev/video0), rtsp(s):// or http(s):// URL, or a file with "
                        "--realtime; several share one GPU and one batched VLM")
    p.add_argument("--query", required=True, help="the question to answer / attend to")
    common(p)
    p.set_defaults(every=2.0)
    p.add_argument("--on-scene-change", action="store_true", help="answer at each scene change instead of every --every s")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="stop after this long (default: until Ctrl-C)")
    p.add_argument("--realtime", action="store_true", help="allow files, played at their real frame rate")
    p.add_argument("--max-reconnects", type=int, metavar="N",
                   help="give up a source after N failed reconnect attempts in a row (default: retry forever)")
    p.add_argument("--transport", choices=["tcp", "udp"], default="tcp", help="RTSP transport (default: tcp)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="open / read timeout: a stream silent this long is reconnected (default: 5)")
    p.add_argument("--buffer", type=int, default=16, metavar="FRAMES",
                   help="newest frames kept per source; older ones are dropped and counted (default: %(default)s)")
    p.add_argument("--metrics-every", type=float, default=5.0, metavar="SECONDS",
                   help="period of the JSON metrics on stderr when it is not a terminal (default: 5)")
    p.set_defaults(func=cmd_live)


def cmd_live(args: argparse.Namespace) -> int:
    from .cli import EXIT_FAILED, EXIT_OK, load_run_config

    if args.overlay:
        raise ConfigError("--overlay is not supported by `live` (use `run` on a recording)")
    cfg = load_run_config(args)
    live = LiveConfig(transport=args.transport, open_timeout_s=args.timeout, read_timeout_s=args.timeout,
                      max_reconnects=args.max_reconnects, buffer_frames=args.buffer, realtime=args.realtime)
    options = LiveOptions(every_s=args.every, on_scene_change=args.on_scene_change, duration_s=args.duration,
                          metrics_every_s=args.metrics_every)
    out = store_location(args.out) if args.out else Path("live.zarr")
    result = run_live(args.sources, args.query, out, cfg, live=live, options=options, answers_out=sys.stdout)
    summary = {"summary": {"out": str(result.out), "wall_s": round(result.wall_s, 2), "grid": list(result.grid),
                           "complete": result.complete, "streams": result.streams}}
    print(json.dumps(summary), file=sys.stderr)
    for note in result.notes:
        print(f"warning: {note}", file=sys.stderr)
    if args.verbose:
        for row in result.metrics:
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    for error in result.errors:
        print(f"error: {error}", file=sys.stderr)
    return EXIT_FAILED if result.errors else EXIT_OK
