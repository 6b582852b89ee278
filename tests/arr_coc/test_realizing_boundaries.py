"""The realizer's three rules at their exact boundaries, on hand-set textures (values exact in
float32): a cut needs the score strictly above both the floor and cut_ratio x the recent level; a
cell whose colour moved by exactly redundancy_threshold is sent again; every cell is resent on
frames refresh_frames apart counted from the stream's first frame, across batches."""
from __future__ import annotations

import pytest
import torch

from arr_coc.realizing import RealizingConfig, StreamState, TemporalRelevanceRealizer
from arr_coc.texture import CHANNELS, Texture

GH, GW = 3, 4


def texture(cell_rgb: torch.Tensor, residual: float = 0.0) -> Texture:
    """T frames with these cell colours (T, 3, gh, gw), no flow or motion, every frame with a
    previous one (so only the cut rule can make a scene change), the same residual everywhere."""
    t = cell_rgb.shape[0]
    return Texture(data=torch.zeros(t, len(CHANNELS), GH, GW), flow=torch.zeros(t, 2, GH, GW),
                   motion=torch.zeros(t, GH, GW), residual=torch.full((t, GH, GW), residual),
                   cell_rgb=cell_rgb, has_prev=torch.ones(t, dtype=torch.bool))


def seen(ref: torch.Tensor, frames: int, cfg: RealizingConfig) -> StreamState:
    """A stream that already sent every cell as `ref` and has processed `frames` frames; a quiet
    cut history (no cut can follow from it)."""
    return StreamState(prev_relevance=torch.zeros(GH, GW), ref_rgb=ref, stale=torch.zeros(GH, GW, dtype=torch.bool),
                       scores=torch.zeros(cfg.cut_window), frames=torch.tensor(frames))


class TestCutBoundary:
    @pytest.mark.parametrize("score, cut", [(0.25, False), (0.2500001, True)])
    def test_the_floor_is_strict(self, score, cut):
        cfg = RealizingConfig(cut_threshold=0.25)
        realizer = TemporalRelevanceRealizer(cfg)
        state = StreamState(scores=torch.full((cfg.cut_window,), 0.001))           # level x ratio: 0.006
        scene_change, _, _ = realizer.detect_cuts(texture(torch.zeros(1, 3, GH, GW), score), state)
        assert scene_change.tolist() == [cut]

    @pytest.mark.parametrize("score, cut", [(0.25, False), (0.2500001, True)])
    def test_the_jump_is_strict(self, score, cut):
        cfg = RealizingConfig(cut_threshold=0.1, cut_ratio=4.0)
        realizer = TemporalRelevanceRealizer(cfg)
        state = StreamState(scores=torch.full((cfg.cut_window,), 0.0625))          # level x ratio: 0.25
        scene_change, _, _ = realizer.detect_cuts(texture(torch.zeros(1, 3, GH, GW), score), state)
        assert scene_change.tolist() == [cut]


class TestRedundancyBoundary:
    def test_a_change_of_exactly_the_threshold_is_sent_again(self):
        cfg = RealizingConfig(redundancy_threshold=0.25, refresh_frames=0)
        realizer = TemporalRelevanceRealizer(cfg)
        cells = torch.zeros(1, 3, GH, GW)
        cells[0, :, 0, 0] = 0.25                     # mean |change| over the 3 channels: exactly 0.25
        cells[0, :, 0, 1] = 0.24                     # just under
        cells[0, 0, 0, 2] = 0.75                     # one channel only: mean 0.25 again
        realized, _ = realizer(torch.zeros(1, GH, GW), texture(cells), seen(torch.zeros(3, GH, GW), 5, cfg))
        expected = torch.zeros(GH, GW, dtype=torch.bool)
        expected[0, 0] = expected[0, 2] = True
        assert not realized.scene_change.any()
        assert torch.equal(realized.available[0], expected)


class TestRefreshPhase:
    @pytest.mark.parametrize("batches", [[10], [3, 7], [1, 1, 1, 7]])
    def test_every_cell_is_resent_on_frames_0_4_8_of_the_stream(self, batches):
        """Frames 0..9 of a still stream, in batches of these sizes: everything is sent at frames
        0, 4 and 8 (frame 0: nothing was seen yet), nothing in between."""
        cfg = RealizingConfig(refresh_frames=4)
        realizer = TemporalRelevanceRealizer(cfg)
        cells = torch.full((1, 3, GH, GW), 0.5)
        state, sent = StreamState(), []
        for n in batches:
            realized, state = realizer(torch.zeros(n, GH, GW), texture(cells.expand(n, -1, -1, -1)), state)
            sent += [bool(a.all()) for a in realized.available]
            assert all(a.all() or not a.any() for a in realized.available)       # whole frames only
        assert [t for t, s in enumerate(sent) if s] == [0, 4, 8]
        assert int(state.frames) == 10

    def test_the_phase_counts_frames_already_processed(self):
        cfg = RealizingConfig(refresh_frames=4)
        realizer = TemporalRelevanceRealizer(cfg)
        cells = torch.full((3, 3, GH, GW), 0.5)
        realized, _ = realizer(torch.zeros(3, GH, GW), texture(cells), seen(cells[0], 7, cfg))   # frames 7, 8, 9
        assert [bool(a.all()) for a in realized.available] == [False, True, False]
