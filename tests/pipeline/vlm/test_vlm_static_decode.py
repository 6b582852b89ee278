"""Static-cache decoding (VLM.generate): the preallocated KV cache with fixed-shape decode steps
gives what the DynamicCache loop it replaced and a full recomputation give, batched and not, and on
CUDA a replayed graph gives what the eager step gives."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from arr_coc._validate import ConfigError
from conftest import mixed_requests
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm.decoding import PACKED_SDPA, sample_next, sdpa_packed_gqa
from pipeline.vlm.generation import DONE_CHECK_EVERY
from pipeline.vlm.prefill import CACHE_BUCKET

# aten ops that read a device value on the host (or size a tensor by one): a CUDA graph cannot hold them
HOST_SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "_unique2",
                 "unique_consecutive", "equal"}


def dynamic_reference(vlm, prefixes, max_new, temperature=0.0, top_p=1.0, seed=0):
    """The loop the static cache replaced: HF's own forward with a DynamicCache, a 2-D mask grown
    by one column per step."""
    embeds, positions, pads = vlm.pool._left_pad(prefixes)
    B, L = embeds.shape[:2]
    mask = (torch.arange(L) >= torch.tensor(pads)[:, None]).long()         # (B, L)
    cache = DynamicCache(config=vlm.lm.config)
    hidden = vlm.pool._hf_lm_step(embeds, mask, positions, cache)[:, -1]
    next_pos = torch.tensor([p.next_position for p in prefixes])
    gen = torch.Generator().manual_seed(seed)
    done = torch.zeros(B, dtype=torch.bool)
    tokens, logits_all = [], []
    for step in range(max_new):
        logits = vlm.model.lm_head(hidden).float()
        logits_all.append(logits)
        token = torch.where(done, vlm.pad_token_id, sample_next(logits, temperature, top_p, gen))
        tokens.append(token)
        done |= torch.isin(token, vlm.eos_ids)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
        pos = (next_pos + step).view(1, B, 1).expand(3, B, 1)
        hidden = vlm.pool._hf_lm_step(vlm.lm.embed_tokens(token)[:, None], mask, pos, cache)[:, -1]
    return torch.stack(tokens, 1), logits_all


def mixed_prefixes(vlm):
    """Three prefixes of different lengths (one stock, two pruned), so the batch is left padded."""
    prefixes = vlm.prepare(mixed_requests(vlm, seed=20))
    assert len({p.embeds.shape[0] for p in prefixes}) == 3
    return prefixes


def assert_steps_close(got, expected, atol=2e-5, rtol=1e-4):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


class TestStaticCache:
    @pytest.mark.parametrize("temperature", [0.0, 1.3])
    def test_batched_equals_dynamic_cache_loop(self, vlm, temperature):
        prefixes = mixed_prefixes(vlm)
        out = vlm.generate(prefixes, max_new_tokens=9, temperature=temperature, top_p=0.9, seed=5,
                           return_logits=True)
        tokens, logits = dynamic_reference(vlm, prefixes, 9, temperature, 0.9, seed=5)
        assert torch.equal(out.tokens, tokens)
        assert out.tokens.shape == (3, 9) and out.lengths == [9, 9, 9]
        assert_steps_close(out.step_logits, logits)

    def test_every_row_equals_full_recomputation(self, vlm):
        prefixes = mixed_prefixes(vlm)
        out = vlm.generate(prefixes, max_new_tokens=7, return_logits=True)
        for b, prefix in enumerate(prefixes):
            reference = vlm.generator.logits_without_cache(prefix, out.tokens[b, :6])   # (7, V)
            assert_steps_close([s[b] for s in out.step_logits], list(reference))
            alone = vlm.generate([prefix], max_new_tokens=7, return_logits=True)
            assert torch.equal(alone.tokens[0], out.tokens[b])
            assert_steps_close([s[0] for s in alone.step_logits], [s[b] for s in out.step_logits])

    def test_sampling_is_seeded(self, vlm):
        prefixes = mixed_prefixes(vlm)[:2]
        a, b, c = (vlm.generate(prefixes, max_new_tokens=12, temperature=1.5, top_p=0.95, seed=s).tokens
                   for s in (3, 3, 4))
        assert torch.equal(a, b)
        assert not torch.equal(a, c)

    def test_cache_is_reused_without_leaking_between_calls(self, vlm):
        long_a, short_b = mixed_prefixes(vlm)[1:]
        first = vlm.generate([long_a], max_new_tokens=6, return_logits=True)
        decoder = vlm.pool._decoders[(1, first_len := next(k for k in vlm.pool._decoders if k[0] == 1)[1])]
        other = vlm.generate([short_b], max_new_tokens=6, return_logits=True)
        again = vlm.generate([long_a], max_new_tokens=6, return_logits=True)
        assert vlm.pool._decoders[(1, first_len)] is decoder                     # same cache, same shape
        assert torch.equal(again.tokens, first.tokens)
        assert_steps_close(again.step_logits, first.step_logits, atol=0, rtol=0)
        tokens, logits = dynamic_reference(vlm, [short_b], 6)
        assert torch.equal(other.tokens, tokens)
        assert_steps_close(other.step_logits, logits)

    def test_cache_length_is_bucketed(self, vlm):
        prefix = mixed_prefixes(vlm)[0]
        L, _ = vlm.pool._prefill_plan(prefix.embeds.shape[0])     # the cache holds the padded prefix
        for max_new in (1, CACHE_BUCKET - L % CACHE_BUCKET + 1, CACHE_BUCKET - L % CACHE_BUCKET + 2):
            decoder, _ = vlm.pool._prefill([prefix], max_new)
            assert decoder.length % CACHE_BUCKET == 0
            assert L + max_new - 1 <= decoder.length < L + max_new - 1 + CACHE_BUCKET

    def test_decode_step_has_no_host_sync_and_no_cache_copy(self, vlm):
        class OpLog(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                self.ops.append((func.overloadpacket.__name__, tuple(getattr(out, "shape", ()))))
                return out

        prefixes = mixed_prefixes(vlm)
        decoder, logits = vlm.pool._prefill(prefixes, 4)
        token = logits.argmax(-1)
        attn = vlm.lm.layers[0].self_attn
        per_query_head = (decoder.rows, attn.num_heads, decoder.length, attn.head_dim)  # what repeat_kv would make
        shapes = []
        for _ in range(3):
            with OpLog() as log:
                logits = decoder.step(token)
            shapes.append(logits.shape)
            token = logits.argmax(-1)
            names = {name for name, _ in log.ops}
            assert "mm" in names or "addmm" in names                         # the log sees the LM's ops
            assert not HOST_SYNC_OPS & names, sorted(HOST_SYNC_OPS & names)
            assert per_query_head not in {shape for _, shape in log.ops}
        assert shapes == [(3, vlm.model.config.text_config.vocab_size)] * 3

    def test_rows_finishing_early(self, vlm):
        """EOS ends a row (pad after it); the host notices all rows are done only every few steps,
        and the output is trimmed to what the every-step check gave."""
        prefixes = mixed_prefixes(vlm)
        free = vlm.generate(prefixes, max_new_tokens=DONE_CHECK_EVERY + 4)
        eos_ids = vlm.eos_ids
        # the tokens rows 0, 2 and 1 emit at steps 1, 2 and 3 become "EOS" (a row may stop earlier)
        stops = torch.unique(torch.stack([free.tokens[0, 1], free.tokens[2, 2], free.tokens[1, 3]]))
        vlm.eos_ids = stops
        try:
            out = vlm.generate(prefixes, max_new_tokens=DONE_CHECK_EVERY + 4, return_logits=True)
            tokens, logits = dynamic_reference(vlm, prefixes, DONE_CHECK_EVERY + 4)
        finally:
            vlm.eos_ids = eos_ids
        n = max(out.lengths)
        assert n <= 4 and out.lengths[0] <= 2 and out.lengths[2] <= 3
        assert torch.equal(out.tokens, tokens) and out.tokens.shape == (3, n) and len(out.step_logits) == n
        assert_steps_close(out.step_logits, logits)
        for b, length in enumerate(out.lengths):
            assert bool(torch.isin(out.tokens[b, length - 1], stops))
            assert (out.tokens[b, length:] == vlm.pad_token_id).all()

    def test_eager_attention_masks(self):
        """The eager attention implementation takes additive float masks, not boolean ones."""
        vlm = build_tiny_vlm("qwen2_vl")
        vlm.model.set_attn_implementation("eager")
        vlm = type(vlm)(vlm.model, vlm.tokenizer, family=vlm.family, name=vlm.name, config=vlm.config,
                        preprocessor=vlm.preprocessor)
        assert vlm.attn_impl == "eager"
        prefixes = mixed_prefixes(vlm)
        out = vlm.generate(prefixes, max_new_tokens=5, return_logits=True)
        for b, prefix in enumerate(prefixes):
            reference = vlm.generator.logits_without_cache(prefix, out.tokens[b, :4])
            assert_steps_close([s[b] for s in out.step_logits], list(reference))


class TestPackedAttention:
    def test_lm_uses_it_and_the_vision_tower_does_not(self, vlm):
        assert vlm.lm.config._attn_implementation == PACKED_SDPA
        assert vlm.model.config.vision_config._attn_implementation == "sdpa"

    @pytest.mark.parametrize("q_len", [1, 3])
    def test_equals_hf_sdpa(self, q_len):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        class Attn(torch.nn.Module):
            num_key_value_groups = 3

        gen = torch.Generator().manual_seed(0)
        B, H_kv, K, d = 2, 2, 40, 16
        query = torch.randn(B, 3 * H_kv, q_len, d, generator=gen)
        key, value = (torch.randn(B, H_kv, K, d, generator=gen) for _ in range(2))
        allowed = torch.rand(B, 1, q_len, K, generator=gen) > 0.3
        allowed[..., 0] = True
        module = Attn().eval()
        got, _ = sdpa_packed_gqa(module, query, key, value, allowed, scaling=0.3)
        want, _ = sdpa_attention_forward(module, query, key, value, allowed, scaling=0.3)
        assert got.shape == want.shape == (B, q_len, 3 * H_kv, d)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_config_cuda_graphs_must_be_bool():
    assert VLMConfig(cuda_graphs=False).cuda_graphs is False
    with pytest.raises(ConfigError, match="vlm.cuda_graphs"):
        VLMConfig(cuda_graphs="yes")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_graph_replay_equals_eager_step(family):
    graphed = build_tiny_vlm(family, device="cuda", config=VLMConfig(cuda_graphs=True))
    eager = build_tiny_vlm(family, device="cuda", config=VLMConfig(cuda_graphs=False))
    prefixes = mixed_prefixes(graphed)
    for p in prefixes:
        assert p.embeds.is_cuda
    calls = [(prefixes, 0.0), (prefixes[::-1], 0.0), (prefixes, 1.2), (prefixes[:1], 0.0)]
    graphs = {}
    for batch, temperature in calls:
        kw = dict(max_new_tokens=10, temperature=temperature, top_p=0.9, seed=11, return_logits=True)
        got, want = graphed.generate(batch, **kw), eager.generate(batch, **kw)
        assert torch.equal(got.tokens, want.tokens) and got.lengths == want.lengths
        assert_steps_close(got.step_logits, want.step_logits, atol=1e-4, rtol=1e-4)
        for key, decoder in graphed.pool._decoders.items():
            assert decoder.graph is not None
            assert graphs.setdefault(key, decoder.graph) is decoder.graph    # captured once per shape
        assert all(d.graph is None for d in eager.pool._decoders.values())
    assert len(graphs) == 2                                                  # batch 3 and batch 1
    one = graphed.generate(prefixes[1:], max_new_tokens=1, return_logits=True)   # no step: no capture
    assert [d.graph is None for d in graphed.pool._decoders.values()] == [False, False, True]
    assert torch.equal(one.tokens, eager.generate(prefixes[1:], max_new_tokens=1).tokens)
