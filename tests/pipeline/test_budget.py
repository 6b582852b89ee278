"""pipeline.budget: one plan says what pass 1, pass 2 and every tempering rung keep, and every share
becomes a count by arr_coc.attending.retained_tokens (half up)."""
from __future__ import annotations

import pytest

from arr_coc.attending import AttendingConfig, retained_tokens
from pipeline.budget import BudgetPlan
from pipeline.vlm_config import TemperingConfig, VLMConfig

FRACTION = AttendingConfig(retention=0.1)
TOPK = AttendingConfig(selection="topk", top_k=20)


class TestPlan:
    def test_one_pass_keeps_the_configured_budget(self):
        plan = BudgetPlan.of(VLMConfig())
        assert plan == BudgetPlan() and plan.pass1(FRACTION) is FRACTION and plan.pass1(TOPK) is TOPK
        assert plan.keep == () and plan.rungs == () and plan.pass_sizes(7) == [7]

    def test_pass2_keeps_candidate_factor_times_the_budget_then_its_inverse(self):
        plan = BudgetPlan.of(VLMConfig(pass2="attention", candidate_factor=4.0))
        assert plan.keep == (0.25,) and plan.rungs == ()
        assert plan.pass1(FRACTION).retention == pytest.approx(0.4) and plan.pass1(FRACTION).selection == "fraction"
        assert plan.pass1(TOPK).top_k == 80
        assert plan.pass_sizes(40) == [10]
        one = BudgetPlan.of(VLMConfig(pass2="attention", candidate_factor=1.0))
        assert one.pass1(FRACTION) is FRACTION and one.pass_sizes(7) == [7]

    def test_topk_candidates_round_half_up(self):
        plan = BudgetPlan.of(VLMConfig(pass2="attention", candidate_factor=2.5))
        assert plan.pass1(AttendingConfig(selection="topk", top_k=3)).top_k == 8       # 7.5 -> 8 (round(): 8)
        assert plan.pass1(AttendingConfig(selection="topk", top_k=5)).top_k == 13      # 12.5 -> 13 (round(): 12)

    def test_tempering_by_attention_keeps_candidate_factor_times_the_top_rung(self):
        plan = BudgetPlan.of(VLMConfig(pass2="attention", candidate_factor=3.0, tempering=TemperingConfig(
            ladder=(0.05, 0.1, 0.25, 0.5), max_passes=3, rank="attention")))
        assert plan.share == pytest.approx(0.75) and plan.rungs == (0.05, 0.1, 0.25)     # max_passes: 3 rungs
        assert plan.keep == pytest.approx((0.05 / 0.75, 0.1 / 0.75, 0.25 / 0.75))
        a = plan.pass1(TOPK)                                                 # fraction mode, whatever the selection
        assert (a.selection, a.retention) == ("fraction", pytest.approx(0.75))

    def test_tempering_shares_are_capped_at_every_cell(self):
        plan = BudgetPlan.of(VLMConfig(pass2="attention", candidate_factor=3.0,
                                       tempering=TemperingConfig(ladder=(0.2, 0.5), rank="attention")))
        assert plan.share == 1.0 and plan.keep == pytest.approx((0.2, 0.5))

    def test_tempering_by_relevance_keeps_the_top_rung(self):
        plan = BudgetPlan.of(VLMConfig(candidate_factor=3.0,
                                       tempering=TemperingConfig(ladder=(0.05, 0.1, 0.25, 0.5), max_passes=3)))
        assert plan.share == pytest.approx(0.25) and plan.keep == pytest.approx((0.2, 0.4, 1.0))
        assert plan.pass1(FRACTION).retention == pytest.approx(0.25)


class TestPassSizes:
    PLAN = BudgetPlan(share=0.15, keep=(1 / 15, 2 / 15, 1 / 3), rungs=(0.01, 0.02, 0.05))

    def test_sizes_grow_or_are_dropped(self):
        assert self.PLAN.pass_sizes(30) == [2, 4, 10]
        assert self.PLAN.pass_sizes(5) == [1, 2]            # 0.33 -> 1, 0.67 -> 1 (again: dropped), 1.67 -> 2
        assert self.PLAN.pass_sizes(1) == [1] and self.PLAN.pass_sizes(0) == [0]

    def test_a_half_rounds_up(self):
        """A rung whose share of the candidates ends in exactly .5 keeps the larger count, as the
        allocator's own frame budget does (round() would give 2 for 2.5 and 4 for 4.5)."""
        plan = BudgetPlan(share=1.0, keep=(0.5, 1.0), rungs=(0.5, 1.0))
        assert plan.pass_sizes(5) == [3, 5] and plan.pass_sizes(9) == [5, 9]

    def test_share_one_keeps_every_candidate(self):
        assert BudgetPlan(share=0.5, keep=(0.4, 1.0), rungs=(0.2, 0.5)).pass_sizes(3) == [1, 3]


@pytest.mark.parametrize("available, retention, tokens", [
    (5, 0.5, 3), (9, 0.5, 5), (17, 0.43, 7), (10, 0.25, 3), (4, 0.125, 1), (7, 0.07, 0), (1, 1.0, 1)])
def test_retained_tokens_rounds_half_up(available, retention, tokens):
    import torch

    assert retained_tokens(available, retention) == tokens
    assert retained_tokens(torch.tensor([available]), retention).tolist() == [tokens]
