"""Typed, self-validating configuration of the VLM stage."""
from __future__ import annotations

from dataclasses import dataclass

from arr_coc._validate import ConfigError, check_choice, check_int, check_range

DTYPES = ("bfloat16", "float16", "float32")
ENCODE_MODES = ("all", "kept")


@dataclass(frozen=True)
class VLMConfig:
    fps: float = 2.0                   # frame rate of answer windows (Qwen2.5-VL's temporal rope uses it)
    max_new_tokens: int = 64
    temperature: float = 0.0           # 0 = greedy
    top_p: float = 1.0
    seed: int = 0                      # sampling seed (per answer batch)
    max_batch: int = 4                 # requests decoded together by VLMBatcher
    max_wait_s: float = 0.05           # how long VLMBatcher waits to fill a batch
    min_pixels: int = 56 * 56          # per-frame pixel range the frames are resized into (video
    max_pixels: int = 448 * 448        # tokens are 4x cheaper than HF's image defaults)
    dtype: str = "bfloat16"
    cuda_graphs: bool = True           # on CUDA, replay each decode step as a captured graph
    # prefixes of up to this many tokens (after left padding up to a multiple of 64) are prefilled
    # by a replayed CUDA graph (with cuda_graphs, on CUDA): short, pruned prefixes are bound by
    # kernel launches, not by the GPU; longer ones run eagerly. 0: every prefill eager, unpadded
    graph_prefill_max_tokens: int = 2048
    # the LM's decoder layers through pipeline.vlm.text_model (fused norms, one q+k GEMM, rotary
    # on both at once: the same results in fewer kernels); false: through HF's own forward
    fast_lm: bool = True
    # the vision tower's blocks through pipeline.vlm.vision_blocks (rotary on q and k at once, QuickGELU
    # as one silu, MLP widths padded to GEMM-friendly multiples of 8, fused RMSNorm: same results,
    # less memory traffic); false: HF's own block forward. Applies to the model, not this VLM only
    fast_vision: bool = True
    # which patches go through the vision tower: "all" (every patch, then the allocation's tokens
    # are picked from the merged grid) or "kept" (only the patches of the cells the allocation
    # keeps, Qwen2.5-VL: of the attention windows holding one; pipeline.vlm.kept_vision)
    encode: str = "all"
    # encode: kept, live streams: at most this many cells' vision features (and pixels, to tell
    # a change) kept per stream, reused for a cell unchanged since it was encoded (0: no reuse)
    reuse_cells: int = 1024
    # mean |colour change| per pixel (0..1) of a cell under which its cached features are reused
    reuse_threshold: float = 0.04

    def __post_init__(self) -> None:
        check_range("vlm.fps", self.fps, 0.0, 240.0, lo_open=True)
        for name in ("max_new_tokens", "max_batch", "min_pixels", "max_pixels", "seed", "graph_prefill_max_tokens",
                     "reuse_cells"):
            check_int(f"vlm.{name}", getattr(self, name))
        check_range("vlm.max_new_tokens", self.max_new_tokens, 1, 8192)
        check_range("vlm.temperature", self.temperature, 0.0, 10.0)
        check_range("vlm.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("vlm.seed", self.seed, 0, 2**63 - 1)
        check_range("vlm.max_batch", self.max_batch, 1, 256)
        check_range("vlm.max_wait_s", self.max_wait_s, 0.0, 60.0)
        check_range("vlm.graph_prefill_max_tokens", self.graph_prefill_max_tokens, 0, 65536)
        check_range("vlm.min_pixels", self.min_pixels, 28 * 28, 16384 * 16384)
        check_range("vlm.max_pixels", self.max_pixels, self.min_pixels, 16384 * 16384)
        check_choice("vlm.dtype", self.dtype, DTYPES)
        check_choice("vlm.encode", self.encode, ENCODE_MODES)
        check_range("vlm.reuse_cells", self.reuse_cells, 0, 1 << 20)
        check_range("vlm.reuse_threshold", self.reuse_threshold, 0.0, 1.0)
        for name in ("cuda_graphs", "fast_lm", "fast_vision"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"vlm.{name} must be true or false, got {getattr(self, name)!r}")
