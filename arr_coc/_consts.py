"""Small constant tensors (filter taps, colour matrices, coordinate grids), made once per device.

Building one with ``torch.tensor(values, device="cuda")`` on every call is a host-to-device copy
from pageable memory: the host then waits for the GPU to drain its queue, which serialises the
pipeline's CPU and GPU work. Cached constants are created outside inference mode so that they
also serve training (inference tensors cannot be saved for backward).
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=256)
def constant(values: tuple, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A read-only constant of `shape` holding the flat `values`."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.tensor(values, dtype=dtype).view(shape).to(device)


@functools.lru_cache(maxsize=256)
def arange(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """torch.arange(n) as a cached constant (pixel coordinates for warps and position channels)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.arange(n, device=device, dtype=dtype)
