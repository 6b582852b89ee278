"""Token-selection baselines ARR-COC is measured against, all query-agnostic, all producing the
same per-frame keep map (T, gh, gw) int of LODs (arr_coc/lod.py: FULL = kept, DROPPED = not)
that ARR-COC's allocation gives the VLM, so every policy runs through the same answer path.

    uniform   whole frame pairs, evenly spaced, to the same token count (frame subsampling)
    random    the same number of cells per frame pair, uniformly at random (seeded)
    evs       temporal-difference pruning as vLLM's "efficient video sampling" for Qwen2.5-VL
              (Bagrov et al., 2025; vllm/multimodal/evs.py): each merged token scored by its
              dissimilarity (1 - cosine) to the same cell of the previous frame pair, the first
              pair always kept, the top tokens over the whole video kept
    fastvid   FastVID-style (Shen et al., "FastVID: Dynamic Density Pruning for Fast Video Large
              Language Models", 2025): dynamic segmentation at the frame pairs whose global
              feature changes most (DySeg), then, per segment, density-peak scores (DPC-KNN:
              local density x distance to a denser token) pick the tokens of each pair (STPrune's
              anchors). FastVID also merges the dropped tokens into their anchors; selection
              alone is what every policy here does, so that is left out.

`evs` and `fastvid` read the VLM's own merged visual tokens (T', gh, gw, D) of the video.
Budgets count video tokens (a token covers a frame pair); `retention` is the share of a stock
VLM's tokens to keep, at least one token per video.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from arr_coc.attending import retained_tokens
from arr_coc.lod import DROPPED, FULL, TEMPORAL_PATCH, token_frames

Policy = Literal["uniform", "random", "evs", "fastvid"]
POLICIES: tuple[str, ...] = ("uniform", "random", "evs", "fastvid")
NEEDS_FEATURES = ("evs", "fastvid")


def budget(retention: float, tokens_full: int) -> int:
    """Tokens to keep of tokens_full at this retention (0 < retention <= 1): retained_tokens' rule,
    at least one."""
    if not 0.0 < retention <= 1.0:
        raise ValueError(f"Invalid retention ({retention}). Supported values are in (0, 1].")
    return max(1, min(tokens_full, retained_tokens(tokens_full, retention)))


def _per(tokens: int, parts: int) -> int:
    """tokens shared among `parts` (frames, pairs), rounded as retained_tokens rounds, at least one."""
    return max(1, retained_tokens(tokens / parts, 1.0))


def _to_frames(pair_keep: torch.Tensor, frames: int, temporal_patch: int) -> np.ndarray:
    """(T', gh, gw) bool per video token -> (T, gh, gw) int LOD per frame (both frames of a pair)."""
    lod = torch.where(pair_keep, FULL, DROPPED).repeat_interleave(temporal_patch, 0)[:frames]
    return lod.to(torch.int64).numpy()                                          # (T, gh, gw)


def uniform_keep(frames: int, grid: tuple[int, int], retention: float,
                 temporal_patch: int = TEMPORAL_PATCH) -> np.ndarray:
    """Evenly spaced whole frame pairs (the first and last included where two or more are kept)."""
    pairs, (gh, gw) = token_frames(frames, temporal_patch), grid
    k = _per(budget(retention, pairs * gh * gw), gh * gw)
    chosen = torch.zeros(pairs, dtype=torch.bool)
    chosen[torch.linspace(0, pairs - 1, k).round().long()] = True              # (T',)
    return _to_frames(chosen[:, None, None].expand(pairs, gh, gw), frames, temporal_patch)


def random_keep(frames: int, grid: tuple[int, int], retention: float, seed: int = 0,
                temporal_patch: int = TEMPORAL_PATCH) -> np.ndarray:
    """The same number of random cells in every frame pair (spread like ARR-COC's per-frame budget)."""
    pairs, (gh, gw) = token_frames(frames, temporal_patch), grid
    per_pair = _per(budget(retention, pairs * gh * gw), pairs)
    g = torch.Generator().manual_seed(seed)
    order = torch.rand(pairs, gh * gw, generator=g).argsort(1)                # (T', N)
    keep = torch.zeros(pairs, gh * gw, dtype=torch.bool)
    keep.scatter_(1, order[:, :per_pair], True)
    return _to_frames(keep.view(pairs, gh, gw), frames, temporal_patch)


def evs_keep(merged: torch.Tensor, frames: int, retention: float, temporal_patch: int = TEMPORAL_PATCH) -> np.ndarray:
    """merged (T', gh, gw, D) -> keep: the tokens most unlike the previous pair's, first pair first."""
    Tp, gh, gw, _ = merged.shape
    x = F.normalize(merged.float(), dim=-1)                                   # (T', gh, gw, D)
    dissimilar = torch.full((Tp, gh, gw), float("inf"))
    if Tp > 1:
        dissimilar[1:] = 1.0 - (x[1:] * x[:-1]).sum(-1).cpu()                  # (T'-1, gh, gw)
    k = budget(retention, Tp * gh * gw)
    keep = torch.zeros(Tp * gh * gw, dtype=torch.bool)
    keep[dissimilar.flatten().topk(k).indices] = True
    return _to_frames(keep.view(Tp, gh, gw), frames, temporal_patch)


def segments(merged: torch.Tensor, threshold: float = 0.9, max_segments: int = 8) -> list[range]:
    """DySeg: split the pairs where the global (mean) feature's cosine to the previous pair falls
    below `threshold`, and at the lowest similarities up to max_segments segments in all."""
    Tp = merged.shape[0]
    if Tp == 1:
        return [range(0, 1)]
    g = F.normalize(merged.float().flatten(1, 2).mean(1), dim=-1)             # (T', D)
    sim = (g[1:] * g[:-1]).sum(-1).cpu()                                       # (T'-1,)
    cuts = set((sim < threshold).nonzero().flatten().add(1).tolist())
    lowest = sim.argsort()[:max_segments - 1].add(1).tolist()
    cuts = sorted(cuts | set(lowest[:max(0, max_segments - 1 - len(cuts))]))[:max_segments - 1]
    bounds = [0, *cuts, Tp]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def density_peaks(tokens: torch.Tensor, k: int = 5) -> torch.Tensor:
    """DPC-KNN score of each of N tokens (N, D): density (exp of minus the mean squared distance to
    its k nearest neighbours) times the distance to the nearest denser token."""
    x = F.normalize(tokens.float(), dim=-1)
    dist = torch.cdist(x, x)                                                  # (N, N)
    n = x.shape[0]
    kk = min(k, n - 1)
    if kk < 1:
        return torch.ones(n)
    knn = dist.topk(kk + 1, largest=False).values[:, 1:]                      # (N, kk) without self
    density = torch.exp(-(knn ** 2).mean(1))                                  # (N,)
    denser = density[None, :] > density[:, None]                              # (N, N) j denser than i
    far = dist.max()
    delta = torch.where(denser, dist, far).min(1).values                      # (N,)
    return (density * delta).cpu()


def fastvid_keep(merged: torch.Tensor, frames: int, retention: float, temporal_patch: int = TEMPORAL_PATCH,
                 threshold: float = 0.9, max_segments: int = 8, k: int = 5) -> np.ndarray:
    """merged (T', gh, gw, D) -> keep: per segment, each pair's tokens of highest density-peak score,
    every pair getting the same share of the budget."""
    Tp, gh, gw, D = merged.shape
    per_pair = _per(budget(retention, Tp * gh * gw), Tp)
    keep = torch.zeros(Tp, gh * gw, dtype=torch.bool)
    for seg in segments(merged, threshold, max_segments):
        tokens = merged[seg.start:seg.stop].reshape(-1, D)                    # (len * N, D)
        score = density_peaks(tokens, k).view(len(seg), gh * gw)              # (len, N)
        keep[seg.start:seg.stop].scatter_(1, score.topk(per_pair, dim=1).indices, True)
    return _to_frames(keep.view(Tp, gh, gw), frames, temporal_patch)


def baseline_keep(policy: Policy, frames: np.ndarray, retention: float, *, grid: tuple[int, int],
                  merged: torch.Tensor | None = None, seed: int = 0,
                  temporal_patch: int = TEMPORAL_PATCH) -> np.ndarray:
    """The keep map (T, gh, gw) of `policy` for frames (T, H, W, 3); evs and fastvid need the VLM's
    merged tokens (T', gh, gw, D) of these frames."""
    T = len(frames)
    if policy not in POLICIES:
        raise ValueError(f"Invalid policy ({policy!r}). Supported values are {', '.join(POLICIES)}.")
    if policy in NEEDS_FEATURES:
        if merged is None or tuple(merged.shape[1:3]) != tuple(grid):
            raise ValueError(f"policy {policy!r} needs the VLM's merged tokens of shape (T', {grid[0]}, {grid[1]}, D)")
        fn = evs_keep if policy == "evs" else fastvid_keep
        return fn(merged, T, retention, temporal_patch)
    if policy == "uniform":
        return uniform_keep(T, grid, retention, temporal_patch)
    return random_keep(T, grid, retention, seed, temporal_patch)
