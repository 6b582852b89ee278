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

from arr_coc.attending import retained_tokens
from arr_coc.lod import DROPPED, FULL, POOLED, pad_to_pairs, pair_lod

__all__ = ["allocation_keys", "pair_lod", "select_tokens", "snap_to_windows", "token_cells", "token_relevance"]


def token_cells(lod: torch.Tensor) -> torch.Tensor:
    """lod (T', gh, gw) -> (T', gh, gw) bool: the cells that carry a token (full ones, and each
    pooled block's anchor); their flat nonzero positions are select_tokens' index."""
    Tp, gh, gw = lod.shape
    ph, pw = gh % 2, gw % 2                      # odd grids: the edge blocks are 2x1 / 1x2 / 1x1
    m = F.pad(lod == POOLED, (0, pw, 0, ph))     # (T', gh2, gw2) bool
    bh, bw = (gh + ph) // 2, (gw + pw) // 2
    in_block = m.view(Tp, bh, 2, bw, 2).permute(0, 1, 3, 2, 4).reshape(Tp, bh, bw, 4)
    first = in_block & (in_block.cumsum(-1) == 1)                          # (T', bh, bw, 4) anchor
    anchor = first.view(Tp, bh, bw, 2, 2).permute(0, 1, 3, 2, 4).reshape(Tp, bh * 2, bw * 2)[:, :gh, :gw]
    return (lod == FULL) | anchor


def select_tokens(merged: torch.Tensor, lod: torch.Tensor,
                  index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """merged (T', gh, gw, D) visual tokens, lod (T', gh, gw) -> kept tokens (K, D) and the flat
    cell index (K,) of each in the (T', gh, gw) raster, in raster order (the model's token order).
    index: that index when the caller has it already (token_cells' nonzero: a host read, which
    VLM.prepare makes once for a batch)."""
    Tp, gh, gw, D = merged.shape
    full = lod == FULL
    pooled = lod == POOLED
    ph, pw = gh % 2, gw % 2
    m = F.pad(pooled, (0, pw, 0, ph))            # (T', gh2, gw2) bool
    x = F.pad(merged * pooled[..., None], (0, 0, 0, pw, 0, ph))  # (T', gh2, gw2, D)
    bh, bw = (gh + ph) // 2, (gw + pw) // 2
    block_sum = x.view(Tp, bh, 2, bw, 2, D).sum((2, 4))                     # (T', bh, bw, D)
    block_cnt = m.view(Tp, bh, 2, bw, 2).sum((2, 4))                        # (T', bh, bw)
    block_mean = block_sum / block_cnt.clamp(min=1)[..., None].to(merged.dtype)
    pooled_at_cell = block_mean.repeat_interleave(2, 1).repeat_interleave(2, 2)[:, :gh, :gw]  # (T', gh, gw, D)
    cell_tokens = torch.where(full[..., None], merged, pooled_at_cell)
    if index is None:
        index = token_cells(lod).flatten().nonzero().squeeze(1)             # (K,)
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


def allocation_keys(keep: torch.Tensor, scores: torch.Tensor, rungs: tuple[float, ...]) -> torch.Tensor:
    """keep (T, gh, gw) LOD of pass 1's allocation at the top rung, scores (T, gh, gw) its relevance,
    rungs the tempering ladder (fractions, increasing) -> (T, gh, gw) float32 keys: R - level plus a
    relevance tiebreak in [0, 0.5), where level is the first rung whose own allocation keeps the
    cell and R = len(rungs); -1 for cells not kept at all.

    ARR-COC spends retained_tokens(available, retention) tokens on each frame's most relevant cells
    (arr_coc/attending.py), so its allocation at a lower rung r is, per frame, the best
    retained_tokens(K, r / top) of the K cells the top rung keeps (at least one): a rung answers
    from what pass 1 run at that rung's retention would have kept. token_relevance then gives a frame pair's
    token the better key of its two cells, as the pairing rule keeps a token either frame wants."""
    kept = keep.reshape(keep.shape[0], -1) != 0                              # (T, N)
    s = scores.float().reshape(kept.shape)
    order = s.masked_fill(~kept, float("-inf")).argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1],
                                                                   device=order.device).expand_as(order))
    top_k = kept.sum(1, keepdim=True).float()                                # (T, 1)
    level = torch.zeros_like(s)
    for rung in rungs[:-1]:
        k = retained_tokens(top_k, rung / rungs[-1]).clamp(min=1).to(top_k.dtype)              # (T, 1)
        k = torch.where(top_k > 0, k, top_k)
        level += (rank >= k).float()
    # the kept cells' range without reading it back (no kept cell: every key is -1 below anyway)
    lo = s.masked_fill(~kept, float("inf")).min()
    span = (s.masked_fill(~kept, float("-inf")).max() - lo).clamp(min=1e-12)
    tiebreak = 0.4999 * (s - lo) / span                                      # [0, 0.5)
    keys = (len(rungs) - level + tiebreak).masked_fill(~kept, -1.0)
    return keys.reshape(keep.shape)


