"""Batch buckets (batch_bucket, VLM._decoder): a batch runs in the decoder of its power-of-two bucket
(KV cache, decode graph, prefill graphs), kept within kv_cache_budget, and can be warmed up ahead
of time; the real rows give exactly what a decoder of the exact batch gives, and the padding rows
stay finite and out of reach. And the shared prefix of one window (window_prefix + question_prefix)
equals the per-question prefix built from the full ids and get_rope_index."""
import gc
import weakref

import numpy as np
import pytest
import torch

from conftest import make_frames, mixed_requests, random_keep, request
from pipeline.vlm.builtin import arch_config, build_model, build_tokenizer
from arr_coc._validate import ConfigError
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import _wrap
from pipeline.vlm.prefill import CACHE_BUCKET, KV_CACHE_BUDGET, batch_bucket
from pipeline.vlm.prefix import MAX_LAYOUTS, Prefix
from pipeline.vlm.selection import pair_lod, select_tokens
from test_vlm_graph_prefill import random_prefix, rewrap
from test_vlm_static_decode import assert_steps_close

MEASURED_MIX = [1, 4, 6, 7, 8, 9, 10, 11, 12, 3, 16, 2, 5, 13, 14, 15]   # the live-mode spread, and the rest


def unbucketed(vlm):
    plain = rewrap(vlm)
    plain.pool.bucket_batches = False
    return plain


@pytest.fixture(scope="module")
def prefixes(vlm):
    """Five prefixes of four different lengths (stock and pruned), so every batch is left padded."""
    prefixes = vlm.prepare(mixed_requests(vlm, seed=20) + mixed_requests(vlm, seed=30)[1:])
    assert len({p.embeds.shape[0] for p in prefixes}) >= 4
    return prefixes


def test_batch_bucket():
    assert [batch_bucket(b) for b in range(1, 18)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8 + [32]
    assert len({batch_bucket(b) for b in range(1, 17)}) == 5
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match=r"Invalid batch size \(.*\): must be an integer >= 1"):
            batch_bucket(bad)


class TestBucketedEqualsExact:
    @pytest.mark.parametrize("row_padded", [True, False], ids=["graph-shaped prefill", "eager prefill"])
    @pytest.mark.parametrize("n", [1, 3, 5])
    def test_greedy_tokens_and_logits(self, vlm, prefixes, n, row_padded):
        """row_padded: the prefill runs every row of the bucket (the shape a GPU replays); else it runs
        at the true batch into the first rows of the bucketed cache (padding rows too costly)."""
        prefixes = prefixes[:n]
        bucketed, plain = rewrap(vlm), unbucketed(vlm)
        if not row_padded:
            bucketed.pool.row_padded_prefill_tokens = 0
        L = max(p.embeds.shape[0] for p in prefixes)
        _, rows, _ = bucketed.pool._prefill_shape(L, n)
        assert rows == (batch_bucket(n) if row_padded else n)
        got = bucketed.generate(prefixes, max_new_tokens=8, return_logits=True)
        want = plain.generate(prefixes, max_new_tokens=8, return_logits=True)
        assert [d.rows for d in bucketed.pool._decoders.values()] == [batch_bucket(n)]
        assert [d.rows for d in plain.pool._decoders.values()] == [n]
        assert torch.equal(got.tokens, want.tokens) and got.lengths == want.lengths
        assert got.tokens.shape == (n, 8) and len(got.step_logits) == 8
        assert all(s.shape == (n, vlm.model.config.text_config.vocab_size) for s in got.step_logits)
        assert_steps_close(got.step_logits, want.step_logits)

    def test_sampling(self, vlm, prefixes):
        """Only the real rows are sampled, so the seeded draws are the exact batch's."""
        kw = dict(max_new_tokens=10, temperature=1.3, top_p=0.9, seed=4, return_logits=True)
        got, want = rewrap(vlm).generate(prefixes, **kw), unbucketed(vlm).generate(prefixes, **kw)
        assert torch.equal(got.tokens, want.tokens)
        assert_steps_close(got.step_logits, want.step_logits)

    def test_row_order_and_lengths_mix(self, vlm, prefixes):
        """Left padding of mixed prefix lengths inside a bucket: each row equals itself alone."""
        prefixes = prefixes[::-1]
        v = rewrap(vlm)
        batched = v.generate(prefixes, max_new_tokens=6, return_logits=True)
        for b, prefix in enumerate(prefixes):
            alone = v.generate([prefix], max_new_tokens=6, return_logits=True)
            assert torch.equal(alone.tokens[0], batched.tokens[b])
            assert_steps_close([s[0] for s in alone.step_logits], [s[b] for s in batched.step_logits])
        assert sorted(v.pool._decoders) == [(1, CACHE_BUCKET), (8, CACHE_BUCKET)]


