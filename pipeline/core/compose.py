"""The graphs, each wired in one function: every stage and every channel's capacity and policy
is visible here.

    run / batch:  decode ──▶ texture ──▶ realize ──▶ [vlm] ──▶ sink     (offline: every channel
                  BLOCKs, backpressure, never a dropped frame)
    live:         capture ──▶ texture ──▶ realize ──▶ [vlm] ──▶ sink    (the capture buffers keep
                  the newest frames; capture -> texture DROP_OLDEST as a last guard; downstream BLOCK:
                  what was processed is never thrown away)
"""
from __future__ import annotations

import threading
from typing import Any, Callable, TextIO

import torch

from arr_coc._validate import ConfigError
from arr_coc.model import ARRCOC
from sources.live import LiveSource

from ..config import PipelineConfig
from .frontend_graphs import FrontendGraphs
from .graph import Channel, Graph, Policy, Stage
from .items import FrameAllocation, Outcome, RunStatus
from .live_stages import CaptureStage, LiveRealizeStage, LiveTextureStage, StreamCounters, stream_ending
from .stages import DecodeStage, RealizeStage, SinkStage, TextureStage


def frontend_graphs(model: ARRCOC, grid: tuple[int, int], query: torch.Tensor, cfg: PipelineConfig,
                    device: torch.device) -> FrontendGraphs | None:
    """CUDA-graph replay for the texture and realize stages (GPU only, runtime.cuda_graphs)."""
    if device.type != "cuda" or not cfg.runtime.cuda_graphs:
        return None
    return FrontendGraphs(model, grid, query.to(device))


def compose(source: Any, writer: Any, model: ARRCOC, query: torch.Tensor, grid: tuple[int, int],
            cfg: PipelineConfig, device: torch.device, status: RunStatus,
            overlay: Any = None, vlm_stage: Stage | None = None, *, query_mask: torch.Tensor | None = None,
            graphs: FrontendGraphs | None = None,
            on_frames: Callable[[list[FrameAllocation]], None] | None = None) -> Graph:
    """Wire the run graph: decode -> texture -> realize -> [vlm] -> sink. graphs: the front end's
    CUDA graphs (frontend_graphs: new ones, or an earlier run's to reuse; None: eager).
    writer None: no store; on_frames: the sink hands each batch's allocations to it."""
    capacity = cfg.runtime.queue_capacity
    # frames go straight to the device unless something reads them on the host (VLM, overlay)
    host_frames = vlm_stage is not None or overlay is not None
    decode = DecodeStage(source, cfg.runtime.batch_size, pin=device.type == "cuda", status=status,
                         device=None if host_frames else device)
    if graphs is not None:  # the run's full batches: captured now (unless earlier), not inside the timed run
        graphs.prepare(cfg.runtime.batch_size, source.height, source.width, query.to(device),
                       None if query_mask is None else query_mask.to(device))
    texture = TextureStage(model, device, grid, graphs)
    realize = RealizeStage(model, device, query, query_mask=query_mask,
                           vlm_fps=cfg.vlm.fps if vlm_stage is not None else None, graphs=graphs)
    def outcome(stream_id: str) -> Outcome:
        with status.lock:
            if status.stopped:
                return "incomplete"
            return "damaged" if status.truncated else "complete"   # truncated: decoded up to the damage
    sink = SinkStage({source.stream_id: writer}, outcome=outcome, overlay=overlay,
                     on_frames=on_frames)
    graph = Graph()
    graph.add_flow(decode, texture, Channel(capacity, Policy.BLOCK))
    graph.add_flow(texture, realize, Channel(capacity, Policy.BLOCK))
    add_answer_tail(graph, realize, vlm_stage, sink, capacity)
    return graph


def add_answer_tail(graph: Graph, realize: Stage, vlm_stage: Stage | None, sink: Stage, capacity: int) -> None:
    """realize -> [vlm] -> sink, blocking: allocations and answers are never dropped."""
    if vlm_stage is None:
        graph.add_flow(realize, sink, Channel(capacity, Policy.BLOCK))
    else:
        graph.add_flow(realize, vlm_stage, Channel(capacity, Policy.BLOCK))
        graph.add_flow(vlm_stage, sink, Channel(capacity, Policy.BLOCK))


def compose_live(sources: list[LiveSource], writers: dict[str, Any], model: Any, query: torch.Tensor,
                 grids: dict[str, tuple[int, int]], cfg: PipelineConfig, device: torch.device,
                 counters: dict[str, StreamCounters], stop: threading.Event, *, vlm_stage: Stage | None = None,
                 answers_out: TextIO | None = None, run_reason: Callable[[], str] = lambda: "stop",
                 graphs: FrontendGraphs | None = None) -> Graph:
    """Wire the live graph: capture -> texture -> realize -> [vlm] -> sink (see the module doc).
    run_reason: why the run stopped (live_stages.RunEnding.reason), for each stream's ending.
    graphs: the front end's CUDA graphs, one per batch shape for all streams (frontend_graphs: new
    ones, or a server's pool's, shared with its other runs; None: eager)."""
    # Live queues stay short: every batch queued is latency. One batch waits for the texture
    # stage (the capture buffers hold the newest frames meanwhile); processed batches block.
    capacity = min(2, cfg.runtime.queue_capacity)
    grid = next(iter(grids.values()))
    if any(g != grid for g in grids.values()):   # one texture stage holds one grid
        raise ConfigError("live sources of different sizes give different allocation grids "
                          f"{sorted(set(grids.values()))}; "
                          f"run them as separate `live` commands")
    capture = CaptureStage(sources, cfg.runtime.batch_size, pin=device.type == "cuda", stop=stop)
    if graphs is not None:
        # every batch shape the capture stage can hand over (a source's buffer caps a batch),
        # captured now: a capture mid-run stalls the stream that needs it, and it races the other
        # threads' CUDA calls (two live runs failed inside or just after one)
        largest = min(cfg.runtime.batch_size, max(s.config.buffer_frames for s in sources))
        for height, width in sorted({(s.height, s.width) for s in sources}):
            for batch in range(1, largest + 1):
                graphs.prepare(batch, height, width, query.to(device))   # a pooled set was made with another query
    texture = LiveTextureStage(model, device, grid, graphs)
    realize = LiveRealizeStage(model, device, query, vlm_fps=cfg.vlm.fps if vlm_stage is not None else None,
                               graphs=graphs)
    by_id = {s.stream_id: s for s in sources}
    sink = SinkStage(writers, outcome=lambda sid: stream_ending(by_id[sid], run_reason())[0], counters=counters,
                     answers_out=answers_out)
    sink.ending_attrs = lambda sid: stream_ending(by_id[sid], run_reason())[1]
    sink.late_gaps = lambda: capture.final_gaps
    graph = Graph()
    capture.outlet = graph.add_flow(capture, texture, Channel(1, Policy.DROP_OLDEST))
    graph.add_flow(texture, realize, Channel(capacity, Policy.BLOCK))
    add_answer_tail(graph, realize, vlm_stage, sink, capacity)
    return graph
