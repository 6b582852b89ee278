"""Pass 2 and tempering (pipeline/vlm/passes.py) on tiny random Qwen2-VL and Qwen2.5-VL models.

The models have no semantics, so these check the wiring: pass 2's scores are the attention the
question's tokens pay each candidate in the VLM's own forward (equal to HF's eager attention
weights), they change with the question and decide the selection; candidate_factor 1 changes
nothing; tempering stops at the first confident pass and escalates while unsure."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_frames, random_keep, record_prefills, request, rewrap, visual_positions

from pipeline.vlm import generation as generation_module
from pipeline.vlm_config import TemperingConfig
from pipeline.runtime.requests import AnswerRequest, WindowQuestions
from pipeline.vlm.passes import PassEngine, blend_ranks, keep_best, narrow
from pipeline.vlm.text_model import FastTextModel

QUESTIONS = ("what colour is the car on the left?", "how many people are there?")


@pytest.fixture(scope="module")
def window_case(vlm):
    """Frames, a candidate keep map (mixed full / pooled tokens) and their window prefix."""
    frames = make_frames(4, 112, 140, seed=3)
    keep = random_keep(vlm, frames, seed=4, p=(0.4, 0.4, 0.2))
    merged = vlm.encoder.merged_tokens([frames])[0]
    return frames, keep, vlm.window_prefix(frames, keep, merged)


def on(vlm, **config):
    return rewrap(vlm, pass2="attention", **config)


def test_the_vlm_is_the_engine_passes_drive(vlm):
    """Passes knows the engine only through PassEngine; the VLM has every member it names."""
    members = set(PassEngine.__annotations__) | {n for n, v in vars(PassEngine).items()
                                                 if callable(v) and not n.startswith("_")}
    assert {"question_prefix", "prefill", "generate_from", "first_confidence", "decode"} <= members
    assert [m for m in sorted(members) if not hasattr(vlm, m)] == []


class TestAttentionInputs:
    @pytest.mark.parametrize("attn", ["sdpa", "eager"])
    def test_equal_hf_eager_attention_weights(self, vlm, attn):
        """softmax(q k^T * scaling) from attention_inputs is HF's own attention map of that layer."""
        vlm.lm.config._attn_implementation = "eager"                        # HF returns weights in eager only
        try:
            g = torch.Generator().manual_seed(0)
            embeds = torch.randn(2, 13, vlm.lm.embed_tokens.embedding_dim, generator=g)
            positions = torch.randint(0, 30, (3, 2, 13), generator=g)
            with torch.no_grad():
                maps = vlm.lm(inputs_embeds=embeds, position_ids=positions, output_attentions=True).attentions
        finally:
            vlm.lm.config._attn_implementation = vlm.attn_impl
        tm = FastTextModel(vlm.lm, attn)
        causal = torch.ones(13, 13, dtype=torch.bool).tril()
        for index in range(len(vlm.lm.layers)):
            q, k = tm.attention_inputs(embeds, None, positions, index)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            weights = (q @ k.transpose(-1, -2) * tm.layers[index].scaling).masked_fill(~causal,
                                                                                       float("-inf")).softmax(-1)
            torch.testing.assert_close(weights, maps[index], atol=1e-5, rtol=1e-5)

    def test_bad_layer_index(self, vlm):
        tm = FastTextModel(vlm.lm, vlm.attn_impl)
        with pytest.raises(ValueError, match=r"Invalid layer index \(2\): this LM has layers 0..1"):
            tm.attention_inputs(torch.zeros(1, 3, vlm.lm.embed_tokens.embedding_dim), None,
                                torch.zeros(3, 1, 3, dtype=torch.long), 2)