class TestPaddingRows:
    @pytest.mark.parametrize("row_padded", [True, False])
    def test_are_finite_and_decode(self, vlm, prefixes, row_padded):
        v = rewrap(vlm)
        if not row_padded:
            v.pool.row_padded_prefill_tokens = 0
        decoder, _ = v.pool._prefill(prefixes, 6)
        L = int(decoder.slot)
        v.generate(prefixes, max_new_tokens=6)
        assert decoder.rows == 8 and decoder.batch == 5
        for k in decoder.cache.keys + decoder.cache.values:
            assert torch.isfinite(k).all()
        # the padding rows feed pad tokens that see only their own slots from L on
        assert (decoder.token[5:] == v.pad_token_id).all()
        assert (decoder.hole_lo[5:] == 0).all() and (decoder.hole_hi[5:] == L).all()
        assert (decoder.hole_hi[:5] < L).all() and (decoder.rope_offset[5:] == 0).all()

    def test_nan_in_padding_rows_does_not_reach_real_rows(self, vlm, prefixes):
        """Even a poisoned padding row (NaN in every slot it may not see and in its fed token's
        embedding path) leaves the real rows exactly as they were: every op is per row."""
        v = rewrap(vlm)
        v.pool.row_padded_prefill_tokens = 0                  # the prefill leaves rows 5.. as they are
        want = v.generate(prefixes, max_new_tokens=6, return_logits=True)
        decoder = next(iter(v.pool._decoders.values()))
        for k in decoder.cache.keys + decoder.cache.values:
            k[5:] = float("nan")
        got = v.generate(prefixes, max_new_tokens=6, return_logits=True)
        assert torch.equal(got.tokens, want.tokens)
        assert_steps_close(got.step_logits, want.step_logits, atol=0, rtol=0)
        assert all(torch.isfinite(s).all() for s in got.step_logits)


