"""The one module that owns every transformers internal of Qwen3-VL (dense and MoE).

Qwen3-VL differs from Qwen2-VL / Qwen2.5-VL where kept tokens are concerned:
  - the vision tower: 16 px patches, learned position embeddings interpolated to each frame's grid
    plus 2D rotary, full attention within a frame group, and DeepStack: the hidden states of the
    layers `deepstack_visual_indexes` pass through their own mergers, one merged feature per visual
    token and layer, which the LM adds to its hidden states after its first layers, at the visual
    positions (layer i's output gets deepstack feature i);
  - interleaved M-RoPE in the LM (t/h/w sections interleaved across frequencies), applied by the
    text model's rotary embedding from the (3, B, L) positions it is given;
  - a textual timestamp before each frame group (pipeline/vlm/frame_groups.py).

Everything here is called by pipeline/vlm/hf_forward.py (Qwen3-VL-MoE's answering facade): configs
and model classes, the vision tower's merged tokens and DeepStack features, the model's own
get_rope_index, and one forward of the text model with DeepStack arguments; and by the fast engine
(dense Qwen3-VL) through its hooks at the end: the tower over kept patches (tower_on), the whole
tower's precomputed inputs for a replayed graph, DeepStack arguments for transformers' text model.
tests/pipeline/vlm/test_hf_boundary.py lets this file, with pipeline/vlm/hf.py, name those internals.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

FAMILIES: tuple[str, ...] = ("qwen3_vl", "qwen3_vl_moe")
# run through transformers' own forward (pipeline/vlm/hf_forward.py): the fast engine covers dense Qwen3-VL only
FALLBACK_FAMILIES: tuple[str, ...] = ("qwen3_vl_moe",)
# Qwen3-VL's processors normalise with mean = std = 0.5 (IMAGENET_STANDARD), not CLIP's values
PROCESSOR_DEFAULTS = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
                      "rescale_factor": 1 / 255}
SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def model_class(family: str) -> type:
    """The transformers class that loads a snapshot of `family`."""
    if family == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration
        return Qwen3VLForConditionalGeneration
    if family == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeForConditionalGeneration
        return Qwen3VLMoeForConditionalGeneration
    raise ValueError(f"Invalid Qwen3-VL family ({family!r}). Supported values are {', '.join(FAMILIES)}.")


# ---- configs built in code (tests, benchmarks) ----
def _token_ids(tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return dict(vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])


def _config(tokenizer, text: dict, vision: dict, tie: bool):
    from transformers import Qwen3VLConfig

    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    text = dict(text, vocab_size=text.get("vocab_size", len(tokenizer)), bos_token_id=pad, eos_token_id=eos,
                pad_token_id=pad, tie_word_embeddings=tie, rms_norm_eps=1e-6, hidden_act="silu")
    vision = dict(vision, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  hidden_act="gelu_pytorch_tanh")
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **_token_ids(tokenizer))
    cfg._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = "sdpa"
    cfg.vision_config._attn_implementation = "sdpa"
    return cfg


def _rope(theta: float, section: list[int]) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "mrope_section": section, "mrope_interleaved": True}


def tiny_config(tokenizer):
    """Hidden 64, 3 LM layers, 3 vision blocks, DeepStack from vision blocks 0 and 1 into LM
    layers 0 and 1 (layer 2 gets none), interleaved M-RoPE over 16 rotary pairs [6, 5, 5], a 4 x 4
    learned position grid (interpolated to every frame's grid). rope_theta 1e4 (not 5e6) so that
    every section turns by a lot per position: a wrong position changes the logits."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, rope_parameters=_rope(1e4, [6, 5, 5]))
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    return _config(tokenizer, text, vision, tie=False)


def small_config(tokenizer, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 vision_depth: int, vision_dim: int, vision_heads: int, vision_mlp_ratio: int, rope_theta: float,
                 deepstack: tuple[int, ...], position_side: int):
    """A small Qwen3-VL trained from scratch (pipeline.training.qa_vlm, model.arch=qwen3_vl): tied
    embeddings, the rotary pairs split over (t, h, w) in the published 24:20:20 ratio, interleaved;
    DeepStack from vision blocks `deepstack`; a position_side^2 learned position grid."""
    pairs = hidden // heads // 2
    h = w = pairs * 20 // 64
    text = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                max_position_embeddings=32768, rope_parameters=_rope(rope_theta, [pairs - h - w, h, w]))
    vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=vision_dim * vision_mlp_ratio,
                  num_heads=vision_heads, out_hidden_size=hidden, num_position_embeddings=position_side ** 2,
                  deepstack_visual_indexes=list(deepstack))
    return _config(tokenizer, text, vision, tie=True)


