"""pipeline.vlm.vision_blocks: the vision tower's faster block forward (VLMConfig.fast_vision, on by
default) against HF's own block forward on the same weights, for the three families, the QuickGELU and
gated MLPs, an MLP width that needs padding, and the joint rotary against HF's."""
import copy
import sys

import pytest
import torch

from arr_coc._validate import ConfigError
from conftest import make_frames
from pipeline.vlm import qwen3_vl
from pipeline.vlm.builtin import build_model, build_tokenizer, tiny_config
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import TINY_WARNING, _wrap
from pipeline.vlm.vision_blocks import ALIGN, patch_vision_blocks, rotate_qk


def tiny_pair(family, dtype=torch.float32, device="cpu", **vision):
    """Two VLMs over two copies of one tiny model (vision config overridden by `vision`): the first
    with HF's block forward, the second with vision_blocks'."""
    tokenizer = build_tokenizer()
    cfg = qwen3_vl.tiny_config(tokenizer) if family == "qwen3_vl" else tiny_config(family, tokenizer)
    for k, v in vision.items():
        setattr(cfg.vision_config, k, v)
    model = build_model(cfg, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():               # weights of std 0.3 (not 0.02), so every block changes the tokens
        for name, p in model.model.visual.named_parameters():
            if "norm" not in name and "ln_" not in name:
                p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.3)
    models = [model, copy.deepcopy(model)]
    return [_wrap(m, tokenizer, family, "tiny", VLMConfig(fast_vision=fast, dtype=str(dtype)[6:]), {}, TINY_WARNING)
            for m, fast in zip(models, (False, True))]


def tower_outputs(vlm, frames):
    with torch.no_grad():
        pixels, grid = vlm.encoder.preprocess([frames])
        batched = vlm.encoder.vision(pixels, grid)[0]                               # the pipeline's batched attention
        # HF's tower forward, blocks patched or not
        plain = vlm.encoder._visual(pixels, grid_thw=grid.to(vlm.device))
    return batched, getattr(plain, "pooler_output", plain)


CASES = [("qwen2_vl", {}),                                                    # QuickGELU MLP, LayerNorm
         ("qwen2_vl", {"hidden_act": "gelu"}),                                # an fc MLP kept as HF computes it
         ("qwen2_5_vl", {}),                                                  # gated MLP, RMSNorm, windows
         ("qwen2_5_vl", {"intermediate_size": 60}),                           # width padded to 64
         ("qwen3_vl", {})]                                                    # tanh-GELU fc MLP, DeepStack


@pytest.mark.parametrize("family,vision", CASES)
def test_tower_equals_hf_blocks(family, vision):
    hf, fast = tiny_pair(family, **vision)
    assert all(not getattr(b, "_arr_coc_fast", False) for b in hf.encoder._visual.blocks)
    assert all(b._arr_coc_fast for b in fast.encoder._visual.blocks)
    frames = make_frames(4, 56, 84, seed=3)
    for got, want in zip(tower_outputs(fast, frames), tower_outputs(hf, frames)):
        # float32 rounding: the patch embedding's GEMM sums in another order than the convolution,
        # and the std-0.3 weights amplify that through the blocks (largest difference seen 1.7e-5)
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_padded_mlp_weights_are_views_and_state_dict_is_unchanged():
    hf, fast = tiny_pair("qwen2_5_vl", intermediate_size=60)
    before = hf.model.state_dict()
    after = fast.model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    mlp = fast.encoder._visual.blocks[0].mlp
    weight, bias = mlp.gate_proj._arr_coc_padded
    assert weight.shape[0] == 64 and 64 % ALIGN == 0
    assert mlp.gate_proj.weight.data_ptr() == weight.data_ptr()              # the module's weight is a view
    assert torch.count_nonzero(weight[60:]) == 0 and torch.count_nonzero(bias[60:]) == 0


