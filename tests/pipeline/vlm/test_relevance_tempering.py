"""Tempering ranked by pass 1's relevance (vlm.tempering.rank: relevance) and the most-confident
fallback (vlm.tempering.fallback), on tiny random Qwen2-VL and Qwen2.5-VL models.

Pass 1's realized relevance travels with the keep map (AnswerRequest.scores,
VLM.answer_questions(scores=)), becomes one score per kept visual token (WindowPrefix.scores: a
frame pair's token the higher of its cells, a pooled token its block's best) and decides which
tokens each rung keeps: the same share of every frame pair, the most relevant first."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_frames, random_keep, record_prefills, rewrap, visual_positions

from pipeline.vlm import generation as generation_module, passes as passes_module
from pipeline.vlm_config import TemperingConfig
from pipeline.runtime.requests import AnswerRequest
from pipeline.vlm.passes import keep_best, per_frame_order
from pipeline.vlm.selection import allocation_keys, allocation_sizes, pair_lod, select_tokens, token_relevance

QUESTION = "what colour is the car on the left?"


def tempered(vlm, ladder=(0.05, 0.1, 0.25), threshold=0.5, **tempering):
    """Relevance tempering (unless `rank` says otherwise): pass 2 off, each rung the best-ranked of
    pass 1's candidates."""
    tempering.setdefault("rank", "relevance")
    return rewrap(vlm, tempering=TemperingConfig(ladder=ladder, threshold=threshold, **tempering))


def scored(frames, keep, seed=0):
    return AnswerRequest("s0", frames, keep, QUESTION, 0.0, 1.0,
                         scores=np.random.default_rng(seed).random(keep.shape).astype(np.float32))


class TestTokenRelevance:
    def test_pair_max_and_pooled_block_max_in_token_order(self):
        """A 2x3 grid, one frame pair: a full token scores the higher of its two frames' cells, a
        pooled token the best pooled cell of its block (the odd column is a 2x1 block)."""
        frame_lod = torch.tensor([[[1, 2, 0], [2, 2, 2]], [[0, 0, 0], [0, 0, 0]]], dtype=torch.int8)
        lod = frame_lod.amax(0, keepdim=True)                               # (1, 2, 3): the pair's LOD
        scores = torch.tensor([[[0.1, 0.2, 0.9], [0.3, 0.4, 0.5]],
                               [[0.6, 0.1, 0.8], [0.2, 0.7, 0.1]]])
        _, index = select_tokens(torch.zeros(1, 2, 3, 4), lod)
        assert index.tolist() == [0, 1, 5]                                   # full (0,0), anchors (0,1), (1,2)
        got = token_relevance(scores, lod, index, temporal_patch=2)
        # (0,0): max(0.1, 0.6); block {(0,1),(1,0),(1,1)} pair maxima 0.2, 0.3, 0.7; (1,2): 0.5
        torch.testing.assert_close(got, torch.tensor([0.6, 0.7, 0.5]))

    def test_window_prefix_carries_one_score_per_kept_token(self, vlm):
        frames = make_frames(4, 112, 140, seed=1)
        keep = random_keep(vlm, frames, seed=2, p=(0.4, 0.4, 0.2))
        req = scored(frames, keep)
        merged = vlm.encoder.merged_tokens([frames])[0]
        window = vlm.window_prefix(frames, keep, merged, req.scores)
        assert window.scores.shape == (window.tokens_kept,) and window.scores.dtype == torch.float32
        assert vlm.window_prefix(frames, keep, merged).scores is None
        tp = vlm.geometry.temporal_patch_size
        paired = pair_lod(torch.as_tensor(keep), tp)
        _, index = select_tokens(merged, paired)
        torch.testing.assert_close(window.scores, token_relevance(torch.as_tensor(req.scores), paired, index, tp))

    def test_scores_off_the_grid_are_refused(self, vlm):
        frames = make_frames(2, 112, 112)
        gh, gw = vlm.geometry.grid(112, 112)
        keep = np.ones((2, gh, gw), np.int64)
        with pytest.raises(ValueError, match=r"scores shape \(2, 1, 1\) does not match the VLM grid"):
            vlm.window_prefix(frames, None, vlm.encoder.merged_tokens([frames])[0], np.zeros((2, 1, 1), np.float32))
        with pytest.raises(ValueError, match=r"AnswerRequest.scores must be the keep map's shape"):
            vlm.answer_questions(frames, keep, [QUESTION], scores=np.zeros((2, gh, gw + 1), np.float32))


