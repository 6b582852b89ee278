"""ARR-COC: knowing -> balancing -> attending, realized over time, for one stream of frames.

    frames ──TextureExtractor──▶ texture ──Knowing──▶ scores ──Balancer──▶ relevance
      ──TemporalRelevanceRealizer (cache, motion, cuts, redundancy)──▶ realized relevance
      ──TokenAllocator──▶ Allocation (homunculus)

The pipeline runs `extract` and `realize` as two stages on two CUDA streams; `forward` runs
both for training and tests.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from .attending import AttendingConfig, TokenAllocator
from .balancing import BalancingConfig, make_balancer
from .knowing import Knowing, KnowingConfig
from .realizing import Realized, RealizingConfig, StreamState, TemporalRelevanceRealizer
from .texture import CHANNELS, Texture, TextureConfig, TextureExtractor

# The relevance cache is an output of realizing, so the knowing scorers (which run before it)
# see every channel but that one; the cache enters through the realizer's learned blend.
KNOWING_CHANNELS = tuple(c for c in CHANNELS if c != "relevance_cache")


@dataclass(frozen=True)
class ARRCOCConfig:
    texture: TextureConfig = field(default_factory=TextureConfig)
    knowing: KnowingConfig = field(default_factory=KnowingConfig)
    balancing: BalancingConfig = field(default_factory=BalancingConfig)
    attending: AttendingConfig = field(default_factory=AttendingConfig)
    realizing: RealizingConfig = field(default_factory=RealizingConfig)


@dataclass(frozen=True)
class Allocation:
    """Per-frame output of ARR-COC for T frames of one stream on a (gh, gw) token grid.

    relevance:    (T, gh, gw) float in [0, 1], realized relevance
    tokens:       (T, gh, gw) int32, homunculus: VLM tokens spent on each cell (0 = none);
                  a pooled 2x2 token is counted on its block's most relevant cell
    selected:     (T, K) int64, flat cell indices holding a token, -1 padded
    lod:          (T, gh, gw) int8, 0 dropped, 1 full token, 2 covered by a pooled 2x2 token
    scene_change: (T,) bool, True on the first frame of each new shot / fixation
    motion:       (T,) float, mean motion magnitude of the frame (0..1 colour units)
    tensions:     name -> (T,) float, the balancer's tension values (for logging)
    soft:         (T, gh, gw) float, differentiable soft token budget (train soft, infer hard)
    """

    relevance: torch.Tensor
    tokens: torch.Tensor
    selected: torch.Tensor
    lod: torch.Tensor
    scene_change: torch.Tensor
    motion: torch.Tensor
    tensions: dict[str, torch.Tensor]
    soft: torch.Tensor

    def __post_init__(self) -> None:
        T, gh, gw = self.relevance.shape
        for name in ("tokens", "lod", "soft"):
            if tuple(getattr(self, name).shape) != (T, gh, gw):
                raise ValueError(f"Allocation.{name} has shape {tuple(getattr(self, name).shape)}, expected "
                                 f"{(T, gh, gw)}")
        for name in ("scene_change", "motion"):
            if tuple(getattr(self, name).shape) != (T,):
                raise ValueError(f"Allocation.{name} has shape {tuple(getattr(self, name).shape)}, expected {(T,)}")
        if self.selected.ndim != 2 or self.selected.shape[0] != T:
            raise ValueError(f"Allocation.selected must be (T, K), got {tuple(self.selected.shape)}")

    def __len__(self) -> int:
        return int(self.relevance.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Allocation":
        move = lambda x: x.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, relevance=move(self.relevance), tokens=move(self.tokens),
                       selected=move(self.selected), lod=move(self.lod),
                       scene_change=move(self.scene_change), motion=move(self.motion),
                       tensions={k: move(v) for k, v in self.tensions.items()}, soft=move(self.soft))


class ARRCOC(nn.Module):
    def __init__(self, cfg: ARRCOCConfig | None = None, query_dim: int = 384) -> None:
        super().__init__()
        self.cfg = cfg = cfg or ARRCOCConfig()
        self.query_dim = query_dim
        self.texture = TextureExtractor(cfg.texture)
        self.knowing = Knowing(replace(cfg.knowing, channels=KNOWING_CHANNELS, query_dim=query_dim))
        self.balancer = make_balancer(cfg.balancing, query_dim)
        self.realizer = TemporalRelevanceRealizer(cfg.realizing)
        self.allocator = TokenAllocator(cfg.attending)
        self.register_buffer("_knowing_index",
                             torch.tensor([CHANNELS.index(c) for c in KNOWING_CHANNELS]), persistent=False)

    @classmethod
    def from_pretrained(cls, weights: str | os.PathLike = "default", config: ARRCOCConfig | None = None,
                        query_dim: int = 384) -> "ARRCOC":
        """A model in eval mode with trained weights: "default" (the checkpoint shipped in the
        package, trained for 384-d MiniLM queries), "none" (the initial values) or a .safetensors
        path. Every checkpoint must fit the model exactly (a misfit is a ConfigError naming the
        tensors): the default fits the default architecture with query_dim 384.

            model = ARRCOC.from_pretrained()                      # the shipped checkpoint
            model = ARRCOC.from_pretrained("run/model.safetensors", query_dim=1536)
        """
        from ._validate import check_int, check_range
        from .checkpoint import load_pretrained

        if config is not None and not isinstance(config, ARRCOCConfig):
            raise TypeError(f"config must be an ARRCOCConfig or None, got {type(config).__name__}")
        check_int("query_dim", query_dim)
        check_range("query_dim", query_dim, 1, None)
        model = cls(config, query_dim=query_dim)
        load_pretrained(model, weights)
        return model.eval()

    def extract(self, frames: torch.Tensor, last_frame: torch.Tensor | None, grid: tuple[int, int],
                last_real: torch.Tensor | None = None) -> Texture:
        """Texture stage for T consecutive frames (T, 3, H, W) of one stream.

        last_frame: (3, H, W) the frame before frames[0], or None at the start of the stream.
        last_real:  () bool tensor, False where last_frame is frames[0] standing in for the
                    stream's start (same result as None); None: True.
        """
        return self.texture.sequence(frames, last_frame, grid, last_real)

    def realize(self, texture: Texture, query: torch.Tensor, state: StreamState | None = None, *,
                query_mask: torch.Tensor | None = None, visual_tokens: torch.Tensor | None = None,
                vlm_frames: torch.Tensor | None = None) -> tuple[Allocation, StreamState, Texture]:
        """Realize stage for T consecutive frames of one stream.

        query:         (Dq,) sentence embedding or (L, Dq) token embeddings of the question
        query_mask:    (L,) bool for token embeddings
        visual_tokens: (T, gh*gw, Dq) the VLM's own visual tokens, when it supplies them
        Returns the allocation, the stream's new state and the texture with its relevance cache.
        """
        realized, tensions, state = self.realized(texture, query, state, query_mask=query_mask,
                                                  visual_tokens=visual_tokens, vlm_frames=vlm_frames)
        allotment = self.allocator(realized.relevance, realized.available)
        allocation = Allocation(
            relevance=realized.relevance,
            tokens=allotment.tokens,
            selected=allotment.selected,
            lod=allotment.lod,
            scene_change=realized.scene_change,
            motion=texture.motion.flatten(1).mean(1),
            tensions=tensions,
            soft=allotment.soft,
        )
        return allocation, state, texture.with_channel("relevance_cache", realized.cache)

    def realized(self, texture: Texture, query: torch.Tensor, state: StreamState | None = None, *,
                 query_mask: torch.Tensor | None = None, visual_tokens: torch.Tensor | None = None,
                 vlm_frames: torch.Tensor | None = None) -> tuple[Realized, dict[str, torch.Tensor], StreamState]:
        """Knowing -> balancing -> temporal realizing, before the allocator: (realized relevance and
        available cells, the balancer's tensions, the stream's new state). Arguments as realize's;
        outcome training samples its own selections from this (pipeline/training/selection.py)."""
        state = state or StreamState()
        T = texture.data.shape[0]
        q = query.expand(T, *query.shape)                                 # (T, Dq) or (T, L, Dq)
        qm = None if query_mask is None else query_mask.expand(T, *query_mask.shape)
        knowing_input = texture.data.index_select(1, self._knowing_index)  # (T, C-1, gh, gw)
        scores = self.knowing(knowing_input, q, qm, visual_tokens)
        pooled_q = q if q.ndim == 2 else _masked_mean(q, qm)               # (T, Dq)
        balanced = self.balancer(scores, pooled_q)
        realized, state = self.realizer(balanced.relevance, texture, state, vlm_frames)
        return realized, balanced.tensions, state

    def forward(self, frames: torch.Tensor, query: torch.Tensor, state: StreamState | None = None, *,
                grid: tuple[int, int], **realize_kwargs) -> tuple[Allocation, StreamState]:
        """Both stages for T consecutive frames (T, 3, H, W) of one stream."""
        state = state or StreamState()
        texture = self.extract(frames, state.prev_frame, grid)
        allocation, state, _ = self.realize(texture, query, state, **realize_kwargs)
        return allocation, replace(state, prev_frame=frames[-1])


def _masked_mean(tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(T, L, D) -> (T, D), ignoring masked-out tokens."""
    if mask is None:
        return tokens.mean(1)
    w = mask.to(tokens.dtype).unsqueeze(-1)                              # (T, L, 1)
    return (tokens * w).sum(1) / w.sum(1).clamp_min(1.0)
