"""The one module that knows Hugging Face transformers' internals.

The fast paths (packed-GQA attention, the pipeline's own LM and vision forwards, replayed vision
graphs, shared M-RoPE layouts) reach into transformers' Qwen2-VL / Qwen2.5-VL modules: private
config fields, attention registries, module-level helper functions, class names. Every such
name is touched here and nowhere else (tests/pipeline/vlm/test_hf_boundary.py checks), so an
upgrade is checked against one file.

TESTED_RANGE is the transformers range the fast paths were tested on. Outside it `check_version`
returns a warning and the VLM runs HF's own forward (fast paths off): slower, never wrong.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pipeline.vlm import qwen3_vl

# [low, high): CPU CI runs the newest release below `high`, the GPU machines 5.17
TESTED_RANGE = ("5.17", "5.25")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def installed_version() -> str:
    import transformers
    return transformers.__version__


def check_version(version: str | None = None) -> str | None:
    """None when `version` (default: the installed one) is in TESTED_RANGE, else a one-line warning."""
    version = version or installed_version()
    low, high = TESTED_RANGE
    if _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        return None
    return (f"transformers {version} is outside the range the fast paths were tested on (>={low},<{high}); "
            f"running transformers' own forward instead (slower). Install a tested version for full speed")


# ---- the model's parts ----
def language_model(model: nn.Module) -> nn.Module:
    """The text decoder (embed_tokens, layers, norm, rotary_emb) of a Qwen2-VL-family model."""
    return model.model.language_model


def vision_tower(model: nn.Module) -> nn.Module:
    return model.model.visual


def cache_keyword(lm: nn.Module) -> str:
    """The LM forward's name for the KV cache argument (renamed across versions)."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def attention_implementation(config: Any) -> str:
    return config._attn_implementation


def set_attention_implementation(config: Any, name: str) -> None:
    config._attn_implementation = name


def rope_index(model: nn.Module, input_ids: torch.Tensor, video_grid_thw: torch.Tensor, video_token_id: int,
               second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
    """(1, L) ids, (1, 3) grid -> (3, 1, L) M-RoPE positions from the model's own get_rope_index."""
    kwargs: dict[str, Any] = dict(input_ids=input_ids, video_grid_thw=video_grid_thw)
    if _rope_takes_token_types(type(model.model)):
        kwargs["mm_token_type_ids"] = (input_ids == video_token_id).int() * 2  # 2: video
    if second_per_grid_ts is not None:
        kwargs["second_per_grid_ts"] = second_per_grid_ts
    positions, _ = model.model.get_rope_index(**kwargs)
    return positions


@functools.lru_cache(maxsize=None)
def _rope_takes_token_types(model_class: type) -> bool:
    """Newer versions' get_rope_index asks which tokens are video (mm_token_type_ids)."""
    return "mm_token_type_ids" in inspect.signature(model_class.get_rope_index).parameters


# ---- attention ----
def register_attention(name: str, forward: Callable[..., Any]) -> None:
    """Register `forward` as LM attention implementation `name`, masked exactly as sdpa is."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)


def sdpa_attention_forward(*args: Any, **kwargs: Any):
    """transformers' own sdpa attention function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as forward
    return forward(*args, **kwargs)


def attention_function(lm: nn.Module, name: str) -> Callable[..., Any]:
    """The attention function the LM's layers call for implementation `name`."""
    if name == "eager":
        return sys.modules[type(lm.layers[0].self_attn).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[name]


def vision_attention_modules(visual: nn.Module) -> Iterator[tuple[nn.Module, Callable[..., Any]]]:
    """(attention module, its module's apply_rotary_pos_emb_vision) for every vision attention
    layer with a fused qkv projection."""
    for module in visual.modules():
        if type(module).__name__.endswith("VisionAttention") and hasattr(module, "qkv") and hasattr(module, "proj"):
            rotary = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb_vision", None)
            if rotary is not None:
                yield module, rotary


# ---- layer kinds the pipeline's forwards replace ----
def is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def is_quick_gelu(module: nn.Module) -> bool:
    return type(module).__name__ == "QuickGELUActivation"


# ---- grid-derived vision inputs ----
def vision_utils():
    """transformers.vision_utils (precomputed vision-tower inputs), or None where this version lacks it."""
    try:
        from transformers import vision_utils as vu
    except ImportError:
        return None
    return vu


# ---- the vision tower over a subset of a video's patches (pipeline.vlm.kept_vision) ----
def vision_window_cells(visual: nn.Module) -> int | None:
    """Side, in merged cells, of the windows Qwen2.5-VL's windowed layers attend within (112 px /
    28 px = 4 for the released models); None for a tower without windows (Qwen2-VL)."""
    if not hasattr(visual, "fullatt_block_indexes"):
        return None
    return visual.window_size // visual.spatial_merge_size // visual.patch_size


def tower_tokens(out: Any) -> torch.Tensor:
    """The vision tower's output -> (N, D) merged tokens, Qwen3-VL's DeepStack features appended
    as more channels, (N, D x (1 + deepstack layers)): selection picks and pools them together."""
    merged = out.pooler_output if hasattr(out, "pooler_output") else out
    deepstack = getattr(out, "deepstack_features", None)
    return torch.cat([merged, *deepstack], -1) if deepstack else merged


def vision_forward_on(visual: nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor, window_index: torch.Tensor | None = None,
                      cu_window_seqlens: torch.Tensor | None = None, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """HF's vision forward over any set of whole merge blocks (pixels (n, F), m^2 rows a block), its
    grid-derived inputs given instead of derived from grid_thw: position_ids (n, 2) (row, column)
    of each patch, cu_seqlens (S + 1,) int32 bounds of the full-attention blocks; Qwen2.5-VL:
    window_index (n / m^2,) the blocks in window order, cu_window_seqlens (W + 1,) int32 window
    bounds (in patches, window order) -> merged tokens (n / m^2, D) in the order of `pixels`.
    Needs a forward that pops precomputed inputs (transformers.vision_utils: all of TESTED_RANGE).
    Qwen3-VL (sizes: (n, 2) each patch's frame grid, for its learned position embeddings): its own
    forward over the subset (qwen3_vl.tower_on), DeepStack features appended (tower_tokens)."""
    if qwen3_vl.has_deepstack(visual):
        return qwen3_vl.tower_on(visual, pixels, position_ids, sizes, cu_seqlens)
    inputs: dict[str, Any] = dict(position_ids=position_ids, cu_seqlens=cu_seqlens)
    if window_index is not None:
        inputs.update(window_index=window_index, cu_window_seqlens=cu_window_seqlens)
    return tower_tokens(visual(pixels, grid_thw=grid_thw, **inputs))

