"""`python -m pipeline run`: one video through decode -> texture -> realize -> [vlm] -> sink.

`compose` is the one place where the graph is wired; each channel's capacity and policy is
visible there. Offline input blocks (backpressure), it never drops a frame.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from arr_coc._validate import ConfigError
from arr_coc.model import ARRCOC
from sinks import ZarrStore, store_location
from sources import open_video
from sources.process import ProcessSource

from .config import PipelineConfig
from .configio import to_dict
from .cudagraph import FrontendGraphs
from .graph import Channel, Graph, Policy, Stage
from .stages import DecodeStage, RealizeStage, RunStatus, SinkStage, TextureStage, VLMStage
from .vlm.geometry import VLMGeometry


@dataclass
class RunResult:
    stream_id: str
    out: Path | str      # a local path or an fsspec URL
    frames: int
    complete: bool
    truncated: bool
    stopped: bool
    wall_s: float
    grid: tuple[int, int]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    answers: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s if self.wall_s > 0 else 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA GPU is available (use --device auto or cpu)")
    return torch.device(name)


def build_model(cfg: PipelineConfig, query_dim: int, device: torch.device) -> ARRCOC:
    from .weights import load_default
    model = ARRCOC(cfg.model, query_dim=query_dim)
    load_default(model, cfg.runtime.model_weights)
    return model.to(device).eval()


def encode_query(question: str, device: torch.device) -> torch.Tensor:
    from .query import sentence_encoder
    return sentence_encoder(str(device)).encode(question)


def load_answerer(cfg: PipelineConfig, device: torch.device):
    """The VLM named by runtime.vlm, or None for allocation only."""
    if cfg.runtime.vlm == "none":
        return None
    from .vlm import load_vlm
    # bf16 matrix products are slow on CPUs; there the VLM runs in float32
    dtype = "float32" if device.type == "cpu" else cfg.vlm.dtype
    return load_vlm(cfg.runtime.vlm, device=device, dtype=dtype, config=cfg.vlm)


def frontend_graphs(model: ARRCOC, grid: tuple[int, int], query: torch.Tensor, cfg: PipelineConfig,
                    device: torch.device) -> FrontendGraphs | None:
    """CUDA-graph replay for the texture and realize stages (GPU only, runtime.cuda_graphs)."""
    if device.type != "cuda" or not cfg.runtime.cuda_graphs:
        return None
    return FrontendGraphs(model, grid, query.to(device))


def compose(source: Any, writer: Any, model: ARRCOC, query: torch.Tensor, grid: tuple[int, int],
            cfg: PipelineConfig, device: torch.device, status: RunStatus,
            overlay: Any = None, vlm_stage: Stage | None = None, *, query_mask: torch.Tensor | None = None,
            graphs: FrontendGraphs | None = None) -> Graph:
    """Wire the run graph: decode -> texture -> realize -> [vlm] -> sink. graphs: the front end's
    CUDA graphs from an earlier run to reuse (default: new ones, where frontend_graphs makes any)."""
    capacity = cfg.runtime.queue_capacity
    # frames go straight to the device unless something reads them on the host (VLM, overlay)
    host_frames = vlm_stage is not None or overlay is not None
    decode = DecodeStage(source, cfg.runtime.batch_size, pin=device.type == "cuda", status=status,
                         device=None if host_frames else device)
    if graphs is None:
        graphs = frontend_graphs(model, grid, query, cfg, device)
    if graphs is not None:  # the run's full batches: captured now (unless earlier), not inside the timed run
        graphs.prepare(cfg.runtime.batch_size, source.height, source.width, query.to(device),
                       None if query_mask is None else query_mask.to(device))
    texture = TextureStage(model, device, grid, graphs)
    realize = RealizeStage(model, device, query, query_mask=query_mask,
                           vlm_fps=cfg.vlm.fps if vlm_stage is not None else None, graphs=graphs)
    sink = SinkStage(writer, status, overlay)
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


def run_video(path: str | Path, question: str, out: str | Path, cfg: PipelineConfig, *,
              overlay_path: str | Path | None = None, progress: bool | None = None,
              on_graph: Callable[[Graph], None] | None = None,
              query_embedding: torch.Tensor | None = None) -> RunResult:
    """Process one video file end to end. Raises SourceError / SinkError / StageError on failure.

    query_embedding: (Dq,) use this instead of encoding `question` (callers with their own encoder).
    """
    from sinks import OverlayWriter

    device = resolve_device(cfg.runtime.device)
    d = cfg.decode
    kwargs = dict(decoder=d.decoder, fps=d.fps, start_s=d.start_s, end_s=d.end_s, max_frames=d.max_frames,
                  threads=d.threads)
    # without a VLM or an overlay no pixels are read on the host: the worker may hand over YUV
    device_color = device.type == "cuda" and cfg.runtime.vlm == "none" and overlay_path is None
    source = (ProcessSource(path, batch_size=cfg.runtime.batch_size, slots=cfg.runtime.queue_capacity + 2,
                            device_color=device_color, **kwargs)
              if d.process else open_video(path, **kwargs))
    try:
        vlm = load_answerer(cfg, device)
        geometry = vlm.geometry if vlm is not None else VLMGeometry(min_pixels=cfg.vlm.min_pixels,
                                                                    max_pixels=cfg.vlm.max_pixels)
        grid = geometry.grid(source.height, source.width)
        store = ZarrStore.open(out, config=to_dict(cfg))
        writer = store.stream(source.stream_id, source=str(path), query=question, fps=float(source.fps),
                              width=source.width, height=source.height, grid=grid, vlm=cfg.runtime.vlm,
                              chunk_frames=cfg.output.chunk_frames, overwrite=True)
    except BaseException:
        source.close()
        raise
    if query_embedding is not None:
        query = query_embedding.to(device)
    elif vlm is not None:  # the VLM's own token embeddings: same space as its visual tokens
        query = vlm.text_embeddings(question).float()                       # (L, D)
    else:
        query = encode_query(question, device)                              # (384,)
    model = build_model(cfg, query.shape[-1], device)
    if isinstance(source, ProcessSource):
        try:
            source.wait_ready()  # its start overlapped the setup above; decoding starts with the clock
        except BaseException:
            source.close()
            writer.close(complete=False)
            raise
    status = RunStatus()
    overlay = None
    if overlay_path is not None:
        overlay = OverlayWriter(overlay_path, fps=float(source.fps), width=source.width, height=source.height)
    vlm_stage = None if vlm is None else VLMStage(vlm, question, cfg.runtime.every_s)
    graph = compose(source, writer, model, query, grid, cfg, device, status, overlay, vlm_stage)
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
    wall = time.perf_counter() - start
    sink = graph.stages[-1]
    return RunResult(stream_id=source.stream_id, out=store_location(out), frames=sink.frames_written,
                     complete=not (status.truncated or status.stopped), truncated=status.truncated,
                     stopped=status.stopped, wall_s=wall, grid=grid, metrics=graph.report(),
                     answers=list(sink.answers), notes=[vlm.warning] if vlm is not None and vlm.warning else [])


def _progress_bar(source: Any, progress: bool | None):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm
    total = getattr(source, "frame_count", None)
    return tqdm(total=total, unit="frame", desc=source.stream_id, dynamic_ncols=True, file=sys.stderr)
