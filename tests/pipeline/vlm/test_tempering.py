"""pipeline.vlm.tempering: the first answer token's confidence, and the threshold calibrated from a
validation split's (confidence, correct) pairs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from pipeline.vlm.tempering import calibrate, first_token_confidence


class TestConfidence:
    def test_margin_is_top1_minus_top2_probability(self):
        probs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]])
        got = first_token_confidence(probs.log(), "margin")
        torch.testing.assert_close(got, torch.tensor([0.5, 0.0]), atol=1e-6, rtol=0)

    def test_entropy_is_one_when_certain_and_zero_when_flat(self):
        logits = torch.tensor([[50.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 0.0, 0.0]])
        got = first_token_confidence(logits, "entropy")
        p = torch.softmax(logits[2], 0)
        expected = 1 - float(-(p * p.log()).sum()) / math.log(4)
        torch.testing.assert_close(got, torch.tensor([1.0, 0.0, expected]), atol=1e-5, rtol=0)

    def test_scale_of_the_logits_matters_not_their_offset(self):
        logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
        for measure in ("margin", "entropy"):
            torch.testing.assert_close(first_token_confidence(logits + 7.0, measure),
                                       first_token_confidence(logits, measure))
            assert (first_token_confidence(3 * logits, measure) > first_token_confidence(logits, measure)).all()

    @pytest.mark.parametrize("logits, measure, match", [
        (torch.zeros(4), "margin", r"logits must be \(B, V\)"),
        (torch.zeros(2, 1), "margin", r"V >= 2"),
        (torch.zeros(2, 3), "top1", r"confidence measure='top1' is not supported; allowed: margin, entropy"),
    ])
    def test_bad_input(self, logits, measure, match):
        with pytest.raises(ValueError, match=match):
            first_token_confidence(logits, measure)


class TestCalibrate:
    def test_threshold_between_the_wrong_and_the_right_answers(self):
        conf = [0.1, 0.3, 0.2, 0.9, 0.6, 0.7]
        correct = [False, False, False, True, True, True]
        assert calibrate(conf, correct) == pytest.approx(0.45)

    def test_best_separation_when_they_overlap(self):
        conf = [0.2, 0.3, 0.5, 0.6, 0.7, 0.8]
        # from 0.55 on: 2 right accepted + 3 wrong asked again (5 of 6 on the right side); from
        # 0.75 on also 5 of 6 (the tie goes to the lower threshold); from 0.4 on 4 of 6
        assert calibrate(conf, [False, False, False, True, False, True]) == pytest.approx(0.55)
        # alternating: 4 of 6 at best, first reached from 0.25 on
        assert calibrate(conf, [False, True, False, True, False, True]) == pytest.approx(0.25)

    def test_all_right_accepts_everything_all_wrong_nothing(self):
        assert calibrate([0.2, 0.5], [True, True]) == 0.0
        t = calibrate([0.2, 0.5], [False, False])
        assert t > 0.5 and all(c < t for c in (0.2, 0.5))

    def test_precision_target_is_the_lowest_threshold_that_reaches_it(self):
        conf = [0.2, 0.4, 0.5, 0.8, 0.9]
        correct = [False, True, False, True, True]
        assert calibrate(conf, correct, precision=1.0) == pytest.approx(0.65)
        assert calibrate(conf, correct, precision=0.75) == pytest.approx(0.3)   # 3 of the 4 from 0.4 on
        assert calibrate(conf, correct, precision=0.5) == 0.0                    # 3 of 5
        assert calibrate([0.3, 0.6], [False, False], precision=0.5) > 0.6       # none reaches it: ask again

    def test_boundaries(self):
        """An answer exactly at a threshold is accepted, a precision met exactly is met, and of equally
        good thresholds the lower one wins (a mutant of any of those comparisons fails here)."""
        assert calibrate([0.0, 1.0], [False, True], precision=1.0) == pytest.approx(0.5)  # 0 accepts the 0.0
        conf, correct = [0.2, 0.4, 0.6, 0.8], [False, True, False, True]
        assert calibrate(conf, correct, precision=0.5) == 0.0                     # 2 of 4: exactly 0.5
        assert calibrate(conf, correct) == pytest.approx(0.3)                     # 3 of 4 from 0.3 and from 0.7

    def test_escalate_asks_again_the_least_confident_share(self):
        conf = [0.9, 0.2, 0.5, 0.4, 0.8, 0.1, 0.7, 0.3, 0.6, 0.05]
        right = [True] * 10                                                  # correctness plays no part
        t = calibrate(conf, right, escalate=0.3)
        assert t == pytest.approx(0.25) and sum(c < t for c in conf) == 3
        assert calibrate(conf, right, escalate=0.0) == 0.0
        assert all(c < calibrate(conf, right, escalate=1.0) for c in conf)
        assert sum(c < calibrate(conf, right, escalate=0.15) for c in conf) == 1   # at most 15%: one of ten
        with pytest.raises(ValueError, match="not both"):
            calibrate(conf, right, precision=0.5, escalate=0.2)

    def test_the_threshold_works_as_the_config_reads_it(self):
        from pipeline.vlm_config import TemperingConfig

        t = calibrate([0.1, 0.9], [False, True])
        assert TemperingConfig(ladder=(0.1, 0.2), threshold=t).threshold == t

    @pytest.mark.parametrize("conf, correct, kw, match", [
        ([], [], {}, "at least one"),
        ([0.5], [True, False], {}, "as many confidences as correctness flags"),
        ([1.5], [True], {}, r"confidence=1.5 is out of range"),
        ([0.5], [True], dict(precision=0.0), r"precision=0.0 is out of range"),
    ])
    def test_bad_input(self, conf, correct, kw, match):
        with pytest.raises(ValueError, match=match):
            calibrate(conf, correct, **kw)


class TestConfig:
    @pytest.mark.parametrize("values, match", [
        (dict(tempering=dict(ladder=[0.1, 0.05])), r"vlm.tempering.ladder must increase strictly, got \[0.1, 0.05\]"),
        (dict(tempering=dict(ladder=[0.0, 0.1])), r"vlm.tempering.ladder\[0\]=0.0 is out of range"),
        (dict(tempering=dict(ladder=[0.1], rank="attention")), r"vlm.tempering.rank=attention needs "
                                                               r"vlm.pass2=attention"),
        (dict(pass2="attention", tempering=dict(ladder=[0.1], rank="relevance")),
         r"vlm.tempering.rank=relevance ranks every pass's tokens by pass 1's relevance, so vlm.pass2=attention "
         r"would go unused: set vlm.pass2=off, or vlm.tempering.rank=attention"),
        (dict(tempering=dict(rank="saliency")), r"vlm.tempering.rank='saliency' is not supported; allowed: "
                                                 r"allocation, relevance, attention"),
        (dict(tempering=dict(fallback="best")), r"vlm.tempering.fallback='best' is not supported; allowed: "
                                                 r"last, most_confident"),
        (dict(pass2="attention", tempering=dict(threshold=1.5)), r"vlm.tempering.threshold=1.5 is out of range"),
        (dict(pass2="attention", tempering=dict(max_passes=0)), r"vlm.tempering.max_passes=0 is out of range"),
        (dict(pass2="attention", tempering=dict(confidence="top1")),
         r"vlm.tempering.confidence='top1' is not supported"),
        (dict(tempering=dict(escalate=1.5)), r"vlm.tempering.escalate=1.5 is out of range"),
        (dict(tempering=dict(window=0)), r"vlm.tempering.window=0 is out of range"),
        (dict(tempering=dict(window=2.5)), r"vlm.tempering.window"),
        (dict(pass2="fastv"), r"vlm.pass2='fastv' is not supported; allowed: off, attention"),
        (dict(pass2="attention", candidate_factor=0.5), r"vlm.candidate_factor=0.5 is out of range"),
        (dict(pass2="attention", pass2_layers=-1), r"vlm.pass2_layers=-1 is out of range"),
    ])
    def test_bad_values_name_the_field(self, values, match):
        from pipeline.configio import from_mapping
        from pipeline.vlm_config import VLMConfig

        with pytest.raises(ConfigError, match=match):
            from_mapping(VLMConfig, values, "vlm")

    def test_multipass(self):
        from pipeline.vlm_config import TemperingConfig, VLMConfig

        v = VLMConfig(candidate_factor=3.0, tempering=TemperingConfig(ladder=(0.05, 0.1, 0.25, 0.5), max_passes=3))
        assert v.pass2 == "off" and v.multipass and not VLMConfig().multipass


class TestEscalationShare:
    """vlm.tempering.escalate: the share asked again is held by a running quantile of the confidences."""

    def test_the_fixed_threshold_decides_until_enough_are_seen(self):
        from pipeline.vlm.tempering import MIN_SEEN, EscalationShare

        share = EscalationShare(0.25, 512, threshold=0.9)
        assert share.threshold_at(0, [0.1] * (MIN_SEEN - 1)) == 0.9
        assert share.threshold_at(0, [0.2]) != 0.9                         # MIN_SEEN seen: the quantile
        assert share.threshold_at(1, [0.5]) == 0.9                         # each rung counts its own

    def test_holds_the_share_where_a_fixed_threshold_drifts(self):
        """Confidences lower than the ones the threshold was calibrated on: the fixed threshold asks
        nearly all again, the held share a quarter of them, batch after batch."""
        from pipeline.vlm.tempering import EscalationShare

        rng = np.random.default_rng(0)
        share, asked, fixed = EscalationShare(0.25, 512, threshold=0.6), 0, 0
        batches = [rng.uniform(0.0, 0.7, 16).tolist() for _ in range(40)]
        for i, batch in enumerate(batches):
            t = share.threshold_at(0, batch)
            if i >= 2:                                                      # past the first MIN_SEEN
                asked += sum(c < t for c in batch)
                fixed += sum(c < 0.6 for c in batch)
        n = 16 * 38
        assert fixed / n > 0.8
        assert asked / n == pytest.approx(0.25, abs=0.04)

    def test_the_window_forgets_what_came_before_it(self):
        from pipeline.vlm.tempering import EscalationShare

        share = EscalationShare(0.5, 64, threshold=0.5)
        for _ in range(8):
            share.threshold_at(0, [0.9] * 16)                               # a confident stretch
        for _ in range(4):
            t = share.threshold_at(0, list(np.linspace(0.0, 0.2, 16)))     # then an unsure one: 64 of them
        assert 0.0 < t < 0.2                                                # half of the last 64 below it

    def test_share_zero_and_one(self):
        from pipeline.vlm.tempering import EscalationShare

        none, every = EscalationShare(0.0, 512, 0.5), EscalationShare(1.0, 512, 0.5)
        values = list(np.linspace(0.1, 0.9, 40))
        assert none.threshold_at(0, values) == 0.0                          # nothing below 0: none asked again
        assert every.threshold_at(0, values) > max(values)                  # every one asked again

    def test_non_finite_confidences_count_as_unsure(self):
        from pipeline.vlm.tempering import EscalationShare

        share = EscalationShare(0.5, 512, 0.5)
        t = share.threshold_at(0, [float("nan")] * 20 + [0.8] * 20)
        assert 0.0 < t < 0.8
