"""The batched vision attention (one SDPA call per layer for frames of one size) gives what HF's
per-block loop gives, for Qwen2-VL and Qwen2.5-VL (whose window layers keep HF's forward)."""
from __future__ import annotations

import torch

from conftest import make_frames
from pipeline.vlm import vision_attention


@torch.no_grad()
def test_batched_equals_hf_per_block_loop(vlm, monkeypatch):
    frames = make_frames(6, 84, 112, seed=3)                        # 3 temporal patches of 6 x 8 patches
    pixels, grid = vlm._preprocess([frames])
    calls = {"batched": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *a, **k):
        calls["batched"] += q.shape[0] > 1                            # blocks batched in one call
        return sdpa(q, *a, **k)

    monkeypatch.setattr(vision_attention.F, "scaled_dot_product_attention", counting)
    batched = vlm._vision(pixels, grid)[0]
    with vision_attention.uniform_blocks(None):                      # HF's own forward in every layer
        reference = vlm._visual(pixels, grid_thw=grid)
    reference = getattr(reference, "pooler_output", reference).view(batched.shape)
    torch.testing.assert_close(batched, reference, rtol=1e-5, atol=1e-5)
    assert calls["batched"] >= 1


def test_uniform_blocks_restores_the_previous_length():
    with vision_attention.uniform_blocks(48):
        with vision_attention.uniform_blocks(None):
            assert vision_attention._local.length is None
        assert vision_attention._local.length == 48
    assert getattr(vision_attention._local, "length", None) is None