class TestRequestValidation:
    @pytest.mark.parametrize("scores, match", [
        (np.zeros((3, 2, 2), np.float32),
         r"AnswerRequest.scores must be the keep map's shape \(2, 2, 2\), got \(3, 2, 2\)"),
        (np.zeros((2, 2, 2), np.int64), r"AnswerRequest.scores must be floats, got int64"),
        (np.full((2, 2, 2), np.nan, np.float32), r"AnswerRequest.scores must be finite"),
        (torch.full((2, 2, 2), float("inf")), r"AnswerRequest.scores must be finite"),
        ([[[0.5]]], r"AnswerRequest.scores must be a \(T, gh, gw\) float array, got list"),
    ])
    def test_bad_scores(self, scores, match):
        frames = np.zeros((2, 8, 8, 3), np.uint8)
        with pytest.raises(ValueError, match=match):
            AnswerRequest("s", frames, np.ones((2, 2, 2), np.int64), "q?", 0.0, 1.0, scores=scores)

    def test_scores_without_a_keep_map_follow_the_frames(self):
        frames = np.zeros((2, 8, 8, 3), np.uint8)
        AnswerRequest("s", frames, None, "q?", 0.0, 1.0, scores=torch.zeros(2, 3, 3))
        with pytest.raises(ValueError, match=r"AnswerRequest.scores must be \(T=2, gh, gw\), got \(1, 3, 3\)"):
            AnswerRequest("s", frames, None, "q?", 0.0, 1.0, scores=torch.zeros(1, 3, 3))


class TestPerFrameOrder:
    def test_each_frame_gives_the_same_share_best_first(self):
        scores = torch.tensor([0.9, 0.8, 0.7, 0.1, 0.2, 0.3, 0.05, 0.5])
        frame = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
        keys = per_frame_order(scores, frame)
        assert keep_best(keys, 3).tolist() == [0, 5, 7]                      # each frame's best
        assert keep_best(keys, 6).tolist() == [0, 1, 4, 5, 6, 7]             # two of each
        assert keep_best(keys, 8).tolist() == list(range(8))

    def test_one_frame_is_plain_relevance_order(self):
        scores = torch.tensor([0.3, 0.9, 0.1, 0.5])
        keys = per_frame_order(scores, torch.zeros(4, dtype=torch.long))
        assert keep_best(keys, 2).tolist() == [1, 3]


