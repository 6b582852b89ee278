"""Texture: the per-cell feature array every later stage reads (Vervaeke's raw material).

A frame is area-resized once to a working resolution of `cell_px` pixels per grid cell, every
feature is computed there, and average-pooled to the allocation grid (gh, gw). With a previous
frame of the same stream it also measures motion: dense optical flow (arr_coc.flow), the raw
frame difference, and the flow-compensated residual that tells a cut from a pan.

Normalisation, always per frame and per channel (never across the batch, so a frame's texture
does not depend on what else is in the batch):
- r, g, b, luminance: absolute values in [0, 1]. They are already bounded; stretching them per
  frame would make a dark frame look like a bright one and destroy the colour a query names.
- lab_l: L* / 100 in [0, 1]; lab_a: a* / 128 in [-1, 1] (fixed CIE ranges, for the same reason).
- pos_y, pos_x: cell centres in [0, 1]; eccentricity: distance of the cell centre from the frame
  centre over the half-diagonal, in [0, 1].
- sobel_gx, sobel_gy: divided by the frame's largest |value| -> [-1, 1]; sobel_mag: divided by its
  max -> [0, 1]; saliency: min-max -> [0, 1]. Each scale has a small floor, so a flat frame gives
  zeros (not NaN, not amplified round-off).
- motion: divided by max(frame max, motion_floor) -> [0, 1]; flow_dy, flow_dx: divided by
  max(frame's largest flow magnitude, flow_floor) -> [-1, 1], one scale for both so the direction
  survives. The floors keep sensor noise on a still frame from being stretched into "motion".
- relevance_cache: zeros here; the temporal realizer fills it.
The raw (unnormalised) flow, motion, residual and cell colours are kept beside the array.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from arr_coc._validate import ConfigError, check_choice, check_int, check_range
from arr_coc._consts import constant
from arr_coc.flow import optical_flow, sobel, warp

CHANNELS = ("r", "g", "b", "lab_l", "lab_a", "sobel_gx", "sobel_gy", "sobel_mag",
            "pos_y", "pos_x", "eccentricity", "saliency", "luminance",      # 13 MVP channels
            "motion", "flow_dy", "flow_dx", "relevance_cache")             # video channels

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}
# sRGB (D65) linear RGB -> XYZ, and the D65 reference white
_RGB_TO_XYZ = ((0.412453, 0.357580, 0.180423),
               (0.212671, 0.715160, 0.072169),
               (0.019334, 0.119193, 0.950227))
_WHITE = (0.950456, 1.0, 1.088754)
# Smallest frame maxima the gradient (intensity / working pixel) and saliency (Delta E) channels
# are scaled by: below them a frame is flat, and stretching float round-off to +-1 would paint
# edges on a blank wall. 1e-3 is a quarter of an 8-bit level per pixel; 1 Delta E is below the
# just-noticeable colour difference (~2.3).
_GRADIENT_FLOOR = 1e-3
_SALIENCY_FLOOR = 1.0


@dataclass(frozen=True)
class TextureConfig:
    """cell_px: working-resolution pixels per grid cell (the frame is resized to grid * cell_px).
    flow_levels / flow_iters / flow_window: pyramid levels, refinements per level and odd LK window
    (pixels at working resolution). saliency_scales: surround sigmas in grid cells of the
    centre-surround saliency. motion_floor ([0, 1] intensity) and flow_floor (grid cells): the
    smallest frame maximum the motion / flow channels are scaled by. dtype: of every output.
    """

    cell_px: int = 8
    flow_levels: int = 3
    flow_iters: int = 3
    flow_window: int = 7
    saliency_scales: tuple[float, ...] = (1.0, 2.0, 4.0)
    motion_floor: float = 0.02
    flow_floor: float = 0.05
    dtype: Literal["float32", "float16", "bfloat16", "float64"] = "float32"

    def __post_init__(self) -> None:
        for name, lo, hi in (("cell_px", 2, 64), ("flow_levels", 1, 6), ("flow_iters", 1, 20),
                             ("flow_window", 3, 31)):
            value = getattr(self, name)
            check_int(name, value)
            check_range(name, value, lo, hi)
        if self.flow_window % 2 == 0:
            raise ConfigError(f"flow_window={self.flow_window} must be odd; allowed: odd integers in [3, 31]")
        if not isinstance(self.saliency_scales, tuple) or not self.saliency_scales:
            raise ConfigError(f"saliency_scales must be a non-empty tuple, got {self.saliency_scales!r}")
        for i, sigma in enumerate(self.saliency_scales):
            check_range(f"saliency_scales[{i}]", sigma, 0.0, 16.0, lo_open=True)
        check_range("motion_floor", self.motion_floor, 0.0, 1.0, lo_open=True)
        check_range("flow_floor", self.flow_floor, 0.0, 100.0, lo_open=True)
        check_choice("dtype", self.dtype, _DTYPES)


@dataclass(frozen=True)
class Texture:
    """data (B, C, gh, gw) in CHANNELS order (see the module docstring for each channel's range);
    flow (B, 2, gh, gw) raw (dy, dx) in grid cells, this(y, x) ~ prev(y - dy, x - dx), set to 0 in
    cells that no motion explains at least as well (|this - prev| <= |this - warp(prev, flow)|);
    motion (B, gh, gw) raw mean |this - prev|; residual (B, gh, gw) raw mean |this - warp(prev, flow)|
    with that same per-cell flow, i.e. min(flow-compensated difference, motion);
    cell_rgb (B, 3, gh, gw) mean colour in [0, 1]; has_prev (B,) bool. Without a previous frame
    flow, motion and residual are zero.
    """

    data: torch.Tensor
    flow: torch.Tensor
    motion: torch.Tensor
    residual: torch.Tensor
    cell_rgb: torch.Tensor
    has_prev: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dim() != 4 or self.data.shape[1] != len(CHANNELS):
            raise ValueError(f"Texture.data must be (B, {len(CHANNELS)}, gh, gw), got {tuple(self.data.shape)}")
        b, _, gh, gw = self.data.shape
        expected = {"flow": (b, 2, gh, gw), "motion": (b, gh, gw), "residual": (b, gh, gw),
                    "cell_rgb": (b, 3, gh, gw), "has_prev": (b,)}
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"Texture.{name} must have shape {shape}, got {tuple(getattr(self, name).shape)}")

    @property
    def grid(self) -> tuple[int, int]:
        return int(self.data.shape[-2]), int(self.data.shape[-1])

    def channel(self, name: str) -> torch.Tensor:
        """The (B, gh, gw) channel called name."""
        return self.data[:, _channel_index(name)]

    def with_channel(self, name: str, value: torch.Tensor) -> "Texture":
        """A new Texture whose channel name is value (B, gh, gw); this one is left untouched."""
        index = _channel_index(name)
        expected = (self.data.shape[0], *self.data.shape[-2:])
        if tuple(value.shape) != expected:
            raise ValueError(f"with_channel({name!r}): value must have shape {expected}, got {tuple(value.shape)}")
        data = self.data.clone()
        data[:, index] = value.to(device=data.device, dtype=data.dtype)
        return dataclasses.replace(self, data=data)


def _channel_index(name: str) -> int:
    if name not in CHANNELS:
        raise KeyError(f"Unknown texture channel {name!r}. Supported channels are {', '.join(CHANNELS)}.")
    return CHANNELS.index(name)


def rgb_to_lab(rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sRGB (B, 3, H, W) in [0, 1] -> (CIE L*a*b* (B, 3, H, W) with L* in [0, 100],
    relative luminance Y (B, 1, H, W) in [0, 1]), D65 white, the exact sRGB transfer curve."""
    linear = torch.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    matrix = constant(tuple(v for row in _RGB_TO_XYZ for v in row), (3, 3), rgb.device, rgb.dtype)
    xyz = torch.einsum("ij,bjhw->bihw", matrix, linear)        # (B, 3, H, W)
    white = constant(tuple(_WHITE), (1, 3, 1, 1), rgb.device, rgb.dtype)
    t = xyz / white
    delta = 6.0 / 29.0
    f = torch.where(t > delta ** 3, t.clamp_min(delta ** 3) ** (1.0 / 3.0), t / (3 * delta ** 2) + 4.0 / 29.0)
    fx, fy, fz = f.unbind(1)                                    # each (B, H, W)
    lab = torch.stack([116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)], dim=1)
    return lab, xyz[:, 1:2].clamp(0.0, 1.0)


