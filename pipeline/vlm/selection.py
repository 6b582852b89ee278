"""Which merged visual tokens reach the language model, and where they sit in M-RoPE space.

Temporal rule: arr_coc/lod.py (pair_lod, re-exported here): a video token's LOD is the most
detailed LOD either frame of its pair asks for.

Pooling rule (lod 2): the lod-2 cells of each aligned 2x2 block (rows 2i..2i+1, cols 2j..2j+1) are
averaged into one token placed at the block's anchor, its first lod-2 cell in raster order (the
block's top-left cell when the whole block is pooled). Lod-1 cells of a mixed block stay full tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from arr_coc.lod import FULL, POOLED, pad_to_pairs, pair_lod

__all__ = ["pair_lod", "select_tokens", "token_relevance"]


def select_tokens(merged: torch.Tensor, lod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """merged (T', gh, gw, D) visual tokens, lod (T', gh, gw) -> kept tokens (K, D) and the flat
    cell index (K,) of each in the (T', gh, gw) raster, in raster order (the model's token order)."""
    Tp, gh, gw, D = merged.shape
    full = lod == FULL
    pooled = lod == POOLED
    ph, pw = gh % 2, gw % 2                      # odd grids: the edge blocks are 2x1 / 1x2 / 1x1
    m = F.pad(pooled, (0, pw, 0, ph))            # (T', gh2, gw2) bool
    x = F.pad(merged * pooled[..., None], (0, 0, 0, pw, 0, ph))  # (T', gh2, gw2, D)
    bh, bw = (gh + ph) // 2, (gw + pw) // 2
    block_sum = x.view(Tp, bh, 2, bw, 2, D).sum((2, 4))                     # (T', bh, bw, D)
    block_cnt = m.view(Tp, bh, 2, bw, 2).sum((2, 4))                        # (T', bh, bw)
    block_mean = block_sum / block_cnt.clamp(min=1)[..., None].to(merged.dtype)
    in_block = m.view(Tp, bh, 2, bw, 2).permute(0, 1, 3, 2, 4).reshape(Tp, bh, bw, 4)
    first = in_block & (in_block.cumsum(-1) == 1)                          # (T', bh, bw, 4) anchor
    anchor = first.view(Tp, bh, bw, 2, 2).permute(0, 1, 3, 2, 4).reshape(Tp, bh * 2, bw * 2)[:, :gh, :gw]
    pooled_at_cell = block_mean.repeat_interleave(2, 1).repeat_interleave(2, 2)[:, :gh, :gw]  # (T', gh, gw, D)
    cell_tokens = torch.where(full[..., None], merged, pooled_at_cell)
    index = (full | anchor).flatten().nonzero().squeeze(1)                 # (K,)
    return cell_tokens.reshape(-1, D)[index], index


def token_relevance(scores: torch.Tensor, lod: torch.Tensor, index: torch.Tensor,
                    temporal_patch: int) -> torch.Tensor:
    """Pass 1's relevance of each kept token: scores (T, gh, gw) per frame cell, lod (T', gh, gw)
    and index (K,) as select_tokens got and gave them -> (K,) float32. A video token scores the
    higher of its frame pair's cells; a pooled token the highest of its block's pooled cells."""
    s = pad_to_pairs(scores.float(), temporal_patch).amax(1)               # (T', gh, gw)
    Tp, gh, gw = s.shape
    ph, pw = gh % 2, gw % 2
    pooled = F.pad(lod == POOLED, (0, pw, 0, ph))                            # (T', gh2, gw2)
    x = F.pad(s, (0, pw, 0, ph)).masked_fill(~pooled, float("-inf"))
    bh, bw = (gh + ph) // 2, (gw + pw) // 2
    block_max = x.view(Tp, bh, 2, bw, 2).amax((2, 4))                       # (T', bh, bw)
    at_cell = block_max.repeat_interleave(2, 1).repeat_interleave(2, 2)[:, :gh, :gw]
    cell = torch.where(lod == FULL, s, at_cell)                              # (T', gh, gw)
    return cell.flatten()[index]                                             # (K,)
