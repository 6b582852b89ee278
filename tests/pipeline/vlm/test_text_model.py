"""pipeline.vlm.text_model: the LM forward the VLM runs by default (fused norms, one q/k/v GEMM,
rotary on q and k at once) against HF's own forward of the same modules. Cached decoding through it
is also compared with HF's forward by test_vlm_static_decode (the dynamic-cache reference) and with
the stock model's logits by test_vlm_model (TestStockEquivalence)."""
import copy

import pytest
import torch
from torch import nn

from arr_coc._validate import ConfigError
from conftest import rewrap
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm.decoding import StaticKVCache
from pipeline.vlm.text_model import FastTextModel, concat_weights, unsupported


def inputs(vlm, B=2, L=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = vlm.lm.embed_tokens.embedding_dim
    embeds = torch.randn(B, L, D, generator=g)
    positions = torch.randint(0, 3 * L, (3, B, L), generator=g)             # M-RoPE: t, h, w differ
    return embeds, positions


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_equals_hf_forward(family, attn):
    vlm = build_tiny_vlm(family)
    vlm.lm.config._attn_implementation = attn
    fast = FastTextModel(vlm.lm, attn)
    embeds, positions = inputs(vlm)
    with torch.no_grad():
        expected = vlm.lm(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        got = fast(embeds, None, positions, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_masked_prefill_then_steps_into_a_cache_equal_hf(family):
    """Left-padded prefill with a mask into a static cache, then single-token steps: each output equals
    HF's forward on the same cache contents and mask."""
    vlm = build_tiny_vlm(family)
    assert vlm.pool._fast_lm is not None
    B, L, steps = 2, 11, 3
    embeds, positions = inputs(vlm, B, L, seed=1)
    pads = torch.tensor([0, 4])
    caches = [StaticKVCache(vlm.lm, B, L + steps, vlm.dtype, vlm.device) for _ in range(2)]
    steppers = [vlm.pool._fast_lm, lambda e, m, p, c: vlm.pool._hf_lm_step(e, vlm.attention_masks(m), p, c)]
    outs = [[], []]
    with torch.no_grad():
        for i, (cache, fn) in enumerate(zip(caches, steppers)):
            keys = torch.arange(L)
            allowed = (keys <= keys[:, None]) & (keys >= pads[:, None, None])
            allowed = (allowed | (keys == keys[:, None]))[:, None]                # (B, 1, L, L)
            cache.at(torch.arange(L), L)
            outs[i].append(fn(embeds, allowed, positions, cache))
            g = torch.Generator().manual_seed(2)
            for s in range(steps):
                slot = L + s
                cache.at(torch.tensor([slot]), slot + 1)
                keys = torch.arange(slot + 1)
                step_allowed = (keys >= pads[:, None])[:, None, None]            # (B, 1, 1, K)
                e = torch.randn(B, 1, embeds.shape[-1], generator=g)
                outs[i].append(fn(e, step_allowed, positions[:, :, -1:] + 1 + s, cache))
    for got, expected in zip(*outs):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rope_equals_rotate_half_form():
    g = torch.Generator().manual_seed(3)
    x, cos, sin = (torch.randn(2, 5, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    half = 8
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    signed = torch.cat([-sin[..., :half], sin[..., half:]], -1)
    torch.testing.assert_close(FastTextModel._rope(x, cos, signed), x * cos + rotated * sin, atol=1e-12, rtol=0)


def test_weights_become_views_and_state_dict_is_unchanged():
    vlm = build_tiny_vlm("qwen2_5_vl", config=VLMConfig(fast_lm=False))
    before = copy.deepcopy(vlm.model.state_dict())
    fast = FastTextModel(vlm.lm, vlm.attn_impl)
    after = vlm.model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    attn, layer = vlm.lm.layers[0].self_attn, fast.layers[0]
    assert attn.q_proj.weight.data_ptr() == layer.qkv_weight.data_ptr()      # one copy: views of the fused weight
    assert attn.v_proj.weight.data_ptr() == layer.qkv_weight[-attn.v_proj.out_features:].data_ptr()
    mlp = vlm.lm.layers[0].mlp
    assert mlp.gate_proj.weight.data_ptr() == layer.gate_up_weight.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == layer.gate_up_weight[layer.inter:].data_ptr()
    assert layer.gate_up_weight.shape == (2 * mlp.gate_proj.out_features, mlp.gate_proj.in_features)
    # a second VLM over the same model (rewrap) reuses the fused weights
    again = FastTextModel(vlm.lm, vlm.attn_impl)
    assert again.layers[0].qkv_weight is layer.qkv_weight and again.layers[0].qkv_bias is layer.qkv_bias
    assert again.layers[0].gate_up_weight is layer.gate_up_weight


def test_concat_weights_without_biases():
    linears = [nn.Linear(4, 3, bias=False), nn.Linear(4, 5, bias=False)]
    w = [m.weight.detach().clone() for m in linears]
    weight, bias = concat_weights(linears)
    assert bias is None and torch.equal(weight, torch.cat(w))
    x = torch.randn(2, 4)
    torch.testing.assert_close(linears[1](x), x @ w[1].T)


def test_models_it_cannot_run_fall_back_to_hf():
    vlm = build_tiny_vlm("qwen2_vl")

    class Adapted(nn.Linear):                                                # e.g. a LoRA or quantized layer
        pass

    old = vlm.lm.layers[1].mlp.up_proj
    new = Adapted(old.in_features, old.out_features, bias=False)
    new.load_state_dict(old.state_dict())
    vlm.lm.layers[1].mlp.up_proj = new
    assert "plain nn.Linear" in unsupported(vlm.lm)
    with pytest.raises(ValueError, match="cannot run this model"):
        FastTextModel(vlm.lm, vlm.attn_impl)
    wrapped = rewrap(vlm)
    assert wrapped.pool._fast_lm is None
    embeds, positions = inputs(wrapped)
    with torch.no_grad():
        torch.testing.assert_close(wrapped.pool.lm_step(embeds, None, positions, None),
                                   wrapped.lm(inputs_embeds=embeds, position_ids=positions).last_hidden_state)


def test_config_flag():
    assert build_tiny_vlm("qwen2_vl", config=VLMConfig(fast_lm=False)).pool._fast_lm is None
    with pytest.raises(ConfigError, match="fast_lm must be true or false"):
        VLMConfig(fast_lm="yes")


def test_rotary_of_older_transformers_is_recomposed():
    """transformers 4.x rotary modules return one cos/sin per M-RoPE axis, (3, B, L, hd), and leave
    the interleaving by mrope_section to the attention layer: recomposed here, they give what
    transformers 5.x's (B, L, hd) give."""
    vlm = build_tiny_vlm("qwen2_5_vl")
    fast, rotary = vlm.pool._fast_lm, vlm.lm.rotary_emb
    embeds, positions = inputs(vlm)
    new = fast.rotary(embeds, positions)

    def per_axis(x, position_ids):                                           # the 4.x form
        freqs = position_ids[..., None].float() * rotary.inv_freq.float()    # (3, B, L, hd / 2)
        emb = torch.cat([freqs, freqs], -1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)

    rotary.forward = per_axis
    try:
        old = fast.rotary(embeds, positions)
    finally:
        del rotary.forward
    for a, b in zip(old, new):
        assert a.shape == b.shape == (2, 23, 1, vlm.lm.layers[0].self_attn.head_dim)
        torch.testing.assert_close(a, b)