# The published config.json values: LM (hidden, intermediate, layers, attention heads), vision tower
# (depth, width, MLP width, DeepStack blocks), tied embeddings. Shared by both: 8 KV heads of 128,
# the 151936-token vocabulary, rope_theta 5e6 with interleaved sections [24, 20, 20], 16 vision
# heads, a 48 x 48 learned position grid.
ARCH_SIZES = {"qwen3-vl-8b": ((4096, 12288, 36, 32), (27, 1152, 4304, [8, 16, 24]), False),
              "qwen3-vl-2b": ((2048, 6144, 28, 16), (24, 1024, 4096, [5, 11, 17]), True)}


ARCHS: tuple[str, ...] = tuple(ARCH_SIZES)


def arch_config(arch: str, tokenizer):
    """Full-size architectures (ARCH_SIZES) with the built-in tokenizer's special ids; the
    vocabulary keeps the real size so the LM head costs what it costs."""
    if arch not in ARCH_SIZES:
        raise ValueError(f"Invalid architecture ({arch!r}). Supported values are {', '.join(ARCHS)}.")
    (hidden, inter, layers, heads), (depth, width, mlp, deepstack), tie = ARCH_SIZES[arch]
    text = dict(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                rope_parameters=_rope(5e6, [24, 20, 20]))
    vision = dict(depth=depth, hidden_size=width, intermediate_size=mlp, num_heads=16, out_hidden_size=hidden,
                  num_position_embeddings=2304, deepstack_visual_indexes=deepstack)
    return _config(tokenizer, text, vision, tie=tie)


# ---- the model's parts ----
def text_model(model: nn.Module) -> nn.Module:
    """The LM (embed_tokens, layers, norm, rotary_emb), which takes DeepStack arguments."""
    return model.model.language_model


def vision_tower(model: nn.Module) -> nn.Module:
    return model.model.visual


def deepstack_layers(model: nn.Module) -> tuple[int, ...]:
    """The vision blocks whose outputs become DeepStack features; feature i is added after LM layer i."""
    return tuple(model.config.vision_config.deepstack_visual_indexes)


def deepstack_mergers(model: nn.Module) -> list[nn.Module]:
    """The merger of each DeepStack layer, in deepstack_layers' order (tests hook them)."""
    return list(vision_tower(model).deepstack_merger_list)