class TestDecoderReuse:
    def test_five_decoders_for_batches_1_to_16(self, vlm):
        """The measured live mix of batch sizes (prefixes of 40..63 tokens): one decoder per bucket,
        each reused by every later batch of its bucket; exact batches would need one per size."""
        v, plain = rewrap(vlm), unbucketed(vlm)
        seen = {}
        for i, n in enumerate(MEASURED_MIX):
            batch = [random_prefix(vlm, 40 + (i + b) % 24, seed=b) for b in range(n)]
            got = v.generate(batch, max_new_tokens=4, return_logits=True)
            decoder = v.pool._decoders[(batch_bucket(n), CACHE_BUCKET)]
            assert seen.setdefault(batch_bucket(n), decoder) is decoder
            if n in (3, 13):                             # and still the exact batch's results
                want = plain.generate(batch, max_new_tokens=4, return_logits=True)
                assert torch.equal(got.tokens, want.tokens)
                assert_steps_close(got.step_logits, want.step_logits)
        assert v.counters["decoders"] == 5 and v.counters["evicted"] == 0
        assert sorted(v.pool._decoders) == [(r, CACHE_BUCKET) for r in (1, 2, 4, 8, 16)]
        for n in MEASURED_MIX[:4]:
            plain.generate([random_prefix(vlm, 40, seed=b) for b in range(n)], max_new_tokens=4)
        assert plain.counters["decoders"] == 4 + 2                   # 3 and 13 above, then 1, 4, 6, 7

    def test_memory_budget_drops_least_recently_used(self, vlm):
        v = rewrap(vlm)
        def gen(n):
            return v.generate([random_prefix(vlm, 50, seed=b) for b in range(n)], max_new_tokens=3)
        gen(1)
        one = v.pool._decoders[(1, CACHE_BUCKET)]
        cache = one.cache.keys + one.cache.values
        assert one.nbytes == sum(t.nbytes for t in cache) == v.pool._slot_bytes * 1 * CACHE_BUCKET
        assert v.pool.kv_cache_budget == KV_CACHE_BUDGET
        v.pool.kv_cache_budget = v.pool._slot_bytes * CACHE_BUCKET * (1 + 8)      # 1, 2 and 4 fit, or 1 and 8
        gen(2), gen(3)
        assert list(v.pool._decoders) == [(1, CACHE_BUCKET), (2, CACHE_BUCKET), (4, CACHE_BUCKET)]
        gen(1)                                                       # now most recently used
        gen(5)                                                       # bucket 8 needs 8 rows: drop 2 and 4
        assert list(v.pool._decoders) == [(1, CACHE_BUCKET), (8, CACHE_BUCKET)]
        assert v.pool._decoders[(1, CACHE_BUCKET)] is one
        assert v.counters["evicted"] == 2 and v.counters["decoders"] == 4
        assert sum(d.nbytes for d in v.pool._decoders.values()) <= v.pool.kv_cache_budget
        v.pool.kv_cache_budget = 0                                        # the one in use is kept regardless
        gen(16)
        assert list(v.pool._decoders) == [(16, CACHE_BUCKET)]

    def test_a_dropped_decoder_is_freed_at_once(self, vlm):
        """Its prefill graphs refer back to it: make_room breaks that cycle, so the cache is freed
        when it is dropped, not whenever (and in whichever thread) Python's collector next runs."""
        v = rewrap(vlm)
        v.generate([random_prefix(vlm, 50, seed=0)], max_new_tokens=3)
        one = v.pool._decoders[(1, CACHE_BUCKET)]
        one._graph(64, lambda b: None, {"embeds": torch.zeros(1, 64, 8)}, pool=None)  # captured on first call
        assert len(one.prefill_graphs) == 1
        dropped = weakref.ref(one)
        del one
        was_on = gc.isenabled()
        gc.disable()
        try:
            v.pool.kv_cache_budget = 0
            v.generate([random_prefix(vlm, 50, seed=b) for b in range(2)], max_new_tokens=3)
            assert list(v.pool._decoders) == [(2, CACHE_BUCKET)] and v.counters["evicted"] == 1
            assert dropped() is None
        finally:
            if was_on:
                gc.enable()

    def test_the_budget_is_a_setting(self, vlm):
        """vlm.kv_cache_gib sets the budget (GiB); out-of-range values are one ConfigError."""
        assert VLMConfig().kv_cache_gib == 6.0 and vlm.pool.kv_cache_budget == KV_CACHE_BUDGET == 6 << 30
        assert rewrap(vlm, kv_cache_gib=0.5).pool.kv_cache_budget == 1 << 29
        assert rewrap(vlm, kv_cache_gib=0).pool.kv_cache_budget == 0
        for bad in (-1.0, 5000.0):
            with pytest.raises(ConfigError, match="vlm.kv_cache_gib"):
                VLMConfig(kv_cache_gib=bad)


class TestWarmUp:
    def test_warmed_decoders_serve_later_batches(self, vlm):
        v = rewrap(vlm)
        keys = v.warm_up(range(1, 17), [50, 300], max_new_tokens=8)
        # 50 -> padded 64 -> 64 + 7 slots -> 256; 300 -> 320 -> 512
        assert keys == [(r, length) for length in (256, 512) for r in (1, 2, 4, 8, 16)]
        assert list(v.pool._decoders) == keys and v.counters["decoders"] == 10
        fresh = rewrap(vlm)
        for n, length in ((3, 50), (9, 45), (16, 61), (1, 300), (6, 290)):
            batch = [random_prefix(vlm, length - b % 3, seed=b) for b in range(n)]
            got = v.generate(batch, max_new_tokens=8, return_logits=True)
            want = fresh.generate(batch, max_new_tokens=8, return_logits=True)  # warm-up leaves nothing behind
            assert torch.equal(got.tokens, want.tokens)
            assert_steps_close(got.step_logits, want.step_logits, atol=0, rtol=0)
        assert v.counters["decoders"] == 10 and v.counters["evicted"] == 0

    def test_budget_and_bad_arguments(self, vlm):
        v = rewrap(vlm)
        v.pool.kv_cache_budget = v.pool._slot_bytes * CACHE_BUCKET * (2 + 16)
        # buckets 1, 2, 16: the 16 rows need the room of bucket 1; then bucket 8 needs all of it
        assert v.warm_up([1, 2, 9, 16], [10], max_new_tokens=4) == [(2, 256), (16, 256)]
        assert v.warm_up([5, 6], [10], max_new_tokens=4) == [(8, 256)]
        assert v.counters["evicted"] == 3
        for args, kw, message in (([[0], [10]], {}, "batch size"), ([[2], [0]], {}, "prefix length"),
                                  ([[2], [10]], {"max_new_tokens": 0}, "max_new_tokens")):
            with pytest.raises(ValueError, match=f"Invalid {message}"):
                v.warm_up(*args, **kw)


