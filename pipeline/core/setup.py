"""What every way of running builds before its graph: the ARR-COC model, the query it attends
to, and the VLM that answers. run, live, batch, train and the server all call these, so a
question is encoded the same way and a model is built from the same checkpoint everywhere.
"""
from __future__ import annotations

from typing import Any

import torch

from arr_coc.model import ARRCOC

from ..config import PipelineConfig
from .cuda import resolve_device

__all__ = ["build_model", "encode_query", "load_answerer", "open_source", "open_writer", "resolve_device"]


def build_model(cfg: PipelineConfig, query_dim: int, device: torch.device) -> ARRCOC:
    """ARR-COC for queries of width query_dim, with the weights runtime.model_weights names."""
    from arr_coc.checkpoint import load_pretrained

    model = ARRCOC(cfg.model, query_dim=query_dim)
    load_pretrained(model, cfg.runtime.model_weights, "runtime.model_weights")
    return model.to(device).eval()


def encode_query(question: str, device: torch.device, vlm: Any = None) -> torch.Tensor:
    """The question as ARR-COC reads it: with a VLM, the VLM's own token embeddings (the space of
    its visual tokens), (L, D); without one, MiniLM's sentence vector, (384,)."""
    if vlm is not None:
        return vlm.text_embeddings(question).float().to(device)           # (L, D)
    from .query import sentence_encoder
    return sentence_encoder(str(device)).encode(question)                  # (384,)


def load_answerer(cfg: PipelineConfig, device: torch.device):
    """The VLM named by runtime.vlm, or None for allocation only."""
    if cfg.runtime.vlm == "none":
        return None
    from ..vlm import load_vlm
    # bf16 matrix products are slow on CPUs; there the VLM runs in float32
    dtype = "float32" if device.type == "cpu" else cfg.vlm.dtype
    return load_vlm(cfg.runtime.vlm, device=device, dtype=dtype, config=cfg.vlm)


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
    (decode.process, or an existing `worker` handed over) or in this process."""
    from sources import open_video
    from sources.process import ProcessSource

    d = cfg.decode
    kwargs = dict(decoder=d.decoder, fps=d.fps, start_s=d.start_s, end_s=d.end_s, max_frames=d.max_frames,
                  threads=d.threads, stream_id=stream_id, max_pixels=d.max_pixels)
    if worker is None and not d.process:
        return open_video(path, **kwargs)
    return ProcessSource(path, batch_size=cfg.runtime.batch_size, slots=cfg.runtime.queue_capacity + 2,
                         device_color=device_color, worker=worker, shared_bytes=d.shared_mb << 20, **kwargs)