def allocation_sizes(keys: torch.Tensor, rungs: int) -> list[int]:
    """(K,) token keys (allocation_keys through token_relevance) -> how many tokens each rung keeps:
    those whose level is at most the rung's, increasing (a rung adding nothing is dropped)."""
    levels = (rungs - keys.floor()).long()                                   # (K,) 0 = the first rung's
    sizes: list[int] = []
    for n in torch.bincount(levels, minlength=rungs)[:rungs].cumsum(0).tolist():   # one read for every rung
        if n and (not sizes or n > sizes[-1]):
            sizes.append(n)
    return sizes or [0]


def snap_to_windows(keep: torch.Tensor, scores: torch.Tensor, side: int, temporal_patch: int = 2) -> torch.Tensor:
    """vlm.snap_windows: keep (T, gh, gw) LOD per frame, scores (T, gh, gw) pass 1's relevance ->
    (T, gh, gw) LOD per frame in which each frame pair keeps as many tokens as before (full cells
    and pooled blocks, one token each), all full, gathered into whole side x side windows (anchored
    at the top left, edge windows cut by the grid): the pair's windows by mean relevance, best
    first, each window's cells by relevance, until the pair's count is reached (so at most one
    window per pair is partly kept). Both frames of a pair get the pair's map. Qwen2.5-VL's
    windowed vision layers attend within 4 x 4-cell windows: a kept window then costs its cells
    and no more where `encode: kept` with whole windows encodes every cell of each touched window.
    No host read (device ops only)."""
    if side < 1:
        raise ValueError(f"snap_to_windows: side must be >= 1, got {side}")
    T = keep.shape[0]
    lod = pair_lod(keep, temporal_patch)                                     # (T', gh, gw)
    Tp, gh, gw = lod.shape
    budget = token_cells(lod).flatten(1).sum(1)                              # (T',) tokens per pair
    relevance = pad_to_pairs(scores.to(torch.float32), temporal_patch).amax(1)  # (T', gh, gw)
    ph, pw = -gh % side, -gw % side
    valid = F.pad(torch.ones_like(relevance), (0, pw, 0, ph))                # (T', H, W) 0 outside the grid
    padded = F.pad(relevance, (0, pw, 0, ph))
    wh, ww = valid.shape[1] // side, valid.shape[2] // side

    def per_window(x: torch.Tensor) -> torch.Tensor:                         # (T', H, W) -> (T', wh, ww)
        return x.view(Tp, wh, side, ww, side).sum((2, 4))
    mean = per_window(padded) / per_window(valid)                            # (T', wh, ww)
    window_rank = mean.flatten(1).argsort(dim=1, descending=True, stable=True).argsort(dim=1)  # (T', wh ww)
    rows = torch.arange(gh, device=keep.device) // side
    cols = torch.arange(gw, device=keep.device) // side
    cell_window = (rows[:, None] * ww + cols[None, :]).flatten()             # (gh gw,) each cell's window
    by_score = relevance.flatten(1).argsort(dim=1, descending=True, stable=True)  # (T', gh gw) cells, best first
    key = window_rank[:, cell_window].gather(1, by_score)                    # their windows' ranks, in that order
    order = by_score.gather(1, key.argsort(dim=1, stable=True))                  # by window rank, then relevance
    position = order.argsort(dim=1)                                             # (T', gh gw) each cell's place
    snapped = torch.where(position < budget[:, None], FULL, DROPPED).to(keep.dtype).view(Tp, gh, gw)
    return snapped.repeat_interleave(temporal_patch, 0)[:T]                  # both frames of each pair