def _luma(rgb: torch.Tensor) -> torch.Tensor:
    """Rec. 601 luma of gamma-encoded RGB (B, 3, H, W) -> (B, 1, H, W): what flow tracks."""
    weights = constant((0.299, 0.587, 0.114), (3,), rgb.device, rgb.dtype)
    return torch.einsum("c,bchw->bhw", weights, rgb).unsqueeze(1)


@functools.lru_cache(maxsize=64)
def _positions(gh: int, gw: int, height: int, width: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cell-centre y and x in [0, 1] and eccentricity (distance from the frame centre, 1 at a
    corner, in frame pixels so it stays round on wide frames); constant per grid and frame size."""
    with torch.inference_mode(False), torch.no_grad():
        pos_y = (torch.arange(gh, device=device, dtype=dtype) + 0.5) / gh
        pos_x = (torch.arange(gw, device=device, dtype=dtype) + 0.5) / gw
        pos_y, pos_x = torch.meshgrid(pos_y, pos_x, indexing="ij")  # (gh, gw) each
        ecc = torch.hypot((pos_y - 0.5) * height, (pos_x - 0.5) * width) / (0.5 * math.hypot(height, width))
        return pos_y, pos_x, ecc


def _gaussian_taps(sigma: float, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Normalised 1-D Gaussian taps (cached per device) and their radius."""
    radius = max(1, math.ceil(3 * sigma))
    taps = [math.exp(-0.5 * (t / sigma) ** 2) for t in range(-radius, radius + 1)]
    total = sum(taps)
    return constant(tuple(v / total for v in taps), (len(taps),), device, dtype), radius


def _separable_blur(t: torch.Tensor, k: torch.Tensor, radius: int) -> torch.Tensor:
    n = t.shape[1]
    t = F.conv2d(t, k.view(1, 1, 1, -1).expand(n, 1, 1, -1), padding=(0, radius), groups=n)
    return F.conv2d(t, k.view(1, 1, -1, 1).expand(n, 1, -1, 1), padding=(radius, 0), groups=n)


@functools.lru_cache(maxsize=64)
def _blur_weight(h: int, w: int, sigma: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, h, w) share of each pixel's Gaussian window inside the image: the normaliser of
    `_gaussian_blur`, fixed per size, so it is computed once instead of in every frame's graph."""
    with torch.inference_mode(False), torch.no_grad():
        k, radius = _gaussian_taps(sigma, device, dtype)
        return _separable_blur(torch.ones(1, 1, h, w, device=device, dtype=dtype), k, radius)


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of (B, C, h, w) that treats outside the image as missing
    (normalised convolution), so borders are neither darkened nor mirrored at any sigma."""
    k, radius = _gaussian_taps(sigma, x.device, x.dtype)
    weight = _blur_weight(x.shape[-2], x.shape[-1], sigma, x.device, x.dtype)  # (1, 1, h, w)
    return _separable_blur(x, k, radius) / weight


def _saliency(lab: torch.Tensor, scales: tuple[float, ...]) -> torch.Tensor:
    """Centre-surround colour contrast (Itti-style) of Lab (B, 3, H2, W2) sampled at 2 points per
    cell per axis -> (B, H2, W2): sum over scales of the Lab distance (Delta E) between each point
    and its Gaussian surround (sigma in cells)."""
    total = lab.new_zeros(lab.shape[0], *lab.shape[-2:])
    for sigma in scales:
        surround = _gaussian_blur(lab, 2.0 * sigma)             # (B, 3, H2, W2)
        total = total + (lab - surround).square().sum(1).sqrt()
    return total


def _normalize_max(x: torch.Tensor, floor: float) -> torch.Tensor:
    """(B, ...) / max(per-frame max |x|, floor): [0, 1] for x >= 0, else [-1, 1]."""
    scale = x.abs().flatten(1).amax(1).clamp_min(floor)         # (B,)
    return x / scale.view(-1, *([1] * (x.dim() - 1)))


def _normalize_minmax(x: torch.Tensor, floor: float) -> torch.Tensor:
    """(B, gh, gw) -> per-frame (x - min) / max(max - min, floor) in [0, 1]."""
    flat = x.flatten(1)
    lo = flat.amin(1).view(-1, 1, 1)
    span = (flat.amax(1).view(-1, 1, 1) - lo).clamp_min(floor)
    return (x - lo) / span


class TextureExtractor(nn.Module):
    """frames (B, 3, H, W) + previous frames -> Texture at grid (gh, gw). No learned parameters."""

    def __init__(self, config: TextureConfig | None = None) -> None:
        super().__init__()
        self.config = config or TextureConfig()

    def _prepare(self, frames: torch.Tensor, size: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """uint8 or [0, 1] float (B, 3, H, W) -> float (B, 3, h, w) at the working resolution."""
        x = frames.to(dtype) / 255.0 if frames.dtype == torch.uint8 else frames.to(dtype)
        if x.shape[-2] >= size[0] and x.shape[-1] >= size[1]:
            # Area resize by a non-integer factor is an adaptive pool, the costliest kernel of the
            # whole front end on large frames. Average integer k x k blocks first (dropping under k
            # edge pixels) so the adaptive pool sees k^2 times less.
            ky, kx = x.shape[-2] // size[0], x.shape[-1] // size[1]
            if ky > 1 or kx > 1:
                x = F.avg_pool2d(x, (ky, kx))
            if tuple(x.shape[-2:]) != tuple(size):
                x = F.interpolate(x, size=size, mode="area")
        else:  # area resize of an upscale is nearest-neighbour blocks, which flow cannot track
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        return x.clamp(0.0, 1.0)

    def forward(self, frames: torch.Tensor, prev: torch.Tensor | None, grid: tuple[int, int], *,
                has_prev: torch.Tensor | None = None) -> Texture:
        """frames, prev: (B, 3, H, W) RGB, uint8 or float in [0, 1]; prev[i] is the frame before
        frames[i] in the same stream, or prev is None. has_prev (B,) bool, optional: marks which
        rows of prev are real (rows marked False get zero flow / motion / residual)."""
        self._validate(frames, prev, grid, has_prev)
        size, work = self._working(grid)
        cur = self._prepare(frames, size, work)                 # (B, 3, h, w)
        before = None if prev is None else self._prepare(prev, size, work)
        return self._texture(cur, before, has_prev, grid, tuple(frames.shape[-2:]))

    def sequence(self, frames: torch.Tensor, last: torch.Tensor | None, grid: tuple[int, int],
                 last_real: torch.Tensor | None = None) -> Texture:
        """Consecutive frames (B, 3, H, W) of one stream after `last` (3, H, W), or None at the
        stream's start. Same result as forward() with prev = [last, frames[:-1]], but each frame
        is resized once instead of twice. last_real: a () bool tensor, False where `last` is
        frames[0] standing in for the stream's start (the same texture as last=None, from a call
        of one signature: what a CUDA graph replays); None: True."""
        self._validate(frames, None, grid, None)
        size, work = self._working(grid)
        cur = self._prepare(frames, size, work)                 # (B, 3, h, w)
        b = cur.shape[0]
        if last is None and b == 1:
            return self._texture(cur, None, None, grid, tuple(frames.shape[-2:]))
        has_prev = torch.ones(b, dtype=torch.bool, device=cur.device)
        if last is None:
            first = cur[:1]                                     # paired with itself, marked not real
            has_prev[0] = False
        else:
            self._validate(frames, last.unsqueeze(0).expand(b, -1, -1, -1), grid, None)
            first = self._prepare(last.unsqueeze(0), size, work)
            if last_real is not None:
                has_prev[0] = last_real                         # a device write: no host sync
        before = torch.cat([first, cur[:-1]])                  # (B, 3, h, w)
        return self._texture(cur, before, has_prev, grid, tuple(frames.shape[-2:]))

    def _working(self, grid: tuple[int, int]) -> tuple[tuple[int, int], torch.dtype]:
        cell = self.config.cell_px
        work = torch.float64 if self.config.dtype == "float64" else torch.float32
        return (grid[0] * cell, grid[1] * cell), work

    def _texture(self, cur: torch.Tensor, before: torch.Tensor | None, has_prev: torch.Tensor | None,
                 grid: tuple[int, int], frame_hw: tuple[int, int]) -> Texture:
        """Channels from frames already at the working resolution: cur and before (B, 3, h, w)."""
        b = cur.shape[0]
        cfg, (gh, gw) = self.config, grid
        cell = cfg.cell_px
        work = cur.dtype
        size = tuple(cur.shape[-2:])

        def pool(x: torch.Tensor) -> torch.Tensor:              # (B, k, h, w) -> (B, k, gh, gw)
            return F.avg_pool2d(x, cell)

        lab, luminance = rgb_to_lab(cur)                        # (B, 3, h, w), (B, 1, h, w)
        gray = _luma(cur)                                       # (B, 1, h, w)
        gy, gx = sobel(gray)
        cell_rgb = pool(cur)                                    # (B, 3, gh, gw)
        cell_lab = pool(lab)                                    # (B, 3, gh, gw)
        gxy = pool(torch.cat([gy, gx], 1))                      # (B, 2, gh, gw)
        magnitude = pool(torch.hypot(gx, gy))[:, 0]             # (B, gh, gw)
        half_cells = F.adaptive_avg_pool2d(lab, (2 * gh, 2 * gw))  # (B, 3, 2gh, 2gw)
        salient = F.avg_pool2d(_saliency(half_cells, cfg.saliency_scales).unsqueeze(1), 2)[:, 0]  # (B, gh, gw)

        pos_y, pos_x, eccentricity = _positions(gh, gw, *frame_hw, cur.device, work)  # (gh, gw) each

        flow, motion, residual, valid = self._motion(cur, gray, before, has_prev, size, work)
        flow_cells = pool(flow) / cell                          # (B, 2, gh, gw)
        motion = pool(motion)[:, 0]                             # (B, gh, gw)
        residual = pool(residual)[:, 0]                         # (B, gh, gw)
        # Lucas-Kanade windows smear a moving object's flow into the still background around it,
        # where warping then invents change. Per cell, keep whichever hypothesis explains the frame
        # better, the estimated flow or no motion, so still cells get flow 0 and residual = motion.
        still = motion <= residual                              # (B, gh, gw)
        flow_cells = flow_cells.masked_fill(still.unsqueeze(1), 0.0)
        residual = torch.minimum(residual, motion)
        flow_scale = torch.hypot(flow_cells[:, 0], flow_cells[:, 1]).flatten(1).amax(1)
        flow_norm = flow_cells / flow_scale.clamp_min(cfg.flow_floor).view(b, 1, 1, 1)

        channels = [
            cell_rgb[:, 0], cell_rgb[:, 1], cell_rgb[:, 2],
            cell_lab[:, 0] / 100.0, (cell_lab[:, 1] / 128.0).clamp(-1.0, 1.0),
            _normalize_max(gxy[:, 1], _GRADIENT_FLOOR), _normalize_max(gxy[:, 0], _GRADIENT_FLOOR),
            _normalize_max(magnitude, _GRADIENT_FLOOR),
            pos_y.expand(b, gh, gw), pos_x.expand(b, gh, gw), eccentricity.expand(b, gh, gw),
            _normalize_minmax(salient, _SALIENCY_FLOOR), pool(luminance)[:, 0],
            _normalize_max(motion, cfg.motion_floor), flow_norm[:, 0], flow_norm[:, 1],
            torch.zeros_like(motion),
        ]
        out = _DTYPES[cfg.dtype]
        return Texture(data=torch.stack(channels, 1).to(out),   # (B, C, gh, gw)
                       flow=flow_cells.to(out), motion=motion.to(out), residual=residual.to(out),
                       cell_rgb=cell_rgb.to(out), has_prev=valid)

    def _motion(self, cur: torch.Tensor, gray: torch.Tensor, before: torch.Tensor | None,
                has_prev: torch.Tensor | None, size: tuple[int, int], work: torch.dtype):
        """Per-pixel flow (B, 2, h, w), |cur - prev| and |cur - warp(prev)| (B, 1, h, w) each, and
        the (B,) mask of real previous frames; all zero where there is no previous frame."""
        b = cur.shape[0]
        if before is None:
            zeros = cur.new_zeros(b, 1, *size)
            return cur.new_zeros(b, 2, *size), zeros, zeros, torch.zeros(b, dtype=torch.bool, device=cur.device)
        valid = (torch.ones(b, dtype=torch.bool, device=cur.device) if has_prev is None
                 else has_prev.to(device=cur.device, dtype=torch.bool))
        cfg = self.config
        flow = optical_flow(_luma(before), gray, levels=cfg.flow_levels, iters=cfg.flow_iters,
                            window=cfg.flow_window)             # (B, 2, h, w) pixels
        keep = valid.to(work).view(b, 1, 1, 1)
        flow = flow * keep
        motion = (cur - before).abs().mean(1, keepdim=True) * keep                 # (B, 1, h, w)
        # borders replicate: content entering the view has no source and counts as change
        residual = (cur - warp(before, flow)).abs().mean(1, keepdim=True) * keep  # (B, 1, h, w)
        return flow, motion, residual, valid

    @staticmethod
    def _validate(frames: torch.Tensor, prev: torch.Tensor | None, grid: tuple[int, int],
                  has_prev: torch.Tensor | None) -> int:
        if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[1] != 3:
            raise ValueError(f"frames must be a (B, 3, H, W) tensor, got {getattr(frames, 'shape', type(frames))}")
        if frames.dtype != torch.uint8 and not frames.is_floating_point():
            raise ValueError(f"frames must be uint8 or float in [0, 1], got {frames.dtype}")
        if prev is not None:
            if not isinstance(prev, torch.Tensor) or prev.shape != frames.shape:
                raise ValueError(f"prev must be None or a tensor shaped like frames {tuple(frames.shape)}, "
                                 f"got {getattr(prev, 'shape', type(prev))}")
            if prev.dtype != torch.uint8 and not prev.is_floating_point():
                raise ValueError(f"prev must be uint8 or float in [0, 1], got {prev.dtype}")
        if (not isinstance(grid, (tuple, list)) or len(grid) != 2
                or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in grid)):
            raise ValueError(f"grid must be (gh, gw) with positive ints, got {grid!r}")
        b = frames.shape[0]
        if has_prev is not None:
            if prev is None:
                raise ValueError("has_prev was given without prev; pass prev frames or leave has_prev None")
            if not isinstance(has_prev, torch.Tensor) or tuple(has_prev.shape) != (b,):
                raise ValueError(f"has_prev must be a ({b},) bool tensor, got {getattr(has_prev, 'shape', has_prev)}")
        return b