class TestScores:
    def test_scores_are_the_questions_attention_to_each_candidate(self, vlm, window_case):
        """For one prefix: the mean over heads and question tokens of HF's eager attention map at the
        pass-2 layer, over the candidate columns."""
        _, _, window = window_case
        v2 = on(vlm, pass2_layers=1)
        got = v2.passes.scores([window], [QUESTIONS[0]])[0]
        prefix = v2.question_prefix(window, QUESTIONS[0])
        vlm.lm.config._attn_implementation = "eager"
        try:
            with torch.no_grad():
                maps = vlm.lm(inputs_embeds=prefix.embeds[None], position_ids=prefix.positions[:, None],
                              output_attentions=True).attentions
        finally:
            vlm.lm.config._attn_implementation = vlm.attn_impl
        S, K = window.embeds.shape[0], window.tokens_kept
        expected = maps[1][0, :, S + 1:, S - K:S].mean((0, 1))             # after <|vision_end|>
        assert got.shape == (K,) and K > 8
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)

    def test_a_different_question_gives_different_scores_and_selection(self, vlm, window_case):
        _, _, window = window_case
        a, b = on(vlm).passes.scores([window, window], list(QUESTIONS))
        assert not torch.allclose(a, b, atol=1e-4)
        assert not torch.equal(keep_best(a, a.numel() // 3), keep_best(b, b.numel() // 3))

    def test_left_padding_changes_no_score(self, vlm, window_case):
        """Rows of different lengths in one forward score as they do alone."""
        frames, keep, window = window_case
        v2 = on(vlm)
        short = v2.window_prefix(frames, random_keep(vlm, frames, seed=9, p=(0.8, 0.1, 0.1)),
                                 vlm.encoder.merged_tokens([frames])[0])
        together = v2.passes.scores([window, short], list(QUESTIONS))
        for w, q, got in zip((window, short), QUESTIONS, together):
            torch.testing.assert_close(got, v2.passes.scores([w], [q])[0], atol=1e-6, rtol=1e-4)


class TestSelection:
    def test_keep_best_and_narrow(self, vlm, window_case):
        _, _, window = window_case
        scores = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.2])
        assert keep_best(scores, 2).tolist() == [1, 3]                      # best two, in token order
        assert keep_best(scores, 1).tolist() == [1]
        assert keep_best(scores, 5).tolist() == keep_best(scores, 9).tolist() == [0, 1, 2, 3, 4]
        assert keep_best(torch.zeros(0), 3).numel() == 0
        K = window.tokens_kept
        v0 = window.embeds.shape[0] - K
        keep = torch.tensor([0, 2, K - 1])
        small = narrow(window, keep)
        assert small.tokens_kept == 3 and small.tokens_full == window.tokens_full
        assert torch.equal(small.embeds, torch.cat([window.embeds[:v0], window.embeds[v0 + keep]]))
        assert torch.equal(small.positions[:, v0:], window.positions[:, v0 + keep])
        assert (small.text_start, small.max_position) == (window.text_start, window.max_position)
        assert narrow(window, torch.arange(K)) is window

    def test_pass2_keeps_its_share_of_the_candidates_by_score(self, vlm, window_case, monkeypatch):
        frames, keep, window = window_case
        v2 = on(vlm, candidate_factor=3.0)
        scores = v2.passes.scores([window], [QUESTIONS[0]])[0]
        calls = record_prefills(v2, monkeypatch)
        result = v2.answer([request(frames, keep, QUESTIONS[0])])[0]
        K = window.tokens_kept
        assert result.tokens_kept == round(K / 3) and result.tokens_full == window.tokens_full
        assert (result.passes, result.tokens_spent) == (1, result.tokens_kept)
        expected = narrow(window, keep_best(scores, round(K / 3)))
        assert visual_positions(calls[-1][0]) == visual_positions(v2.question_prefix(expected, QUESTIONS[0]))

    def test_per_frame_keeps_each_pairs_share_of_the_best_attended(self, vlm, window_case, monkeypatch):
        """vlm.pass2_per_frame: attention that favours frame pair 0 everywhere still leaves pair 1 its
        share (per_frame_order's keys); without it the window's best-attended win wherever they are."""
        frames, keep, window = window_case
        S, K = window.embeds.shape[0], window.tokens_kept
        pair = window.positions[0, S - K:]                                   # (K,) M-RoPE t of each candidate
        first = pair == pair.min()
        favour_first = torch.rand(K, generator=torch.Generator().manual_seed(0)) + 10.0 * first

        def kept_pairs(**config):
            v2 = on(vlm, candidate_factor=3.0, **config)
            monkeypatch.setattr(v2.passes, "scores", lambda windows, questions: [favour_first for _ in windows])
            calls = record_prefills(v2, monkeypatch)
            v2.answer([request(frames, keep, QUESTIONS[0])])
            return [t for t, _, _ in visual_positions(calls[-1][0])], int(pair.min())
        n = round(K / 3)
        assert n <= int(first.sum())                                         # the global pick fits in pair 0
        picked, t0 = kept_pairs()
        assert all(t == t0 for t in picked)
        picked, t0 = kept_pairs(pass2_per_frame=True)
        assert 0 < sum(t == t0 for t in picked) < len(picked)                # both pairs keep tokens

    def test_blend_ranks_mixes_the_two_orders(self):
        attention, relevance = torch.tensor([0.1, 0.5, 0.3, 0.9]), torch.tensor([4.0, 1.0, 3.0, 2.0])
        assert keep_best(blend_ranks(attention, relevance, 0.0), 2).tolist() == keep_best(attention, 2).tolist()
        assert keep_best(blend_ranks(attention, relevance, 1.0), 2).tolist() == keep_best(relevance, 2).tolist()
        torch.testing.assert_close(blend_ranks(attention, relevance, 0.5), torch.tensor([0.5, 1 / 3, 0.5, 2 / 3]))

    @pytest.mark.parametrize("weight", [0.0, 1.0])
    def test_pass2_blend_weighs_pass_1s_relevance_in(self, vlm, window_case, monkeypatch, weight):
        """vlm.pass2_blend: 0 keeps pass 2's attention order, 1 pass 1's relevance order among the
        candidates (the request's scores)."""
        frames, keep, _ = window_case
        scores = np.random.default_rng(7).random(keep.shape).astype(np.float32)
        v2 = on(vlm, candidate_factor=3.0, pass2_blend=weight)
        window = v2.window_prefix(frames, keep, vlm.encoder.merged_tokens([frames])[0], scores)
        attention = v2.passes.scores([window], [QUESTIONS[0]])[0]
        assert not torch.equal(keep_best(attention, round(window.tokens_kept / 3)),
                               keep_best(window.scores, round(window.tokens_kept / 3)))  # the two orders differ
        monkeypatch.setattr(v2.passes, "scores", lambda windows, questions: [attention for _ in windows])
        calls = record_prefills(v2, monkeypatch)
        req = AnswerRequest("s0", frames, keep, QUESTIONS[0], 0.0, 1.0, scores=scores)
        v2.answer([req])
        n = round(window.tokens_kept / 3)
        expected = narrow(window, keep_best(attention if weight == 0.0 else window.scores, n))
        assert visual_positions(calls[-1][0]) == visual_positions(v2.question_prefix(expected, QUESTIONS[0]))

    def test_attention_favouring_a_cell_gets_it_selected(self, vlm, window_case, monkeypatch):
        """Make the pass-2 layer's key of one candidate point where the question's queries do: that
        candidate is kept, though its own score was among the lowest."""
        frames, keep, window = window_case
        v2 = on(vlm, candidate_factor=4.0)
        S, K = window.embeds.shape[0], window.tokens_kept
        scores = v2.passes.scores([window], [QUESTIONS[0]])[0]
        target = int(scores.argmin())
        assert target not in keep_best(scores, round(K / 4)).tolist()
        inputs = v2.passes.text_model.attention_inputs

        def favour(embeds, mask, positions, index, deepstack=None):
            q, k = inputs(embeds, mask, positions, index, deepstack)
            H_kv, hd = k.shape[1], k.shape[3]
            toward = q[0, :, S + 1:].mean(1).view(H_kv, -1, hd).mean(1)       # (H_kv, hd) the question's queries
            k = k.clone()
            # a logit of 30 for the mean question query: that key takes nearly all its attention
            scale = 30 / (toward.square().sum(-1, keepdim=True) * v2.passes.text_model.layers[index].scaling)
            k[0, :, S - K + target] = toward * scale
            return q, k
        monkeypatch.setattr(v2.passes.text_model, "attention_inputs", favour)
        calls = record_prefills(v2, monkeypatch)
        v2.answer([request(frames, keep, QUESTIONS[0])])
        target_position = tuple(window.positions[:, S - K + target].tolist())
        assert target_position in visual_positions(calls[-1][0])

    def test_candidate_factor_one_is_a_no_op(self, vlm, window_case, monkeypatch):
        frames, keep, _ = window_case
        one = on(vlm, candidate_factor=1.0)
        monkeypatch.setattr(one.passes, "scores", lambda *a: pytest.fail("nothing to choose: no scoring"))
        reqs = [request(frames, keep, q) for q in QUESTIONS]
        for got, want in zip(one.answer(reqs), vlm.answer(reqs)):
            assert (got.text, got.tokens_kept, got.tokens_full, got.passes, got.tokens_spent) == \
                (want.text, want.tokens_kept, want.tokens_full, 1, want.tokens_kept)
        got = one.answer_questions(frames, keep, list(QUESTIONS))
        want = vlm.answer_questions(frames, keep, list(QUESTIONS))
        assert [(r.text, r.tokens_kept) for r in got] == [(r.text, r.tokens_kept) for r in want]

    def test_answer_questions_selects_per_question(self, vlm, window_case, monkeypatch):
        """One window, several questions: each keeps the tokens its own question attends to."""
        frames, keep, window = window_case
        v2 = on(vlm)
        calls = record_prefills(v2, monkeypatch)
        results = v2.answer_questions(frames, keep, list(QUESTIONS), max_batch=1)
        assert len(calls) == 2 and all(len(c) == 1 for c in calls)         # one question per generate
        assert visual_positions(calls[0][0]) != visual_positions(calls[1][0])
        assert [r.tokens_kept for r in results] == [round(window.tokens_kept / 3)] * 2
        assert all(r.latency_s > 0 and 0 <= r.confidence <= 1 for r in results)

    def test_several_windows_answer_as_each_alone(self, vlm, window_case):
        """answer_windows (a batch job's videos together) under pass 2: each question still keeps
        its own window's best-attended candidates."""
        frames, keep, _ = window_case
        v2 = on(vlm)
        jobs = [WindowQuestions(frames, keep, list(QUESTIONS)),
                WindowQuestions(np.ascontiguousarray(frames[:, ::-1]), keep, list(QUESTIONS[1:]))]
        together = v2.answer_windows(jobs)
        alone = [v2.answer_questions(j.frames, j.keep, j.questions) for j in jobs]
        assert [[(r.text, r.tokens_kept, r.passes) for r in rs] for rs in together] == \
            [[(r.text, r.tokens_kept, r.passes) for r in rs] for rs in alone]

    def test_a_window_without_candidates(self, vlm):
        frames = make_frames(2, 56, 56)
        gh, gw = vlm.geometry.grid(56, 56)
        result = on(vlm).answer([request(frames, np.zeros((2, gh, gw), np.int64), "anything?")])[0]
        assert (result.tokens_kept, result.tokens_spent, result.passes) == (0, 0, 1)


