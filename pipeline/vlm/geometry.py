"""Where frames meet the VLM's token grid (Qwen2-VL family geometry).

Qwen2-VL cuts a frame resized to a multiple of ``patch * merge`` pixels into ``patch`` x ``patch``
patches and merges each 2x2 group into one language-model token. The ARR-COC allocation grid is
exactly that merged-token grid, so a grid cell is a VLM token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class VLMGeometry:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"VLMGeometry.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"VLMGeometry.min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")

    @property
    def cell_px(self) -> int:
        """Side in (resized) pixels of one merged token."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) the VLM resizes a frame to: HF's ``smart_resize`` with this geometry's limits."""
        return smart_resize(height, width, self.cell_px, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Merged-token grid (gh, gw) of a frame of this size."""
        h, w = self.resized_size(height, width)
        return h // self.cell_px, w // self.cell_px


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Same rule as transformers' Qwen2-VL ``smart_resize``: nearest multiple of ``factor``,
    rescaled (keeping the aspect ratio) into [min_pixels, max_pixels]."""
    if height < 1 or width < 1:
        raise ValueError(f"frame size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio must be smaller than 200, got {max(height, width) / min(height, width):.1f}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
