"""Balancing: opponent processing of the three ways of knowing into one relevance map.

Three tensions, each a weight in (0, 1) on its first pole:
- compress <-> particularize: structural information vs query-specific coupling,
- exploit <-> explore: the known salient regions vs the unremarked rest,
- focus <-> diversify: the fused score as is vs spread out (cells whose neighbourhood is already
  relevant are suppressed, so tokens go to several places instead of one blob).

`TensionBalancer` (seed Part 29) learns the tensions as constants; `AdaptiveTensionBalancer`
(seed Part 44) predicts them per frame from the query and summaries of the score maps. Both
return a relevance map in [0, 1] and the tensions per frame, for logging.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from arr_coc._validate import ConfigError, check_choice, check_int, check_range
from arr_coc.knowing import KnowingScores

TENSIONS = ("compress", "exploit", "focus")
SCORES = ("information", "salience", "coupling")


@dataclass(frozen=True)
class BalancingConfig:
    kind: Literal["tension", "adaptive"] = "adaptive"
    weight_mode: Literal["softmax", "sigmoid"] = "softmax"  # adaptive score weights: compete or gate
    hidden_dim: int = 64  # width of the fusion / policy MLPs
    diversity_window: int = 3  # odd side (cells) of the neighbourhood the diversify term looks at
    initial_tension: float = 0.5  # starting weight on each tension's first pole

    def __post_init__(self) -> None:
        check_choice("balancing.kind", self.kind, ("tension", "adaptive"))
        check_choice("balancing.weight_mode", self.weight_mode, ("softmax", "sigmoid"))
        for name in ("hidden_dim", "diversity_window"):
            check_int(f"balancing.{name}", getattr(self, name))
        check_range("balancing.hidden_dim", self.hidden_dim, 1)
        check_range("balancing.diversity_window", self.diversity_window, 3, 15)
        if self.diversity_window % 2 == 0:
            raise ConfigError(f"balancing.diversity_window={self.diversity_window} must be odd")
        check_range("balancing.initial_tension", self.initial_tension, 0.0, 1.0, lo_open=True, hi_open=True)


@dataclass(frozen=True)
class Balanced:
    relevance: torch.Tensor  # (B, gh, gw) in [0, 1]
    tensions: dict[str, torch.Tensor]  # name -> (B,)


class Spread(nn.Module):
    """Neighbourhood suppression: x * (1 - mean of x over the neighbours, centre excluded).

    A relevant cell inside a relevant blob is damped (its neighbours will be looked at anyway);
    an isolated relevant cell keeps its score. Replaces the seeds' per-position distance loop.
    """

    def __init__(self, window: int):
        super().__init__()
        kernel = torch.ones(1, 1, window, window)
        kernel[..., window // 2, window // 2] = 0.0
        self.register_buffer("kernel", kernel, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x4 = x.unsqueeze(1)  # (B, 1, gh, gw)
        k = self.kernel.to(x.dtype)
        pad = k.shape[-1] // 2
        total = F.conv2d(x4, k, padding=pad)  # (B, 1, gh, gw)
        # (1, 1, gh, gw) border cells have fewer
        count = F.conv2d(torch.ones_like(x4[:1]), k, padding=pad).clamp_min(1.0)
        return x * (1.0 - (total / count).squeeze(1))  # (B, gh, gw)


def oppose(scores: KnowingScores, base: torch.Tensor, tension: torch.Tensor, spread: Spread) -> torch.Tensor:
    """The three tension-resolved maps (B, 3, gh, gw) from per-frame tensions (B, 3) in (0, 1)."""
    c, e, f = (t.view(-1, 1, 1) for t in tension.unbind(dim=1))  # each (B, 1, 1)
    compress = c * scores.information + (1 - c) * scores.coupling  # (B, gh, gw)
    exploit = e * scores.salience + (1 - e) * (1 - scores.salience)  # (B, gh, gw)
    focus = f * base + (1 - f) * spread(base)  # (B, gh, gw)
    return torch.stack([compress, exploit, focus], dim=1)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


class TensionBalancer(nn.Module):
    """Part 29: learned constant tensions, a learned per-cell fusion and a learned mix.

    The seed min-max normalised the balanced scores over everything it was given, which couples
    frames of a batch; a convex mix of [0, 1] maps is already in [0, 1] and needs no normalising.
    """

    def __init__(self, cfg: BalancingConfig = BalancingConfig()):
        super().__init__()
        self.tension_logits = nn.Parameter(torch.full((3,), _logit(cfg.initial_tension)))
        self.fuse = nn.Sequential(  # per-cell MLP on (information, salience, coupling)
            nn.Conv2d(3, cfg.hidden_dim, 1), nn.GELU(), nn.Conv2d(cfg.hidden_dim, 1, 1))
        self.mix_logits = nn.Parameter(torch.zeros(3))
        self.spread = Spread(cfg.diversity_window)

    def forward(self, scores: KnowingScores, query: torch.Tensor | None = None) -> Balanced:
        # The query is accepted for a uniform balancer interface; fixed tensions ignore it by design.
        x = scores.stack().to(self.mix_logits.dtype)  # (B, 3, gh, gw)
        scores = KnowingScores(*x.unbind(dim=1))
        B = x.shape[0]
        base = torch.sigmoid(self.fuse(x)).squeeze(1)  # (B, gh, gw)
        tension = torch.sigmoid(self.tension_logits).expand(B, 3)  # (B, 3)
        maps = oppose(scores, base, tension, self.spread)  # (B, 3, gh, gw)
        relevance = torch.einsum("bthw,t->bhw", maps, torch.softmax(self.mix_logits, dim=0))
        return Balanced(relevance, dict(zip(TENSIONS, tension.unbind(dim=1))))


class AdaptiveTensionBalancer(nn.Module):
    """Part 44: a policy MLP maps (query, mean/max/std of each score map) to per-frame tensions
    and per-frame score weights.

    weight_mode "softmax": the three ways of knowing compete, base = convex mix of the scores.
    weight_mode "sigmoid": each way of knowing is gated independently and any one can make a
    cell relevant, base = 1 - prod(1 - w_i * s_i) (noisy-OR), which stays in [0, 1] without
    renormalising the weights back into a softmax.
    """

    def __init__(self, cfg: BalancingConfig, query_dim: int):
        super().__init__()
        self.weight_mode = cfg.weight_mode
        self.query_norm = nn.LayerNorm(query_dim)  # LM embeddings vary in scale between models
        self.policy = nn.Sequential(
            nn.Linear(query_dim + 9, cfg.hidden_dim), nn.GELU(), nn.Linear(cfg.hidden_dim, 6))
        with torch.no_grad():  # start at the configured tensions and equal score weights
            self.policy[-1].weight.mul_(0.1)
            self.policy[-1].bias.copy_(torch.tensor([_logit(cfg.initial_tension)] * 3 + [0.0] * 3))
        self.mix_logits = nn.Parameter(torch.zeros(3))
        self.spread = Spread(cfg.diversity_window)

    def forward(self, scores: KnowingScores, query: torch.Tensor) -> Balanced:
        dtype = self.mix_logits.dtype
        x = scores.stack().to(dtype)  # (B, 3, gh, gw)
        scores = KnowingScores(*x.unbind(dim=1))
        flat = x.flatten(2)  # (B, 3, N)
        # Population std (a 1x1 grid has no unbiased one); eps bounds sqrt's gradient on a blank frame.
        std = (flat.var(dim=-1, unbiased=False) + 1e-6).sqrt()  # (B, 3)
        summary = torch.cat([flat.mean(dim=-1), flat.amax(dim=-1), std], dim=1)  # (B, 9)
        out = self.policy(torch.cat([self.query_norm(query.to(dtype)), summary], dim=1))  # (B, 6)
        tension = torch.sigmoid(out[:, :3])  # (B, 3)
        if self.weight_mode == "softmax":
            weight = torch.softmax(out[:, 3:], dim=1)  # (B, 3)
            base = torch.einsum("bshw,bs->bhw", x, weight)  # (B, gh, gw)
        else:
            weight = torch.sigmoid(out[:, 3:])  # (B, 3)
            base = 1 - torch.prod(1 - weight.view(-1, 3, 1, 1) * x, dim=1)  # (B, gh, gw)
        maps = oppose(scores, base, tension, self.spread)  # (B, 3, gh, gw)
        relevance = torch.einsum("bthw,t->bhw", maps, torch.softmax(self.mix_logits, dim=0))
        tensions = dict(zip(TENSIONS, tension.unbind(dim=1)))
        tensions.update({f"weight_{name}": w for name, w in zip(SCORES, weight.unbind(dim=1))})
        return Balanced(relevance, tensions)


def make_balancer(cfg: BalancingConfig, query_dim: int) -> nn.Module:
    """The balancer cfg.kind names; query_dim is the width of the (pooled) query embedding."""
    if isinstance(query_dim, bool) or not isinstance(query_dim, int) or query_dim < 1:
        raise ConfigError(f"query_dim={query_dim!r} is out of range; allowed: integers >= 1")
    if cfg.kind == "tension":
        return TensionBalancer(cfg)
    return AdaptiveTensionBalancer(cfg, query_dim)