class TestTempering:
    LADDER = (0.05, 0.1, 0.25)

    def tempered(self, vlm, threshold=0.5, **tempering):
        return on(vlm, candidate_factor=3.0, tempering=TemperingConfig(ladder=self.LADDER, threshold=threshold,
                                                                       rank="attention", **tempering))

    def rung_sizes(self, v, window) -> list[int]:
        return v.passes.plan.pass_sizes(window.tokens_kept)

    def test_rung_sizes_grow_or_are_dropped(self, vlm):
        v = self.tempered(vlm)                                              # shares 1/15, 2/15, 1/3
        assert v.passes.plan.pass_sizes(30) == [2, 4, 10]
        assert v.passes.plan.pass_sizes(5) == [1, 2]                        # 0.33 -> 1, 0.67 -> 1 (again), 1.67 -> 2
        assert v.passes.plan.pass_sizes(1) == [1] and v.passes.plan.pass_sizes(0) == [0]
        assert on(vlm, candidate_factor=1.0).passes.plan.pass_sizes(7) == [7]

    def test_threshold_zero_stops_at_the_first_pass(self, vlm, window_case, monkeypatch):
        frames, keep, window = window_case
        v = self.tempered(vlm, threshold=0.0)
        calls = record_prefills(v, monkeypatch)
        result = v.answer([request(frames, keep, QUESTIONS[0])])[0]
        first = self.rung_sizes(v, window)[0]
        assert (result.passes, result.tokens_kept, result.tokens_spent) == (1, first, first)
        assert len(calls) == 1                                              # decoded from that very prefill

    def test_unsure_escalates_to_the_cap(self, vlm, window_case):
        frames, keep, window = window_case
        v = self.tempered(vlm, threshold=1.0)                               # a random model is never sure
        result = v.answer([request(frames, keep, QUESTIONS[0])])[0]
        sizes = self.rung_sizes(v, window)
        assert len(sizes) == 3 and sizes == sorted(sizes)
        assert (result.passes, result.tokens_kept, result.tokens_spent) == (3, sizes[-1], sum(sizes))
        two = self.tempered(vlm, threshold=1.0, max_passes=2)
        capped = two.answer([request(frames, keep, QUESTIONS[0])])[0]
        assert (capped.passes, capped.tokens_spent) == (2, sum(self.rung_sizes(two, window)))

    def test_stops_at_the_first_confident_pass_each(self, vlm, window_case, monkeypatch):
        """Confidence stubbed: request 0 sure at pass 1, request 1 at pass 2. Each answer is the one
        its accepted prefix gives, and the larger rungs keep pass 2's best tokens too."""
        frames, keep, window = window_case
        v = self.tempered(vlm)
        sure = iter([[0.9, 0.1], [0.8]])
        monkeypatch.setattr(generation_module, "first_token_confidence",
                            lambda logits, measure: torch.tensor(next(sure)))
        calls = record_prefills(v, monkeypatch)
        reqs = [request(frames, keep, q) for q in QUESTIONS]
        results = v.answer(reqs)
        sizes = self.rung_sizes(v, window)
        assert [(r.passes, r.tokens_kept, r.tokens_spent) for r in results] == \
            [(1, sizes[0], sizes[0]), (2, sizes[1], sizes[0] + sizes[1])]
        assert [r.confidence for r in results] == pytest.approx([0.9, 0.8])
        assert [len(c) for c in calls] == [2, 1, 2]                         # pass 1, pass 2, one decode of both
        final = calls[-1]
        assert visual_positions(calls[0][1]) < visual_positions(final[1])   # rung 2 holds rung 1's tokens
        direct = vlm.generate(final, confidence=torch.zeros(2))                 # no stubbed value used up
        assert [r.text for r in results] == [vlm.decode(direct.tokens[b], direct.lengths[b]) for b in range(2)]

    def test_a_confidence_at_the_threshold_is_accepted(self, vlm, window_case, monkeypatch):
        """Accepted means confidence >= threshold: exactly 0.5 at threshold 0.5 stops at pass 1."""
        frames, keep, window = window_case
        v = self.tempered(vlm, threshold=0.5)
        sure = iter([[0.5, 0.5]] * 3)
        monkeypatch.setattr(generation_module, "first_token_confidence",
                            lambda logits, measure: torch.tensor(next(sure)))
        results = v.answer([request(frames, keep, q) for q in QUESTIONS])
        first = self.rung_sizes(v, window)[0]
        assert [(r.passes, r.tokens_kept) for r in results] == [(1, first), (1, first)]

    def test_most_confident_breaks_a_tie_for_the_larger_budget(self, vlm, window_case, monkeypatch):
        """fallback most_confident, no pass confident enough, two passes equally sure: the answer is
        the second's (the larger budget), as vlm.tempering documents."""
        frames, keep, window = window_case
        v = self.tempered(vlm, threshold=0.9, max_passes=2, fallback="most_confident")
        sure = iter([[0.4], [0.4]])
        monkeypatch.setattr(generation_module, "first_token_confidence",
                            lambda logits, measure: torch.tensor(next(sure)))
        result = v.answer([request(frames, keep, QUESTIONS[0])])[0]
        sizes = self.rung_sizes(v, window)
        assert (result.passes, result.tokens_kept, result.tokens_spent) == (2, sizes[1], sizes[0] + sizes[1])
        assert result.confidence == pytest.approx(0.4)

    def test_generate_reports_a_first_confidence_it_is_given(self, vlm, window_case):
        """Passes hands generate the confidence it already measured: reported as given, not measured
        again, and the answers are the same."""
        frames, keep, window = window_case
        prefixes = [vlm.question_prefix(window, q) for q in QUESTIONS]
        own = vlm.generate(prefixes)
        given = vlm.generate(prefixes, confidence=torch.tensor([0.25, 0.75]))
        assert given.confidence == pytest.approx([0.25, 0.75])
        assert own.confidence == pytest.approx(vlm.first_confidence(vlm.prefill(prefixes)[1]).tolist())
        assert torch.equal(given.tokens, own.tokens) and given.lengths == own.lengths

    def test_escalate_holds_a_share_where_the_threshold_would_ask_all(self, vlm, window_case, monkeypatch):
        """vlm.tempering.escalate: with the confidences seen so far spread over [0, 1], the answer below
        their median is asked again and the one above is not, though the fixed threshold (0.9)
        asks both again (as it does without escalate)."""
        frames, keep, window = window_case
        sure = [0.3, 0.7]
        monkeypatch.setattr(generation_module, "first_token_confidence",
                            lambda logits, measure: torch.tensor(sure[:len(logits)]))
        reqs = [request(frames, keep, q) for q in QUESTIONS]
        fixed = self.tempered(vlm, threshold=0.9, max_passes=2).answer(reqs)
        assert [r.passes for r in fixed] == [2, 2]
        v = self.tempered(vlm, threshold=0.9, max_passes=2, escalate=0.5)
        v.passes.share.threshold_at(0, np.linspace(0.0, 1.0, 40).tolist())   # what earlier answers were
        held = v.answer(reqs)
        assert [r.passes for r in held] == [2, 1]
        assert [r.confidence for r in held] == pytest.approx([0.3, 0.7])
        assert len(v.passes.share._seen[0]) == 42                           # this call's confidences remembered

    def test_answer_fields_reach_the_store(self, vlm, tmp_path):
        """run_video with tempering: the answers' passes and tokens_spent land in the store."""
        from pipeline.config import PipelineConfig, RuntimeConfig
        from pipeline.vlm_config import VLMConfig
        from pipeline.config import DecodeConfig
        from pipeline.runners.run import run_video
        from sinks import read_stream, validate_store
        from sources.synthetic import Shot, render_clip, write_video

        clip = render_clip([Shot("moving_object", 12, speed=2.0)], height=192, width=256, seed=2)
        video = write_video(tmp_path / "clip.mp4", clip.frames, fps=6)
        cfg = PipelineConfig(runtime=RuntimeConfig(device="cpu", vlm=vlm.name, batch_size=4, every_s=1.0),
                             decode=DecodeConfig(process=False),
                             vlm=VLMConfig(max_new_tokens=3, pass2="attention",
                                           tempering=TemperingConfig(ladder=self.LADDER, threshold=1.0,
                                                                     rank="attention")))
        v = rewrap(vlm, **{k: getattr(cfg.vlm, k) for k in ("max_new_tokens", "pass2", "tempering")})
        result = run_video(video, "where is the square?", tmp_path / "out.zarr", cfg, vlm=v,
                           query_embedding=torch.nn.functional.normalize(torch.ones(384), dim=0))
        answers = read_stream(tmp_path / "out.zarr", result.stream_id)["answers"]
        assert len(answers["passes"]) == 2
        # the first window climbs the whole ladder; the second's candidates are few (temporal
        # redundancy: cells seen unchanged are no candidates), so its rungs may coincide
        assert answers["passes"][0] == 3 and answers["tokens_spent"][0] > answers["tokens_kept"][0]
        assert [(a.passes, a.tokens_spent) for a in result.answers] == \
            list(zip(answers["passes"].tolist(), answers["tokens_spent"].tolist()))
        validate_store(tmp_path / "out.zarr")