def test_patching_twice_changes_nothing():
    _, fast = tiny_pair("qwen2_vl")
    frames = make_frames(2, 56, 56, seed=4)
    first = tower_outputs(fast, frames)[0]
    forwards = [b.forward for b in fast.encoder._visual.blocks]
    assert patch_vision_blocks(fast.encoder._visual) == len(forwards)
    assert [b.forward for b in fast.encoder._visual.blocks] == forwards
    torch.testing.assert_close(tower_outputs(fast, frames)[0], first, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_patch_embedding_as_a_gemm_equals_the_convolution(family):
    """The fast patch embedding (one GEMM over the patch rows) gives what HF's Conv3d gives; in
    training the module keeps HF's forward."""
    hf, fast = tiny_pair(family)
    embed = fast.encoder._visual.patch_embed
    assert embed._arr_coc_fast and not getattr(hf.encoder._visual.patch_embed, "_arr_coc_fast", False)
    rows = torch.randn(12, embed.proj.weight[0].numel(), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf.encoder._visual.patch_embed(rows)
        got = embed(rows)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    seen = []
    handle = embed.proj.register_forward_hook(lambda *a: seen.append(1))      # the convolution module runs
    embed.train()
    embed(rows)
    handle.remove()
    assert seen


def test_training_runs_hf_forward():
    _, fast = tiny_pair("qwen2_vl")
    block = fast.encoder._visual.blocks[0]
    seen = []
    block.mlp.register_forward_hook(lambda *a: seen.append(1))                # HF's forward calls the MLP module
    x = torch.randn(8, block.norm1.normalized_shape[0])
    emb = torch.randn(8, x.shape[1] // block.attn.num_heads)
    kw = dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), position_embeddings=(emb.cos(), emb.sin()))
    block(x, **kw)
    assert not seen                                                          # eval: the fast forward
    block.train()
    block(x, **kw)
    assert seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_rotary_equals_hf(dtype):
    module = sys.modules["transformers.models.qwen2_vl.modeling_qwen2_vl"]
    g = torch.Generator().manual_seed(0)
    N, H, hd = 257, 3, 16
    qkv = torch.randn(N, 3, H, hd, generator=g).to(dtype)
    angles = torch.randn(N, hd // 2, generator=g) * 20
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos(), emb.sin()                                           # float32, as HF's tower makes them
    want = module.apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    got = rotate_qk(qkv, cos, sin)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        else:                                 # float32 inside, one rounding at the end, as HF
            assert (a == b).float().mean() > 0.99
            torch.testing.assert_close(a, b, atol=2 ** -7, rtol=2 ** -7)


def test_config_flag():
    assert VLMConfig().fast_vision is True
    with pytest.raises(ConfigError, match="fast_vision must be true or false"):
        VLMConfig(fast_vision="no")


def test_unknown_blocks_keep_hf_forward():
    hf, _ = tiny_pair("qwen2_vl")
    block = hf.encoder._visual.blocks[0]
    block.norm1 = torch.nn.Identity()                                         # not a norm this forward knows
    forward = block.forward
    assert patch_vision_blocks(hf.encoder._visual) == len(hf.encoder._visual.blocks) - 1
    assert block.forward == forward and not getattr(block, "_arr_coc_fast", False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,vision", CASES)
def test_cuda_bf16_tower_close_to_hf(family, vision):
    """On CUDA in bfloat16 (graph replay included): within bf16 rounding of HF's blocks."""
    hf, fast = tiny_pair(family, dtype=torch.bfloat16, device="cuda", **vision)
    frames = make_frames(4, 112, 140, seed=5)
    for got, want in zip(tower_outputs(fast, frames), tower_outputs(hf, frames)):
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < 2e-2, float(err)


def test_rotary_under_autograd_has_gradients():
    """With grad enabled and q/k requiring it (train_vlm's backward through a frozen model), the
    rotary takes a form autograd records, with HF's values and gradients."""
    module = sys.modules["transformers.models.qwen2_vl.modeling_qwen2_vl"]
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, 3, 2, 8, generator=g, requires_grad=True)
    emb = torch.randn(9, 8, generator=g)
    cos, sin = emb.cos(), emb.sin()
    got = torch.stack(rotate_qk(qkv, cos, sin))
    (grad,) = torch.autograd.grad(got.square().sum(), qkv)
    want = torch.stack(module.apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin))
    (want_grad,) = torch.autograd.grad(want.square().sum(), qkv)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
