"""Bucketed prefill (VLM._prefill_plan): short prefixes are left padded up to a multiple of
PREFILL_BUCKET so their shapes repeat, and on CUDA replayed as one graph per (batch, padded
length). The padding must change nothing (same logits, same greedy continuation as the unpadded
prefill), and a replayed graph must give what the eager prefill gives."""

import pytest
import torch

from arr_coc._validate import ConfigError
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm.decoding import MAX_PREFILL_GRAPHS
from pipeline.vlm.prefill import PREFILL_BUCKET
from pipeline.vlm.prefix import Prefix
from conftest import rewrap
from test_vlm_static_decode import HOST_SYNC_OPS, assert_steps_close, mixed_prefixes


def with_eager_attention(family):
    vlm = build_tiny_vlm(family)
    vlm.model.set_attn_implementation("eager")
    return rewrap(vlm)


def random_prefix(vlm, n, seed):
    """A plain LM input of n tokens (text-like positions), for lengths the tiny prompts do not reach."""
    gen = torch.Generator().manual_seed(seed)
    D = vlm.lm.config.hidden_size
    embeds = (torch.randn(n, D, generator=gen) * 0.5).to(vlm.device)
    positions = torch.arange(n, device=vlm.device).expand(3, n)
    return Prefix(embeds, positions, n, 0, 0)


class TestPlan:
    def test_lengths_round_up_to_the_bucket_below_the_threshold(self, vlm):
        small = rewrap(vlm, graph_prefill_max_tokens=256)
        got = {n: small.pool._prefill_plan(n) for n in (1, 63, 64, 65, 200, 256, 257, 1000)}
        # on the CPU nothing is replayed, but the padding is the same as on a GPU
        assert got == {1: (64, False), 63: (64, False), 64: (64, False), 65: (128, False),
                       200: (256, False), 256: (256, False), 257: (257, False), 1000: (1000, False)}
        assert rewrap(vlm, graph_prefill_max_tokens=0).pool._prefill_plan(65) == (65, False)
        assert rewrap(vlm, cuda_graphs=False).pool._prefill_plan(65) == (65, False)
        assert PREFILL_BUCKET == 64 and VLMConfig().graph_prefill_max_tokens == 2048

    def test_config_is_validated(self):
        assert VLMConfig(graph_prefill_max_tokens=0).graph_prefill_max_tokens == 0
        for bad, message in ((-1, "out of range"), (70000, "out of range"), (64.0, "integer"), (True, "integer")):
            with pytest.raises(ConfigError, match=f"vlm.graph_prefill_max_tokens.*{message}"):
                VLMConfig(graph_prefill_max_tokens=bad)


def check_bucketed_equals_unbucketed(vlm, batch, max_new=8):
    plain = rewrap(vlm, graph_prefill_max_tokens=0)
    L = max(p.embeds.shape[0] for p in batch)
    padded, _ = vlm.pool._prefill_plan(L)
    assert padded % PREFILL_BUCKET == 0 and padded > L                      # really padded further
    decoder, first = vlm.pool._prefill(batch, max_new)
    assert int(decoder.slot) == padded                                       # decoding resumes after it
    first = first.clone()
    plain_decoder, plain_first = plain.pool._prefill(batch, max_new)
    assert int(plain_decoder.slot) == L
    torch.testing.assert_close(first, plain_first, atol=2e-5, rtol=1e-4)
    got = vlm.generate(batch, max_new_tokens=max_new, return_logits=True)
    want = plain.generate(batch, max_new_tokens=max_new, return_logits=True)
    assert torch.equal(got.tokens, want.tokens) and got.lengths == want.lengths == [max_new] * len(batch)
    assert_steps_close(got.step_logits, want.step_logits)
    for b, prefix in enumerate(batch):                                       # and the uncached forward
        reference = vlm.generator.logits_without_cache(prefix, got.tokens[b, :max_new - 1])
        assert_steps_close([s[b] for s in got.step_logits], list(reference))


