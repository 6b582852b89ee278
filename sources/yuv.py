"""Planar YUV 4:2:0 frames as FFmpeg decodes them, converted to RGB on the device.

Why: converting to RGB with swscale costs the decoder's host thread a large share of its time
at 720p and up (docs/performance.md), and RGB is twice the bytes of YUV 4:2:0 to copy between
processes and over PCIe. So the decode worker
copies the three planes as they are and the GPU converts them (a few elementwise kernels).

`yuv_to_rgb` reproduces swscale's default conversion of PyAV's `reformat(frame, format="rgb24")`
for the frames it accepts, planar (yuv420p: Y, U, V) or semi-planar (NV12: Y, then U and V
interleaved, what NVDEC outputs: sources/nvdec.py) (checked in tests/sources/test_yuv.py: mean
difference ~0.6 levels, max 2): the frame's colour matrix (BT.601 or BT.709) and range (limited
or full), chroma repeated over each 2x2 block, results truncated. Other formats and matrices
(10-bit, 4:2:2/4:4:4, BT.2020) and odd frame sizes keep the RGB path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the decode worker imports this module: torch would add seconds to its start
    import torch

# AVColorSpace -> (Kr, Kb). Unspecified is treated as BT.601, as swscale does.
_MATRICES = {1: (0.2126, 0.0722), 2: (0.299, 0.114), 5: (0.299, 0.114), 6: (0.299, 0.114)}
_FORMATS = {"yuv420p": False, "yuvj420p": True}  # -> full range implied by the format
_FULL_RANGE = 2                                    # AVCOL_RANGE_JPEG


@dataclass(frozen=True)
class YuvLayout:
    """Where the planes of one (height, width) frame sit in a flat uint8 buffer, and its colours."""

    height: int                # of the coded frame (before rotation)
    width: int
    kr: float
    kb: float
    full_range: bool
    rotation: int = 0          # counter-clockwise degrees that make the frame upright
    semi_planar: bool = False  # NV12: one chroma plane of (U, V) pairs after Y, not U then V

    @property
    def chroma(self) -> tuple[int, int]:
        return self.height // 2, self.width // 2

    @property
    def frame_bytes(self) -> int:
        ch, cw = self.chroma
        return self.height * self.width + 2 * ch * cw

    @property
    def upright(self) -> tuple[int, int]:
        """(height, width) of the RGB frame after rotation."""
        return (self.width, self.height) if self.rotation % 180 else (self.height, self.width)


def yuv_layout(pixel_format: str | None, colorspace: int, color_range: int, height: int, width: int,
               rotation: int = 0, *, semi_planar: bool = False) -> YuvLayout | None:
    """The layout for frames of this format and colour description, None where the RGB path must
    stay (formats and matrices yuv_to_rgb does not reproduce). semi_planar: the frames come as NV12
    (NVDEC's output of a yuv420p / yuvj420p stream), with the colours the stream describes."""
    if pixel_format not in _FORMATS or colorspace not in _MATRICES or height % 2 or width % 2:
        return None  # odd sizes: swscale leaves its unscaled path and interpolates chroma
    kr, kb = _MATRICES[colorspace]
    return YuvLayout(height, width, kr, kb, _FORMATS[pixel_format] or color_range == _FULL_RANGE, rotation,
                     semi_planar)


def matches(layout: YuvLayout, frame) -> bool:
    """Whether a decoded av.VideoFrame has exactly this layout (formats can change mid-stream)."""
    return (frame.height == layout.height and frame.width == layout.width
            and yuv_layout(frame.format.name, int(frame.colorspace), int(frame.color_range),
                           frame.height, frame.width, layout.rotation) == layout)


def write_planes(frame, out: np.ndarray, layout: YuvLayout) -> None:
    """Copy the Y, U, V planes of an av.VideoFrame (rows padded to line_size) into out (frame_bytes,)."""
    h, w = layout.height, layout.width
    ch, cw = layout.chroma
    offset = 0
    for plane, (ph, pw) in zip(frame.planes, ((h, w), (ch, cw), (ch, cw))):
        src = np.frombuffer(plane, np.uint8).reshape(ph, plane.line_size)[:, :pw]
        out[offset:offset + ph * pw].reshape(ph, pw)[...] = src
        offset += ph * pw


def yuv_to_rgb(planes: torch.Tensor, layout: YuvLayout) -> torch.Tensor:
    """(T, frame_bytes) uint8 planes -> (T, H', W', 3) uint8 upright RGB, on planes' device.

    One pass of a few whole-batch kernels (about 12), whatever T: the chroma terms are computed at
    chroma resolution and broadcast over each 2x2 block of luma instead of upsampling the planes.
    Every value goes through the same float32 operations in the same order as the formula below
    spelled out per channel, so the result does not depend on T or on the batching."""
    import torch

    T = planes.shape[0]
    h, w = layout.height, layout.width
    ch, cw = layout.chroma
    luma = planes[:, :h * w].view(T, ch, 2, cw, 2).float()                        # (T, ch, 2, cw, 2): 2x2 blocks
    if layout.semi_planar:
        uv = planes[:, h * w:].view(T, ch, cw, 2).float()                         # (T, ch, cw, 2): U, V
    else:
        uv = planes[:, h * w:].view(T, 2, ch, cw).permute(0, 2, 3, 1).float()     # (T, ch, cw, 2)
    uv -= 128
    if not layout.full_range:
        luma.sub_(16).mul_(255 / 219)
        uv *= 255 / 224
    # (cr * V, -gu * U, cb * U, gv * V): a product with a zero coefficient adds an exact zero
    terms = (uv[..., :, None] * _chroma_coefficients(layout.kr, layout.kb, planes.device)).sum(-2)  # (T, ch, cw, 4)
    blocks = terms[:, :, None, :, None]                                           # (T, ch, 1, cw, 1, 4)
    rgb = torch.empty((T, ch, 2, cw, 2, 3), dtype=torch.float32, device=planes.device)
    torch.add(luma[..., None], blocks[..., :3], out=rgb)          # R = Y + cr V, G = Y - gu U, B = Y + cb U
    rgb[..., 1] -= blocks[..., 3]                                 # G -= gv V
    # truncation after the clamp is the floor the conversion wants (values are >= 0 by then)
    rgb = rgb.view(T, h, w, 3).clamp_(0, 255).to(torch.uint8)                    # (T, h, w, 3)
    if layout.rotation:
        rgb = torch.rot90(rgb, layout.rotation // 90, dims=(1, 2)).contiguous()
    return rgb


@functools.lru_cache(maxsize=32)
def _chroma_coefficients(kr: float, kb: float, device: torch.device) -> torch.Tensor:
    """(2, 4) float32: row U, row V -> the terms (R from V, G from U, B from U, G from V) of the
    matrix (Kr, Kb), on `device` (kept: one upload per matrix and device, not one per batch)."""
    import torch

    kg = 1 - kr - kb
    cr, cb = 2 * (1 - kr), 2 * (1 - kb)
    gu, gv = 2 * (1 - kb) * kb / kg, 2 * (1 - kr) * kr / kg
    return torch.tensor([[0.0, -gu, cb, 0.0], [cr, 0.0, 0.0, gv]], dtype=torch.float32, device=device)
