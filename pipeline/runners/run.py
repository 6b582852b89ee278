"""One video file through decode -> texture -> realize -> [vlm] -> sink (graph: core/compose.py).
Offline input blocks (backpressure): no frame is ever dropped. `run_video` writes a store (or
not); `AllocationStream` runs the same graph and hands its per-frame allocations to an iterator.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from arr_coc.model import ARRCOC
from sinks import ZarrStore, store_location
from sources.process import ProcessSource

from ..config import PipelineConfig
from ..configio import to_dict
from ..core.compose import compose, frontend_graphs
from ..core.frontend_graphs import FrontendGraphsPool, frontend_key
from ..core.graph import Graph
from ..core.setup import build_model, check_query, encode_query, open_source, open_writer, runtime_device
from ..core.items import AnswerItem, FrameAllocation, RunStatus
from ..core.stages import VLMStage
from ..vlm.geometry import VLMGeometry

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    stream_id: str
    out: Path | str | None  # a local path or an fsspec URL; None: no store was written
    frames: int
    complete: bool
    truncated: bool
    stopped: bool
    wall_s: float
    grid: tuple[int, int]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    answers: list[AnswerItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s if self.wall_s > 0 else 0.0


def run_video(path: str | Path, question: str, out: str | Path | None, cfg: PipelineConfig, *,
              overlay_path: str | Path | None = None, progress: bool | None = None,
              on_graph: Callable[[Graph], None] | None = None,
              query_embedding: torch.Tensor | None = None, vlm: Any = None, model: ARRCOC | None = None,
              stream_id: str | None = None, vlm_factory: Callable[[torch.device], Any] | None = None,
              status: RunStatus | None = None,
              on_frames: Callable[[list[FrameAllocation]], None] | None = None,
              frontends: FrontendGraphsPool | None = None) -> RunResult:
    """Process one video file end to end. Raises SourceError / SinkError / StageError on failure.

    out:             the store; None writes none (the answers and on_frames are the output)
    query_embedding: (384,) use this instead of encoding `question` with MiniLM (callers that
                     cannot load it, e.g. benchmarks on a machine without its wheel)
    vlm, model:      an already loaded VLM (or an object with its interface: geometry, config,
                     answer, warning) and ARR-COC model (core/setup.build_model with answering=True
                     where a VLM answers), instead of loading cfg's (the server shares one of each
                     between its requests)
    vlm_factory:     device -> the VLM (or None), loaded on first use (the Python API keeps one)
    stream_id:       the stream's name in the store (default: the file stem)
    status:          the run's status, for a caller that stops it from another thread (see
                     AllocationStream.close)
    on_frames:       called by the sink with each batch's allocations, in order
    frontends:       front-end graphs shared with other runs (a server's requests and live streams),
                     taken for this run's shape and given back at its end
    """
    from sinks import OverlayWriter

    device = runtime_device(cfg)
    if query_embedding is not None:
        check_query(query_embedding)
    # without a VLM or an overlay no pixels are read on the host: the worker may hand over YUV
    device_color = device.type == "cuda" and cfg.runtime.vlm == "none" and overlay_path is None
    source = open_source(path, cfg, stream_id=stream_id, device_color=device_color)
    writer = None
    try:
        if vlm is None:
            from ..vlm.loading import load_answerer
            vlm = load_answerer(cfg, device) if vlm_factory is None else vlm_factory(device)
        geometry = vlm.geometry if vlm is not None else VLMGeometry(min_pixels=cfg.vlm.min_pixels,
                                                                    max_pixels=cfg.vlm.max_pixels)
        grid = geometry.grid(source.height, source.width)
        if out is not None:
            store = ZarrStore.open(out, config=to_dict(cfg))
            writer = open_writer(store, source.stream_id, to_dict(cfg), source=str(path), query=question,
                                 fps=float(source.fps), width=source.width, height=source.height, grid=grid,
                                 vlm=cfg.runtime.vlm, chunk_frames=cfg.output.chunk_frames, overwrite=True)
    except BaseException:
        source.close()
        raise
    query = query_embedding.to(device) if query_embedding is not None else encode_query(question, device)
    model = build_model(cfg, device, answering=vlm is not None) if model is None else model
    if isinstance(source, ProcessSource):
        try:
            source.wait_ready()  # its start overlapped the setup above; decoding starts with the clock
        except BaseException:
            source.close()
            if writer is not None:
                writer.close(complete=False)
            raise
    status = RunStatus() if status is None else status
    overlay = None
    if overlay_path is not None:
        overlay = OverlayWriter(overlay_path, fps=float(source.fps), width=source.width, height=source.height)
    vlm_stage = None if vlm is None else VLMStage(vlm, question, cfg.runtime.every_s)
    shape = frontend_key(grid, [(source.height, source.width)])
    # a pool's set, or none (eager) when every set is in use: never one of the run's own beside the pool
    graphs = (frontend_graphs(model, grid, query, cfg, device) if frontends is None
              else frontends.take(shape, model, grid, query, cfg, device))
    try:
        graph = compose(source, writer, model, query, grid, cfg, device, status, overlay, vlm_stage,
                        on_frames=on_frames, graphs=graphs)
        if on_graph is not None:
            on_graph(graph)
        bar = _progress_bar(source, progress)
        start = time.perf_counter()
        try:
            graph.run(on_progress=(lambda stage, item: bar.update(item.frames_count) if stage.name == "sink" else None)
                      if bar is not None else None,
                      on_interrupt=lambda: setattr(status, "stopped", True))
        finally:
            if bar is not None:
                bar.close()
    finally:
        if frontends is not None:
            frontends.give_back(shape, graphs)
    wall = time.perf_counter() - start
    sink = graph.stages[-1]
    return RunResult(stream_id=source.stream_id, out=None if out is None else store_location(out),
                     frames=sink.frames_written, complete=not (status.truncated or status.stopped),
                     truncated=status.truncated, stopped=status.stopped, wall_s=wall, grid=grid,
                     metrics=graph.report(), answers=list(sink.answers),
                     notes=[vlm.warning] if vlm is not None and vlm.warning else [])


_END = object()


class _Handoff:
    """What the run's thread and the iterator share. The thread holds only this, not the
    AllocationStream, so an abandoned stream is collected and its __del__ can stop the run."""

    def __init__(self, capacity: int) -> None:
        # bounded: a slow consumer holds the graph back (backpressure), as a slow sink does
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.status = RunStatus()
        self.closed = threading.Event()
        self.composed = threading.Event()
        self.graph: Graph | None = None
        self.error: BaseException | None = None
        self.result: RunResult | None = None

    def run(self, path: str | Path, question: str, out: str | Path | None, cfg: PipelineConfig,
            vlm_factory: Callable[[torch.device], Any] | None, query_embedding: torch.Tensor | None) -> None:
        try:
            self.result = run_video(path, question, out, cfg, progress=False, vlm_factory=vlm_factory,
                                    query_embedding=query_embedding, status=self.status, on_graph=self.on_graph,
                                    on_frames=self.put)
        except BaseException as e:  # raised in the consumer's thread
            self.error = e
        finally:
            self.composed.set()
            self.put([_END])

    def on_graph(self, graph: Graph) -> None:
        self.graph = graph
        self.composed.set()

    def put(self, items: list[Any]) -> None:
        for item in items:
            while not self.closed.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def stop(self) -> None:
        """Stop the graph's source; what it produced drains to the sink, which closes the store
        with complete=false. Frames no one takes any more are dropped here."""
        if not self.closed.is_set():
            self.closed.set()
            with self.status.lock:
                self.status.stopped = True
            self.graph.stop()


class AllocationStream:
    """A video's per-frame allocations as the run graph makes them: run_video in a thread, its sink
    handing each frame over (no store unless `out`). Iterate it; stop early with close() (or by
    leaving a `with` block, or dropping it): the graph stops, and a store is closed with
    complete=false.

    Setup errors (a missing video, a bad config) are raised here, before the first frame; a stage's
    failure is raised by the iteration, after the frames processed before it.
    """

    def __init__(self, path: str | Path, question: str, cfg: PipelineConfig, *, out: str | Path | None = None,
                 vlm_factory: Callable[[torch.device], Any] | None = None,
                 query_embedding: torch.Tensor | None = None) -> None:
        self._handoff = handoff = _Handoff(2 * cfg.runtime.batch_size)
        self._thread = threading.Thread(target=handoff.run, args=(path, question, out, cfg, vlm_factory,
                                                                  query_embedding),
                                        name="allocations", daemon=True)
        self._thread.start()
        handoff.composed.wait()
        if handoff.graph is None:  # setup failed
            self._thread.join()
            raise handoff.error

    @property
    def result(self) -> RunResult | None:
        """The run's summary, once it ended."""
        return self._handoff.result

    def __iter__(self) -> Iterator[FrameAllocation]:
        return self

    def __next__(self) -> FrameAllocation:
        handoff = self._handoff
        if handoff.closed.is_set():
            raise StopIteration
        item = handoff.queue.get()
        if item is _END:
            handoff.closed.set()
            self._thread.join()
            if handoff.error is not None:
                raise handoff.error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the run (if it still runs) and wait for its thread; the frames decoded so far drain."""
        self._handoff.stop()
        self._thread.join()

    def __enter__(self) -> "AllocationStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # an abandoned iterator must not leave its graph waiting for it
        handoff = getattr(self, "_handoff", None)
        if handoff is not None and handoff.graph is not None:
            handoff.stop()


def _progress_bar(source: Any, progress: bool | None):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm
    total = getattr(source, "frame_count", None)
    return tqdm(total=total, unit="frame", desc=source.stream_id, dynamic_ncols=True, file=sys.stderr)


def print_summary(result: RunResult, verbose: bool = False) -> None:
    """The run's JSON summary on stdout (frames, scene changes, tokens, answers); warnings on stderr."""
    import json

    from sinks import read_stream

    data = read_stream(result.out, result.stream_id)
    tokens = data["tokens"].reshape(len(data["tokens"]), -1).sum(1) if len(data["tokens"]) else []
    gh, gw = result.grid
    summary = {
        "stream": result.stream_id, "out": str(result.out), "frames": result.frames,
        "fps": round(result.fps, 1), "grid": [gh, gw], "complete": result.complete,
        "scene_changes": [int(i) for i in data["frame_index"][data["scene_change"]]],
        "mean_tokens_per_frame": round(float(sum(tokens)) / max(1, len(tokens)), 2),
        "tokens_per_frame_full": gh * gw,
        "answers": [{"t_start": a.t_start, "t_end": a.t_end, "text": a.text, "no_answer": a.no_answer,
                     "tokens_kept": a.tokens_kept, "tokens_full": a.tokens_full} for a in result.answers],
    }
    if result.truncated:
        summary["damaged"] = True   # done up to the damage: core/damage.py
    if result.notes:
        summary["notes"] = result.notes
    print(json.dumps(summary))
    for a in result.answers:
        if a.no_answer:
            print(f"warning: {a.t_start:.1f}-{a.t_end:.1f} s: no answer ({a.no_answer})", file=sys.stderr)
    for note in result.notes:
        log.warning("%s", note)
    if result.truncated:  # the source already warned about the damage itself
        log.warning("%s: stored the %d frames decoded before the damage (complete=false, damaged=true)",
                    result.stream_id, result.frames)
    if verbose:
        for row in result.metrics:
            log.info("  %s", "  ".join(f"{k}={v}" for k, v in row.items()))
