import numpy as np
import pytest
import torch

from arr_coc.lod import FULL, pair_lod
from evaluation.baselines import (POLICIES, baseline_keep, budget, density_peaks, evs_keep, fastvid_keep,
                                    random_keep, segments, uniform_keep)

GRID = (4, 6)


def kept_tokens(keep: np.ndarray) -> int:
    return int((pair_lod(torch.as_tensor(keep)) == FULL).sum())


def features(pairs: int, seed: int = 0, D: int = 16) -> torch.Tensor:
    return torch.randn(pairs, *GRID, D, generator=torch.Generator().manual_seed(seed))


class TestBudgets:
    @pytest.mark.parametrize("retention", [1.0, 0.5, 0.25, 0.1, 0.05])
    @pytest.mark.parametrize("policy", POLICIES)
    def test_every_policy_spends_about_the_budget(self, policy, retention):
        frames = np.zeros((16, 8, 8, 3), np.uint8)                       # 8 pairs x 24 cells = 192 tokens
        keep = baseline_keep(policy, frames, retention, grid=GRID, merged=features(8))
        assert keep.shape == (16, *GRID)
        assert abs(kept_tokens(keep) - budget(retention, 192)) <= 24     # at most a pair's worth off

    def test_bad_retention_and_policy(self):
        with pytest.raises(ValueError, match="retention"):
            budget(0.0, 10)
        with pytest.raises(ValueError, match="Supported values"):
            baseline_keep("oracle", np.zeros((2, 8, 8, 3), np.uint8), 0.5, grid=GRID)
        with pytest.raises(ValueError, match="merged tokens"):
            baseline_keep("evs", np.zeros((2, 8, 8, 3), np.uint8), 0.5, grid=GRID)


def test_uniform_keeps_whole_evenly_spaced_pairs():
    keep = uniform_keep(20, GRID, 0.3)                                    # 10 pairs -> 3 whole pairs
    pairs = pair_lod(torch.as_tensor(keep)).flatten(1).all(1).nonzero().flatten().tolist()
    assert pairs == [0, 4, 9] or pairs == [0, 5, 9]
    assert kept_tokens(keep) == 3 * 24


def test_random_spreads_the_budget_over_pairs_and_follows_the_seed():
    a, b = random_keep(16, GRID, 0.25, seed=1), random_keep(16, GRID, 0.25, seed=2)
    per_pair = pair_lod(torch.as_tensor(a)).flatten(1).sum(1)
    assert per_pair.tolist() == [6] * 8
    assert not np.array_equal(a, b) and np.array_equal(a, random_keep(16, GRID, 0.25, seed=1))


def test_evs_keeps_the_first_pair_and_what_changed():
    merged = features(1).expand(6, *GRID, 16).clone()                     # a still video ...
    merged[3:5, 1, 2] = -merged[3:5, 1, 2]                                # ... where one cell changes in pair 3
    keep = pair_lod(torch.as_tensor(evs_keep(merged, 12, budget_share(26, merged))))   # and back in pair 5
    assert bool(keep[0].all())                                            # the first pair, whole
    assert keep[3, 1, 2] == FULL and keep[5, 1, 2] == FULL and keep[4, 1, 2] != FULL
    assert int(keep[1:].sum()) == 2                                       # nothing still is kept


def budget_share(tokens: int, merged: torch.Tensor) -> float:
    return tokens / merged[..., 0].numel()


class TestFastVID:
    def test_segments_split_at_a_cut(self):
        merged = torch.cat([features(1, seed=0).expand(4, *GRID, 16), features(1, seed=9).expand(3, *GRID, 16)])
        merged = merged + 0.01 * features(7, seed=3)
        assert segments(merged, threshold=0.9, max_segments=2) == [range(0, 4), range(4, 7)]

    def test_density_peaks_prefer_cluster_centres_over_their_members(self):
        centre = torch.tensor([[1.0, 0.0, 0.0]])
        cluster = centre + 0.05 * torch.randn(9, 3, generator=torch.Generator().manual_seed(0))
        other = torch.tensor([[0.0, 1.0, 0.0]]) + 0.05 * torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
        score = density_peaks(torch.cat([cluster, other]), k=3)
        assert int(score[:9].argmax()) in range(9) and score.topk(2).indices.tolist() != list(range(2))
        top2 = set(score.topk(2).indices.tolist())
        assert any(i < 9 for i in top2) and any(i >= 9 for i in top2)   # one peak per cluster

    def test_each_pair_gets_its_share(self):
        keep = pair_lod(torch.as_tensor(fastvid_keep(features(8), 16, 0.25)))
        assert keep.flatten(1).sum(1).tolist() == [6] * 8


def test_budgets_round_half_up_as_the_allocator_does():
    """Every count follows arr_coc.attending.retained_tokens (half up); round() would give the even
    neighbour of each .5 below: 2 for 2.5, 4 for 4.5."""
    assert budget(0.5, 5) == 3 and budget(0.25, 10) == 3 and budget(0.5, 9) == 5
    assert kept_tokens(uniform_keep(10, GRID, 0.5)) == 3 * 24             # 60 of 120 tokens: 2.5 pairs -> 3
    per_pair = pair_lod(torch.as_tensor(random_keep(4, GRID, 0.1875))).flatten(1).sum(1)
    assert per_pair.tolist() == [5, 5]                                     # 9 of 48 tokens: 4.5 a pair -> 5
    keep = pair_lod(torch.as_tensor(fastvid_keep(features(8), 16, 0.1875)))
    assert keep.flatten(1).sum(1).tolist() == [5] * 8                     # 36 of 192: 4.5 a pair -> 5
