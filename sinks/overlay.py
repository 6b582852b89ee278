"""The homunculus made visible: token heat maps over the video (H.264 mp4) and as a PNG contact sheet.

Each grid cell is one VLM token position. Kept cells (tokens > 0) are tinted with a colour map of
their heat and outlined; dropped cells are darkened, so what the VLM did not see reads at a glance.
Optionally each frame carries a label (time, frame index, tokens kept / full, a scene-change tag)
and a legend strip under it says what the colours mean (`FrameLabel`, `legend_strip`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, Sequence

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
BACKGROUND = 24  # grey level of the sheet's gaps and the legend strip
CUT_COLOUR = (0, 220, 255)  # scene-change tag and border: cyan, apart from every colour-map stop
FONT = cv2.FONT_HERSHEY_SIMPLEX

ColourBy = Literal["relevance", "tokens"]
COLOUR_BY = ("relevance", "tokens")


def colormap(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] (any shape S) to uint8 RGB (S, 3)."""
    index = np.clip(np.nan_to_num(values) * 255.0 + 0.5, 0, 255).astype(np.intp)
    return _LUT[index]


def render_homunculus(rgb: np.ndarray, tokens: np.ndarray, relevance: np.ndarray | None = None, *,
                      token_scale: float | None = None) -> np.ndarray:
    """Blend the token map over one frame.

    rgb (H, W, 3) uint8; tokens (gh, gw) tokens spent per cell (0 = dropped). With relevance
    (gh, gw) in [0, 1]: a heat map of it over every cell, the kept cells outlined (the relevance map
    whole, and where the tokens went). Without: kept cells tinted by tokens / token_scale (default:
    tokens.max()) and outlined, dropped cells darkened. Returns (H, W, 3) uint8.
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
    tinted = kept if relevance is None else np.ones_like(kept)  # relevance: every cell (H, W)
    out = np.where(tinted[..., None], (1 - ALPHA) * frame + ALPHA * tint, DROP_DIM * frame)
    out = out.astype(np.uint8)
    # outline kept cells: first and last pixel row/column of every cell
    edge_y = np.diff(cell_y, prepend=-1) != 0
    edge_y |= np.diff(cell_y, append=gh) != 0
    edge_x = np.diff(cell_x, prepend=-1) != 0
    edge_x |= np.diff(cell_x, append=gw) != 0
    out[kept & (edge_y[:, None] | edge_x[None, :])] = OUTLINE
    return out


@dataclass(frozen=True)
class FrameLabel:
    """What the label of a rendered frame says: its time and index, the tokens the frame kept of a
    stock VLM's (one per cell), and whether a new shot / fixation starts there. `cuts`: frame
    indices of the scene changes the tile stands for (a contact sheet's tile stands for the frames
    since the previous tile, so a cut between two tiles is tagged on the later one). `unchanged`: the
    frame got no tokens because nothing in it changed since the VLM last saw it (temporal
    redundancy, arr_coc/realizing.py): the VLM's earlier tokens of it are reused, not lost."""

    pts_s: float
    frame_index: int
    tokens_kept: int
    tokens_full: int
    scene_change: bool = False
    cuts: tuple[int, ...] = ()
    unchanged: bool = False   # no cell changed since the VLM saw it: no new tokens, its earlier ones serve

    def lines(self) -> tuple[str, ...]:
        lines = (f"{self.pts_s:.2f} s  #{self.frame_index}", f"{self.tokens_kept}/{self.tokens_full} tokens")
        return (*lines, "unchanged: reused") if self.unchanged else lines

    def cut_tag(self) -> str | None:
        """The tag of the label's scene changes: "CUT" on the cut's own frame, else where they were."""
        cuts = tuple(c for c in self.cuts if c != self.frame_index)
        if not cuts:
            return "CUT" if self.scene_change else None
        shown = " ".join(f"#{c}" for c in cuts[:2]) + (f" +{len(cuts) - 2}" if len(cuts) > 2 else "")
        return ("CUT " if len(cuts) == 1 else "CUTS ") + shown


