"""The homunculus made visible: token heat maps over the video (H.264 mp4) and as a PNG contact sheet.

Each grid cell is one VLM token position. Kept cells (tokens > 0) are tinted with a colour map of
their heat and outlined; dropped cells are darkened, so what the VLM did not see reads at a glance.
"""
from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import cv2
import numpy as np

from sinks.zarr_store import SinkError

# Five stops of an inferno-like map (dark purple -> red -> yellow): perceptually ordered, and it
# stays visible over both dark and bright frames. Interpolated to a 256-entry LUT once.
_STOPS = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], np.float32)
_LUT = np.stack([np.interp(np.linspace(0, 1, 256), np.linspace(0, 1, len(_STOPS)), _STOPS[:, c])
                 for c in range(3)], axis=1).astype(np.uint8)  # (256, 3)

ALPHA = 0.45     # weight of the colour map over kept cells
DROP_DIM = 0.35  # brightness left in dropped cells
OUTLINE = np.array([255, 255, 255], np.uint8)


def colormap(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] (any shape S) to uint8 RGB (S, 3)."""
    index = np.clip(np.nan_to_num(values) * 255.0 + 0.5, 0, 255).astype(np.intp)
    return _LUT[index]


def render_homunculus(rgb: np.ndarray, tokens: np.ndarray, relevance: np.ndarray | None = None, *,
                      token_scale: float | None = None) -> np.ndarray:
    """Blend the token map over one frame.

    rgb (H, W, 3) uint8; tokens (gh, gw) tokens spent per cell (0 = dropped); relevance (gh, gw)
    in [0, 1] colours the kept cells when given, else tokens / token_scale (default: tokens.max()).
    Returns (H, W, 3) uint8.
    """
    rgb = np.asarray(rgb)
    tokens = np.asarray(tokens)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"rgb must be uint8 (H, W, 3), got {rgb.dtype} {rgb.shape}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (gh, gw), got {tokens.shape}")
    h, w, _ = rgb.shape
    gh, gw = tokens.shape
    if relevance is not None:
        relevance = np.asarray(relevance, np.float32)
        if relevance.shape != tokens.shape:
            raise ValueError(f"relevance must have the shape of tokens {tokens.shape}, got {relevance.shape}")
        heat = np.clip(relevance, 0.0, 1.0)  # (gh, gw)
    else:
        scale = float(token_scale) if token_scale else max(float(tokens.max()), 1.0)
        heat = tokens.astype(np.float32) / scale  # (gh, gw)
    # nearest upsampling by index: pixel row y belongs to cell row y * gh // h
    cell_y = np.arange(h) * gh // h  # (H,)
    cell_x = np.arange(w) * gw // w  # (W,)
    kept = (tokens > 0)[cell_y][:, cell_x]  # (H, W)
    tint = colormap(heat)[cell_y][:, cell_x].astype(np.float32)  # (H, W, 3)
    frame = rgb.astype(np.float32)
    out = np.where(kept[..., None], (1 - ALPHA) * frame + ALPHA * tint, DROP_DIM * frame)
    out = out.astype(np.uint8)
    # outline kept cells: first and last pixel row/column of every cell
    edge_y = np.diff(cell_y, prepend=-1) != 0
    edge_y |= np.diff(cell_y, append=gh) != 0
    edge_x = np.diff(cell_x, prepend=-1) != 0
    edge_x |= np.diff(cell_x, append=gw) != 0
    out[kept & (edge_y[:, None] | edge_x[None, :])] = OUTLINE
    return out


class OverlayWriter:
    """Streams homunculus overlays into an H.264 mp4 (yuv420p; odd sizes are padded to even).

    with OverlayWriter("out.mp4", fps=25, width=W, height=H) as ov:
        ov.write(rgb, tokens, relevance)
    """

    def __init__(self, path: str | os.PathLike, *, fps: float, width: int, height: int, crf: int = 23) -> None:
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
            raise ValueError(f"fps must be a number > 0, got {fps!r}")
        for name, value in (("width", width), ("height", height)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.path = Path(path)
        self.width, self.height = int(width), int(height)
        # yuv420p subsamples chroma 2x2, so the encoder needs even sides
        self.out_width, self.out_height = self.width + self.width % 2, self.height + self.height % 2
        self.frames = 0
        self._token_scale = 1.0  # running max, so colours mean the same thing across the video
        # PyAV opens the file only at the first packet; fail here, before any frame was rendered
        if not self.path.parent.is_dir():
            raise SinkError(f"cannot write the overlay video {self.path}: {self.path.parent} is not a directory")
        try:
            self._container = av.open(str(self.path), mode="w")
        except (OSError, av.FFmpegError) as e:
            raise SinkError(f"cannot write the overlay video {self.path}: {e}") from e
        self._stream = self._container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        self._stream.width, self._stream.height = self.out_width, self.out_height
        self._stream.pix_fmt = "yuv420p"
        self._stream.options = {"crf": str(crf), "preset": "veryfast"}

    def write(self, rgb: np.ndarray, tokens: np.ndarray, relevance: np.ndarray | None = None) -> None:
        """Encode one frame: rgb (height, width, 3) uint8, tokens (gh, gw), relevance (gh, gw) or None."""
        if self._container is None:
            raise SinkError(f"overlay video {self.path} is already closed")
        if np.shape(rgb) != (self.height, self.width, 3):
            raise ValueError(f"rgb must have shape ({self.height}, {self.width}, 3), got {np.shape(rgb)}")
        self._token_scale = max(self._token_scale, float(np.max(tokens)))
        image = render_homunculus(rgb, tokens, relevance, token_scale=self._token_scale)
        pad = ((0, self.out_height - self.height), (0, self.out_width - self.width), (0, 0))
        image = np.pad(image, pad, mode="edge")
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = self.frames
        self._mux(self._stream.encode(frame))
        self.frames += 1

    def close(self) -> None:
        if self._container is None:
            return
        try:
            self._mux(self._stream.encode(None))
        finally:
            self._container.close()
            self._container = None

    def _mux(self, packets: Any) -> None:
        try:
            self._container.mux(packets)
        except (OSError, av.FFmpegError) as e:
            raise SinkError(f"cannot write the overlay video {self.path}: {e}") from e

    def __enter__(self) -> "OverlayWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def contact_sheet(frames: np.ndarray, token_maps: np.ndarray, path: str | os.PathLike, *, columns: int = 4,
                  gap: int = 4, relevance: np.ndarray | None = None) -> Path:
    """Write a PNG grid of overlays: frames (N, H, W, 3) uint8, token_maps (N, gh, gw), relevance
    (N, gh, gw) or None. Tiles are separated by `gap` dark pixels; the image is
    (rows * (H + gap) + gap, columns' * (W + gap) + gap) with columns' = min(columns, N)."""
    frames = np.asarray(frames)
    token_maps = np.asarray(token_maps)
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (N, H, W, 3), got {frames.dtype} {frames.shape}")
    if token_maps.ndim != 3 or len(token_maps) != len(frames):
        raise ValueError(f"token_maps must be (N, gh, gw) with N={len(frames)}, got {token_maps.shape}")
    if relevance is not None and np.shape(relevance) != token_maps.shape:
        raise ValueError(f"relevance must have shape {token_maps.shape}, got {np.shape(relevance)}")
    if len(frames) == 0:
        raise ValueError("contact_sheet needs at least one frame")
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
        raise ValueError(f"columns must be an int >= 1, got {columns!r}")
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"contact sheet path must end in .png, got {str(path)!r}")
    n, h, w, _ = frames.shape
    cols = min(columns, n)
    rows = -(-n // cols)
    sheet = np.full((rows * (h + gap) + gap, cols * (w + gap) + gap, 3), 24, np.uint8)
    scale = max(float(token_maps.max()), 1.0)  # one scale for the sheet, so tiles compare
    for i in range(n):
        r, c = divmod(i, cols)
        y, x = gap + r * (h + gap), gap + c * (w + gap)
        rel = None if relevance is None else relevance[i]
        sheet[y:y + h, x:x + w] = render_homunculus(frames[i], token_maps[i], rel, token_scale=scale)
    # cv2 wants BGR; it returns False (no exception) when it cannot write
    if not cv2.imwrite(str(path), np.ascontiguousarray(sheet[..., ::-1])):
        raise SinkError(f"cannot write the contact sheet {path}")
    return path
