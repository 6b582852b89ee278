"""The unit every source produces: one decoded RGB frame with its place in the stream."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:  # the decode worker imports this module: torch would add seconds to its start
    import torch


@dataclass(frozen=True)
class Frame:
    """One decoded frame.

    stream_id: the file stem, dataset video id, or sanitized camera/URL name.
    index:     index of the frame in the decoded stream (before any fps sampling).
    pts_s:     presentation time in seconds.
    rgb:       uint8 array of shape (H, W, 3), C-contiguous: a numpy array on the host, or a torch
               tensor on the GPU for frames the GPU decoded (decoder "nvdec"), which go on to the
               texture stage without a trip through host memory. `host_rgb()` is numpy either way.
    arrival_s: wall-clock arrival time (time.time()) for live sources (a network stream's frame:
               when its packet came in, before any decoder delay), else None.
    """

    stream_id: str
    index: int
    pts_s: float
    rgb: Union[np.ndarray, "torch.Tensor"]
    arrival_s: float | None = None

    def __post_init__(self) -> None:
        if self.on_device:
            dtype, shape = str(self.rgb.dtype), tuple(self.rgb.shape)
            if dtype != "torch.uint8":
                raise ValueError(f"Frame.rgb must be a uint8 tensor, got {dtype}")
        elif isinstance(self.rgb, np.ndarray) and self.rgb.dtype == np.uint8:
            shape = self.rgb.shape
        else:
            raise ValueError(f"Frame.rgb must be a uint8 numpy array, got {getattr(self.rgb, 'dtype', type(self.rgb))}")
        if len(shape) != 3 or shape[2] != 3:
            raise ValueError(f"Frame.rgb must have shape (H, W, 3), got {shape}")
        if self.index < 0:
            raise ValueError(f"Frame.index must be >= 0, got {self.index}")

    @property
    def on_device(self) -> bool:
        """Whether rgb is a torch tensor (on the GPU that decoded it) rather than a numpy array."""
        torch = sys.modules.get("torch")  # a tensor cannot exist unless torch was imported
        return torch is not None and isinstance(self.rgb, torch.Tensor)

    def host_rgb(self) -> np.ndarray:
        """rgb as a numpy array: itself, or a copy from the device (overlay videos, host-side readers)."""
        return self.rgb.cpu().numpy() if self.on_device else self.rgb

    @property
    def height(self) -> int:
        return int(self.rgb.shape[0])

    @property
    def width(self) -> int:
        return int(self.rgb.shape[1])
