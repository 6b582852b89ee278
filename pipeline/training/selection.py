"""The stochastic hard selection of outcome training: ARR-COC's relevance as a policy over cells.

At inference the allocator keeps, in every frame, the K most relevant available cells (K: the
frame's budget, TokenAllocator.frame_budget). Outcome training makes that choice stochastic so it
can be rewarded: the cells of a frame are drawn without replacement from a Plackett-Luce
distribution with logits relevance / temperature, K of them (as temperature -> 0 the draw becomes the
allocator's own top-K). Sampling uses the Gumbel-top-k trick (Kool et al. 2019): the K largest of
logits + Gumbel noise, in order, are an ordered Plackett-Luce sample. Its log-probability is

    log p(i_1 .. i_K) = sum_j [ s_{i_j} - logsumexp_{c not in i_1 .. i_{j-1}} s_c ]

The reward (the answer right or wrong) depends on the set alone, so REINFORCE on the ordered
sample's log-probability is an unbiased gradient of the expected reward. Frames are independent
given the relevance, so a selection's log-probability is the sum over its frames.
"""
from __future__ import annotations

from typing import Literal

import torch

Advantage = Literal["group", "group_norm", "none"]
_UNAVAILABLE = -1e4     # the logit of a cell that may get no token: exp() of it vanishes next to any real one


def _masked(logits: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~available, _UNAVAILABLE)


def ordered_log_prob(logits: torch.Tensor, available: torch.Tensor, order: torch.Tensor,
                     budget: torch.Tensor) -> torch.Tensor:
    """Log-probability of ordered selections under Plackett-Luce.

    logits (T, N), available (T, N) bool, budget (T,) cells kept per frame (at most the available
    ones); order (G, T, N) per sample and frame a permutation of the cells whose first budget[t]
    entries are the cells drawn, in the order drawn. -> (G,), differentiable in logits.
    """
    s = _masked(logits, available).expand(order.shape[0], -1, -1).gather(-1, order)   # (G, T, N) drawn order
    rest = torch.logcumsumexp(s.flip(-1), -1).flip(-1)                   # (G, T, N) logsumexp of s[j:]
    drawn = torch.arange(s.shape[-1], device=s.device) < budget[:, None]    # (T, N) the first K places
    return ((s - rest) * drawn).sum((-1, -2))                               # (G,)


def sample_selection(logits: torch.Tensor, available: torch.Tensor, budget: torch.Tensor, samples: int,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` selections of exactly budget[t] available cells in every frame t.

    logits (T, N), available (T, N) bool, budget (T,) int64 <= available.sum(-1).
    -> keep (G, T, N) bool, log_prob (G,) (differentiable in logits).
    """
    T, N = logits.shape
    if bool((budget > available.sum(-1)).any()):
        raise ValueError("a frame's budget exceeds its available cells")
    u = torch.rand((samples, T, N), generator=generator, device=logits.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp(1e-12, 1 - 1e-12))).to(logits.dtype)     # (G, T, N)
    key = (logits.detach() + gumbel).masked_fill(~available, float("-inf"))         # (G, T, N)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices          # (G, T, N)
    place = torch.arange(N, device=logits.device).expand_as(order)                 # (G, T, N)
    keep = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, place < budget[None, :, None])
    return keep, ordered_log_prob(logits, available, order, budget)


def advantages(rewards: torch.Tensor, mode: Advantage = "group") -> torch.Tensor:
    """rewards (Q, G): G samples of each of Q questions -> the advantage of each sample.

    group: the reward minus its question's mean (GRPO's group baseline); group_norm: that divided
    by the group's standard deviation; none: the reward itself (plain REINFORCE). With the group
    modes a question whose samples all score the same teaches nothing (advantage 0)."""
    if mode == "none":
        return rewards
    centred = rewards - rewards.mean(1, keepdim=True)
    if mode == "group":
        return centred
    if mode == "group_norm":
        return centred / (rewards.std(1, keepdim=True, unbiased=False) + 1e-6)
    raise ValueError(f"Invalid advantage ({mode!r}). Supported values are group, group_norm, none.")


def policy_loss(log_prob: torch.Tensor, rewards: torch.Tensor, mode: Advantage = "group") -> torch.Tensor:
    """REINFORCE: -mean(advantage x log p(selection)); log_prob and rewards (Q, G)."""
    return -(advantages(rewards.to(log_prob.dtype), mode).detach() * log_prob).mean()
