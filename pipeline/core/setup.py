"""What every way of running builds before its graph: the ARR-COC model, the query it attends
to, and the VLM that answers. run, live, batch, train and the server all call these, so a
question is encoded the same way and a model is built from the same checkpoint everywhere.

ARR-COC reads the question as all-MiniLM-L6-v2's 384-d sentence vector whatever VLM answers:
the shipped checkpoint was trained for it, so every layer that reads the query runs trained
weights under any VLM. The VLM couples to the question itself, in pass 2 (pipeline/vlm/passes.py).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from arr_coc.model import ARRCOC

from ..budget import BudgetPlan
from ..config import PipelineConfig
from ..runtime.cuda import resolve_device, set_cuda_wait
from .query import QUERY_DIM

__all__ = ["QUERY_DIM", "build_model", "check_query", "encode_query",
           "open_source", "open_writer", "resolve_device", "runtime_device"]


def runtime_device(cfg: PipelineConfig) -> torch.device:
    """runtime.device resolved, with runtime.cuda_wait set on it: call before the first CUDA work
    of the process (the models' loading)."""
    device = resolve_device(cfg.runtime.device)
    set_cuda_wait(cfg.runtime.cuda_wait, device)
    return device


def build_model(cfg: PipelineConfig, device: torch.device, *, answering: bool = False) -> ARRCOC:
    """ARR-COC for MiniLM queries, with the weights runtime.model_weights names ("auto": those trained
    for runtime.vlm, else default; they must fit it exactly). answering: a VLM answers from this
    model's allocations, so the allocator keeps pass 1's candidates of the budget plan
    (pipeline/budget.py: pass 2's or the tempering ladder's)."""
    from arr_coc.checkpoint import load_pretrained

    model_cfg = cfg.model
    if answering:
        model_cfg = replace(model_cfg, attending=BudgetPlan.of(cfg.vlm).pass1(model_cfg.attending))
    model = ARRCOC(model_cfg, query_dim=QUERY_DIM)
    load_pretrained(model, cfg.runtime.arrcoc_weights, "runtime.model_weights", also=("auto",))
    return model.to(device).eval()


def check_query(query: torch.Tensor, what: str = "query_embedding") -> torch.Tensor:
    """A query given instead of encoding the question: (384,) floats, as MiniLM makes them."""
    if not isinstance(query, torch.Tensor) or tuple(query.shape) != (QUERY_DIM,) or not query.is_floating_point():
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"{what} must be a ({QUERY_DIM},) float tensor (a MiniLM sentence vector), got {shape}")
    return query


def encode_query(question: str, device: torch.device) -> torch.Tensor:
    """The question as ARR-COC reads it: MiniLM's sentence vector, (384,), whatever VLM answers."""
    from .query import sentence_encoder
    return sentence_encoder(str(device)).encode(question)                  # (384,)


def open_writer(store: Any, stream_id: str, config: dict[str, Any], *, resuming: bool = False, **attrs: Any):
    """The stream's writer, recording the run's `config` (the store's root keeps the first run's).

    A stream that replaces another says so on stderr (a warning): a re-run over a complete stream,
    or another file with the same stem. `resuming` (batch): redoing an incomplete stream of the same
    source is the point of a resume and goes unsaid."""
    import warnings

    writer = store.stream(stream_id, config=config, **attrs)
    old = writer.replaced
    if old is not None and not (resuming and not old.complete and old.source == attrs.get("source")):
        warnings.warn(str(old), stacklevel=2)
    return writer


def open_source(path: Any, cfg: PipelineConfig, *, stream_id: str | None = None, worker: Any = None,
                device_color: bool = False):
    """The video file's frame source as decode.* configures it: in a decode worker process
    (decode.process, or an existing `worker` handed over) or in this process. NVDEC decodes in this
    process whatever decode.process says (its frames are CUDA tensors, which shared memory would
    only carry through the host), and with decode.fallback a video it cannot decode here falls back
    to pyav, in this process too (one warning)."""
    from sources import open_video
    from sources.process import ProcessSource

    d = cfg.decode
    kwargs = dict(decoder=d.decoder, fps=d.fps, start_s=d.start_s, end_s=d.end_s, max_frames=d.max_frames,
                  threads=d.threads, stream_id=stream_id, max_pixels=d.max_pixels)
    if d.decoder == "nvdec":
        return open_video(path, fallback=d.fallback, **kwargs)
    if worker is None and not d.process:
        return open_video(path, **kwargs)
    return ProcessSource(path, batch_size=cfg.runtime.batch_size, slots=cfg.runtime.queue_capacity + 2,
                         device_color=device_color, worker=worker, shared_bytes=d.shared_mb << 20, **kwargs)
