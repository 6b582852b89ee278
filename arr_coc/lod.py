"""Levels of detail of a grid cell, and how frames pair into the VLM's video tokens.

One rule, used by the allocator (which writes LODs), the VLM's selection (which reads them), the
answer-loss training (its soft version) and the live warm-up (which counts tokens ahead):

  DROPPED (0): no token; FULL (1): the cell's own merged token; POOLED (2): the cell is averaged
  with the other pooled cells of its aligned 2x2 block into one token.

A video token covers TEMPORAL_PATCH (2) consecutive frames. Its LOD is the most detailed LOD
either frame asks for at that cell (FULL > POOLED > DROPPED), so a token is kept if either frame
keeps the cell. An odd frame count repeats the last frame, as HF's Qwen2-VL processor does.
"""
from __future__ import annotations

import torch

DROPPED, FULL, POOLED = 0, 1, 2
TEMPORAL_PATCH = 2


def token_frames(frames: int, temporal_patch: int = TEMPORAL_PATCH) -> int:
    """Frames -> video tokens along time (ceil: the last frame fills an odd pair)."""
    return -(-frames // temporal_patch)


def pad_to_pairs(x: torch.Tensor, temporal_patch: int = TEMPORAL_PATCH) -> torch.Tensor:
    """(T, ...) -> (T', temporal_patch, ...), the last frame repeated to fill the last pair."""
    if pad := -x.shape[0] % temporal_patch:
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
    return x.view(-1, temporal_patch, *x.shape[1:])                      # (T', tp, ...)


def pair_lod(lod: torch.Tensor, temporal_patch: int = TEMPORAL_PATCH) -> torch.Tensor:
    """(T, gh, gw) LOD per frame -> (T', gh, gw) int8 LOD per video token."""
    pairs = pad_to_pairs(lod, temporal_patch)                           # (T', tp, gh, gw)
    full = (pairs == FULL).any(1)
    pooled = (pairs == POOLED).any(1)
    return torch.where(full, FULL, torch.where(pooled, POOLED, DROPPED)).to(torch.int8)  # (T', gh, gw)


def pair_soft(soft: torch.Tensor, temporal_patch: int = TEMPORAL_PATCH) -> torch.Tensor:
    """(T, gh, gw) soft token budget per frame -> (T', gh, gw) keep weight in [0, 1] per video
    token: the differentiable counterpart of pair_lod (the pair's mean budget, at most one token)."""
    return pad_to_pairs(soft, temporal_patch).mean(1).clamp(max=1.0)   # (T', gh, gw)
