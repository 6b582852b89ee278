"""The vision tower as a CUDA graph (pipeline/vlm/vision_graph.py) rests on three facts, checked
here on CPU for Qwen2-VL and Qwen2.5-VL: HF's vision forward takes its grid-derived inputs
precomputed (and then never reads grid_thw), frames go through the tower independently (a window
padded with more frame pairs, whatever they hold, gives the same tokens for its own), and same-size
videos through the tower at once equal each through it alone. On CUDA: the replayed graph gives
what the eager tower gives, capture once per bucket, fresh pixels each replay."""
from __future__ import annotations

import pytest
import torch

from conftest import make_frames
from pipeline.vlm.vision_attention import batched_attention
from pipeline.vlm.vision_graph import T_BUCKET, grid_inputs


def tower(vlm, pixels, grid, **inputs):
    """Merged tokens of the eager tower (batched attention, as VLM._vision runs it)."""
    t, h, w = grid
    with batched_attention(h * w):
        out = vlm.encoder._visual(pixels, grid_thw=None if inputs else torch.tensor([grid], device=vlm.device),
                                  **inputs)
    return out.pooler_output


@torch.no_grad()
def test_precomputed_grid_inputs_equal_hf_forward(vlm):
    pixels, grid = vlm.encoder.preprocess([make_frames(6, 84, 112, seed=1)])
    reference = vlm.encoder._visual(pixels, grid_thw=grid).pooler_output          # HF's own forward
    inputs = grid_inputs(vlm.encoder._visual, grid)
    assert inputs is not None
    expected = {"position_ids", "cu_seqlens"} | ({"window_index", "cu_window_seqlens"}
                                                 if vlm.family == "qwen2_5_vl" else set())
    assert expected <= set(inputs)
    # grid_thw=None: with the inputs precomputed, nothing of the forward may need it
    torch.testing.assert_close(tower(vlm, pixels, tuple(grid[0].tolist()), **inputs), reference, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_extra_frame_pairs_leave_a_windows_tokens_unchanged(vlm):
    pixels, grid = vlm.encoder.preprocess([make_frames(6, 84, 112, seed=2)])    # 3 frame pairs
    t, h, w = grid[0].tolist()
    alone = tower(vlm, pixels, (t, h, w))
    padded_t = -(-t // T_BUCKET) * T_BUCKET + T_BUCKET                    # at least one whole extra bucket
    junk = torch.randn((padded_t - t) * h * w, pixels.shape[1], generator=torch.Generator().manual_seed(0))
    padded = tower(vlm, torch.cat([pixels, junk.to(pixels)]), (padded_t, h, w))
    assert padded.shape[0] == alone.shape[0] * padded_t // t
    torch.testing.assert_close(padded[:alone.shape[0]], alone, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_same_size_videos_together_equal_each_alone(vlm):
    videos = [make_frames(4, 84, 112, seed=3), make_frames(5, 84, 112, seed=4)]   # 2 and 3 frame pairs
    together = vlm.encoder.merged_tokens(videos)
    for video, merged in zip(videos, together):
        torch.testing.assert_close(merged, vlm.encoder.merged_tokens([video])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@torch.no_grad()
def test_graph_replay_equals_the_eager_tower(cuda_pair):
    graphed, eager = cuda_pair
    assert graphed.encoder._vision_graphs is not None and eager.encoder._vision_graphs is None
    for seed, T in enumerate([6, 6, 8, 3]):                    # 3, 3, 4 and 2 frame pairs
        frames = make_frames(T, 84, 112, seed=10 + seed)
        got, want = graphed.encoder.merged_tokens([frames])[0], eager.encoder.merged_tokens([frames])[0]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # two same-size videos: one replay of a longer graph
    videos = [make_frames(6, 84, 112, seed=20), make_frames(10, 84, 112, seed=21)]   # 3 + 5 frame pairs
    for got, want in zip(graphed.encoder.merged_tokens(videos), eager.encoder.merged_tokens(videos)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    graphs = graphed.encoder._vision_graphs
    buckets = {-(-t // T_BUCKET) * T_BUCKET for t in (3, 3, 4, 2)} | {8}  # pairs per call, rounded up
    assert graphs.enabled and graphs.captured == len(buckets)
    # different sizes in one call: the eager tower
    mixed = [make_frames(4, 84, 112, seed=30), make_frames(4, 56, 84, seed=31)]
    for got, want in zip(graphed.encoder.merged_tokens(mixed), eager.encoder.merged_tokens(mixed)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphs.captured == len(buckets)