def font_scale(height: int, width: int) -> float:
    """Text size for an image: legible from 96-pixel thumbnails to 1080p frames."""
    return float(np.clip(min(height, width * 0.75) / 480.0, 0.3, 1.5))


def _text(image: np.ndarray, text: str, x: int, baseline: int, scale: float, colour: Any = (255, 255, 255)) -> None:
    cv2.putText(image, text, (x, baseline), FONT, scale, colour, 1, cv2.LINE_AA)


def label_frame(image: np.ndarray, label: FrameLabel) -> np.ndarray:
    """Draw the label on a rendered frame (H, W, 3) uint8, in place, and return it: time, frame index
    and tokens in the top-left corner on a dark box; on a scene change a CUT tag in the top-right
    corner and a border in CUT_COLOUR; for cuts in the frames the tile stands for, a tag naming them
    ("CUT #13") and the border."""
    h, w = image.shape[:2]
    scale = font_scale(h, w)
    lines = label.lines()
    sizes = [cv2.getTextSize(t, FONT, scale, 1) for t in lines]
    line_h = max(size[1] + size[0][1] for size in sizes) + 2
    pad = max(2, line_h // 4)
    box_w = max(size[0][0] for size in sizes) + 2 * pad
    box = image[:line_h * len(lines) + 2 * pad, :box_w]
    box[:] = (box.astype(np.float32) * 0.35).astype(np.uint8)  # darkened, the frame shows through
    for k, text in enumerate(lines):
        _text(image, text, pad, pad + line_h * (k + 1) - sizes[k][1] - 1, scale)
    tag = label.cut_tag()
    if tag is not None:
        border = max(2, round(min(h, w) / 100))
        image[:border], image[-border:], image[:, :border], image[:, -border:] = (CUT_COLOUR,) * 4
        (tw, th), base = cv2.getTextSize(tag, FONT, scale, 2)
        x0, y0 = max(border, w - tw - 2 * pad - border), border
        image[y0:y0 + th + base + 2 * pad, x0:w - border] = CUT_COLOUR
        cv2.putText(image, tag, (x0 + pad, y0 + pad + th), FONT, scale, (0, 0, 0), 2, cv2.LINE_AA)
    return image


def legend_strip(width: int, *, colour_by: ColourBy, token_scale: float = 1.0,
                 scale: float | None = None) -> np.ndarray:
    """A strip (h, width, 3) uint8 to put under a frame or a sheet, saying what the colours mean.

    colour_by "tokens": one swatch per count 0..token_scale (0: a dropped, darkened cell) under a
    caption saying what 0 means; "relevance": a colour bar from 0 to 1 under "relevance of every
    cell". token_scale: the count that gets the top colour.
    """
    if colour_by not in COLOUR_BY:
        raise ValueError(f"Invalid colour_by ({colour_by!r}). Supported values are {', '.join(COLOUR_BY)}.")
    scale = font_scale(width * 0.4, width) if scale is None else scale
    (_, text_h), base = cv2.getTextSize("0", FONT, scale, 1)
    line = text_h + base + 4
    pad = max(3, line // 3)
    bar_h = max(6, line)
    strip = np.full((pad + line + bar_h + line + pad, width, 3), BACKGROUND, np.uint8)
    bar_top = pad + line
    caption = ("tokens per cell (0: no new token: unchanged since the VLM saw it, or not relevant)"
               if colour_by == "tokens" else "relevance of every cell (outlined: cells given tokens)")
    _text(strip, caption, pad, pad + text_h + 1, scale)
    dropped = np.uint8(DROP_DIM * 128)  # a mid-grey frame under a dropped cell
    left, right = pad, width - pad
    if colour_by == "tokens" and token_scale <= 16:
        counts = list(range(int(round(token_scale)) + 1))
        right = min(right, left + len(counts) * 6 * line)  # swatches of a few characters' width
        edges = np.linspace(left, right, len(counts) + 1).round().astype(int)
        for k, (x0, x1) in zip(counts, zip(edges[:-1], edges[1:])):
            colour = dropped if k == 0 else colormap(np.array(k / max(token_scale, 1.0)))
            strip[bar_top:bar_top + bar_h, x0 + 1:x1 - 1] = colour
            tw = cv2.getTextSize(str(k), FONT, scale, 1)[0][0]
            _text(strip, str(k), (x0 + x1 - tw) // 2, bar_top + bar_h + text_h + 3, scale)
        return strip
    # many token counts: a dropped-cell swatch, then a continuous bar; relevance: the bar 0..1 alone
    # (every cell is coloured by it)
    x0 = left
    if colour_by == "tokens":
        swatch = max(bar_h, (right - left) // 8)
        strip[bar_top:bar_top + bar_h, left:left + swatch] = dropped
        _text(strip, "0", left, bar_top + bar_h + text_h + 3, scale)
        x0 = left + swatch + pad
    values = np.linspace(0.0, 1.0, max(right - x0, 1))
    strip[bar_top:bar_top + bar_h, x0:right] = colormap(values)[None]
    low, high = ("1", f"{token_scale:g}") if colour_by == "tokens" else ("0", "1")
    _text(strip, low, x0, bar_top + bar_h + text_h + 3, scale)
    tw = cv2.getTextSize(high, FONT, scale, 1)[0][0]
    _text(strip, high, right - tw, bar_top + bar_h + text_h + 3, scale)
    return strip


class OverlayWriter:
    """Streams homunculus overlays into an H.264 mp4 (yuv420p; odd sizes are padded to even).

    with OverlayWriter("out.mp4", fps=25, width=W, height=H) as ov:
        ov.write(rgb, tokens, relevance)

    colour_by:   "relevance" colours kept cells by the relevance given to write (by tokens where
                 none is given); "tokens" by tokens / token_scale
    token_scale: the token count that gets the top colour (None: the largest seen so far)
    legend:      put legend_strip under every frame (the video is taller by the strip); with
                 colour_by "tokens" it needs a fixed token_scale, or the strip would not match
    """

    def __init__(self, path: str | os.PathLike, *, fps: float, width: int, height: int, crf: int = 23,
                 colour_by: ColourBy = "relevance", token_scale: float | None = None, legend: bool = False) -> None:
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
            raise ValueError(f"fps must be a number > 0, got {fps!r}")
        for name, value in (("width", width), ("height", height)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if colour_by not in COLOUR_BY:
            raise ValueError(f"Invalid colour_by ({colour_by!r}). Supported values are {', '.join(COLOUR_BY)}.")
        if token_scale is not None and not (isinstance(token_scale, (int, float)) and token_scale > 0):
            raise ValueError(f"token_scale must be a number > 0 or None, got {token_scale!r}")
        if legend and colour_by == "tokens" and token_scale is None:
            raise ValueError("a legend for colour_by='tokens' needs a fixed token_scale")
        self.path = Path(path)
        self.width, self.height = int(width), int(height)
        self.colour_by = colour_by
        self._legend = legend_strip(self.width, colour_by=colour_by, token_scale=token_scale or 1.0,
                                    scale=font_scale(self.height, self.width)) if legend else None
        full_height = self.height + (0 if self._legend is None else len(self._legend))
        # yuv420p subsamples chroma 2x2, so the encoder needs even sides
        self.out_width, self.out_height = self.width + self.width % 2, full_height + full_height % 2
        self.frames = 0
        self._fixed_scale = token_scale
        self._token_scale = 1.0  # running max, so colours mean the same thing across the video
        # PyAV opens the file only at the first packet; fail here, before any frame was rendered
        if not self.path.parent.is_dir():
            raise SinkError(f"cannot write the overlay video {self.path}: {self.path.parent} is not a directory")
        try:
            self._container = av.open(str(self.path), mode="w")
        except (OSError, ValueError, av.FFmpegError) as e:  # ValueError: no container for the suffix
            raise SinkError(f"cannot write the overlay video {self.path}: {e}") from e
        self._stream = self._container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        self._stream.width, self._stream.height = self.out_width, self.out_height
        self._stream.pix_fmt = "yuv420p"
        self._stream.options = {"crf": str(crf), "preset": "veryfast"}

    def write(self, rgb: np.ndarray, tokens: np.ndarray, relevance: np.ndarray | None = None,
              label: FrameLabel | None = None) -> None:
        """Encode one frame: rgb (height, width, 3) uint8, tokens (gh, gw), relevance (gh, gw) or None,
        label: drawn on the frame (label_frame) when given."""
        if self._container is None:
            raise SinkError(f"overlay video {self.path} is already closed")
        if np.shape(rgb) != (self.height, self.width, 3):
            raise ValueError(f"rgb must have shape ({self.height}, {self.width}, 3), got {np.shape(rgb)}")
        self._token_scale = max(self._token_scale, float(np.max(tokens)))
        scale = self._fixed_scale if self._fixed_scale is not None else self._token_scale
        image = render_homunculus(rgb, tokens, relevance if self.colour_by == "relevance" else None, token_scale=scale)
        if label is not None:
            label_frame(image, label)
        if self._legend is not None:
            image = np.concatenate([image, self._legend])
        pad = ((0, self.out_height - len(image)), (0, self.out_width - self.width), (0, 0))
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
                  gap: int = 4, relevance: np.ndarray | None = None, labels: Sequence[FrameLabel] | None = None,
                  colour_by: ColourBy = "relevance", legend: bool = False) -> Path:
    """Write a PNG grid of overlays: frames (N, H, W, 3) uint8, token_maps (N, gh, gw), relevance
    (N, gh, gw) or None. Tiles are separated by `gap` dark pixels; the image is
    (rows * (H + gap) + gap, columns' * (W + gap) + gap) with columns' = min(columns, N), plus a
    legend strip under it when `legend`. labels: one FrameLabel per tile, drawn on it. colour_by:
    as OverlayWriter's ("tokens" where no relevance is given; one token scale for the sheet: the
    largest count, so tiles compare)."""
    frames = np.asarray(frames)
    token_maps = np.asarray(token_maps)
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (N, H, W, 3), got {frames.dtype} {frames.shape}")
    if token_maps.ndim != 3 or len(token_maps) != len(frames):
        raise ValueError(f"token_maps must be (N, gh, gw) with N={len(frames)}, got {token_maps.shape}")
    if relevance is not None and np.shape(relevance) != token_maps.shape:
        raise ValueError(f"relevance must have shape {token_maps.shape}, got {np.shape(relevance)}")
    if labels is not None and len(labels) != len(frames):
        raise ValueError(f"labels must hold one FrameLabel per frame ({len(frames)}), got {len(labels)}")
    if colour_by not in COLOUR_BY:
        raise ValueError(f"Invalid colour_by ({colour_by!r}). Supported values are {', '.join(COLOUR_BY)}.")
    if len(frames) == 0:
        raise ValueError("contact_sheet needs at least one frame")
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
        raise ValueError(f"columns must be an int >= 1, got {columns!r}")
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"contact sheet path must end in .png, got {str(path)!r}")
    colour_by = "tokens" if relevance is None else colour_by
    n, h, w, _ = frames.shape
    cols = min(columns, n)
    rows = -(-n // cols)
    sheet = np.full((rows * (h + gap) + gap, cols * (w + gap) + gap, 3), BACKGROUND, np.uint8)
    scale = max(float(token_maps.max()), 1.0)  # one scale for the sheet, so tiles compare
    for i in range(n):
        r, c = divmod(i, cols)
        y, x = gap + r * (h + gap), gap + c * (w + gap)
        rel = None if colour_by == "tokens" else relevance[i]
        tile = render_homunculus(frames[i], token_maps[i], rel, token_scale=scale)
        sheet[y:y + h, x:x + w] = tile if labels is None else label_frame(tile, labels[i])
    if legend:
        strip = legend_strip(sheet.shape[1], colour_by=colour_by, token_scale=scale, scale=font_scale(h, w))
        sheet = np.concatenate([sheet, strip])
    # cv2 wants BGR; it returns False (no exception) when it cannot write
    if not cv2.imwrite(str(path), np.ascontiguousarray(sheet[..., ::-1])):
        raise SinkError(f"cannot write the contact sheet {path}")
    return path
