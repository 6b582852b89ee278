"""The batched vision attention (one SDPA call per layer: frame blocks, or windows padded to the
longest) gives what HF's per-block loop gives, for Qwen2-VL and Qwen2.5-VL."""
from __future__ import annotations

import torch

from conftest import make_frames
from pipeline.vlm import vision_attention


@torch.no_grad()
def test_batched_equals_hf_per_block_loop(vlm, monkeypatch):
    frames = make_frames(6, 84, 112, seed=3)                        # 3 temporal patches of 6 x 8 patches
    pixels, grid = vlm.encoder.preprocess([frames])
    calls = {"batched": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *a, **k):
        calls["batched"] += q.shape[0] > 1                            # blocks batched in one call
        calls["padded"] = calls.get("padded", 0) + (k.get("attn_mask") is not None)
        return sdpa(q, *a, **k)

    monkeypatch.setattr(vision_attention.F, "scaled_dot_product_attention", counting)
    batched = vlm.encoder.vision(pixels, grid)[0]
    counted = dict(calls)
    reference = vlm.encoder._visual(pixels, grid_thw=grid.to(vlm.device))    # outside batched_attention: HF's forward
    reference = getattr(reference, "pooler_output", reference).view(batched.shape)
    torch.testing.assert_close(batched, reference, rtol=1e-5, atol=1e-5)
    assert counted["batched"] == len(vlm.encoder._visual.blocks)                # every layer, one call each
    # Qwen2.5-VL's windows at 6 x 8 patches: 4 x 4 and 2 x 4 edge windows, padded to 16 and masked
    assert counted["padded"] == (0 if vlm.family == "qwen2_vl" else len(vlm.encoder._visual.blocks) - 1)


def test_batched_attention_restores_the_previous_length():
    with vision_attention.batched_attention(48):
        with vision_attention.batched_attention(None):
            assert vision_attention._local.state[0] is None
        assert vision_attention._local.state[0] == 48
    assert getattr(vision_attention._local, "state", None) is None
