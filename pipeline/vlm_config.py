"""Typed, self-validating configuration of the VLM stage."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from arr_coc._validate import ConfigError, check_choice, check_int, check_range

DTYPES = ("bfloat16", "float16", "float32")
ENCODE_MODES = ("all", "kept")
KEPT_WINDOWS = ("whole", "cells")
PASS2 = ("off", "attention")
CONFIDENCE = ("margin", "entropy", "answer", "coverage", "probe")
RANKS = ("allocation", "relevance", "attention")
KV_CACHE_GIB = 6.0                     # vlm.kv_cache_gib's default
DEFAULT_PASS2_LAYERS = 2               # FastV's: a VLM whose snapshot names no layer of its own
FALLBACKS = ("last", "most_confident")


@dataclass(frozen=True)
class TemperingConfig:
    """Multi-pass answering (pipeline/vlm/passes.py): answer with the ladder's first budget; while the
    VLM is unsure of the answer's first token, answer again with the next one (the best tokens as
    `rank` orders them)."""

    # budgets as fractions of the window's full visual tokens, strictly increasing; () = one pass
    ladder: tuple[float, ...] = ()
    # a pass is accepted when the confidence of its first answer token is at least this: calibrate
    # it on a validation split with pipeline.vlm.tempering.calibrate (0: never answer again)
    threshold: float = 0.5
    max_passes: int = 3                # the most rungs of the ladder one answer may use
    # margin: top-1 minus top-2 probability of the first answer token; entropy: 1 - its entropy /
    # log(vocabulary size); answer: the smallest margin over every token of the answer (each pass
    # then decodes its answer before the next is decided: "bottom right" is decided at "right");
    # coverage: 1 - the question's attention (pass 2's, at vlm.pass2_layers) beyond uniform over
    # pass 1's candidates that the rung drops: low when the rung dropped what it looks for; probe:
    # 1 - P(ask again) from a logistic regression over the first token's distribution (pipeline/vlm/probe.py)
    confidence: Literal["margin", "entropy", "answer", "coverage", "probe"] = "margin"
    # confidence probe: the probe file it reads (benchmarks/fit_probe.py fits and writes one)
    probe: str | None = None
    # which of pass 1's candidates each rung keeps (pass 1 keeping the top rung's budget, vlm.pass2
    # off): allocation, what ARR-COC's own allocation at the rung's retention keeps (each frame's
    # best cells, as many as that retention buys); relevance, the same share of every frame pair's
    # candidates, the best rated first; attention, those the question attends to most in the VLM
    # (needs vlm.pass2=attention, pass 1 keeping candidate_factor times the top rung)
    rank: Literal["allocation", "relevance", "attention"] = "allocation"
    # no rung confident enough: answer from the last pass (the largest budget), or from the pass
    # whose first answer token was the most confident
    fallback: Literal["last", "most_confident"] = "last"
    # a share of the answers to ask again at each rung, held whatever the input (the least confident
    # of the last `window` answers that rung saw; `threshold` decides until 32 are seen), or None: the
    # fixed threshold alone. It bounds the tokens spent: first rung + escalate x the next
    escalate: float | None = None
    window: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.ladder, tuple):
            raise ConfigError(f"vlm.tempering.ladder must be a list of fractions, got {self.ladder!r}")
        for i, fraction in enumerate(self.ladder):
            check_range(f"vlm.tempering.ladder[{i}]", fraction, 0.0, 1.0, lo_open=True)
        if any(b <= a for a, b in zip(self.ladder, self.ladder[1:])):
            raise ConfigError(f"vlm.tempering.ladder must increase strictly, got {list(self.ladder)}")
        check_range("vlm.tempering.threshold", self.threshold, 0.0, 1.0)
        check_int("vlm.tempering.max_passes", self.max_passes)
        check_range("vlm.tempering.max_passes", self.max_passes, 1, 255)
        check_choice("vlm.tempering.confidence", self.confidence, CONFIDENCE)
        if self.probe is not None and (not isinstance(self.probe, str) or not self.probe):
            raise ConfigError(f"vlm.tempering.probe must be a file path, got {self.probe!r}")
        if self.confidence == "probe" and self.probe is None:
            raise ConfigError("vlm.tempering.confidence=probe needs vlm.tempering.probe, the probe file "
                              "(benchmarks/fit_probe.py writes one)")
        if self.confidence != "probe" and self.probe is not None:
            raise ConfigError(f"vlm.tempering.probe is read only with vlm.tempering.confidence=probe, got "
                              f"confidence={self.confidence}")
        check_choice("vlm.tempering.rank", self.rank, RANKS)
        check_choice("vlm.tempering.fallback", self.fallback, FALLBACKS)
        if self.escalate is not None:
            check_range("vlm.tempering.escalate", self.escalate, 0.0, 1.0)
        check_int("vlm.tempering.window", self.window)
        check_range("vlm.tempering.window", self.window, 1, 1_000_000)

    @property
    def rungs(self) -> tuple[float, ...]:
        """The budgets one answer may use: the ladder up to max_passes."""
        return self.ladder[:self.max_passes]


@dataclass(frozen=True)
class VLMConfig:
    fps: float = 2.0                   # frame rate of answer windows (Qwen2.5-VL's temporal rope uses it)
    max_new_tokens: int = 64
    temperature: float = 0.0           # 0 = greedy
    top_p: float = 1.0
    seed: int = 0                      # sampling seed (per answer batch)
    max_batch: int = 4                 # requests (live) or videos (batch) VLMBatcher answers together
    max_wait_s: float = 0.05           # how long VLMBatcher waits to fill a batch
    min_pixels: int = 56 * 56          # per-frame pixel range the frames are resized into (video
    max_pixels: int = 448 * 448        # tokens are 4x cheaper than HF's image defaults)
    dtype: str = "bfloat16"
    cuda_graphs: bool = True           # on CUDA, replay each decode step as a captured graph
    # prefixes of up to this many tokens (after left padding up to a multiple of 64) are prefilled
    # by a replayed CUDA graph (with cuda_graphs, on CUDA): short, pruned prefixes are bound by
    # kernel launches, not by the GPU; longer ones run eagerly. 0: every prefill eager, unpadded
    graph_prefill_max_tokens: int = 2048
    # GPU memory (GiB) the VLM keeps for the decoders it has built (their KV caches and prefill
    # graphs, by batch rows and cache length): past it the least recently used go (counters
    # "evicted") and a later batch of that shape builds and captures them again. What one batch
    # needs is allocated even beyond it. Many videos in flight with stock tokens outgrow 6 GiB
    kv_cache_gib: float = KV_CACHE_GIB
    # the LM's decoder layers through pipeline.vlm.text_model (fused norms, one q+k GEMM, rotary
    # on both at once: the same results in fewer kernels); false: through HF's own forward
    fast_lm: bool = True
    # the vision tower's blocks through pipeline.vlm.vision_blocks (rotary on q and k at once, QuickGELU
    # as one silu, MLP widths padded to GEMM-friendly multiples of 8, fused RMSNorm: same results,
    # less memory traffic); false: HF's own block forward. Applies to the model, not this VLM only
    fast_vision: bool = True
    # which patches go through the vision tower: "kept" (only the patches of the cells the
    # allocation keeps and of their context, kept_context; Qwen2.5-VL: of the attention windows
    # holding one; pipeline.vlm.kept_vision) or "all" (every patch, then the allocation's tokens are
    # picked from the merged grid). Default kept with kept_context 1: on the shipped QA model about
    # as accurate as all, at a fraction of the time to first token (docs/performance.md)
    encode: str = "kept"
    # encode: kept, Qwen2.5-VL: "whole" (every cell of an attention window holding a kept cell goes
    # through the tower, so the windowed layers compute what the stock tower does) or "cells" (the
    # kept cells only: fewer cells encoded, and each windowed layer sees only the window's kept cells)
    kept_windows: str = "whole"
    # 0: off; N: before selection, each frame pair's kept tokens (as many as the allocation gives it)
    # are moved into whole N x N-cell windows, the windows of highest mean relevance first
    # (selection.snap_to_windows). Qwen2.5-VL attends within 4 x 4-cell windows: with 4 and
    # encode: kept (whole windows) no cell goes through the tower only to complete a window.
    # Needs pass 1's relevance (requests without it keep their map)
    snap_windows: int = 0
    # encode: kept: cells within this many cells (in each direction, per frame pair) of a kept cell
    # go through the tower too, as context the kept cells attend to, and are then dropped: the LM
    # gets the same tokens, computed with more of their surroundings. 0: the kept cells only, the
    # fastest, at some accuracy (docs/performance.md)
    kept_context: int = 1
    # encode: kept, live streams: at most this many cells' vision features (and pixels, to tell
    # a change) kept per stream, reused for a cell unchanged since it was encoded (0: no reuse)
    reuse_cells: int = 1024
    # mean |colour change| per pixel (0..1) of a cell under which its cached features are reused
    reuse_threshold: float = 0.04
    # pass 2 (pipeline/vlm/passes.py): off, or attention: pass 1 (ARR-COC) keeps candidate_factor
    # times the final budget, and the VLM keeps the final budget among them, the tokens its question
    # attends to most at LM layer pass2_layers (the layers before it run over the candidates; an LM
    # with no such layer: its last). None: the layer the VLM's snapshot names (config.json
    # "arrcoc_pass2_layers": the shipped arrcoc-synth-qa names 2, the layer it was trained to ground), else
    # DEFAULT_PASS2_LAYERS (FastV's 2)
    pass2: Literal["off", "attention"] = "off"
    candidate_factor: float = 3.0
    pass2_layers: int | None = None
    # pass 2 keeps the same share of every frame pair's candidates (each pair's best-attended first,
    # as pass 1 budgets every frame) instead of the window's best-attended candidates wherever they are
    pass2_per_frame: bool = False
    # pass 2 ranks the candidates by (1 - w) x its attention's rank quantile + w x pass 1's relevance
    # rank quantile (passes.blend_ranks; 0: attention alone, 1: pass 1's order)
    pass2_blend: float = 0.0
    tempering: TemperingConfig = field(default_factory=TemperingConfig)
    # Qwen3-VL: a frame group none of whose tokens is kept keeps its timestamp text and markers
    # ("keep") or loses them too ("drop"): pipeline/vlm/frame_groups.py
    empty_frame_groups: Literal["keep", "drop"] = "keep"

    def __post_init__(self) -> None:
        check_range("vlm.fps", self.fps, 0.0, 240.0, lo_open=True)
        for name in ("max_new_tokens", "max_batch", "min_pixels", "max_pixels", "seed", "graph_prefill_max_tokens",
                     "reuse_cells", "kept_context", "snap_windows"):
            check_int(f"vlm.{name}", getattr(self, name))
        check_range("vlm.max_new_tokens", self.max_new_tokens, 1, 8192)
        check_range("vlm.temperature", self.temperature, 0.0, 10.0)
        check_range("vlm.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("vlm.seed", self.seed, 0, 2**63 - 1)
        check_range("vlm.max_batch", self.max_batch, 1, 256)
        check_range("vlm.max_wait_s", self.max_wait_s, 0.0, 60.0)
        check_range("vlm.graph_prefill_max_tokens", self.graph_prefill_max_tokens, 0, 65536)
        check_range("vlm.kv_cache_gib", self.kv_cache_gib, 0.0, 4096.0)
        check_range("vlm.min_pixels", self.min_pixels, 28 * 28, 16384 * 16384)
        check_range("vlm.max_pixels", self.max_pixels, self.min_pixels, 16384 * 16384)
        check_choice("vlm.dtype", self.dtype, DTYPES)
        check_choice("vlm.encode", self.encode, ENCODE_MODES)
        check_choice("vlm.kept_windows", self.kept_windows, KEPT_WINDOWS)
        check_range("vlm.kept_context", self.kept_context, 0, 16)
        check_range("vlm.snap_windows", self.snap_windows, 0, 64)
        check_range("vlm.pass2_blend", self.pass2_blend, 0.0, 1.0)
        check_range("vlm.reuse_cells", self.reuse_cells, 0, 1 << 20)
        check_range("vlm.reuse_threshold", self.reuse_threshold, 0.0, 1.0)
        for name in ("cuda_graphs", "fast_lm", "fast_vision", "pass2_per_frame"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"vlm.{name} must be true or false, got {getattr(self, name)!r}")
        check_choice("vlm.pass2", self.pass2, PASS2)
        check_choice("vlm.empty_frame_groups", self.empty_frame_groups, ("keep", "drop"))
        check_range("vlm.candidate_factor", self.candidate_factor, 1.0, 64.0)
        if self.pass2_layers is not None:
            check_int("vlm.pass2_layers", self.pass2_layers)
            check_range("vlm.pass2_layers", self.pass2_layers, 0, 255)
        if not isinstance(self.tempering, TemperingConfig):
            raise ConfigError(f"vlm.tempering must be a mapping of tempering settings, got {self.tempering!r}")
        t = self.tempering
        if t.ladder and t.rank == "attention" and self.pass2 == "off":
            raise ConfigError("vlm.tempering.rank=attention needs vlm.pass2=attention: each pass keeps the "
                              "tokens pass 2 ranked best (or rank them by pass 1's relevance: "
                              "vlm.tempering.rank=relevance)")
        if t.ladder and t.rank in ("relevance", "allocation") and self.pass2 != "off":
            raise ConfigError(f"vlm.tempering.rank={t.rank} ranks every pass's tokens by pass 1's relevance, so "
                              f"vlm.pass2={self.pass2} would go unused: set vlm.pass2=off, or "
                              f"vlm.tempering.rank=attention")

    @property
    def multipass(self) -> bool:
        """Whether pipeline/vlm/passes.py answers (pass 2, or a tempering ladder)."""
        return self.pass2 != "off" or bool(self.tempering.ladder)
