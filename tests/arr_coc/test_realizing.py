"""Temporal realizing and the composed ARRCOC model, on generated video with exact ground truth."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.model import ARRCOC, Allocation
from arr_coc.realizing import RealizingConfig, StreamState, TemporalRelevanceRealizer
from arr_coc.texture import CHANNELS, Texture
from sources.synthetic import Shot, render_clip

GRID = (6, 8)  # 144x192 frames -> 24 px cells


def run_clip(model: ARRCOC, frames: np.ndarray, query: torch.Tensor, batch: int,
             device: str = "cpu", **kwargs) -> list[Allocation]:
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).to(device)        # (T, 3, H, W) uint8
    state, out = None, []
    with torch.no_grad():
        for i in range(0, len(x), batch):
            allocation, state = model(x[i:i + batch], query.to(device), state, grid=GRID, **kwargs)
            out.append(allocation.to("cpu"))
    return out


def cat(allocs: list[Allocation], name: str) -> torch.Tensor:
    return torch.cat([getattr(a, name) for a in allocs])


@pytest.fixture(scope="module")
def model() -> ARRCOC:
    torch.manual_seed(0)
    return ARRCOC(query_dim=16).eval()


@pytest.fixture(scope="module")
def query() -> torch.Tensor:
    return torch.randn(16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def cut_clip():
    # a fast-moving object and a slow pan in the middle: neither may be taken for a cut
    return render_clip([Shot("moving_object", 18, speed=2.0), Shot("fast_object", 20, speed=3.0),
                        Shot("pan", 20, speed=1.0), Shot("static", 12)], seed=3)


class TestSceneChange:
    def test_cuts_flagged_exactly(self, model, query, cut_clip):
        flags = cat(run_clip(model, cut_clip.frames, query, batch=7), "scene_change")
        assert torch.nonzero(flags).flatten().tolist() == [0] + cut_clip.cuts

    def test_fast_object_and_pan_are_not_cuts(self, model, query):
        clip = render_clip([Shot("fast_object", 24, speed=4.0), Shot("pan", 24, speed=2.5)], seed=5)
        flags = cat(run_clip(model, clip.frames, query, batch=8), "scene_change")
        assert torch.nonzero(flags).flatten().tolist() == [0, 24]

    def test_batch_size_does_not_change_the_result(self, model, query, cut_clip):
        a = run_clip(model, cut_clip.frames, query, batch=5)
        b = run_clip(model, cut_clip.frames, query, batch=16)
        for name in ("scene_change", "tokens", "lod"):
            assert torch.equal(cat(a, name), cat(b, name)), name
        torch.testing.assert_close(cat(a, "relevance"), cat(b, "relevance"))


class TestCutRule:
    """detect_cuts on hand-set residuals: a cut needs the absolute floor *and* the jump over the
    recent level; either alone is a still shot's noise or a busy shot's usual change."""

    @staticmethod
    def flat_texture(score: float, grid=(3, 4)) -> Texture:
        gh, gw = grid
        return Texture(data=torch.zeros(1, len(CHANNELS), gh, gw), flow=torch.zeros(1, 2, gh, gw),
                       motion=torch.full((1, gh, gw), score), residual=torch.full((1, gh, gw), score),
                       cell_rgb=torch.zeros(1, 3, gh, gw), has_prev=torch.ones(1, dtype=torch.bool))

    @pytest.mark.parametrize("level, score, cut", [
        (0.005, 0.035, False),  # 7x a still shot's level, but under the absolute floor
        (0.10, 0.12, False),    # over the floor, but a busy shot's usual level: no jump
        (0.005, 0.30, True),    # both
    ])
    def test_a_cut_needs_the_floor_and_the_jump(self, level, score, cut):
        cfg = RealizingConfig()
        above_floor, jumped = score > cfg.cut_threshold, score > cfg.cut_ratio * level
        assert (above_floor or jumped) and (above_floor and jumped) == cut   # each case tests one side
        realizer = TemporalRelevanceRealizer(cfg)
        state = StreamState(scores=torch.full((cfg.cut_window,), level))
        scene_change, cut_score, history = realizer.detect_cuts(self.flat_texture(score), state)
        torch.testing.assert_close(cut_score, torch.tensor([score]))
        assert scene_change.tolist() == [cut]
        torch.testing.assert_close(history, torch.tensor([level] * (cfg.cut_window - 1) + [score]))


class TestFollowsContent:
    def test_tokens_and_relevance_follow_moving_object(self, model, query):
        clip = render_clip([Shot("moving_object", 30, speed=3.0, object_size=0.3)], seed=7)
        allocs = run_clip(model, clip.frames, query, batch=10)
        tokens, relevance = cat(allocs, "tokens").float(), cat(allocs, "relevance")
        cell = 144 // GRID[0]
        inside_tok = outside_tok = inside_rel = outside_rel = 0.0
        n_in = 0
        for t in range(1, 30):
            y0, x0, y1, x1 = clip.boxes[t]
            mask = torch.zeros(GRID, dtype=torch.bool)
            mask[y0 // cell:(y1 - 1) // cell + 1, x0 // cell:(x1 - 1) // cell + 1] = True
            inside_tok += tokens[t][mask].sum().item()
            outside_tok += tokens[t][~mask].sum().item()
            inside_rel += relevance[t][mask].mean().item()
            outside_rel += relevance[t][~mask].mean().item()
            n_in += 1
        # tokens after the first frame go where things change: the object's cells
        assert inside_tok > 4 * max(outside_tok, 1.0)
        # relevance per cell inside the object's box is well above the background's
        assert inside_rel / n_in > 1.3 * outside_rel / n_in

    def test_warped_cache_moves_with_content(self):
        torch.manual_seed(0)
        model = ARRCOC(query_dim=8).eval()
        clip = render_clip([Shot("pan", 3, speed=24.0)], height=96, width=192, seed=2)  # one cell per frame
        frames = torch.from_numpy(clip.frames).permute(0, 3, 1, 2)
        grid = (4, 8)
        with torch.no_grad():
            texture = model.extract(frames[1:2], frames[0], grid)
            blob = torch.zeros(grid)
            blob[1, 5] = 1.0                                                # relevance of the previous frame
            state = StreamState(prev_relevance=blob, scores=torch.zeros(8))
            _, _, tex = model.realize(texture, torch.randn(8), state)
        cache = tex.channel("relevance_cache")[0]
        # the camera pans right by one cell, so content (and the cached relevance) moves left
        assert divmod(int(cache.argmax()), grid[1]) == (1, 4)
        assert float(texture.flow[0, 1].median()) == pytest.approx(-1.0, abs=0.15)


class TestRedundancy:
    def test_static_shot_costs_tokens_only_once(self, model, query):
        clip = render_clip([Shot("static", 12)], seed=1)
        tokens = cat(run_clip(model, clip.frames, query, batch=4), "tokens")
        per_frame = tokens.flatten(1).sum(1)
        assert per_frame[0] == round(model.cfg.attending.retention * GRID[0] * GRID[1])
        assert per_frame[1:].sum() == 0

    def test_slow_change_is_not_lost_to_drift(self):
        # the object moves 1 px per frame: under the threshold frame to frame, but the VLM's view
        # of those cells goes stale, so they must come back
        torch.manual_seed(0)
        model = ARRCOC(query_dim=8).eval()
        clip = render_clip([Shot("moving_object", 40, speed=1.0, object_size=0.3)], seed=4)
        tokens = cat(run_clip(model, clip.frames, torch.randn(8), batch=8), "tokens")
        assert tokens[1:].flatten(1).sum(1).gt(0).sum() >= 5

    def test_vlm_frames_limit_what_counts_as_seen(self, model, query):
        clip = render_clip([Shot("moving_object", 16, speed=3.0)], seed=8)
        only_first = torch.zeros(16, dtype=torch.bool)
        only_first[0] = True
        a = cat(run_clip(model, clip.frames, query, batch=16, vlm_frames=only_first), "tokens")
        b = cat(run_clip(model, clip.frames, query, batch=16), "tokens")
        # judged against frame 0 only, later frames find more changed cells than frame-to-frame
        assert a[1:].sum() > b[1:].sum()

    def test_cut_resets_allocation(self, model, query, cut_clip):
        tokens = cat(run_clip(model, cut_clip.frames, query, batch=7), "tokens").flatten(1).sum(1)
        full = round(model.cfg.attending.retention * GRID[0] * GRID[1])
        for c in cut_clip.cuts:
            assert tokens[c] == full


class TestLearning:
    def test_gradients_reach_every_parameter(self, cut_clip):
        torch.manual_seed(0)
        model = ARRCOC(query_dim=16).train()
        frames = torch.from_numpy(cut_clip.frames[10:26]).permute(0, 3, 1, 2)
        allocation, _ = model(frames, torch.randn(16), grid=GRID)
        loss = allocation.relevance.square().mean() + allocation.soft.square().mean()
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
                   or p.grad.abs().sum() == 0]
        assert missing == []

    def test_learned_temporal_parameters_shape_the_output(self):
        cfg = RealizingConfig(initial_decay=0.9)
        assert torch.sigmoid(torch.logit(torch.tensor(cfg.initial_decay))).item() == pytest.approx(0.9)
        with pytest.raises(ConfigError, match=r"realizing.initial_decay=1.5 is out of range"):
            RealizingConfig(initial_decay=1.5)
        with pytest.raises(ConfigError, match=r"realizing.cut_ratio"):
            RealizingConfig(cut_ratio=0.5)


class TestAllocation:
    def test_output_contract(self, model, query, cut_clip):
        allocs = run_clip(model, cut_clip.frames[:10], query, batch=10)
        a = allocs[0]
        T, (gh, gw) = 10, GRID
        assert a.relevance.shape == (T, gh, gw) and a.relevance.min() >= 0 and a.relevance.max() <= 1
        assert a.tokens.shape == (T, gh, gw) and a.tokens.min() >= 0
        assert a.lod.shape == (T, gh, gw) and a.scene_change.dtype == torch.bool
        assert a.motion.shape == (T,) and set(a.tensions) >= {"compress", "exploit", "focus"}
        # selected lists exactly the cells holding a token
        for t in range(T):
            sel = a.selected[t][a.selected[t] >= 0]
            assert sorted(sel.tolist()) == torch.nonzero(a.tokens[t].flatten()).flatten().tolist()

    def test_shape_mismatch_is_rejected(self):
        z = torch.zeros(2, 3, 4)
        with pytest.raises(ValueError, match="Allocation.tokens"):
            Allocation(relevance=z, tokens=torch.zeros(2, 3, 5), selected=torch.zeros(2, 1), lod=z, soft=z,
                       scene_change=torch.zeros(2, dtype=torch.bool), motion=torch.zeros(2), tensions={})

    def test_query_token_embeddings_with_mask(self, model, cut_clip):
        frames = torch.from_numpy(cut_clip.frames[:4]).permute(0, 3, 1, 2)
        tokens = torch.randn(5, 16)
        mask = torch.tensor([True, True, True, False, False])
        with torch.no_grad():
            a, _ = model(frames, tokens, grid=GRID, query_mask=mask)
            garbage = tokens.clone()
            garbage[3:] = 100.0                                             # masked out: no effect
            b, _ = model(frames, garbage, grid=GRID, query_mask=mask)
        torch.testing.assert_close(a.relevance, b.relevance)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_agree(cut_clip):
    torch.manual_seed(0)
    model = ARRCOC(query_dim=16).eval()
    q = torch.randn(16)
    cpu = run_clip(model, cut_clip.frames, q, batch=16)
    gpu = run_clip(model.cuda(), cut_clip.frames, q, batch=16, device="cuda")
    assert torch.equal(cat(cpu, "scene_change"), cat(gpu, "scene_change"))
    torch.testing.assert_close(cat(cpu, "relevance"), cat(gpu, "relevance"), atol=2e-3, rtol=0)
    agree = (cat(cpu, "tokens") == cat(gpu, "tokens")).float().mean()
    assert agree > 0.98  # ties at the budget boundary may break differently


@torch.no_grad()
def test_initial_state_is_what_a_missing_state_means(model, query, cut_clip):
    """realize() of a stream's first batch with the initial state as tensors (what a CUDA graph
    replays) equals realize() with no state, and so does the batch after it."""
    x = torch.from_numpy(cut_clip.frames).permute(0, 3, 1, 2)
    first, second = x[:6], x[6:12]
    grid = (6, 8)
    tex = model.extract(first, None, grid)
    initial = model.realizer.initial_state(tex)
    # the documented start: nothing cached, every cell stale, no cut history, no frames
    assert not initial.prev_relevance.any() and initial.prev_relevance.shape == grid
    assert not initial.ref_rgb.any() and initial.ref_rgb.shape == (3, *grid)
    assert initial.stale.dtype == torch.bool and bool(initial.stale.all())
    assert bool(initial.scores.isnan().all()) and initial.scores.shape == (model.realizer.cfg.cut_window,)
    assert int(initial.frames) == 0
    want, want_state, _ = model.realize(tex, query, None)
    got, got_state, _ = model.realize(tex, query, initial)
    tex2 = model.extract(second, first[-1], grid)
    want2, _, _ = model.realize(tex2, query, want_state)
    got2, _, _ = model.realize(tex2, query, got_state)
    for a, b in ((got, want), (got2, want2)):
        for name in ("relevance", "tokens", "lod", "selected", "scene_change"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("prev_relevance", "ref_rgb", "stale", "frames"):
        assert torch.equal(getattr(got_state, name), getattr(want_state, name)), name
    torch.testing.assert_close(got_state.scores, want_state.scores, equal_nan=True, rtol=0, atol=0)
