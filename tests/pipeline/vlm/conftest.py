from dataclasses import replace

import numpy as np
import pytest
import torch

from pipeline.vlm.loading import build_tiny_vlm
from pipeline.runtime.requests import AnswerRequest

FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request):
    return build_tiny_vlm(request.param)


@pytest.fixture(params=FAMILIES)
def cuda_pair(request):
    """A tiny VLM on CUDA replaying CUDA graphs, and the same weights without (CUDA tests)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphed = build_tiny_vlm(request.param, device="cuda")
    return graphed, rewrap(graphed, cuda_graphs=False)


def rewrap(vlm, **config):
    """The same model and weights behind a VLM with another config."""
    return type(vlm)(vlm.model, vlm.tokenizer, family=vlm.family, name=vlm.name,
                     config=replace(vlm.config, **config), preprocessor=vlm.preprocessor)


def make_frames(T: int, H: int, W: int, seed: int = 0) -> np.ndarray:
    """Smooth random video (low-frequency colour fields + noise), so resizing is non-trivial."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:H, 0:W] / max(H, W)
    base = np.stack([np.sin(6 * yy + c) * np.cos(5 * xx - c) for c in range(3)], -1)
    video = [(base * 100 + 128 + rng.normal(0, 30, (H, W, 3)) + 10 * t) for t in range(T)]
    return np.clip(np.stack(video), 0, 255).astype(np.uint8)


def random_keep(vlm, frames: np.ndarray, seed: int, p=(0.5, 0.3, 0.2)) -> np.ndarray:
    """Random LOD map (0 dropped / 1 full / 2 pooled) on the VLM's grid."""
    gh, gw = vlm.geometry.grid(*frames.shape[1:3])
    rng = np.random.default_rng(seed)
    return rng.choice(3, size=(frames.shape[0], gh, gw), p=p).astype(np.int64)


def request(frames, keep=None, question="what moves?", stream="s0") -> AnswerRequest:
    return AnswerRequest(stream, frames, keep, question, 0.0, 1.0)


def mixed_requests(vlm, seed: int) -> list[AnswerRequest]:
    """Three requests whose prefixes differ in length (one stock, two pruned), so a batch of them
    is left padded; seeds seed .. seed + 4."""
    reqs = [request(make_frames(4, 56, 84, seed=seed), None, "a?"),
            request(make_frames(3, 112, 112, seed=seed + 1), None, "what colour is the car on the left?"),
            request(make_frames(6, 84, 84, seed=seed + 2), None, "count")]
    reqs[1] = request(reqs[1].frames, random_keep(vlm, reqs[1].frames, seed=seed + 3), reqs[1].question)
    reqs[2] = request(reqs[2].frames, random_keep(vlm, reqs[2].frames, seed=seed + 4, p=(0.8, 0.1, 0.1)), "count")
    return reqs


def stock_inputs(vlm, frames, question):
    """HF model inputs for the unpruned video (pixel values from our preprocessing: test_vlm_preprocess
    shows they equal HF's processor output)."""
    pixels, grid = vlm.preprocessor(frames, vlm.device)
    n_full = int(grid.prod()) // vlm.geometry.merge_size ** 2
    ids = vlm.prefixes.full_input_ids(question, n_full)[None]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=pixels,
                  video_grid_thw=grid[None], mm_token_type_ids=(ids == vlm.video_token_id).int() * 2)
    if vlm.family == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([vlm.geometry.temporal_patch_size / vlm.config.fps])
    return inputs


def visual_positions(prefix) -> set[tuple[int, int, int]]:
    """The (t, h, w) M-RoPE positions of a prefix's visual tokens: which cells it kept."""
    w = prefix.window
    v0 = w.embeds.shape[0] - w.tokens_kept
    return {tuple(c) for c in w.positions[:, v0:].T.tolist()}


def record_prefills(vlm, monkeypatch) -> list:
    """Every prefill's prefixes, in order (pass by pass, then a final generate's)."""
    calls = []
    prefill = vlm.prefill

    def recording(prefixes, *args, **kwargs):
        calls.append(list(prefixes))
        return prefill(prefixes, *args, **kwargs)
    monkeypatch.setattr(vlm, "prefill", recording)
    return calls
