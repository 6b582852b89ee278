"""Knowing: three ways of knowing each grid cell (Vervaeke).

- propositional (information): how much is there to know about this cell,
- perspectival (salience): how much the cell stands out from the viewer's standpoint,
- participatory (coupling): how strongly the cell couples to the question being asked.

Each score is a (B, gh, gw) map in [0, 1]. Every operation is per cell or per frame: nothing is
normalised over the batch, so a frame's scores never depend on which frames share its batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from arr_coc._validate import ConfigError, check_choice, check_int, check_range

# Mirrors arr_coc.texture.CHANNELS (docs/internals.md). Kept here rather than imported so the
# scorers can be built and tested for any channel layout without the texture extractor.
DEFAULT_CHANNELS = (
    "r", "g", "b", "lab_l", "lab_a", "sobel_gx", "sobel_gy", "sobel_mag",
    "pos_y", "pos_x", "eccentricity", "saliency", "luminance",
    "motion", "flow_dy", "flow_dx", "relevance_cache",
)

# Variance floor of the local entropy estimate: flat regions bottom out here instead of at -inf.
_VAR_FLOOR = 1e-4


@dataclass(frozen=True)
class KnowingConfig:
    channels: tuple[str, ...] = DEFAULT_CHANNELS  # texture channel names, in texture order
    query_dim: int = 1536  # Dq: the VLM's text embedding width
    hidden_dim: int = 64  # participatory projection C -> hidden -> Dq; 0 = one Linear C -> Dq
    context_dim: int = 8  # channels of the 3x3 convs that read each cell's neighbours' coupling; 0 = none
    salience_channels: tuple[str, ...] = ("saliency", "sobel_mag", "eccentricity", "motion")
    information_window: int = 3  # odd side (cells) of the neighbourhood the information is measured in
    token_pooling: Literal["max", "attention"] = "max"  # how query tokens (B, L, Dq) are reduced

    def __post_init__(self) -> None:
        if len(self.channels) < 1 or len(set(self.channels)) != len(self.channels):
            raise ConfigError(f"knowing.channels={self.channels!r} must be non-empty and unique")
        for name in ("query_dim", "hidden_dim", "context_dim", "information_window"):
            check_int(f"knowing.{name}", getattr(self, name))
        check_range("knowing.query_dim", self.query_dim, 1)
        check_range("knowing.hidden_dim", self.hidden_dim, 0)
        check_range("knowing.context_dim", self.context_dim, 0)
        check_range("knowing.information_window", self.information_window, 3, 15)
        if self.information_window % 2 == 0:
            raise ConfigError(f"knowing.information_window={self.information_window} must be odd")
        if not self.salience_channels:
            raise ConfigError("knowing.salience_channels must name at least one channel")
        for name in self.salience_channels:
            check_choice("knowing.salience_channels", name, self.channels)
        check_choice("knowing.token_pooling", self.token_pooling, ("max", "attention"))


@dataclass(frozen=True)
class KnowingScores:
    information: torch.Tensor  # (B, gh, gw) propositional, [0, 1]
    salience: torch.Tensor  # (B, gh, gw) perspectival, [0, 1]
    coupling: torch.Tensor  # (B, gh, gw) participatory, [0, 1]

    def stack(self) -> torch.Tensor:
        """The three maps as channels: (B, 3, gh, gw) in (information, salience, coupling) order."""
        return torch.stack([self.information, self.salience, self.coupling], dim=1)


class PropositionalScorer(nn.Module):
    """Information content as the local differential entropy of the texture features.

    The seeds take the entropy of each cell's channel vector, which measures how evenly the
    channels are spread, not how much the image varies there. Here each channel is modelled as
    Gaussian over the cell's neighbourhood, whose entropy is 0.5 * log(2 pi e var): busy cells
    (edges, texture, motion) carry more information than flat ones. Channels are weighted by a
    learned softmax, so the model chooses which kinds of variation count.
    """

    def __init__(self, channels: int, window: int):
        super().__init__()
        self.window = window
        self.channel_logits = nn.Parameter(torch.zeros(channels))
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.bias = nn.Parameter(torch.tensor(0.5 * math.log(1e-2)))  # mid-grey: local variance 0.01

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, pad = self.window, self.window // 2
        mean = F.avg_pool2d(x, k, stride=1, padding=pad, count_include_pad=False)  # (B, C, gh, gw)
        mean_sq = F.avg_pool2d(x * x, k, stride=1, padding=pad, count_include_pad=False)  # (B, C, gh, gw)
        var = (mean_sq - mean * mean).clamp_min(0.0)  # (B, C, gh, gw)
        entropy = 0.5 * torch.log(var + _VAR_FLOOR)  # (B, C, gh, gw), constant terms dropped
        w = torch.softmax(self.channel_logits, dim=0)  # (C,)
        h = torch.einsum("bchw,c->bhw", entropy, w)  # (B, gh, gw)
        return torch.sigmoid(self.gain * (h - self.bias))


class PerspectivalScorer(nn.Module):
    """Salience: a learned 1x1 combination of the salience channels and their centre-surround contrast."""

    def __init__(self, index: list[int], names: tuple[str, ...]):
        super().__init__()
        self.register_buffer("index", torch.tensor(index, dtype=torch.long), persistent=False)
        n = len(index)
        self.mix = nn.Conv2d(2 * n, 1, kernel_size=1)
        # Start from a sensible prior rather than noise: salient, edgy, moving cells stand out and
        # so do central ones (low eccentricity); training is free to move away from it.
        sign = torch.tensor([-1.0 if name == "eccentricity" else 1.0 for name in names])
        with torch.no_grad():
            self.mix.weight.copy_(torch.cat([sign, 0.5 * sign]).view(1, 2 * n, 1, 1) / n)
            self.mix.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.index_select(1, self.index)  # (B, S, gh, gw)
        # A cell that differs from its surround pops out even where the channel itself is modest.
        surround = F.avg_pool2d(s, 3, stride=1, padding=1, count_include_pad=False)  # (B, S, gh, gw)
        feats = torch.cat([s, s - surround], dim=1)  # (B, 2S, gh, gw)
        return torch.sigmoid(self.mix(feats)).squeeze(1)  # (B, gh, gw)


class ParticipatoryScorer(nn.Module):
    """Query coupling: cosine between each cell's embedding and the query, squashed to [0, 1].

    Cell embeddings come from a learned texture -> query-space projection, or, when the VLM
    supplies them, from its own visual tokens (already in the text embedding space).

    A cell's own cosine says how much of the named thing it shows, not how much of the named
    object's extent it holds: a cell on a triangle's empty box corner or a car's cut-away cabin
    corner shows mostly background, yet the object is there. Two 3x3 convolutions over the
    frame's cosine map (context_dim channels, 5x5 cells of context) add a learned term to each
    cell's coupling logit from its neighbours' coupling, so cells next to a strongly coupled
    cell can rank above equally weak cells elsewhere. It reads cosines only, so it works the
    same on the projected texture and on a VLM's visual tokens.
    """

    def __init__(self, channels: int, query_dim: int, hidden_dim: int, pooling: str, context_dim: int = 0):
        super().__init__()
        if hidden_dim == 0:
            self.project = nn.Linear(channels, query_dim)
        else:
            self.project = nn.Sequential(
                nn.Linear(channels, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, query_dim))
        self.pooling = pooling
        # CLIP-style learned temperature and bias: raw cosines of unrelated embeddings crowd near
        # 0, and (cos + 1) / 2 as in the seeds would leave every cell at about 0.5.
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.bias = nn.Parameter(torch.tensor(0.0))
        if pooling == "attention":
            self.log_pool_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.context = None
        if context_dim > 0:
            self.context = nn.Sequential(nn.Conv2d(1, context_dim, 3, padding=1), nn.GELU(),
                                         nn.Conv2d(context_dim, 1, 3, padding=1))
            # Start (almost) as the plain per-cell coupling; not exactly zero, so that the first
            # conv gets a gradient from the first step.
            with torch.no_grad():
                self.context[2].weight.mul_(0.01)
                self.context[2].bias.zero_()

    def forward(self, x: torch.Tensor, query: torch.Tensor, query_mask: torch.Tensor | None,
                visual_tokens: torch.Tensor | None) -> torch.Tensor:
        B, C, gh, gw = x.shape
        if visual_tokens is None:
            cells = self.project(x.flatten(2).transpose(1, 2))  # (B, N, Dq)
        else:
            cells = visual_tokens  # (B, N, Dq)
        q = query if query.dim() == 3 else query.unsqueeze(1)  # (B, L, Dq)
        cos = F.normalize(cells, dim=-1) @ F.normalize(q, dim=-1).transpose(1, 2)  # (B, N, L)
        if query_mask is None:
            valid = torch.ones(B, 1, q.shape[1], dtype=torch.bool, device=x.device)  # (B, 1, L)
        else:
            valid = query_mask.unsqueeze(1)  # (B, 1, L)
        if self.pooling == "max":
            sim = cos.masked_fill(~valid, float("-inf")).amax(dim=-1)  # (B, N)
        else:
            logits = (cos * self.log_pool_scale.exp()).masked_fill(~valid, float("-inf"))  # (B, N, L)
            attn = torch.softmax(logits, dim=-1)  # (B, N, L)
            sim = (attn * cos.masked_fill(~valid, 0.0)).sum(dim=-1)  # (B, N)
        logit = self.log_scale.exp() * sim + self.bias  # (B, N)
        if self.context is not None:
            logit = logit + self.context(sim.view(B, 1, gh, gw)).flatten(1)  # (B, N)
        return torch.sigmoid(logit).view(B, gh, gw)


class Knowing(nn.Module):
    """The three scorers side by side: texture (+ query) -> KnowingScores."""

    def __init__(self, cfg: KnowingConfig = KnowingConfig()):
        super().__init__()
        self.cfg = cfg
        C = len(cfg.channels)
        index = [cfg.channels.index(name) for name in cfg.salience_channels]
        self.propositional = PropositionalScorer(C, cfg.information_window)
        self.perspectival = PerspectivalScorer(index, cfg.salience_channels)
        self.participatory = ParticipatoryScorer(C, cfg.query_dim, cfg.hidden_dim, cfg.token_pooling,
                                                 cfg.context_dim)

    def forward(self, texture_data: torch.Tensor, query: torch.Tensor,
                query_mask: torch.Tensor | None = None,
                visual_tokens: torch.Tensor | None = None) -> KnowingScores:
        self._check(texture_data, query, query_mask, visual_tokens)
        dtype = self.participatory.bias.dtype
        x = texture_data.to(dtype)  # (B, C, gh, gw)
        q = query.to(dtype)  # (B, Dq) or (B, L, Dq)
        v = None if visual_tokens is None else visual_tokens.to(dtype)  # (B, N, Dq)
        return KnowingScores(
            information=self.propositional(x),
            salience=self.perspectival(x),
            coupling=self.participatory(x, q, query_mask, v),
        )

    def _check(self, x: torch.Tensor, query: torch.Tensor, mask: torch.Tensor | None,
               visual_tokens: torch.Tensor | None) -> None:
        C, Dq = len(self.cfg.channels), self.cfg.query_dim
        if x.dim() != 4 or x.shape[1] != C:
            raise ValueError(f"texture_data must be (B, {C}, gh, gw), got {tuple(x.shape)}")
        B, _, gh, gw = x.shape
        if query.dim() not in (2, 3) or query.shape[0] != B or query.shape[-1] != Dq:
            raise ValueError(f"query must be ({B}, {Dq}) or ({B}, L, {Dq}), got {tuple(query.shape)}")
        if mask is not None:
            if query.dim() != 3 or mask.shape != query.shape[:2] or mask.dtype != torch.bool:
                raise ValueError(f"query_mask must be a bool (B, L) tensor matching query tokens "
                                 f"{tuple(query.shape[:2])}, got {mask.dtype} {tuple(mask.shape)}")
            # (a host sync: skipped while a CUDA graph captures, where the inputs are placeholders)
            capturing = mask.is_cuda and torch.cuda.is_current_stream_capturing()
            if not capturing and not bool(mask.any(dim=1).all()):
                raise ValueError("query_mask masks every token of some frame; each frame needs a query")
        if visual_tokens is not None and tuple(visual_tokens.shape) != (B, gh * gw, Dq):
            raise ValueError(f"visual_tokens must be ({B}, {gh * gw}, {Dq}), got {tuple(visual_tokens.shape)}")
