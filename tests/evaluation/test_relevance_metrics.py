"""Relevance metrics on hand-made cases whose values are known exactly."""
import math

import pytest
import torch

from evaluation.metrics import (best_share, box_coverage, consecutive_cosine, cut_scores, distinctiveness,
                             own_object_accuracy, share_inside, top_fraction_iou)


class TestCoverage:
    def test_cell_aligned_box(self):
        cov = box_coverage(torch.tensor([[0, 0, 56, 84]]), (224, 224), (8, 8))[0]
        assert cov[:2, :3].eq(1).all() and cov.sum() == 6

    def test_partial_cells_are_fractional(self):
        # a 14-pixel box centred on the corner of four 28-pixel cells covers a quarter of each
        cov = box_coverage(torch.tensor([[21, 21, 35, 35]]), (224, 224), (8, 8))[0]
        assert torch.allclose(cov[:2, :2], torch.full((2, 2), 0.0625))
        assert math.isclose(float(cov.sum()), 14 * 14 / 28 ** 2, rel_tol=1e-6)


class TestShare:
    def test_homunculus_all_inside_the_box_scores_one(self):
        cov = box_coverage(torch.tensor([[28, 28, 112, 112]]), (224, 224), (8, 8))
        tokens = torch.zeros(1, 8, 8)
        tokens[0, 1:4, 1:3] = 1
        assert float(share_inside(tokens, cov)) == pytest.approx(1.0)

    @pytest.mark.parametrize("box", [(28, 28, 112, 112), (10, 37, 61, 200), (0, 0, 224, 30)])
    def test_uniform_scores_the_box_area_share(self, box):
        cov = box_coverage(torch.tensor([box]), (224, 224), (8, 8))
        area = (box[2] - box[0]) * (box[3] - box[1]) / 224 ** 2
        assert float(share_inside(torch.ones(1, 8, 8), cov)) == pytest.approx(area, rel=1e-5)

    def test_all_outside_scores_zero_and_half_half(self):
        cov = box_coverage(torch.tensor([[0, 0, 28, 28]]), (224, 224), (8, 8))
        tokens = torch.zeros(1, 8, 8)
        tokens[0, 7, 7] = 1
        assert float(share_inside(tokens, cov)) == 0.0
        tokens[0, 0, 0] = 1
        assert float(share_inside(tokens, cov)) == pytest.approx(0.5)

    def test_best_share_is_the_ceiling(self):
        cov = box_coverage(torch.tensor([[0, 0, 56, 28]]), (224, 224), (8, 8))  # two full cells
        assert float(best_share(cov, 2)) == pytest.approx(1.0)
        assert float(best_share(cov, 4)) == pytest.approx(0.5)


class TestIoU:
    def test_exact_match_is_one(self):
        cov = box_coverage(torch.tensor([[0, 0, 56, 196]]), (224, 224), (8, 8))  # 2 x 7 = 14 cells
        rel = torch.zeros(1, 8, 8)
        rel[0, :2, :7] = 1.0
        rel[0, 2, 0] = 0.5  # top 20% of 64 cells = 13 cells: all inside the 14-cell box
        assert float(top_fraction_iou(rel, cov)) == pytest.approx(13 / 14)

    def test_disjoint_is_zero(self):
        cov = box_coverage(torch.tensor([[0, 0, 56, 56]]), (224, 224), (8, 8))
        rel = torch.zeros(1, 8, 8)
        rel[0, 4:, 4:] = 1.0
        assert float(top_fraction_iou(rel, cov)) == 0.0


class TestQueryAwareness:
    def test_disjoint_homunculi_are_fully_distinct(self):
        h = torch.zeros(3, 8, 8)
        h[0, 0, 0] = h[1, 4, 4] = h[2, 7, 7] = 1
        assert float(distinctiveness(h)) == pytest.approx(1.0)
        assert float(distinctiveness(torch.ones(3, 8, 8))) == pytest.approx(0.0, abs=1e-7)

    def test_half_overlap(self):
        h = torch.zeros(2, 8, 8)
        h[0, 0, :2] = 1
        h[1, 0, 1:3] = 1  # cos = 1/2
        assert float(distinctiveness(h)) == pytest.approx(0.5)

    def test_own_object_accuracy(self):
        boxes = torch.tensor([[0, 0, 28, 28], [196, 196, 224, 224]])
        cov = box_coverage(boxes, (224, 224), (8, 8))
        right = torch.zeros(2, 8, 8)
        right[0, 0, 0] = right[1, 7, 7] = 1
        assert float(own_object_accuracy(right, cov)) == 1.0
        assert float(own_object_accuracy(right.flip(0), cov)) == 0.0
        assert float(own_object_accuracy(torch.ones(2, 8, 8), cov)) == 0.0  # a tie is not a hit


class TestTemporal:
    def test_consecutive_cosine(self):
        maps = torch.zeros(3, 2, 2)
        maps[0, 0, 0] = maps[1, 0, 0] = 1
        maps[2, 1, 1] = 1
        assert consecutive_cosine(maps).tolist() == pytest.approx([1.0, 0.0])

    def test_cut_scores(self):
        events = [(20, 20), (40, 48)]  # a hard cut and an 8-frame dissolve
        s = cut_scores([0, 21, 45, 60], events)
        assert (s["precision"], s["recall"]) == pytest.approx((2 / 3, 1.0))
        assert s["f1"] == pytest.approx(0.8)
        # one event is matched once, however many detections fall in it
        s = cut_scores([20, 20, 41], events)
        assert (s["tp"], s["detections"]) == (2, 3)
        assert cut_scores([], events)["recall"] == 0.0 and cut_scores([], events)["f1"] == 0.0