class TestFullSizeArithmetic:
    """The numbers the memory and padding policies are argued with, from the real architectures
    (built on the meta device: no weights)."""

    @pytest.fixture(scope="class")
    @classmethod
    def full_size(cls):
        tok = build_tokenizer()
        return {arch: _wrap(build_model(arch_config(arch, tok), device="meta", dtype=torch.bfloat16), tok,
                            family, arch, VLMConfig(), {}, None)
                for arch, family in (("qwen2-vl-2b", "qwen2_vl"), ("qwen2.5-vl-7b", "qwen2_5_vl"))}

    def test_kv_bytes_and_padded_prefill_limit(self, full_size):
        small, large = full_size["qwen2-vl-2b"], full_size["qwen2.5-vl-7b"]
        assert (small.pool._slot_bytes, large.pool._slot_bytes) == (28 * 1024, 56 * 1024)
        assert KV_CACHE_BUDGET // small.pool._slot_bytes // (31 * 768) == 9        # all buckets, 9 cache lengths
        assert KV_CACHE_BUDGET // large.pool._slot_bytes // (31 * 768) == 4
        assert 4500 < small.pool.row_padded_prefill_tokens < 4700 and 880 < large.pool.row_padded_prefill_tokens < 960
        # 2B: buckets 16 / 8 / 4 padded up to 256 / 512 / 1088 tokens; a full bucket always
        assert small.pool._prefill_shape(250, 9) == (256, 16, False)
        assert small.pool._prefill_shape(300, 9) == (300, 9, False)
        assert small.pool._prefill_shape(500, 5) == (512, 8, False)
        assert small.pool._prefill_shape(1050, 3) == (1088, 4, False)
        assert small.pool._prefill_shape(1100, 3) == (1100, 3, False)
        assert small.pool._prefill_shape(2000, 16) == (2048, 16, False)
        assert small.pool._prefill_shape(2100, 16) == (2100, 16, False)           # past graph_prefill_max_tokens
        assert large.pool._prefill_shape(100, 3) == (128, 4, False)
        assert large.pool._prefill_shape(100, 7) == (100, 7, False)
        assert large.pool._prefill_shape(500, 8) == (512, 8, False)
        off = rewrap(small, cuda_graphs=False)
        assert not off.pool.bucket_batches and off.pool._prefill_shape(100, 3) == (100, 3, False)


def reference_prefix(vlm, frames, keep, question, merged) -> Prefix:
    """The per-question prefix as it was built before windows were shared: full unpruned ids, their
    positions from get_rope_index, the kept tokens cut out of both."""
    Tp, gh, gw, _ = merged.shape
    n_full = Tp * gh * gw
    lod = torch.ones(Tp, gh, gw, dtype=torch.int8) if keep is None else pair_lod(torch.as_tensor(keep))
    tokens, index = select_tokens(merged, lod)
    ids = vlm.prefixes.full_input_ids(question, n_full)
    m = vlm.geometry.merge_size
    full_pos = vlm.prefixes.rope_positions(ids, torch.tensor([Tp, gh * m, gw * m]))
    v0 = int((ids == vlm.video_token_id).nonzero()[0])
    text = vlm.lm.embed_tokens(ids)
    embeds = torch.cat([text[:v0], tokens.to(text.dtype), text[v0 + n_full:]])
    positions = torch.cat([full_pos[:, :v0], full_pos[:, v0 + index], full_pos[:, v0 + n_full:]], 1)
    return Prefix(embeds, positions, int(full_pos.max()) + 1, int(index.numel()), n_full)


QUESTIONS = ["a?", "what colour is the car on the left?", "count the people, then say what each one holds " * 3]


