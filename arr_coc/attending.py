"""Attending: relevance -> VLM visual tokens per grid cell (the homunculus).

A grid cell is one merged VLM token. Each frame gets an exact budget K_b of tokens:
  fraction mode: K_b = clamp(retained_tokens(n_b, retention), min_tokens, n_b)
  topk mode:     K_b = min(top_k, n_b)
where n_b counts the cells that may receive tokens (`available`; the temporal realizer removes
cells the VLM already saw unchanged). Tokens are spent at two levels of detail:
  lod 1 (FULL): one full token on a cell,
  lod 2 (POOLED): one pooled token for a 2x2 block of cells holding no full token (it covers the block's
         available cells and is counted on the block's most relevant one),
so that the most relevant cells are seen in full and a wider surround coarsely.

Relevance first goes through a per-cell budget curve (power / exponential / linear with learned
steepness and offset, clamped to [min_budget, max_budget]): the share of one full token a cell
deserves. Hard allocation (inference) is exact and monotone in relevance; the soft budget
(training) spreads the same K_b tokens differentiably, so the curve's parameters and everything
upstream get gradients ("train soft, infer hard", seed Part 44).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from arr_coc._validate import check_choice, check_int, check_range
from arr_coc.lod import DROPPED, FULL, POOLED


def retained_tokens(available, retention: float):
    """The tokens a retention buys of `available` cells (or candidates): floor(available x retention
    + 0.5), rounded half up, in float64, so a 0.5 boundary never depends on a dtype or on Python's
    round-half-to-even. The one rule everywhere a share becomes a count (each frame's budget here,
    pass 2's and each tempering rung's keep, the baselines' budgets, the live warm-up's estimates).
    An int or float gives an int; a tensor gives an int64 tensor."""
    if isinstance(available, torch.Tensor):
        return torch.floor(available.double() * retention + 0.5).long()
    return math.floor(available * retention + 0.5)


@dataclass(frozen=True)
class AttendingConfig:
    selection: Literal["fraction", "topk"] = "fraction"
    retention: float = 0.25  # fraction of available cells that get a token (fraction mode)
    top_k: int = 64  # tokens per frame (topk mode)
    curve: Literal["power", "exponential", "linear"] = "power"
    steepness: float = 2.0  # initial curve steepness (power exponent / exponential rate)
    offset: float = 0.0  # initial additive offset of the curve
    min_budget: float = 0.05  # per-cell budget floor, in full tokens
    max_budget: float = 1.0  # per-cell budget cap, in full tokens
    pooled_share: float = 0.0  # at most this share of a frame's tokens is spent as pooled 2x2 tokens
    min_tokens: int = 1  # fraction mode: never fewer tokens than this (if that many cells are available)
    soft_temperature: float = 0.05  # width of the soft top-K edge, in budget units

    def __post_init__(self) -> None:
        check_choice("attending.selection", self.selection, ("fraction", "topk"))
        check_choice("attending.curve", self.curve, ("power", "exponential", "linear"))
        for name in ("top_k", "min_tokens"):
            check_int(f"attending.{name}", getattr(self, name))
        check_range("attending.retention", self.retention, 0.0, 1.0, lo_open=True)
        check_range("attending.top_k", self.top_k, 1)
        check_range("attending.steepness", self.steepness, 0.0, 20.0, lo_open=True)
        check_range("attending.offset", self.offset, -1.0, 1.0)
        check_range("attending.min_budget", self.min_budget, 0.0, 1.0, lo_open=True)
        check_range("attending.max_budget", self.max_budget, self.min_budget, 1.0)
        check_range("attending.pooled_share", self.pooled_share, 0.0, 1.0, hi_open=True)
        check_range("attending.min_tokens", self.min_tokens, 0)
        check_range("attending.soft_temperature", self.soft_temperature, 0.0, lo_open=True)


@dataclass(frozen=True)
class Allotment:
    tokens: torch.Tensor  # (B, gh, gw) int32 homunculus; sum per frame == budget
    lod: torch.Tensor  # (B, gh, gw) int8: 0 dropped, 1 full token, 2 covered by a pooled 2x2 token
    budget: torch.Tensor  # (B,) int64 tokens spent per frame
    soft: torch.Tensor  # (B, gh, gw) float differentiable soft budget, sums to budget per frame
    selected: torch.Tensor  # (B, K) int64 flat indices of cells holding a token (raster order), -1 padded;
    #                         K = the most any frame of this grid can get (max_budget), fixed per grid


def _rank(key: torch.Tensor) -> torch.Tensor:
    """Descending rank of every entry along dim 1 (0 = largest); ties keep index order."""
    order = torch.sort(key, dim=1, descending=True, stable=True).indices  # (B, N)
    arange = torch.arange(key.shape[1], device=key.device).expand_as(order)  # (B, N)
    return torch.empty_like(order).scatter_(1, order, arange)  # (B, N)


class TokenAllocator(nn.Module):
    def __init__(self, cfg: AttendingConfig = AttendingConfig()):
        super().__init__()
        self.cfg = cfg
        if cfg.curve != "linear":  # a linear curve has no steepness to learn
            inv_softplus = cfg.steepness + math.log(-math.expm1(-cfg.steepness))
            self.steepness_raw = nn.Parameter(torch.tensor(inv_softplus))
        self.offset = nn.Parameter(torch.tensor(float(cfg.offset)))

    def demand(self, relevance: torch.Tensor) -> torch.Tensor:
        """Per-cell budget in full tokens, [min_budget, max_budget], non-decreasing in relevance."""
        r = relevance.clamp(0.0, 1.0)
        if self.cfg.curve == "power":
            # clamp away from 0: d(r^g)/dg = r^g log r is NaN at r = 0
            curve = r.clamp_min(1e-6) ** F.softplus(self.steepness_raw)
        elif self.cfg.curve == "exponential":
            g = F.softplus(self.steepness_raw)
            curve = torch.expm1(g * r) / torch.expm1(g)  # maps [0, 1] onto [0, 1]
        else:
            curve = r
        return (curve + self.offset).clamp(self.cfg.min_budget, self.cfg.max_budget)

    def frame_budget(self, n_available: torch.Tensor) -> torch.Tensor:
        """(B,) int64 tokens per frame from (B,) available cell counts."""
        if self.cfg.selection == "topk":
            return n_available.clamp(max=self.cfg.top_k)
        k = retained_tokens(n_available, self.cfg.retention)
        return torch.minimum(k.clamp(min=self.cfg.min_tokens), n_available)

    def forward(self, relevance: torch.Tensor, available: torch.Tensor | None = None) -> Allotment:
        if relevance.dim() != 3:
            raise ValueError(f"relevance must be (B, gh, gw), got {tuple(relevance.shape)}")
        B, gh, gw = relevance.shape
        if available is None:
            available = torch.ones_like(relevance, dtype=torch.bool)
        elif available.dtype != torch.bool or available.shape != relevance.shape:
            raise ValueError(f"available must be a bool tensor of shape {tuple(relevance.shape)}, "
                             f"got {available.dtype} {tuple(available.shape)}")
        r = relevance.to(torch.promote_types(relevance.dtype, self.offset.dtype)).reshape(B, -1)  # (B, N)
        avail = available.reshape(B, -1)  # (B, N)
        n = avail.sum(dim=1)  # (B,)
        budget = self.frame_budget(n)  # (B,)
        # Pooled tokens cover up to 4 cells each; capping them at (n - K) / 3 guarantees that
        # full tokens can always make up the rest (see _hard), so the budget is always exact.
        pooled = torch.minimum(torch.floor(budget.double() * self.cfg.pooled_share).long(),
                               torch.div(n - budget, 3, rounding_mode="floor"))  # (B,)
        demand = self.demand(r)  # (B, N)
        rank = _rank(r.detach().masked_fill(~avail, float("-inf")))  # (B, N)
        tokens, lod = self._hard(r.detach(), demand.detach(), avail, rank, budget, pooled, gh, gw)
        soft = self._soft(demand, avail, rank, budget)  # (B, N)
        return Allotment(
            tokens=tokens.view(B, gh, gw),
            lod=lod.view(B, gh, gw),
            budget=budget,
            soft=soft.view(B, gh, gw),
            selected=self._selected(tokens > 0, self.max_budget(gh * gw)),
        )

    def _hard(self, r, demand, avail, rank, budget, pooled, gh, gw):
        """(tokens int32, lod int8), both (B, N): exact per-frame budgets, no loop over cells.

        1. full tokens on the K - P most relevant available cells;
        2. pooled tokens on the P blocks (without a full cell) of largest total demand;
        3. if fewer than P such blocks exist, full tokens on the next most relevant free cells.
        Step 3 always has room: with E < P blocks pooled, the free cells number at least
        n - (K - P) - 4E >= P - E because P <= (n - K) / 3.
        """
        B, N = r.shape
        full = rank < (budget - pooled).unsqueeze(1)  # (B, N)
        to_blocks, from_blocks = _block_view(B, gh, gw)
        b_avail = to_blocks(avail, False)  # (B, nb, 4)
        eligible = b_avail.any(dim=-1) & ~to_blocks(full, False).any(dim=-1)  # (B, nb)
        # Total demand: a pooled token is worth what the cells it covers together deserve.
        b_score = (to_blocks(demand, 0.0) * b_avail).sum(dim=-1)  # (B, nb)
        b_rank = _rank(b_score.masked_fill(~eligible, float("-inf")))  # (B, nb)
        chosen = eligible & (b_rank < pooled.unsqueeze(1))  # (B, nb)
        b_r = to_blocks(r, 0.0).masked_fill(~b_avail, float("-inf"))  # (B, nb, 4)
        top = F.one_hot(b_r.argmax(dim=-1), 4).bool()  # (B, nb, 4) block's most relevant cell
        covered = from_blocks(chosen.unsqueeze(-1) & b_avail)  # (B, N)
        pooled_token = from_blocks(chosen.unsqueeze(-1) & top & b_avail)  # (B, N)

        shortfall = pooled - chosen.sum(dim=1)  # (B,)
        free = avail & ~full & ~covered  # (B, N)
        top_up = free & (_rank(r.masked_fill(~free, float("-inf"))) < shortfall.unsqueeze(1))  # (B, N)

        detail = full | top_up  # (B, N)
        tokens = (detail | pooled_token).to(torch.int32)  # (B, N)
        lod = torch.where(detail, FULL, torch.where(covered, POOLED, DROPPED)).to(torch.int8)  # (B, N)
        return tokens, lod

    def _soft(self, demand, avail, rank, budget):
        """Differentiable soft budget (B, N), summing to the budget per frame.

        A sigmoid gate around the K-th / (K+1)-th demand says how surely a cell makes the cut; the
        K tokens are then shared among the gated cells in proportion to their demand, so the
        curve's steepness and offset shape the result and get gradients.
        """
        B, N = demand.shape
        order = torch.empty_like(rank).scatter_(1, rank, torch.arange(N, device=rank.device).expand_as(rank))
        d_sorted = demand.gather(1, order)  # (B, N) non-increasing over the available cells
        n = avail.sum(dim=1)  # (B,)
        kth = d_sorted.gather(1, (budget - 1).clamp(0, N - 1).unsqueeze(1))  # (B, 1)
        next_ = d_sorted.gather(1, budget.clamp(0, N - 1).unsqueeze(1))  # (B, 1)
        next_ = torch.where((budget < n).unsqueeze(1), next_, kth - 1.0)  # every available cell makes the cut
        gate = torch.sigmoid((demand - 0.5 * (kth + next_)) / self.cfg.soft_temperature) * avail  # (B, N)
        share = gate * demand  # (B, N)
        return share * (budget.to(share.dtype) / share.sum(dim=1).clamp_min(1e-12)).unsqueeze(1)

    def max_budget(self, n_cells: int) -> int:
        """Most tokens a frame of n_cells can get: the width of `selected`, known on the host, so the
        output shape never waits for the GPU (and the step can be captured in a CUDA graph)."""
        return int(self.frame_budget(torch.tensor([n_cells]))[0])

    @staticmethod
    def _selected(has_token: torch.Tensor, k_max: int) -> torch.Tensor:
        """(B, k_max) int64 flat indices of cells with a token, raster order, -1 padded."""
        B, N = has_token.shape
        idx = torch.arange(N, device=has_token.device).expand(B, N)  # (B, N)
        key = torch.where(has_token, idx, N)  # (B, N) cells without a token sort last
        first = torch.sort(key, dim=1).values[:, :k_max]  # (B, K)
        return torch.where(first < N, first, -1)


def _block_view(B: int, gh: int, gw: int):
    """(to_blocks, from_blocks): (B, N) <-> (B, nb, 4) views of the aligned 2x2 blocks.

    Odd grids are padded by one row / column; padded cells are never available, so the edge
    blocks are 1x2, 2x1 or 1x1 in effect.
    """
    H, W = gh + gh % 2, gw + gw % 2

    def to_blocks(x: torch.Tensor, fill) -> torch.Tensor:
        g = F.pad(x.view(B, 1, gh, gw).to(torch.float32 if x.dtype == torch.bool else x.dtype),
                  (0, W - gw, 0, H - gh), value=float(fill))  # (B, 1, H, W)
        g = g.view(B, H // 2, 2, W // 2, 2).permute(0, 1, 3, 2, 4).reshape(B, -1, 4)  # (B, nb, 4)
        return g.bool() if x.dtype == torch.bool else g

    def from_blocks(x: torch.Tensor) -> torch.Tensor:
        g = x.view(B, H // 2, W // 2, 2, 2).permute(0, 1, 3, 2, 4).reshape(B, H, W)  # (B, H, W)
        return g[:, :gh, :gw].reshape(B, -1)  # (B, N)

    return to_blocks, from_blocks
