"""Temporal realizing: relevance that persists, moves with the content, and resets at a cut.

Vervaeke's relevance realization is a process in time: what mattered a moment ago still matters
unless the world changed. Per stream, the realizer keeps
  - the previous frame's realized relevance, warped into this frame by optical flow and blended
    with the new relevance (learned decay), so attention follows moving content;
  - a learned motion boost (moving things deserve a look);
  - scene-change detection: a cut starts a new fixation, and the cache and the redundancy memory
    are dropped so the allocation is computed from scratch;
  - temporal redundancy: cells the VLM has already seen, unchanged since, need no tokens.

The blend and the redundancy memory are true recurrences (frame t needs frame t-1's realized
relevance and what the VLM has seen so far); they run branch-free on (gh, gw) maps, one small
step per frame of a batch and no host synchronisation. Cut detection is vectorised.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._validate import check_range
from .flow import sample, sampling_grid
from .texture import Texture


@dataclass(frozen=True)
class RealizingConfig:
    # Cut detection works on the median over cells of the flow-compensated residual: a pan or a
    # moving object leaves most cells explained by the flow (low median), a cut leaves none.
    cut_threshold: float = 0.04        # absolute median residual (0..1 colour units) for a cut
    cut_ratio: float = 6.0             # ... and at least this many times the recent level
    cut_window: int = 4                # frames in the trailing mean that defines "recent level"
    initial_decay: float = 0.5         # weight of the warped cache in the blend (learned)
    initial_motion_boost: float = 0.3  # weight of the motion channel added to relevance (learned)
    redundancy: bool = True            # drop cells the VLM saw unchanged
    redundancy_threshold: float = 0.04  # mean |colour change| per cell under which a cell is unchanged
    refresh_frames: int = 64           # resend every cell every this many frames (0: never)

    def __post_init__(self) -> None:
        check_range("realizing.cut_threshold", self.cut_threshold, 0.0, 1.0, lo_open=True)
        check_range("realizing.cut_ratio", self.cut_ratio, 1.0, None)
        check_range("realizing.cut_window", self.cut_window, 1, 1000)
        check_range("realizing.initial_decay", self.initial_decay, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("realizing.initial_motion_boost", self.initial_motion_boost, 0.0, None, lo_open=True)
        check_range("realizing.redundancy_threshold", self.redundancy_threshold, 0.0, 1.0)
        check_range("realizing.refresh_frames", self.refresh_frames, 0, None)


@dataclass(frozen=True)
class StreamState:
    """Everything one stream carries from one batch to the next.

    prev_frame:     (3, H, W) last frame of the previous batch (history for flow and motion)
    prev_relevance: (gh, gw) realized relevance of that frame
    ref_rgb:        (3, gh, gw) each cell's colour when the VLM last saw it
    stale:          (gh, gw) bool, cells the VLM must see again (after a cut or refresh)
    scores:         (cut_window,) latest cut scores, NaN where there is no history yet
    frames:         () int64, frames processed so far (a device tensor: no host sync to advance it)
    """

    prev_frame: torch.Tensor | None = None
    prev_relevance: torch.Tensor | None = None
    ref_rgb: torch.Tensor | None = None
    stale: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    frames: torch.Tensor | None = None


STATE_TENSORS = ("prev_relevance", "ref_rgb", "stale", "scores", "frames")  # what a stream's first batch lacks


@dataclass(frozen=True)
class Realized:
    relevance: torch.Tensor     # (T, gh, gw) in [0, 1]
    available: torch.Tensor     # (T, gh, gw) bool, cells that may receive tokens
    scene_change: torch.Tensor  # (T,) bool
    cut_score: torch.Tensor     # (T,) median flow-compensated residual
    cache: torch.Tensor         # (T, gh, gw) warped previous relevance (the texture's relevance_cache)


class TemporalRelevanceRealizer(nn.Module):
    def __init__(self, cfg: RealizingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.decay_logit = nn.Parameter(torch.logit(torch.tensor(cfg.initial_decay)))
        # softplus^-1, so that softplus(boost_raw) starts at the configured boost
        self.boost_raw = nn.Parameter(torch.log(torch.expm1(torch.tensor(cfg.initial_motion_boost))))

    @property
    def decay(self) -> torch.Tensor:
        return torch.sigmoid(self.decay_logit)

    @property
    def motion_boost(self) -> torch.Tensor:
        return F.softplus(self.boost_raw)

    def initial_state(self, texture: Texture) -> StreamState:
        """The state a stream starts from, as tensors (forward() fills a None field from it): nothing
        cached, every cell stale (the VLM has seen none), no cut history, no frames. Given to a
        stream's first batch, it lets that batch run like any other (a CUDA graph needs them all)."""
        cells = texture.cell_rgb.detach()[0]                                     # (3, gh, gw)
        return StreamState(prev_relevance=torch.zeros_like(cells[0]), ref_rgb=torch.zeros_like(cells),
                           stale=torch.ones_like(cells[0], dtype=torch.bool),
                           scores=torch.full((self.cfg.cut_window,), float("nan"), device=cells.device,
                                             dtype=texture.residual.dtype),
                           frames=torch.zeros((), dtype=torch.long, device=cells.device))

    def filled(self, state: StreamState, texture: Texture) -> StreamState:
        """state with its None fields (prev_frame aside) from initial_state."""
        missing = [n for n in STATE_TENSORS if getattr(state, n) is None]
        if not missing:
            return state
        initial = self.initial_state(texture)
        return replace(state, **{n: getattr(initial, n) for n in missing})

    def detect_cuts(self, texture: Texture, state: StreamState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scene_change (T,), cut_score (T,), new score history) — vectorised over the batch.

        A cut: the median residual exceeds an absolute floor and `cut_ratio` times the mean of the
        previous `cut_window` scores. The cut's own score stays in that window, so the frames right
        after a cut need an even larger jump: no double detection on a two-frame transition.
        """
        cfg = self.cfg
        score = texture.residual.detach().flatten(1).median(dim=1).values        # (T,)
        T, k = score.shape[0], cfg.cut_window
        history = state.scores if state.scores is not None else self.initial_state(texture).scores
        series = torch.cat([history.to(score), score])                           # (k + T,)
        windows = series.unfold(0, k, 1)[:T]                                     # (T, k) previous k scores
        level = torch.nan_to_num(windows.nanmean(dim=1), nan=0.0).clamp_min(1e-3)  # (T,)
        jump = (score > cfg.cut_threshold) & (score > cfg.cut_ratio * level)
        scene_change = jump | ~texture.has_prev
        return scene_change, score, series[-k:]

    def forward(self, relevance_now: torch.Tensor, texture: Texture, state: StreamState,
                vlm_frames: torch.Tensor | None = None) -> tuple[Realized, StreamState]:
        """Realize relevance over T consecutive frames of one stream.

        relevance_now: (T, gh, gw) balanced relevance of each frame alone, in [0, 1]
        vlm_frames:    (T,) bool, the frames the VLM will see (None: all); only they update what
                       the VLM has seen, since only they put tokens in front of it.
        """
        cfg = self.cfg
        T = relevance_now.shape[0]
        device = relevance_now.device
        state = self.filled(state, texture)
        scene_change, cut_score, scores = self.detect_cuts(texture, state)
        motion = texture.channel("motion").clamp(0, 1)                           # (T, gh, gw)
        boost = self.motion_boost
        boosted = (relevance_now + boost * motion) / (1 + boost)                 # (T, gh, gw) in [0, 1]

        if vlm_frames is None:
            vlm_frames = torch.ones(T, dtype=torch.bool, device=device)
        reset = scene_change.clone()                                             # (T,) everything is new
        done = state.frames
        if cfg.refresh_frames:
            reset |= (done + torch.arange(T, device=device)) % cfg.refresh_frames == 0
        cells = texture.cell_rgb.detach()                                        # (T, 3, gh, gw)
        ref, stale = state.ref_rgb.to(cells), state.stale

        # Branch-free recurrences on (gh, gw) maps, so no host sync inside the loop:
        #  - relevance blends with the flow-warped previous relevance; a cut zeroes the cache;
        #  - redundancy compares each cell with what the VLM last saw *of that cell* (not with the
        #    previous frame, which would let a slow change slip under the threshold forever).
        keep = (~scene_change).to(boosted.dtype)                                 # (T,)
        weight = self.decay * keep                                               # (T,) cache weight
        grids = sampling_grid(texture.flow)                                      # (T, gh, gw, 2), built once
        left_vlm = ~vlm_frames
        prev = state.prev_relevance.to(boosted)
        out, caches, avail = [], [], []
        for t in range(T):
            cache = sample(prev[None, None], grids[t:t + 1])[0, 0]               # (gh, gw)
            prev = torch.lerp(boosted[t], cache, weight[t])
            if cfg.redundancy:
                stale = stale | reset[t]
                available = stale | ((cells[t] - ref).abs().mean(0) >= cfg.redundancy_threshold)
                ref = torch.where(available & vlm_frames[t], cells[t], ref)     # the VLM gets these now
                stale = stale & left_vlm[t]
                avail.append(available)
            out.append(prev)
            caches.append(cache)
        available = (torch.stack(avail) if cfg.redundancy
                     else torch.ones_like(boosted, dtype=torch.bool))            # (T, gh, gw)
        relevance = torch.stack(out).clamp(0, 1)                                 # (T, gh, gw)
        realized = Realized(relevance=relevance, available=available, scene_change=scene_change,
                            cut_score=cut_score, cache=torch.stack(caches) * keep[:, None, None])
        new_state = replace(state, prev_relevance=relevance[-1], ref_rgb=ref, stale=stale, scores=scores,
                            frames=done + T)
        return realized, new_state