class TestSharedWindowPrefix:
    # (T, H, W): in recent transformers the text after the video starts at max(gh, gw), not after the
    # video's largest position; 16 frames of a 2x2 grid at 0.5 fps put Qwen2.5-VL's temporal positions
    # (spaced by 8) past the end of the text, so next_position comes from the video
    @pytest.mark.parametrize("shape", [(4, 56, 84), (5, 112, 84), (16, 56, 56)])
    @pytest.mark.parametrize("fps", [2.0, 0.5])
    def test_equals_per_question_prefix(self, vlm, shape, fps):
        v = rewrap(vlm, fps=fps)                         # Qwen2.5-VL's temporal positions scale with 1/fps
        frames = make_frames(*shape, seed=3)
        merged = v.encoder.merged_tokens([frames])[0]
        for keep in (None, random_keep(v, frames, seed=4), random_keep(v, frames, seed=5, p=(0.9, 0.05, 0.05))):
            window = v.window_prefix(frames, keep, merged)
            for question in QUESTIONS:
                got = v.question_prefix(window, question)
                want = reference_prefix(v, frames, keep, question, merged)
                assert torch.equal(got.embeds, want.embeds)
                assert torch.equal(got.positions, want.positions)
                assert (got.next_position, got.tokens_kept, got.tokens_full) == \
                       (want.next_position, want.tokens_kept, want.tokens_full)
                assert v.prefix_length(question, got.tokens_kept) == got.embeds.shape[0]

    def test_rope_index_once_per_grid(self, vlm, monkeypatch):
        v = rewrap(vlm, max_new_tokens=4)
        calls = []
        original = v.model.model.get_rope_index
        monkeypatch.setattr(v.model.model, "get_rope_index", lambda **kw: calls.append(1) or original(**kw))
        frames = make_frames(4, 56, 84, seed=6)
        keep = random_keep(v, frames, seed=7)
        first = v.answer_questions(frames, keep, QUESTIONS)
        assert len(calls) == 1                                       # one window, three questions
        again = v.answer_questions(frames, random_keep(v, frames, seed=8), QUESTIONS[:2])
        assert len(calls) == 1                                       # same grid, other keep map
        for result, question in zip(first, QUESTIONS):
            alone = v.answer([request(frames, keep, question)])[0]
            assert (result.text, result.tokens_kept) == (alone.text, alone.tokens_kept)
        assert len(calls) == 1 and len(again) == 2
        grid = next(iter(v.prefixes._layouts))
        for t in range(1, MAX_LAYOUTS + 1):                          # as many other grids as are kept
            v.prefixes._layout(t, 1, 3)
        assert (len(calls) == 1 + MAX_LAYOUTS and len(v.prefixes._layouts) == MAX_LAYOUTS
                and grid not in v.prefixes._layouts)
        v.answer_questions(frames, keep, QUESTIONS[:1])              # dropped as least recently used
        assert len(calls) == 2 + MAX_LAYOUTS

    def test_bad_keep_is_still_rejected(self, vlm):
        frames = make_frames(2, 56, 84)
        with pytest.raises(ValueError, match="does not match the VLM grid"):
            vlm.answer_questions(frames, np.ones((2, 3, 3), dtype=np.int64), ["q"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_cuda_warm_up_captures_everything_ahead(family):
    """After warm_up, the measured mix of batch sizes captures nothing more, and the replayed bucketed
    graphs give what eager decoding at the exact batch gives, with row-padded prefill graphs and
    with eager prefills at the true batch into the bucketed cache."""
    from pipeline.vlm.loading import build_tiny_vlm

    graphed = build_tiny_vlm(family, device="cuda")
    eager = build_tiny_vlm(family, device="cuda", config=VLMConfig(cuda_graphs=False))
    keys = graphed.warm_up(range(1, 17), [50, 120], max_new_tokens=8)    # padded 64 and 128, 256 slots
    assert keys == [(r, CACHE_BUCKET) for r in (1, 2, 4, 8, 16)]
    captured = dict(graphed.counters)
    assert (captured["decoders"], captured["decode_graphs"], captured["prefill_graphs"]) == (5, 5, 10)
    for row_padded_tokens in (graphed.pool.row_padded_prefill_tokens, 0):
        graphed.pool.row_padded_prefill_tokens = row_padded_tokens
        for n in MEASURED_MIX:
            batch = [random_prefix(graphed, 40 + (b * 37) % 80, seed=b) for b in range(n)]
            kw = dict(max_new_tokens=8, return_logits=True)
            got, want = graphed.generate(batch, **kw), eager.generate(batch, **kw)
            assert torch.equal(got.tokens, want.tokens) and got.lengths == want.lengths
            assert_steps_close(got.step_logits, want.step_logits, atol=1e-4, rtol=1e-4)
    assert graphed.counters == captured
