"""The vision tower's attention as one batched kernel call per layer.

Qwen2-VL's vision attention is block diagonal: each temporal patch (a pair of frames) attends
within itself (`cu_seqlens` bounds the blocks); Qwen2.5-VL's full-attention layers do the same and
its other layers attend within windows (`cu_window_seqlens`). Outside flash-attention, HF runs that
as a Python loop of one SDPA call per block, after reading the block lengths back to the host
(`.tolist()`: a GPU sync in every layer). A window of 20 frames at 240x320 is 10 blocks x 32
layers: 320 calls and 32 syncs; 32 frames at 448x448 through Qwen2.5-VL-7B's window layers are
256 windows x 28 layers: 7168 calls.

Inside `batched_attention(L)` (VisionEncoder.vision), each layer instead makes one SDPA call over
(blocks, heads, L, head_dim): with no sync at all when the blocks are the frames (N / L blocks of
the given L, frames of one size), else after one read of the block lengths per boundary tensor
and vision forward (shared by all layers that use it), with blocks of unequal length (edge
windows) padded to the longest and the padding masked as keys. Calls outside it keep HF's forward.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.vlm import hf
from pipeline.vlm.vision_blocks import rotate_qk

_local = threading.local()


@contextlib.contextmanager
def batched_attention(length: int | None, plans: dict | None = None) -> Iterator[None]:
    """Inside: the vision tower's attention runs batched (see the module doc); `length`: how many
    patches each frame block holds when all frames have one size (None: unknown, the block lengths
    are read from the boundaries once per tensor). `plans`: where the per-boundary-tensor plans are
    kept (default: for this block only); a vision graph passes its own, so that the plans its warm-up
    made (with their one host read) serve its capture, which must not read anything back."""
    previous = getattr(_local, "state", None)
    _local.state = (length, {} if plans is None else plans)            # (frame block length, plans)
    try:
        yield
    finally:
        _local.state = previous


def patch_vision_attention(visual: nn.Module) -> int:
    """Give each vision attention module of `visual` the batched forward (used inside
    batched_attention); returns how many were patched."""
    count = 0
    for module, rotary in hf.vision_attention_modules(visual):
        module.forward = _batched_forward(module, module.forward, rotary)
        count += 1
    return count


def _plan(cu_seqlens: torch.Tensor, N: int, length: int | None, plans: dict) -> tuple:
    """('uniform', L) or ('padded', gather index (B, Lmax), key mask (B, 1, 1, Lmax), valid (N,))
    for these block boundaries, made once per boundary tensor inside one batched_attention."""
    key = (cu_seqlens.data_ptr(), cu_seqlens.numel(), N)
    if key in plans:
        return plans[key]
    blocks = cu_seqlens.numel() - 1
    # blocks partition the frames, so N / L blocks of frame length L means each block is one frame pair
    if length is not None and N % length == 0 and blocks == N // length:
        plan: tuple = ("uniform", length)
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()               # one sync per tensor
        longest = max(lengths)
        if longest * len(lengths) == N:
            plan = ("uniform", longest)
        else:
            starts = torch.tensor([0] + lengths[:-1], device=cu_seqlens.device).cumsum(0)     # (B,)
            offsets = torch.arange(longest, device=cu_seqlens.device)                        # (Lmax,)
            mask = offsets < torch.tensor(lengths, device=cu_seqlens.device)[:, None]        # (B, Lmax)
            index = torch.where(mask, starts[:, None] + offsets, N)                          # N: a zero row
            plan = ("padded", index, mask[:, None, None, :], mask.flatten().nonzero().squeeze(1))
    plans[key] = plan
    return plan


def varlen_available() -> bool:
    """Whether this torch has varlen flash attention (torch.nn.attention.varlen, CUDA)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, longest: int,
                     scale: float) -> torch.Tensor:
    """Attention within the blocks cu_seqlens bounds: q, k, v (N, heads, head_dim) packed, longest
    a bound on the blocks' lengths -> (N, heads, head_dim); rows outside every block are left
    undefined (CUDA, flash attention: no host read, graph-safe) or zero (elsewhere: one SDPA per
    block, after reading the bounds)."""
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, scale=scale)
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            block = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))      # (1, heads, L, head_dim)
            out[a:b] = F.scaled_dot_product_attention(*block, scale=scale)[0].transpose(0, 1)
    return out


def _batched_forward(module: nn.Module, original: Any, rotary: Any):
    def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, *args: Any,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
        state = getattr(_local, "state", None)
        if state is None or args or position_embeddings is None or module.training:
            return original(hidden_states, cu_seqlens, *args, position_embeddings=position_embeddings, **kwargs)
        N, H = hidden_states.shape[0], module.num_heads
        plan = _plan(cu_seqlens, N, state[0], state[1])
        qkv = module.qkv(hidden_states).reshape(N, 3, H, -1)
        if getattr(module, "_arr_coc_fast_rotary", False):                  # vision_blocks: q and k at once
            q, k = rotate_qk(qkv, *position_embeddings)                      # (N, heads, head_dim)
        else:
            q, k = rotary(qkv[:, 0], qkv[:, 1], *position_embeddings)
        v = qkv[:, 2]
        if plan[0] == "varlen":                                             # kept_graph's packed blocks
            out = varlen_attention(q, k, v, cu_seqlens, plan[1], module.scaling)  # (N, heads, head_dim)
            return module.proj(out.reshape(N, -1))
        if plan[0] == "uniform":
            L = plan[1]
            q, k, v = (t.reshape(N // L, L, H, -1).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, scale=module.scaling)  # (blocks, heads, L, head_dim)
            return module.proj(out.transpose(1, 2).reshape(N, -1))
        _, index, key_mask, valid = plan
        B, Lmax = index.shape
        q, k, v = (torch.cat([t, t.new_zeros(1, *t.shape[1:])])[index].transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=module.scaling)  # (B, heads, Lmax, hd)
        return module.proj(out.transpose(1, 2).reshape(B * Lmax, -1)[valid])
    return forward