class TestBucketedPrefill:
    def test_batched_and_alone_equal_unbucketed(self, vlm):
        prefixes = mixed_prefixes(vlm)                                       # 73, 114 and 75 tokens
        for batch in (prefixes, prefixes[::-1], prefixes[:1], prefixes[1:2]):
            check_bucketed_equals_unbucketed(vlm, batch)

    @pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
    def test_eager_attention(self, family):
        vlm = with_eager_attention(family)
        assert vlm.attn_impl == "eager"
        check_bucketed_equals_unbucketed(vlm, mixed_prefixes(vlm), max_new=5)

    @torch.no_grad()                                    # as VLM._prefill
    def test_pad_slots_do_not_reach_real_tokens(self, vlm):
        """Whatever the extra pad slots and the padding rows of the batch bucket hold (embeddings,
        M-RoPE positions), real rows see none of it."""
        prefixes = mixed_prefixes(vlm)
        B = len(prefixes)
        padded, _ = vlm.pool._prefill_plan(max(p.embeds.shape[0] for p in prefixes), B)
        decoder, _ = vlm.pool._prefill(prefixes, 2)
        assert decoder.rows == 4                                             # one padding row
        embeds, positions, pads = vlm.pool._left_pad(prefixes, padded, decoder.rows)  # (R, L, D), (3, R, L)
        slots = torch.arange(padded)
        pad = torch.tensor(pads)
        want = decoder.prefill_forward(embeds, positions, slots, pad)       # (R, V)
        keys = [k[:, :, :padded].clone() for k in decoder.cache.keys]
        is_pad = slots < pad[:, None]                                        # (R, L)
        assert is_pad[B:].all() and not is_pad[:B].all(1).any()
        gen = torch.Generator().manual_seed(1)
        noisy_embeds = torch.where(is_pad[..., None], torch.randn(embeds.shape, generator=gen) * 3, embeds)
        noisy_pos = torch.where(is_pad, torch.randint(0, 5000, positions.shape, generator=gen), positions)
        got = decoder.prefill_forward(noisy_embeds, noisy_pos, slots, pad)
        assert torch.isfinite(got).all()                                     # padding rows too
        torch.testing.assert_close(got[:B], want[:B], atol=1e-6, rtol=1e-6)
        real = ~is_pad[:, None, :, None]                                     # (R, 1, L, 1)
        for k_new, k_old in zip(decoder.cache.keys, keys):
            torch.testing.assert_close(k_new[:, :, :padded] * real, k_old * real, atol=1e-6, rtol=1e-6)

    @torch.no_grad()                                    # as VLM._prefill
    def test_prefill_forward_has_no_host_sync(self, vlm):
        """What the graph captures: no op may read a device value on the host."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class OpNames(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.names = set()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.add(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        prefixes = mixed_prefixes(vlm)
        padded, _ = vlm.pool._prefill_plan(114)
        embeds, positions, pads = vlm.pool._left_pad(prefixes, padded)
        decoder, _ = vlm.pool._prefill(prefixes, 2)
        slots, pad = torch.arange(padded), torch.tensor(pads)
        with OpNames() as log:
            logits = decoder.prefill_forward(embeds, positions, slots, pad)
        assert logits.shape == (3, vlm.model.config.text_config.vocab_size) and logits.dtype == torch.float32
        assert "mm" in log.names or "addmm" in log.names
        assert not HOST_SYNC_OPS & log.names, sorted(HOST_SYNC_OPS & log.names)

    def test_no_graphs_on_cpu(self, vlm):
        vlm.generate(mixed_prefixes(vlm), max_new_tokens=3)
        assert all(not d.prefill_graphs and d.graph is None for d in vlm.pool._decoders.values())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestGraphReplay:
    @torch.no_grad()                                    # as VLM._prefill
    def test_replay_equals_eager_prefill(self, family):
        """Same padded inputs, same decoder: the replayed graph's logits and cache = the eager ones."""
        vlm = build_tiny_vlm(family, device="cuda")
        prefixes = mixed_prefixes(vlm)
        graphs = set()
        for batch in (prefixes, prefixes[::-1]):                             # 2nd: same graph, new inputs
            padded, graphed = vlm.pool._prefill_plan(max(p.embeds.shape[0] for p in batch), len(batch))
            assert graphed and padded == 128
            decoder, _ = vlm.pool._prefill(batch, 4)
            assert decoder.rows == 4                                         # batch 3 in bucket 4
            embeds, positions, pads = vlm.pool._left_pad(batch, padded, decoder.rows)
            want = decoder.prefill(embeds, positions, pads).clone()          # eager
            want_keys = [k[:, :, :padded].clone() for k in decoder.cache.keys]
            for k in decoder.cache.keys:
                k.zero_()
            got = decoder.prefill(embeds, positions, pads, pool=vlm.pool.graph_pool())
            assert list(decoder.prefill_graphs) == [padded]
            graphs.add(decoder.prefill_graphs[padded])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            for k, w in zip(decoder.cache.keys, want_keys):
                torch.testing.assert_close(k[:, :, :padded], w, atol=1e-5, rtol=1e-5)
        assert len(graphs) == 1

    def test_generate_equals_eager_unbucketed(self, family):
        graphed = build_tiny_vlm(family, device="cuda")
        eager = build_tiny_vlm(family, device="cuda", config=VLMConfig(graph_prefill_max_tokens=0))
        prefixes = mixed_prefixes(graphed)
        graphs = {}
        # batch 3 twice (different row order), then two different single prefixes in one bucket
        for batch in (prefixes, prefixes[::-1], prefixes[:1], prefixes[2:], prefixes[1:2]):
            kw = dict(max_new_tokens=10, seed=3, return_logits=True)
            got, want = graphed.generate(batch, **kw), eager.generate(batch, **kw)
            assert torch.equal(got.tokens, want.tokens) and got.lengths == want.lengths
            assert_steps_close(got.step_logits, want.step_logits, atol=1e-4, rtol=1e-4)
            for key, decoder in graphed.pool._decoders.items():
                for length, graph in decoder.prefill_graphs.items():
                    assert graph.graph is not None
                    assert graphs.setdefault((key, length), graph) is graph  # captured once per shape
            assert all(not d.prefill_graphs for d in eager.pool._decoders.values())
        assert sorted((key[0], length) for key, length in graphs) == [(1, 128), (4, 128)]

    def test_graphs_per_decoder_are_bounded_and_long_prefixes_eager(self, family):
        n_graphs = MAX_PREFILL_GRAPHS + 1
        top = PREFILL_BUCKET * n_graphs
        vlm = build_tiny_vlm(family, device="cuda", config=VLMConfig(graph_prefill_max_tokens=top))
        plain = rewrap(vlm, graph_prefill_max_tokens=0)
        captured = []
        # padded lengths 64..top, each with room for max_new tokens so that all share the
        # (1, 1024) decoder: one more than it keeps graphs for
        for padded in range(PREFILL_BUCKET, top + 1, PREFILL_BUCKET):
            n = padded - 10
            assert vlm.pool._prefill_plan(n) == (padded, True)
            prefix = random_prefix(vlm, n, seed=n)
            decoder, got = vlm.pool._prefill([prefix], 1025 - padded)
            assert decoder.length == 1024 and list(decoder.prefill_graphs)[-1] == padded
            captured.append(decoder.prefill_graphs[padded])
            _, want = plain.pool._prefill([prefix], 1025 - padded)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        kept = list(range(2 * PREFILL_BUCKET, top + 1, PREFILL_BUCKET))
        assert list(decoder.prefill_graphs) == kept                          # 64 was dropped
        assert len(decoder.prefill_graphs) == MAX_PREFILL_GRAPHS
        assert vlm.counters["prefill_graphs"] == n_graphs
        vlm.pool._prefill([random_prefix(vlm, 40, seed=40)], 1025 - PREFILL_BUCKET)
        assert list(decoder.prefill_graphs) == kept[1:] + [PREFILL_BUCKET]
        assert decoder.prefill_graphs[PREFILL_BUCKET] is not captured[0]     # captured again
        long = random_prefix(vlm, top + 10, seed=1)                          # past the threshold: eager
        assert vlm.pool._prefill_plan(top + 10) == (top + 10, False)
        same, got = vlm.pool._prefill([long], 1025 - (top + 10))                  # the (1, 1024) decoder too
        assert same is decoder and list(decoder.prefill_graphs) == kept[1:] + [PREFILL_BUCKET]
        torch.testing.assert_close(got, plain.pool._prefill([long], 2)[1], atol=1e-4, rtol=1e-4)


def test_bench_records_the_prefill_it_times(tmp_path):
    """bench_vlm times generate()'s own prefill: padded by default, unpadded with --eager-prefill."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_vlm.py"
    spec = importlib.util.spec_from_file_location("bench_vlm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {}
    for flags in ([], ["--eager-prefill"]):
        out = tmp_path / "bench.json"
        argv = ["--tiny", "--arch", "tiny-qwen2_vl", "--retention", "0.1", "--new-tokens", "2", "--out", str(out)]
        assert bench.main(argv + flags) == 0
        report = json.loads(out.read_text())
        assert report["graph_prefill_max_tokens"] == (0 if flags else 2048)
        rows[bool(flags)] = report["results"]
    for padded, plain in zip(rows[False], rows[True]):
        assert padded["prefix_len"] == plain["prefix_len"] == plain["prefill_len"]
        assert padded["prefill_len"] % 64 == 0 and 0 <= padded["prefill_len"] - padded["prefix_len"] < 64
        assert padded["prefill_graph"] is plain["prefill_graph"] is False       # CPU: nothing replayed