class TestRelevanceRanking:
    def test_each_rung_keeps_the_most_relevant_tokens_of_every_frame_pair(self, vlm, monkeypatch):
        """Every cell full, frame pair 0 far more relevant than pair 1: the first rung keeps the
        same number of tokens of each pair, each pair's most relevant cells (not pair 0's only)."""
        frames = make_frames(4, 112, 140, seed=5)
        gh, gw = vlm.geometry.grid(112, 140)
        keep = np.ones((4, gh, gw), np.int64)
        scores = np.random.default_rng(6).random((4, gh, gw)).astype(np.float32)
        scores[:2] += 10.0                                                   # pair 0 outranks pair 1 everywhere
        v = tempered(vlm, ladder=(0.2, 1.0), threshold=0.0)                  # share 0.2 of the candidates
        calls = record_prefills(v, monkeypatch)
        result = v.answer([AnswerRequest("s", frames, keep, QUESTION, 0.0, 1.0, scores=scores)])[0]
        n = result.tokens_kept
        assert n == round(0.2 * 2 * gh * gw) and n % 2 == 0 and result.passes == 1
        pair = scores.reshape(2, 2, gh, gw).max(1)                           # (2, gh, gw) a token's score
        expected = np.zeros_like(keep)
        for t in range(2):
            best = np.argsort(-pair[t].ravel(), kind="stable")[: n // 2]
            expected[2 * t: 2 * t + 2].reshape(2, -1)[:, best] = 1
        merged = vlm.encoder.merged_tokens([frames])[0]
        want = vlm.question_prefix(vlm.window_prefix(frames, expected, merged), QUESTION)
        assert visual_positions(calls[0][0]) == visual_positions(want)

    def test_answer_questions_takes_the_scores(self, vlm, monkeypatch):
        """answer_questions(scores=) ranks as answer([AnswerRequest(scores=)]) does, for every question."""
        frames = make_frames(4, 112, 140, seed=7)
        keep = random_keep(vlm, frames, seed=8, p=(0.2, 0.6, 0.2))
        req = scored(frames, keep, seed=9)
        v = tempered(vlm, threshold=0.0)
        calls = record_prefills(v, monkeypatch)
        both = v.answer_questions(frames, keep, [QUESTION, "how many?"], scores=req.scores)
        single = v.answer([req])[0]
        assert len(calls) == 2
        assert visual_positions(calls[0][0]) == visual_positions(calls[0][1]) == visual_positions(calls[1][0])
        assert (both[0].text, both[0].tokens_kept) == (single.text, single.tokens_kept)
        other = scored(frames, keep, seed=10)                               # other relevance: other tokens
        v.answer([other])
        assert visual_positions(calls[2][0]) != visual_positions(calls[1][0])

    def test_without_scores_is_one_clear_error(self, vlm):
        frames = make_frames(4, 112, 140, seed=7)
        keep = random_keep(vlm, frames, seed=8, p=(0.2, 0.6, 0.2))
        with pytest.raises(ValueError, match=r"vlm.tempering.rank=relevance ranks the visual tokens by pass 1's "
                                             r"relevance, and this request has none: pass scores="):
            tempered(vlm).answer_questions(frames, keep, [QUESTION])

    def test_pass2_off_builds_no_attention_forward(self, vlm):
        v = tempered(vlm)
        assert v.config.pass2 == "off" and v.passes is not None and v.passes.text_model is None
        assert rewrap(vlm).passes is None                                    # neither pass 2 nor a ladder


class TestAllocationRanking:
    """vlm.tempering.rank: allocation: each rung answers from what ARR-COC's own allocation at that
    rung's retention keeps (arr_coc/attending.py's TokenAllocator, hard: each frame's best cells)."""

    @staticmethod
    def allocate(relevance: torch.Tensor, retention: float) -> torch.Tensor:
        from arr_coc.attending import AttendingConfig, TokenAllocator
        return TokenAllocator(AttendingConfig(retention=retention)).eval()(relevance).lod   # (T, gh, gw)

    def test_each_level_is_the_allocation_at_that_rung(self):
        g = torch.Generator().manual_seed(3)
        relevance = torch.rand(4, 6, 8, generator=g)
        relevance[1] *= 0.1                                                  # a dull frame keeps its own budget
        rungs = (0.05, 0.1, 0.25)
        keys = allocation_keys(self.allocate(relevance, 0.25), relevance, rungs)
        for k, rung in enumerate(rungs):
            own = self.allocate(relevance, rung) != 0
            assert torch.equal(keys >= len(rungs) - k, own), rung            # level <= k: kept at rung k
        assert (keys[self.allocate(relevance, 0.25) == 0] == -1).all()
        kept = keys[keys >= 0]
        assert torch.equal(kept.floor() >= 1, torch.ones_like(kept, dtype=torch.bool))

    def test_without_scores_is_one_clear_error_and_stock_is_one_pass(self, vlm):
        frames = make_frames(4, 112, 140, seed=9)
        keep = random_keep(vlm, frames, seed=10)
        v = tempered(vlm, ladder=(0.2, 0.5), threshold=1.0, rank="allocation")
        with pytest.raises(ValueError, match="rank=allocation answers each rung from pass 1's allocation"):
            v.answer([AnswerRequest("s", frames, keep, QUESTION, 0.0, 1.0)])
        stock = v.answer([AnswerRequest("s", frames, None, QUESTION, 0.0, 1.0)])[0]   # every token: one pass
        assert stock.passes == 1 and stock.tokens_kept == stock.tokens_full

    def test_sizes_count_each_rungs_tokens(self):
        keys = torch.tensor([3.2, 3.1, 2.4, 2.0, 1.3, 1.0])
        assert allocation_sizes(keys, 3) == [2, 4, 6]
        assert allocation_sizes(torch.tensor([3.0, 3.1]), 3) == [2]         # every rung keeps both: one pass
        assert allocation_sizes(torch.empty(0), 2) == [0]

    def test_rungs_answer_from_their_own_allocations(self, vlm, monkeypatch):
        frames = make_frames(4, 112, 140, seed=7)
        gh, gw = vlm.geometry.grid(112, 140)
        relevance = torch.rand(4, gh, gw, generator=torch.Generator().manual_seed(8))
        keep = self.allocate(relevance, 0.5).numpy()
        v = tempered(vlm, ladder=(0.2, 0.5), threshold=1.0, rank="allocation")   # never sure: both rungs
        calls = record_prefills(v, monkeypatch)
        result = v.answer([AnswerRequest("s", frames, keep, QUESTION, 0.0, 1.0, scores=relevance.numpy())])[0]
        assert result.passes == 2
        merged = v.encoder.merged_tokens([frames])[0]
        for call, retention in zip(calls, (0.2, 0.5)):
            own = self.allocate(relevance, retention).numpy()
            want = v.question_prefix(v.window_prefix(frames, own, merged), QUESTION)
            assert visual_positions(call[0]) == visual_positions(want), retention
        assert result.tokens_spent == sum(c[0].tokens_kept for c in calls)


class TestFallback:
    """No rung reaches the threshold (confidences stubbed 0.3, 0.6, 0.2 against 0.9)."""

    def run(self, vlm, monkeypatch, fallback):
        frames = make_frames(4, 112, 140, seed=11)
        keep = random_keep(vlm, frames, seed=12, p=(0.1, 0.7, 0.2))
        v = tempered(vlm, threshold=0.9, fallback=fallback)
        sure = iter([[0.3], [0.6], [0.2]])
        monkeypatch.setattr(generation_module, "first_token_confidence",
                            lambda logits, measure: torch.tensor(next(sure)))
        calls = record_prefills(v, monkeypatch)
        return v, v.answer([scored(frames, keep, seed=13)])[0], calls

    def test_last_answers_from_the_largest_budget(self, vlm, monkeypatch):
        _, result, calls = self.run(vlm, monkeypatch, "last")
        sizes = [c[0].tokens_kept for c in calls[:3]]
        assert sizes == sorted(sizes) and len(set(sizes)) == 3
        assert (result.passes, result.tokens_kept, result.tokens_spent) == (3, sizes[2], sum(sizes))
        assert result.confidence == pytest.approx(0.2)

    def test_most_confident_answers_from_that_pass(self, vlm, monkeypatch):
        v, result, calls = self.run(vlm, monkeypatch, "most_confident")
        sizes = [c[0].tokens_kept for c in calls[:3]]
        assert (result.passes, result.tokens_kept, result.tokens_spent) == (3, sizes[1], sum(sizes))
        assert result.confidence == pytest.approx(0.6)
        assert calls[-1][0] is calls[1][0]                                   # decoded from pass 2's prefix
        direct = vlm.generate([calls[1][0]], confidence=torch.zeros(1))      # no stubbed value used up
        assert result.text == vlm.decode(direct.tokens[0], direct.lengths[0])

    def test_an_accepted_pass_is_the_answer_either_way(self, vlm, monkeypatch):
        frames = make_frames(4, 112, 140, seed=11)
        keep = random_keep(vlm, frames, seed=12, p=(0.1, 0.7, 0.2))
        v = tempered(vlm, threshold=0.5, fallback="most_confident")
        sure = iter([[0.3], [0.6]])
        monkeypatch.setattr(generation_module, "first_token_confidence",
                            lambda logits, measure: torch.tensor(next(sure)))
        calls = record_prefills(v, monkeypatch)
        result = v.answer([scored(frames, keep, seed=13)])[0]
        assert (result.passes, result.tokens_kept) == (2, calls[1][0].tokens_kept)
        assert result.confidence == pytest.approx(0.6)


def test_yaml_off_names_the_choice():
    """--set vlm.pass2=off: YAML reads off as false, the config takes it as the choice it spells."""
    from pipeline.config import PipelineConfig
    from pipeline.configio import load_config

    cfg = load_config(PipelineConfig, None, ["vlm.pass2=off", "vlm.tempering.ladder=[0.1,0.25]"])
    assert cfg.vlm.pass2 == "off" and cfg.vlm.tempering.rank == "allocation"


class TestPass2Layer:
    """vlm.pass2_layers None: the layer the snapshot names (config.json arrcoc_pass2_layers), else 2."""

    def test_resolution(self, vlm, monkeypatch):
        from arr_coc._validate import ConfigError
        from pipeline.vlm.passes import pass2_layer

        assert rewrap(vlm).config.pass2_layers is None
        assert pass2_layer(rewrap(vlm)) == 2                                # no snapshot setting: FastV's
        monkeypatch.setattr(vlm.model.config, "arrcoc_pass2_layers", 1, raising=False)
        assert pass2_layer(rewrap(vlm)) == 1
        assert rewrap(vlm, pass2="attention").passes.layer == 1
        assert pass2_layer(rewrap(vlm, pass2_layers=0)) == 0                # the config wins
        monkeypatch.setattr(vlm.model.config, "arrcoc_pass2_layers", "last")
        with pytest.raises(ConfigError, match=r"config.json names arrcoc_pass2_layers='last': it must be a layer "
                                              r"index >= 0 \(or set vlm.pass2_layers\)"):
            pass2_layer(rewrap(vlm))


class TestAnswerConfidence:
    """vlm.tempering.confidence: answer, the least sure token of the whole answer."""

    def test_generate_reports_the_smallest_margin_of_the_answers_tokens(self, vlm):
        from pipeline.vlm.tempering import first_token_confidence
        v = rewrap(vlm, max_new_tokens=5, tempering=TemperingConfig(confidence="answer"))
        frames = make_frames(4, 112, 140, seed=3)
        prefixes = v.prepare([AnswerRequest("s", frames, None, q, 0.0, 1.0) for q in (QUESTION, "how many cars?")])
        v.eos_ids = torch.tensor([int(v.generate(prefixes[:1]).tokens[0, 2])])    # answers end at their 3rd token
        out = v.generate(prefixes, return_logits=True)
        margins = torch.stack([first_token_confidence(s, "margin") for s in out.step_logits], 1)   # (B, steps)
        for b, n in enumerate(out.lengths):
            assert out.confidence[b] == pytest.approx(float(margins[b, :n].min()), abs=1e-6)
        assert min(out.lengths) < 5, "no answer ended early: the test would not see it"
        first = rewrap(vlm, max_new_tokens=5).generate(prefixes)                      # margin: the first token's
        torch.testing.assert_close(torch.tensor(first.confidence), margins[:, 0], atol=1e-6, rtol=0)

    def test_each_pass_decodes_and_the_accepted_one_answers(self, vlm, monkeypatch):
        frames = make_frames(4, 112, 140, seed=11)
        keep = random_keep(vlm, frames, seed=12, p=(0.1, 0.7, 0.2))
        v = tempered(vlm, threshold=0.5, confidence="answer")
        runs = []
        generate_from = v.generate_from

        def stubbed(decoder, logits, batch, **kwargs):                       # confidences 0.3, then 0.6
            out = generate_from(decoder, logits, batch, **kwargs)
            runs.append(out)
            out.confidence = [0.3 if len(runs) == 1 else 0.6] * batch
            return out
        monkeypatch.setattr(v, "generate_from", stubbed)
        calls = record_prefills(v, monkeypatch)
        result = v.answer([scored(frames, keep, seed=13)])[0]
        assert (result.passes, len(calls), len(runs)) == (2, 2, 2)           # no extra generate at the end
        assert result.tokens_kept == calls[1][0].tokens_kept and result.confidence == pytest.approx(0.6)
        assert result.text == v.decode(runs[1].tokens[0], runs[1].lengths[0])
        direct = vlm.generate([calls[1][0]])
        assert result.text == vlm.decode(direct.tokens[0], direct.lengths[0])


class TestCoverage:
    """vlm.tempering.confidence: coverage, 1 - the question's attention beyond uniform over the
    candidates (pass 2's) that a rung drops: low when it dropped what the question looks at."""

    def run(self, vlm, monkeypatch, hot_kept: bool):
        frames = make_frames(4, 112, 140, seed=11)
        keep = random_keep(vlm, frames, seed=12, p=(0.1, 0.7, 0.2))
        v = tempered(vlm, ladder=(0.2, 1.0), threshold=0.5, confidence="coverage")
        seen = {}

        def attention(windows, questions):
            # a fifth of the attention spread evenly, the rest on one candidate: one the first rung
            # keeps (ranked first by pass 1's relevance) or one it drops (ranked last)
            K = windows[0].tokens_kept
            rel = windows[0].scores
            hot = int(rel.argmax()) if hot_kept else int(rel.argmin())
            a = torch.full((K,), 0.2 / K)
            a[hot] += 0.8
            seen["K"], seen["hot"] = K, hot
            return [a]
        monkeypatch.setattr(v.passes, "scores", attention)
        calls = record_prefills(v, monkeypatch)
        result = v.answer([scored(frames, keep, seed=13)])[0]
        return result, calls, seen

    def test_a_rung_keeping_what_the_question_looks_at_is_enough(self, vlm, monkeypatch):
        result, calls, seen = self.run(vlm, monkeypatch, hot_kept=True)
        n = calls[0][0].tokens_kept
        assert result.passes == 1 and n < seen["K"]
        assert result.confidence == pytest.approx(1.0)                       # no excess attention dropped

    def test_a_rung_that_dropped_it_asks_again(self, vlm, monkeypatch):
        result, calls, seen = self.run(vlm, monkeypatch, hot_kept=False)
        n = calls[0][0].tokens_kept
        assert result.passes == 2 and result.tokens_spent == n + seen["K"]
        assert result.confidence == pytest.approx(1.0)                       # the last rung keeps them all


def test_coverage_builds_the_attention_forward_without_pass2(vlm):
    v = tempered(vlm, ladder=(0.2, 1.0), confidence="coverage", rank="allocation")
    assert v.config.pass2 == "off" and v.passes.text_model is not None


def test_coverage_counts_the_excess_attention_a_rung_drops():
    from pipeline.vlm.passes import coverage
    kept = torch.tensor([0, 1])
    assert coverage(torch.full((8,), 3.0), kept) == pytest.approx(1.0)              # diffuse: nothing dropped
    assert coverage(torch.eye(8)[5] * 2.0, kept) == pytest.approx(1 / 8)             # all of it on a dropped one
    assert coverage(torch.eye(8)[1], kept) == pytest.approx(1.0)                     # on a kept one
    half = torch.tensor([0.5, 0, 0, 0, 0.5, 0, 0, 0])
    assert coverage(half, kept) == pytest.approx(1 - (0.5 - 1 / 8))
    assert coverage(torch.zeros(8), kept) == 1.0


def test_coverage_on_an_lm_without_queries_and_keys_names_the_setting(vlm, monkeypatch):
    from arr_coc._validate import ConfigError
    monkeypatch.setattr(passes_module, "unsupported", lambda lm: "a projection is not a plain nn.Linear")
    with pytest.raises(ConfigError, match=r"^vlm.tempering.confidence=coverage needs the LM's queries and keys"):
        tempered(vlm, ladder=(0.2, 1.0), confidence="coverage", rank="allocation")
    with pytest.raises(ConfigError, match=r"^vlm.pass2=attention needs the LM's queries and keys"):
        rewrap(vlm, pass2="attention")
