"""The vision tower's attention over frames of one size, as one batched kernel call.

Qwen2-VL's vision attention is block diagonal: each temporal patch (a pair of frames) attends
within itself (`cu_seqlens` bounds the blocks); Qwen2.5-VL's full-attention layers do the same and
its other layers attend within windows. Outside flash-attention, HF runs that as a Python loop of
one SDPA call per block, after reading the block lengths back to the host (`.tolist()`: a GPU sync
in every layer). A window of 20 frames at 240x320 is 10 blocks x 32 layers: 320 calls, 32 syncs,
and the tower is launch-bound (~0.1 s on an H100 for ~5 TFLOP of work).

When every block of a call has the same length L (frames of one size, which is what the VLM sends
within one call), the same attention is one SDPA call over (blocks, heads, L, head_dim), with no
sync. `uniform_blocks(L)` says so for the calls made inside it; a layer whose blocks are not
frames (Qwen2.5-VL's windows: more blocks than N / L) and every call outside it keep HF's forward.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

_local = threading.local()


@contextlib.contextmanager
def uniform_blocks(length: int | None) -> Iterator[None]:
    """Inside: the vision tower's attention blocks (temporal patches) all hold `length` patches
    (None: unknown; HF's own forward runs)."""
    previous = getattr(_local, "length", None)
    _local.length = length
    try:
        yield
    finally:
        _local.length = previous


def patch_vision_attention(visual: nn.Module) -> int:
    """Give each vision attention module of `visual` the batched forward (used inside
    uniform_blocks); returns how many were patched."""
    count = 0
    for module in visual.modules():
        if type(module).__name__.endswith("VisionAttention") and hasattr(module, "qkv") and hasattr(module, "proj"):
            rotary = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb_vision", None)
            if rotary is not None:
                module.forward = _batched_forward(module, module.forward, rotary)
                count += 1
    return count


def _batched_forward(module: nn.Module, original: Any, rotary: Any):
    def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, *args: Any,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
        N, L = hidden_states.shape[0], getattr(_local, "length", None)
        # blocks partition the frames, so N / L blocks means each block is one whole frame pair
        if (L is None or args or position_embeddings is None or module.training or N % L
                or cu_seqlens.numel() - 1 != N // L):
            return original(hidden_states, cu_seqlens, *args, position_embeddings=position_embeddings, **kwargs)
        q, k, v = module.qkv(hidden_states).reshape(N, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = rotary(q, k, *position_embeddings)                            # (N, heads, head_dim)
        blocks = N // L
        q, k, v = (t.reshape(blocks, L, module.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=module.scaling)  # (blocks, heads, L, head_dim)
        return module.proj(out.transpose(1, 2).reshape(N, -1))
    return forward