def vision_features(model: nn.Module, pixels: torch.Tensor,
                    grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """pixels (N_patches, F), grid_thw (V, 3) -> merged tokens (N, D) and one (N, D) DeepStack
    feature per deepstack layer, rows in the merged-token raster order of the videos in turn."""
    out = vision_tower(model)(pixels, grid_thw=grid_thw, return_dict=True)
    return out.pooler_output, list(out.deepstack_features)


def rope_index(model: nn.Module, input_ids: torch.Tensor, video_grid_thw: torch.Tensor,
               video_token_id: int) -> torch.Tensor:
    """(1, L) ids of the full prompt (timestamps and every video token), (1, 3) grid -> (3, 1, L)
    M-RoPE positions from the model's own get_rope_index."""
    types = (input_ids == video_token_id).int() * 2                          # 2: video
    positions, _ = model.model.get_rope_index(input_ids, types, video_grid_thw=video_grid_thw)
    return positions


def new_cache(model: nn.Module):
    from transformers import DynamicCache
    return DynamicCache(config=text_model(model).config)


def copy_cache(cache: Any):
    """An independent copy of a DynamicCache (a window's, each question then extends its own)."""
    return copy.deepcopy(cache)


def lm_forward(model: nn.Module, embeds: torch.Tensor, positions: torch.Tensor, cache: Any,
               visual_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None) -> torch.Tensor:
    """transformers' text model forward: embeds (1, L, D), positions (3, 1, L), a DynamicCache;
    visual_mask (1, L) bool, the visual positions, deepstack one (K, D) feature per deepstack layer
    for the K visual positions (None: no visual token in this chunk) -> hidden states (1, L, D)."""
    out = text_model(model)(inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True,
                            visual_pos_masks=visual_mask, deepstack_visual_embeds=deepstack)
    return out.last_hidden_state


def lm_head(model: nn.Module) -> nn.Module:
    return model.lm_head


def embed_tokens(model: nn.Module) -> nn.Module:
    return text_model(model).embed_tokens


# ---- the fast engine's hooks (pipeline/vlm/model.py: dense Qwen3-VL) ----
def has_deepstack(module: nn.Module) -> bool:
    """Whether `module` (a model or its vision tower) is a Qwen3-VL with DeepStack mergers."""
    visual = getattr(getattr(module, "model", None), "visual", module)
    return hasattr(visual, "deepstack_merger_list") and len(visual.deepstack_merger_list) > 0


def deepstack_count(model: nn.Module) -> int:
    """How many DeepStack features each visual token carries (0: none, Qwen2-VL)."""
    return len(vision_tower(model).deepstack_merger_list) if has_deepstack(model) else 0


def position_interpolation(positions: torch.Tensor, sizes: torch.Tensor,
                           side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's learned position grid (side x side) resampled bilinearly, corners aligned, to each
    patch's frame: positions (n, 2) (row, column) in the patch grid, sizes (n, 2) that grid's (H, W)
    -> (n, 4) indices into the flat table and (n, 4) float32 weights (as transformers' tower makes
    them for the whole grid; here for any subset of patches)."""
    def axis(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / (size - 1).clamp(min=1)
        low = src.floor()
        frac = src - low
        taps = torch.stack([low, low + 1], 1).long().clamp(0, side - 1)    # (n, 2)
        return taps, torch.stack([1 - frac, frac], 1)
    rows, row_w = axis(positions[:, 0], sizes[:, 0])
    cols, col_w = axis(positions[:, 1], sizes[:, 1])
    index = (rows[:, :, None] * side + cols[:, None, :]).flatten(1)         # (n, 4)
    return index, (row_w[:, :, None] * col_w[:, None, :]).flatten(1)


def vision_rotary(visual: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's 2D rotary for patches at positions (n, 2) -> cos, sin (n, head_dim) float32:
    rows' frequencies then columns', twice (transformers' layout)."""
    inv_freq = visual.rotary_pos_emb.inv_freq.float()                        # (hd / 4,)
    freqs = (positions[..., None].float() * inv_freq).flatten(1)            # (n, hd / 2)
    emb = torch.cat([freqs, freqs], -1)                                      # (n, hd)
    return emb.cos(), emb.sin()


def tower_on(visual: nn.Module, pixels: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor,
             cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's vision tower over any set of whole merge blocks: pixels (n, F), positions (n, 2)
    (row, column) of each patch in its frame's patch grid, sizes (n, 2) that grid, cu_seqlens
    (S + 1,) int32 bounds of the attention blocks (each frame group's encoded patches) ->
    (n / m^2, D x (1 + deepstack layers)): each cell's merged token, then its DeepStack features
    from its own patches' hidden states at the DeepStack blocks. The same modules and operations
    as transformers' forward, which takes the whole grid only."""
    hidden = visual.patch_embed(pixels)                                      # (n, C)
    side = int(round(visual.pos_embed.num_embeddings ** 0.5))
    index, weights = position_interpolation(positions, sizes, side)         # (n, 4) each
    hidden = hidden + (visual.pos_embed(index) * weights[:, :, None]).sum(1).to(hidden.dtype)
    rotary = vision_rotary(visual, positions)
    layers = list(visual.deepstack_visual_indexes)
    features = []
    for i, block in enumerate(visual.blocks):
        hidden = block(hidden, cu_seqlens=cu_seqlens, position_embeddings=rotary)
        if i in layers:
            features.append(visual.deepstack_merger_list[layers.index(i)](hidden))  # (n / m^2, D)
    return torch.cat([visual.merger(hidden), *features], -1)


def grid_interpolation(visual: nn.Module, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The whole-grid tower's interpolation inputs precomputed (a replayed graph cannot make them:
    transformers' own reads sizes back to the host), for a forward that takes them."""
    from transformers import vision_utils as vu

    index, weights = vu.get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.spatial_merge_size)
    return {"interp_indices": index, "interp_weights": weights}


def deepstack_lm_kwargs(deepstack: torch.Tensor | None) -> dict[str, Any]:
    """deepstack (n, B, L, D) dense over the slots (zeros outside the visual ones) -> the keyword
    arguments of transformers' text model that add it: every slot marked visual, feature i added
    after layer i (adding zeros changes nothing)."""
    if deepstack is None:
        return {}
    n, B, L, _ = deepstack.shape
    mask = torch.ones(B, L, dtype=torch.bool, device=deepstack.device)
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": [d.flatten(0, 1) for d in deepstack]}