def test_requests_of_several_streams_are_batched_through_the_passes(vlm, window_case, monkeypatch):
    """Live mode's VLMBatcher: requests of two streams answered in one call, each from its own share."""
    from pipeline.vlm.batcher import VLMBatcher

    frames, keep, window = window_case
    v2 = on(vlm)
    calls = record_prefills(v2, monkeypatch)
    with VLMBatcher(v2, max_batch=2, max_wait_s=5.0) as batcher:
        futures = [batcher.submit(request(frames, keep, q, stream=f"cam{i}")) for i, q in enumerate(QUESTIONS)]
        results = [f.result() for f in futures]
    assert batcher.batch_sizes == [2] and [len(c) for c in calls] == [2]
    assert [r.tokens_kept for r in results] == [round(window.tokens_kept / 3)] * 2


def test_rung_budgets_count_pooled_tokens_as_one(vlm):
    """A pooled 2x2 token is one candidate: budgets are in the tokens the LM gets."""
    frames = make_frames(2, 112, 112)
    gh, gw = vlm.geometry.grid(112, 112)
    keep = np.full((2, gh, gw), 2, np.int64)                                 # every cell pooled
    window = vlm.window_prefix(frames, keep, vlm.encoder.merged_tokens([frames])[0])
    assert window.tokens_kept == -(-gh // 2) * -(-gw // 2)                   # one token per block
    result = on(vlm, candidate_factor=2.0).answer([request(frames, keep, "where?")])[0]
    assert result.tokens_kept == round(window.tokens_kept / 2)


@pytest.mark.parametrize("value, message", [(1.5, "vlm.pass2_blend=1.5 is out of range"),
                                            ("x", "vlm.pass2_blend must be a number")])
def test_pass2_blend_is_checked(value, message):
    from arr_coc._validate import ConfigError
    from pipeline.vlm_config import VLMConfig
    assert VLMConfig().pass2_blend == 0.0
    with pytest.raises(ConfigError, match=message):
        VLMConfig(pass2_blend=value)
