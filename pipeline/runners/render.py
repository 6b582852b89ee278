"""Render a finished store: its stored token maps over the video's frames, as an overlay video or
a PNG contact sheet, each frame labelled (time, frame index, tokens kept / full, scene changes)
and with a legend of the colours (sinks/overlay.py draws them).

The frames are matched to the store's rows by `frame_index`, so a store made from part of a
video or at a lower frame rate (decode.start_s, decode.fps) renders the frames it holds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from sinks import SinkError, ZarrStore
from sinks.overlay import COLOUR_BY, ColourBy, FrameLabel, OverlayWriter, contact_sheet
from sources import open_video

VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov")


@dataclass(frozen=True)
class RenderResult:
    out: Path
    frames: int      # frames rendered (tiles of a contact sheet)


def render_store(store: str | os.PathLike, stream_id: str, video: str | os.PathLike, *,
                 overlay: str | os.PathLike | None = None, sheet: str | os.PathLike | None = None,
                 colour_by: ColourBy = "tokens", tiles: int = 8, columns: int = 4) -> RenderResult:
    """Render stream `stream_id` of `store` over `video` (the video it was made from) into an
    overlay video (`overlay`, .mp4/.mkv/.mov: every stored frame) or a contact sheet (`sheet`, .png:
    `tiles` frames spread evenly over the stream, `columns` wide). Exactly one of the two.
    colour_by: "tokens" (tokens per cell) or "relevance" (a heat map of the realized relevance of
    every cell, the cells given tokens outlined). Labels name every scene change a tile stands for
    and say when a frame got no tokens because nothing in it changed (its earlier tokens serve)."""
    if (overlay is None) == (sheet is None):
        raise ValueError("render_store needs exactly one of overlay= and sheet=")
    if colour_by not in COLOUR_BY:
        raise ValueError(f"Invalid colour_by ({colour_by!r}). Supported values are {', '.join(COLOUR_BY)}.")
    out = Path(overlay if overlay is not None else sheet)
    allowed = VIDEO_SUFFIXES if overlay is not None else (".png",)
    if out.suffix.lower() not in allowed:
        what = "overlay video" if overlay is not None else "contact sheet"
        raise SinkError(f"the {what} must end in {', '.join(allowed)}, got {str(out)!r}")
    for name, value in (("tiles", tiles), ("columns", columns)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SinkError(f"{name} must be an integer >= 1, got {value!r}")
    data = ZarrStore.open(store, mode="r").read(stream_id)
    count = len(data["pts"])
    if count == 0:
        raise SinkError(f"stream {stream_id!r} of {store} has no frames to render")
    rows = np.arange(count) if overlay is not None else np.unique(np.linspace(0, count - 1, min(tiles,
                                                                                                count)).round().astype(int))
    zero_is_unchanged = _zero_means_unchanged(data["attrs"].get("config") or {})
    # a tile stands for the frames since the previous one: it names every cut among them
    starts = np.concatenate([[0], rows[:-1] + 1])
    labels = [_label(data, int(k), int(start), zero_is_unchanged) for start, k in zip(starts, rows)]
    pixels = _frames(video, data, rows, stream_id, store)
    token_scale = max(float(data["tokens"].max()), 1.0)
    if overlay is not None:
        return RenderResult(_write_overlay(out, data, rows, labels, pixels, colour_by, token_scale), len(rows))
    frames = np.stack(list(pixels))
    relevance = data["relevance"][rows].astype(np.float32)
    path = contact_sheet(frames, data["tokens"][rows], out, columns=columns, relevance=relevance, labels=labels,
                         colour_by=colour_by, legend=True)
    return RenderResult(path, len(rows))


def _label(data: dict[str, Any], k: int, start: int, zero_is_unchanged: bool) -> FrameLabel:
    """Row k's label, standing for rows start..k (their cuts are named on it)."""
    tokens = data["tokens"][k]
    cuts = tuple(int(i) for i in data["frame_index"][start:k + 1][data["scene_change"][start:k + 1]])
    kept = int(tokens.sum())
    return FrameLabel(pts_s=float(data["pts"][k]), frame_index=int(data["frame_index"][k]),
                      tokens_kept=kept, tokens_full=int(tokens.size), scene_change=bool(data["scene_change"][k]),
                      cuts=cuts, unchanged=zero_is_unchanged and kept == 0 and not data["scene_change"][k])


def _zero_means_unchanged(config: dict[str, Any]) -> bool:
    """Whether a frame without tokens had no cell changed since the VLM saw it. With temporal
    redundancy on, the allocator gives every frame with a changed cell at least one token
    (topk mode, or fraction mode with min_tokens >= 1: arr_coc/attending.py): then zero tokens
    means nothing changed. Stores without a recorded config use the defaults."""
    model = config.get("model", {})
    realizing, attending = model.get("realizing", {}), model.get("attending", {})
    return (realizing.get("redundancy", True) and
            (attending.get("selection", "fraction") == "topk" or attending.get("min_tokens", 1) >= 1))


def _write_overlay(out: Path, data: dict[str, Any], rows: np.ndarray, labels: list[FrameLabel],
                   pixels: Iterator[np.ndarray], colour_by: ColourBy, token_scale: float) -> Path:
    attrs = data["attrs"]
    writer = OverlayWriter(out, fps=float(attrs["fps"]), width=int(attrs["width"]), height=int(attrs["height"]),
                           colour_by=colour_by, token_scale=token_scale, legend=True)
    try:
        for k, label, rgb in zip(rows, labels, pixels):
            writer.write(rgb, data["tokens"][k], data["relevance"][k].astype(np.float32), label=label)
        writer.close()
    except BaseException:
        writer.close()
        out.unlink(missing_ok=True)  # no half-written video left behind
        raise
    return out


def _frames(video: str | os.PathLike, data: dict[str, Any], rows: np.ndarray, stream_id: str,
            store: str | os.PathLike) -> Iterator[np.ndarray]:
    """The video's frames of the stored rows, in order. The video is opened (and its size checked
    against the stream's) here, before the first frame is asked for."""
    attrs = data["attrs"]
    source = open_video(video)
    if (source.width, source.height) != (attrs["width"], attrs["height"]):
        source.close()
        raise SinkError(f"{video} is {source.width}x{source.height} but stream {stream_id!r} of {store} was made "
                        f"from a {attrs['width']}x{attrs['height']} video ({attrs['source']})")
    wanted = data["frame_index"][rows]

    def frames() -> Iterator[np.ndarray]:
        with source:
            frame_iter = iter(source)
            for index in wanted:
                frame = next(frame_iter, None)
                while frame is not None and frame.index < index:
                    frame = next(frame_iter, None)
                if frame is None or frame.index != index:
                    raise SinkError(f"{video} has no frame {index}, which stream {stream_id!r} of {store} holds: "
                                    f"not the video the stream was made from ({attrs['source']})")
                yield frame.rgb
    return frames()
