"""Answer a question continuously over live video: `run_live` opens the sources, builds the model
and the VLM (core/setup.py), wires the live graph (core/compose.py: compose_live) and runs it
until the duration ends, the sources end, a stop event or Ctrl-C. Answers go to `answers_out` as
JSON lines and to the store; the status to `status_out` (a live line on a terminal, JSON metrics
lines otherwise).
"""
from __future__ import annotations

import functools
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TextIO

from arr_coc._validate import ConfigError
from sinks import ZarrStore, store_location
from sources.live import Gap, LiveConfig, LiveSource

from ..config import PipelineConfig, validate_every
from ..configio import to_dict
from ..core.compose import compose_live, frontend_graphs
from ..core.frontend_graphs import FrontendGraphsPool, frontend_key
from ..core.graph import Stage
from ..core.items import AnswerItem
from ..core.live_stages import LiveOptions, LiveVLMStage, RunEnding, StreamCounters, stream_ending, warm_vlm
from ..core.stages import SinkStage
from ..core.warmup import WarmUpReport
from ..vlm.geometry import VLMGeometry

if TYPE_CHECKING:
    import torch


@dataclass
class LiveResult:
    out: Path | str      # a local path or an fsspec URL
    stream_ids: list[str]
    complete: bool                      # every stream's store is whole (core/live_stages.py: stream_ending)
    stopped: bool                       # ended by Ctrl-C / SIGTERM
    wall_s: float
    grid: tuple[int, int]
    streams: dict[str, dict[str, Any]]  # final per-source metrics (live_status.snapshot)
    answers: list[AnswerItem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # sources that gave up (one line each)
    damaged: list[str] = field(default_factory=list)  # --realtime files that damage cut short
    metrics: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warm_up: WarmUpReport | None = None  # what warm-up captured before the first frame (None: none ran)


def open_sources(specs: list[str], config: LiveConfig, stream_ids: list[str] | None = None) -> list[LiveSource]:
    """Open every source, up to OPEN_AT_ONCE at a time (sources.live.open_many: one SourceError if any
    fails, the first in the order of `specs`; the ones opened are closed again), or in
    live.capture_processes worker processes. Opening one by one cost a live stream's probe each (~0.8 s
    on loopback), growing with the streams already running: 32 cameras waited ~30 s. Two sources with
    the same name get distinct stream ids (name, name_2, ...), unless `stream_ids` names each one."""
    from sources.live import open_many, parse_source

    if stream_ids is not None and len(stream_ids) != len(specs):
        raise ValueError(f"stream_ids names {len(stream_ids)} streams for {len(specs)} sources")
    seen: dict[str, int] = {}
    sids: list[str] = []
    for k, spec in enumerate(specs):   # every spec is checked before anything is opened
        sid = parse_source(spec, realtime=config.realtime).stream_id
        seen[sid] = seen.get(sid, 0) + 1
        if stream_ids is not None:
            sid = stream_ids[k]
        elif seen[sid] > 1:
            sid = f"{sid}_{seen[sid]}"
        sids.append(sid)
    workers = config.capture_workers(len(specs))
    if workers:
        from sources.capture_process import open_in_processes
        return open_in_processes(specs, sids, config, workers)
    return open_many(list(zip(specs, sids)), config)


def run_live(specs: list[str], question: str, out: str | Path, cfg: PipelineConfig, *,
             live: LiveConfig | None = None, options: LiveOptions | None = None,
             answers_out: TextIO | None = None, status_out: TextIO | None = None, status_tty: bool | None = None,
             stop: threading.Event | None = None, on_graph: Any = None, slow_stage_s: float = 0.0,
             vlm: Any = None, model: Any = None, query_embedding: torch.Tensor | None = None,
             stream_ids: list[str] | None = None,
             on_answer: Callable[[AnswerItem], None] | None = None,
             on_gap: Callable[[str, Gap], None] | None = None,
             frontends: FrontendGraphsPool | None = None) -> LiveResult:
    """Watch the live sources and answer `question` until the duration ends, the sources end
    (realtime files), `stop` is set, or Ctrl-C / SIGTERM (KeyboardInterrupt, re-raised after the
    store is closed). Raises SourceError when a source cannot be opened at start.

    slow_stage_s: extra seconds the texture stage spends per batch (overload tests and benchmarks).
    vlm: an already loaded VLM to use instead of loading cfg.runtime.vlm (benchmarks reuse one).
    model: an already built ARR-COC model (the server shares one; core/setup.build_model).
    query_embedding: (384,) use this instead of encoding `question` with MiniLM (benchmarks on a
        machine without its wheel).
    stream_ids: the streams' names in the store, one per source (default: from the sources).
    on_answer, on_gap: called from the sink's thread with each answer / each reconnect gap (a
        stream id and its Gap), after the store has it (the server's event streams).
    frontends: front-end graphs shared with other runs (a server's requests and live streams), taken
        for this run's shape (frontend_key) and given back at its end; default: the run's own.
    """
    from ..core.live_status import StatusReporter, snapshot
    from ..core.setup import build_model, check_query, encode_query, open_writer, runtime_device
    from ..vlm.loading import load_answerer

    live, options = live or LiveConfig(), options or LiveOptions()
    stop = stop or threading.Event()
    ending = RunEnding(stop)
    device = runtime_device(cfg)
    if query_embedding is not None:
        check_query(query_embedding)
    sources = open_sources(specs, live, stream_ids)
    remote, taken = None, False
    try:
        if (vlm is not None or cfg.runtime.vlm != "none") and not options.on_scene_change:
            check_every(options.every_s, sources)   # before a model is loaded or anything written
        if vlm is None and options.vlm_process and cfg.runtime.vlm != "none":
            from ..vlm.remote import RemoteVLM
            vlm = remote = RemoteVLM(functools.partial(load_answerer, cfg, device))
        vlm = load_answerer(cfg, device) if vlm is None else vlm
        if vlm is None:   # the sources are open: say what this run makes before it starts
            warnings.warn(f"no VLM is loaded (--vlm none): allocation only. Every frame's homunculus goes to {out}; "
                          "no answers are printed. For answers: --vlm arrcoc-synth-qa (shipped, generated scenes "
                          "only) or a Qwen2-VL id or snapshot", stacklevel=2)
        geometry = vlm.geometry if vlm is not None else VLMGeometry(min_pixels=cfg.vlm.min_pixels,
                                                                    max_pixels=cfg.vlm.max_pixels)
        grids = {s.stream_id: geometry.grid(s.height, s.width) for s in sources}
        config = {**to_dict(cfg), "live": _live_dict(live, options)}
        store = ZarrStore.open(out, config=config)
        writers = {s.stream_id: open_writer(store, s.stream_id, config, source=s.name, query=question,
                                            fps=float(s.fps), width=s.width, height=s.height,
                                            grid=grids[s.stream_id], vlm=cfg.runtime.vlm,
                                            chunk_frames=cfg.output.chunk_frames, overwrite=True)
                   for s in sources}
        query = query_embedding.to(device) if query_embedding is not None else encode_query(question, device)
        model = build_model(cfg, device, answering=vlm is not None) if model is None else model
        vlm_stage, warmed = None, None
        if vlm is not None:
            from ..vlm.batcher import VLMBatcher
            warm = options.warm_up
            if warm if warm is not None else (device.type == "cuda" and cfg.vlm.cuda_graphs):
                warmed = warm_vlm(vlm, question, [(s.height, s.width) for s in sources], cfg, options)
            vlm_stage = LiveVLMStage(VLMBatcher(vlm), question, options, vlm_fps=cfg.vlm.fps)
        counters = {s.stream_id: StreamCounters() for s in sources}
        shape = frontend_key(next(iter(grids.values())), [(s.height, s.width) for s in sources])
        # a pool's set, or none (eager) when every set is in use: never one of the run's own beside the pool
        graphs = (frontend_graphs(model, shape[0], query, cfg, device) if frontends is None
                  else frontends.take(shape, model, shape[0], query, cfg, device))
        taken = frontends is not None
        graph = compose_live(sources, writers, model, query, grids, cfg, device, counters, stop, graphs=graphs,
                             vlm_stage=vlm_stage, answers_out=answers_out, run_reason=lambda: ending.reason)
        sink: SinkStage = graph.stages[-1]
        sink.on_answer, sink.on_gap = on_answer, on_gap
        if slow_stage_s > 0:
            _slow_down(graph.stages[1], slow_stage_s)
        if on_graph is not None:
            on_graph(graph)
        reporter = StatusReporter(sources, counters, every_s=options.metrics_every_s, stream=status_out,
                                  tty=status_tty).start()
        timer = None
        if options.duration_s is not None:
            timer = threading.Timer(options.duration_s, ending.end, ("duration",))
        if timer is not None:
            timer.daemon = True
            timer.start()
    except BaseException:    # a failed setup leaves no source open, no VLM process, no graphs taken
        for source in sources:
            source.close()
        if remote is not None:
            remote.close()
        if taken:
            frontends.give_back(shape, graphs)
        raise
    start = time.perf_counter()
    switch_interval = sys.getswitchinterval()
    if options.switch_interval_ms is not None:
        sys.setswitchinterval(options.switch_interval_ms / 1e3)
    try:
        graph.run(on_interrupt=lambda: (setattr(sink, "interrupted", True), ending.end("interrupt")))
    finally:
        sys.setswitchinterval(switch_interval)
        if timer is not None:
            timer.cancel()
        reporter.close()
        if remote is not None:
            remote.close()
        if taken:
            frontends.give_back(shape, graphs)
    errors = [str(s.error) for s in sources if s.error is not None]
    damaged = [s.stream_id for s in sources if s.truncated and s.error is None]
    endings = {s.stream_id: stream_ending(s, ending.reason) for s in sources}
    streams = snapshot(sources, counters)["streams"]
    for sid, (outcome, attrs) in endings.items():
        streams[sid].update(attrs, complete=outcome == "complete")
    return LiveResult(out=store_location(out), stream_ids=[s.stream_id for s in sources],
                      complete=all(outcome == "complete" for outcome, _ in endings.values()), damaged=damaged,
                      stopped=False, wall_s=time.perf_counter() - start, grid=next(iter(grids.values())),
                      streams=streams, answers=list(sink.answers), errors=errors,
                      metrics=graph.report(), notes=[vlm.warning] if vlm is not None and vlm.warning else [],
                      warm_up=warmed)


def check_every(every_s: float, sources: list[LiveSource]) -> None:
    """ConfigError (one line naming the source) unless `every_s` is at least one frame interval of
    each source: a shorter answer period has no frame of its own to answer on."""
    for source in sources:
        try:
            validate_every(every_s, source.fps, name="--every")
        except ConfigError as e:
            raise ConfigError(f"{source.name}: {e}") from None


def _slow_down(stage: Stage, seconds: float) -> None:
    """Make `stage` take `seconds` longer per item: a deliberately slow GPU for overload tests."""
    process = stage.process

    def slow(item: Any) -> Iterable[Any]:
        time.sleep(seconds)
        return process(item)
    stage.process = slow


def _live_dict(live: LiveConfig, options: LiveOptions) -> dict[str, Any]:
    from dataclasses import asdict, fields
    # live.connect is how the run reaches its streams (a server's fetch policy), not a setting
    return {**{f.name: getattr(live, f.name) for f in fields(live) if f.name != "connect"}, **asdict(options)}
