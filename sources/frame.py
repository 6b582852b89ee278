"""The unit every source produces: one decoded RGB frame with its place in the stream."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Frame:
    """One decoded frame.

    stream_id: the file stem, dataset video id, or sanitized camera/URL name.
    index:     index of the frame in the decoded stream (before any fps sampling).
    pts_s:     presentation time in seconds.
    rgb:       uint8 array of shape (H, W, 3), C-contiguous.
    arrival_s: wall-clock arrival time (time.time()) for live sources (a network stream's frame:
               when its packet came in, before any decoder delay), else None.
    """

    stream_id: str
    index: int
    pts_s: float
    rgb: np.ndarray
    arrival_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rgb, np.ndarray) or self.rgb.dtype != np.uint8:
            raise ValueError(f"Frame.rgb must be a uint8 numpy array, got {getattr(self.rgb, 'dtype', type(self.rgb))}")
        if self.rgb.ndim != 3 or self.rgb.shape[2] != 3:
            raise ValueError(f"Frame.rgb must have shape (H, W, 3), got {self.rgb.shape}")
        if self.index < 0:
            raise ValueError(f"Frame.index must be >= 0, got {self.index}")

    @property
    def height(self) -> int:
        return int(self.rgb.shape[0])

    @property
    def width(self) -> int:
        return int(self.rgb.shape[1])
