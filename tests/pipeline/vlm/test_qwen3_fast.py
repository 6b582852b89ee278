"""Dense Qwen3-VL through the fast engine (pipeline/vlm/model.py: static KV cache, batched prefill and
decoding, kept-token vision with DeepStack, pass 2, tempering) against transformers' own forward,
on tiny random Qwen3-VL models built here: DeepStack from vision blocks 0 and 1 into LM layers 0
and 1 (of 3), interleaved M-RoPE, the vision weights scaled up so that a patch's position and
company show in its tokens. The prompt (a timestamp per frame group) comes from the transformers-
forward VLM over the same model, whose prompt tests/pipeline/vlm/test_qwen3_vl.py holds to
transformers' processor."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import make_frames, request, rewrap

from pipeline.vlm.hf_forward import HFForwardVLM
from pipeline.vlm.kept_graph import KeptGraphs
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm.model import VLM
from pipeline.vlm.passes import narrow
from pipeline.vlm_config import TemperingConfig, VLMConfig

QUESTION = "what moves?"
ENCODES = ("all", "kept")


def build(device: str = "cpu", dtype: torch.dtype = torch.float32, **config) -> VLM:
    """The tiny dense Qwen3-VL on the fast engine, its vision weights x10 (std 0.2)."""
    vlm = build_tiny_vlm("qwen3_vl", device=device, dtype=dtype,
                         config=VLMConfig(max_new_tokens=4, kept_context=0, **config))
    with torch.no_grad():
        for p in vlm.model.model.visual.parameters():
            if p.dim() > 1:
                p.mul_(10)
    return vlm


@pytest.fixture(scope="module")
def vlm() -> VLM:
    return build()


def with_config(vlm: VLM, **fields) -> VLM:
    return rewrap(vlm, **fields)


def reference(vlm: VLM) -> HFForwardVLM:
    """transformers' forward over the same model: the unpruned prompt (as HF's processor writes it)."""
    return HFForwardVLM(vlm.model, vlm.tokenizer, family="qwen3_vl", name=vlm.name,
                        config=dataclasses.replace(vlm.config, encode="all"), preprocessor=vlm.preprocessor)


def grid_of(vlm, frames) -> tuple[int, int, int]:
    gh, gw = vlm.geometry.grid(*frames.shape[1:3])
    return -(-frames.shape[0] // vlm.geometry.temporal_patch_size), gh, gw


@torch.no_grad()
def engine_logits(vlm: VLM, reqs) -> torch.Tensor:
    """(B, V) the engine's logits of the first answer token (its batched, padded prefill)."""
    _, logits = vlm.prefill(vlm.prepare(reqs), 4)
    return logits.clone()


@torch.no_grad()
def hf_full_logits(vlm: VLM, frames, question=QUESTION) -> torch.Tensor:
    """transformers' whole forward (its tower, DeepStack, get_rope_index) on the unpruned prompt."""
    pixels, grid = vlm.preprocessor(frames, vlm.device)
    ids = reference(vlm).full_prompt_ids(question, frames.shape[0], *grid_of(vlm, frames)[1:])[None].to(vlm.device)
    out = vlm.model(input_ids=ids, pixel_values_videos=pixels, video_grid_thw=grid[None].to(vlm.device),
                    mm_token_type_ids=(ids == vlm.video_token_id).int() * 2)
    return out.logits[0, -1].float()                                        # (V,)


@torch.no_grad()
def hf_tower(vlm: VLM, frames) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' vision tower on every patch: merged tokens and DeepStack features, (N, D) each."""
    pixels, grid = vlm.preprocessor(frames, vlm.device)
    out = vlm.model.model.visual(pixels, grid_thw=grid[None].to(vlm.device), return_dict=True)
    return out.pooler_output, list(out.deepstack_features)


@torch.no_grad()
def hf_kept_logits(vlm: VLM, frames, cells: torch.Tensor, merged: torch.Tensor, deepstack: list[torch.Tensor],
                   drop_empty: bool = False, continuation=(), attention_at: int | None = None) -> torch.Tensor:
    """transformers' forward given kept tokens: the unpruned prompt less every video token not in
    `cells` (raster indices; drop_empty: less every frame group without one, timestamp and
    markers), each slot at the full prompt's position, `merged` (K, D) and `deepstack` (K, D) per
    layer handed in as the tower's outputs for those cells; continuation: ids after the prompt ->
    (1 + len(continuation), V) logits from the prompt's last slot on; attention_at: instead, LM layer
    attention_at's attention weights (H, L, L), from transformers' eager attention."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    Tp, gh, gw = grid_of(vlm, frames)
    ids = reference(vlm).full_prompt_ids(QUESTION, frames.shape[0], gh, gw).to(vlm.device)
    m = vlm.geometry.merge_size
    types = (ids == vlm.video_token_id).int() * 2
    grid = torch.tensor([[Tp, gh * m, gw * m]], device=vlm.device)
    positions, _ = vlm.model.model.get_rope_index(ids[None], types[None], video_grid_thw=grid)   # (3, 1, L)
    video = (ids == vlm.video_token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[video] = False
    keep[video[cells]] = True
    if drop_empty:
        starts = (ids == vlm.model.config.vision_start_token_id).nonzero().squeeze(1).tolist()
        ends = (ids == vlm.model.config.vision_end_token_id).nonzero().squeeze(1).tolist()
        for g in set(range(Tp)) - set((cells // (gh * gw)).tolist()):
            keep[(ends[g - 1] if g else starts[0]) + 1:ends[g] + 1] = False
    kept_ids = torch.cat([ids[keep], torch.tensor(list(continuation), dtype=torch.long, device=vlm.device)])
    pos = positions[:, 0, keep]
    after = int(pos.max()) + 1 + torch.arange(len(continuation), device=vlm.device)
    pos = torch.cat([pos, after.expand(3, -1)], 1)
    encoded = BaseModelOutputWithDeepstackFeatures(pooler_output=(merged,),
                                                   deepstack_features=[(d,) for d in deepstack])
    if attention_at is not None:
        config, impl = vlm.lm.config, vlm.lm.config._attn_implementation
        config._attn_implementation = "eager"
        try:
            out = vlm.model(input_ids=kept_ids[None], position_ids=pos[:, None], mm_encoder_outputs={"video": encoded},
                            output_attentions=True)
        finally:
            config._attn_implementation = impl
        return out.attentions[attention_at][0].float()
    out = vlm.model(input_ids=kept_ids[None], position_ids=pos[:, None], mm_encoder_outputs={"video": encoded})
    return out.logits[0, -1 - len(continuation):].float()


def keep_fraction(vlm, frames, fraction: float, seed: int, drop_pair: int | None = None) -> np.ndarray:
    """A (T, gh, gw) 0/1 keep map of about `fraction` of the cells, the same in both frames of a
    pair (a kept token is one kept cell); drop_pair: a frame pair left without a token."""
    Tp, gh, gw = grid_of(vlm, frames)
    rng = np.random.default_rng(seed)
    pairs = (rng.random((Tp, gh, gw)) < fraction).astype(np.int64)
    pairs[:, 0, 0] = 1
    if drop_pair is not None:
        pairs[drop_pair] = 0
    return np.repeat(pairs, 2, axis=0)[:frames.shape[0]]


def cells_of(keep: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(keep[::2].reshape(-1)).nonzero().squeeze(1).to(device)


def kept_features(vlm: VLM, frames, keep, encode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The kept cells' tokens and DeepStack features the engine gives the LM: transformers' tower
    rows (encode: all), or the tower over the kept patches only (kept), split per layer."""
    cells = cells_of(keep, vlm.device)
    if encode == "all":
        merged, deepstack = hf_tower(vlm, frames)
        return merged[cells], [d[cells] for d in deepstack]
    tokens = vlm.encode_cells(frames, keep).tokens                          # (K, D x 3)
    return tokens.chunk(1 + vlm.pool.deepstack, dim=-1)[0], list(tokens.chunk(1 + vlm.pool.deepstack, dim=-1)[1:])


class TestAgainstTransformers:
    @pytest.mark.parametrize("encode", ENCODES)
    @pytest.mark.parametrize("shape", [(4, 64, 96), (5, 96, 64)])          # 5 frames: the last group padded
    @pytest.mark.parametrize("fast_lm", [True, False])                     # False: transformers' text model
    def test_every_token_equals_transformers_forward(self, vlm, encode, shape, fast_lm):
        frames = make_frames(*shape, seed=1)
        got = engine_logits(with_config(vlm, encode=encode, fast_lm=fast_lm), [request(frames)])[0]
        torch.testing.assert_close(got, hf_full_logits(vlm, frames), rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("encode", ENCODES)
    @pytest.mark.parametrize("empty_groups", ["keep", "drop"])
    def test_ten_percent_equals_transformers_given_the_same_kept_tokens(self, vlm, encode, empty_groups):
        frames = make_frames(8, 96, 128, seed=2)
        keep = keep_fraction(vlm, frames, 0.1, seed=3, drop_pair=2)
        engine = with_config(vlm, encode=encode, empty_frame_groups=empty_groups)
        got = engine_logits(engine, [request(frames, keep)])[0]
        merged, deepstack = kept_features(engine, frames, keep, encode)
        want = hf_kept_logits(vlm, frames, cells_of(keep, vlm.device), merged, deepstack,
                              drop_empty=empty_groups == "drop")[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if encode == "kept":                      # the kept patches' own tower, not the whole frame's
            assert not torch.allclose(merged, hf_tower(vlm, frames)[0][cells_of(keep, vlm.device)], atol=1e-3)

    def test_kept_tower_over_every_cell_equals_transformers_tower(self, vlm):
        frames = make_frames(6, 64, 96, seed=4)
        tokens = vlm.encode_cells(frames, None).tokens
        merged, deepstack = hf_tower(vlm, frames)
        torch.testing.assert_close(tokens, torch.cat([merged, *deepstack], -1), rtol=1e-4, atol=1e-4)


    def test_padded_kept_graph_forward_equals_the_ragged_tower(self, vlm):
        """The kept tower at a graph's padded shape (run eagerly here: capture_graphs=False), its
        padding rows at grid size 1, gives the ragged tower's tokens and DeepStack features."""
        padded = with_config(vlm, encode="kept")
        padded.kept_encoder.graphs = KeptGraphs(padded.encoder._visual, padded.dtype, None, capture_graphs=False)
        frames = make_frames(6, 96, 128, seed=17)
        for seed in (18, 19):
            keep = keep_fraction(vlm, frames, 0.3, seed=seed)
            want, got = vlm.encode_cells(frames, keep), padded.encode_cells(frames, keep)
            assert torch.equal(got.index, want.index)
            torch.testing.assert_close(got.tokens, want.tokens, rtol=1e-4, atol=1e-4)
        assert padded.kept_encoder.graphs.captured >= 1


class TestDecoding:
    @pytest.mark.parametrize("fast_lm", [True, False])
    def test_cached_decode_equals_step_by_step(self, vlm, fast_lm):
        """Batched (left padded, two lengths) static-cache decoding: every step's logits equal
        transformers' uncached forward over the prompt and the tokens generated so far."""
        frames = [make_frames(4, 64, 96, seed=5), make_frames(6, 64, 96, seed=6)]
        keeps = [keep_fraction(vlm, frames[0], 0.3, seed=7), keep_fraction(vlm, frames[1], 0.2, seed=8, drop_pair=1)]
        engine = with_config(vlm, encode="all", fast_lm=fast_lm)
        out = engine.generate(engine.prepare([request(f, k) for f, k in zip(frames, keeps)]), max_new_tokens=5,
                              temperature=0.0, return_logits=True)
        for b, (f, k) in enumerate(zip(frames, keeps)):
            merged, deepstack = kept_features(engine, f, k, "all")
            n = out.lengths[b]
            want = hf_kept_logits(vlm, f, cells_of(k, vlm.device), merged, deepstack,
                                  continuation=out.tokens[b, :n - 1].tolist())  # (n, V)
            got = torch.stack([step[b] for step in out.step_logits[:n]])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    def test_questions_sharing_a_window_equal_whole_prompts(self, vlm):
        frames = make_frames(4, 64, 96, seed=9)
        keep = keep_fraction(vlm, frames, 0.4, seed=10)
        window = vlm.prepare([request(frames, keep)])[0].window
        prefixes = vlm.question_prefixes(window, ["a?", "what colour is it?", QUESTION])
        shared = vlm.generate(prefixes, max_new_tokens=3, return_logits=True)
        whole = vlm.generate([dataclasses.replace(p, window=None) for p in prefixes], max_new_tokens=3,
                             return_logits=True)
        assert torch.equal(shared.tokens, whole.tokens)
        for a, b in zip(shared.step_logits, whole.step_logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class TestDeepStack:
    @staticmethod
    def logits_with(vlm, frames, keep, merged) -> torch.Tensor:
        window = vlm.window_prefix(frames, keep, merged)
        _, logits = vlm.prefill([vlm.question_prefix(window, QUESTION)], 2)
        return logits[0].clone()

    def test_a_dropped_tokens_deepstack_feature_never_reaches_the_lm(self, vlm):
        """Noise on the DeepStack features of every dropped cell leaves the logits as they are; the
        same noise on a kept cell's feature of either layer moves them (so the check can fail)."""
        frames = make_frames(6, 64, 96, seed=11)
        keep = keep_fraction(vlm, frames, 0.3, seed=12)
        keep[2:4, 1, 1] = 2                                                   # a pooled (LOD 2) token too
        merged = vlm.encoder.merged_tokens([frames])[0]                      # (T', gh, gw, D x 3)
        D = vlm.lm.embed_tokens.embedding_dim
        want = self.logits_with(vlm, frames, keep, merged)
        dropped = torch.from_numpy(keep[::2] == 0).to(vlm.device)            # (T', gh, gw)
        pooled_block = torch.zeros_like(dropped)
        pooled_block[1, 0:2, 0:2] = True                                     # the pooled cell's 2x2 block
        noisy = merged.clone()
        noise = torch.randn_like(noisy[..., D:]) * 10
        noisy[..., D:] = torch.where((dropped & ~pooled_block)[..., None], noise, noisy[..., D:])
        torch.testing.assert_close(self.logits_with(vlm, frames, keep, noisy), want, rtol=1e-5, atol=1e-5)
        for layer in range(vlm.pool.deepstack):                              # a kept token's feature: moves
            moved = merged.clone()
            moved[0, 0, 0, D * (1 + layer):D * (2 + layer)] += 10
            assert not torch.allclose(self.logits_with(vlm, frames, keep, moved), want, atol=1e-3)


class TestPasses:
    @pytest.mark.parametrize("empty_groups", ["keep", "drop"])
    def test_narrowed_window_equals_the_window_of_the_narrower_keep(self, vlm, empty_groups):
        """Pass 2 and tempering narrow a window of candidates: the result is the window built from
        the narrower keep map (slots, positions, timestamps, DeepStack features)."""
        engine = with_config(vlm, encode="all", empty_frame_groups=empty_groups)
        frames = make_frames(6, 64, 96, seed=13)
        wide = keep_fraction(vlm, frames, 0.5, seed=14)
        merged = engine.encoder.merged_tokens([frames])[0]
        window = engine.window_prefix(frames, wide, merged)
        cells = cells_of(wide, vlm.device)
        Tp, gh, gw = grid_of(vlm, frames)
        chosen = torch.tensor([i for i, c in enumerate(cells.tolist())          # every other one, pair 1 emptied
                               if c // (gh * gw) != 1 and i % 2 == 0])
        narrow_keep = np.zeros_like(wide)
        for c in cells[chosen].tolist():
            t, h, w = c // (gh * gw), c % (gh * gw) // gw, c % gw
            narrow_keep[2 * t:2 * t + 2, h, w] = 1
        got, want = narrow(window, chosen.to(vlm.device)), engine.window_prefix(frames, narrow_keep, merged)
        assert torch.equal(got.positions, want.positions) and torch.equal(got.visual, want.visual)
        torch.testing.assert_close(got.embeds, want.embeds)
        torch.testing.assert_close(got.deepstack, want.deepstack)

    @pytest.mark.parametrize("layer", [0, 2])        # 0: no DeepStack level yet; 2: levels 0 and 1
    def test_pass2_reads_the_questions_attention_at_layer_k(self, vlm, layer):
        """Pass 2's scores are the attention the question pays each kept token at LM layer K, as
        transformers' eager attention gives it (with the DeepStack features of the layers before K)."""
        engine = with_config(vlm, encode="all", pass2="attention", pass2_layers=layer)
        frames = make_frames(6, 64, 96, seed=21)
        keep = keep_fraction(vlm, frames, 0.5, seed=22, drop_pair=1)
        window = engine.prepare([request(frames, keep)])[0].window
        got = engine.passes.scores([window], [QUESTION])[0]                 # (K,)
        merged, deepstack = kept_features(engine, frames, keep, "all")
        weights = hf_kept_logits(vlm, frames, cells_of(keep, vlm.device), merged, deepstack, attention_at=layer)
        want = weights[:, window.embeds.shape[0]:].mean((0, 1))[window.visual_slots()]   # the question's rows
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    def test_pass2_and_tempering_answer(self, vlm):
        tempering = TemperingConfig(ladder=(0.5, 1.0), threshold=1.0, rank="attention")   # never sure: both rungs
        engine = with_config(vlm, pass2="attention", tempering=tempering)
        frames = make_frames(6, 64, 96, seed=15)
        keep = keep_fraction(vlm, frames, 0.6, seed=16)
        window = engine.prepare([request(frames, keep)])[0].window
        scores = engine.passes.scores([window], [QUESTION])[0]
        assert scores.shape == (window.tokens_kept,) and torch.isfinite(scores).all() and scores.sum() > 0
        [result] = engine.answer([request(frames, keep)])
        assert result.passes == 2 and result.tokens_kept == window.tokens_kept
        assert result.tokens_spent > result.tokens_kept


# ---- CUDA: the graph / static-cache path (pytest -m cuda) ----
@pytest.fixture
def cuda_qwen3():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphed = build("cuda")
    return graphed, rewrap(graphed, cuda_graphs=False)


@pytest.mark.cuda
@torch.no_grad()
def test_on_cuda_graphed_generation_equals_eager(cuda_qwen3):
    """Prefill graphs (padded, bucketed rows), decode-step graphs and the static cache with DeepStack
    features: the same tokens and logits as the eager engine, for several batches of one shape."""
    graphed, eager = cuda_qwen3
    reqs = [request(make_frames(4, 64, 96, seed=20)),
            request(make_frames(6, 64, 96, seed=21), keep_fraction(graphed, make_frames(6, 64, 96), 0.2, seed=22)),
            request(make_frames(4, 96, 64, seed=23), keep_fraction(graphed, make_frames(4, 96, 64), 0.5, seed=24))]
    for batch in (reqs, reqs[::-1], reqs[:1]):
        got = graphed.generate(graphed.prepare(batch), max_new_tokens=6, return_logits=True)
        want = eager.generate(eager.prepare(batch), max_new_tokens=6, return_logits=True)
        assert torch.equal(got.tokens, want.tokens)
        for a, b in zip(got.step_logits, want.step_logits):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert graphed.counters["prefill_graphs"] >= 1 and graphed.counters["decode_graphs"] >= 1
    hf_lm = rewrap(graphed, fast_lm=False)       # transformers' text model: eager prefill, graphed steps
    got = hf_lm.generate(hf_lm.prepare(reqs), max_new_tokens=6, return_logits=True)
    want = eager.generate(eager.prepare(reqs), max_new_tokens=6, return_logits=True)
    assert torch.equal(got.tokens, want.tokens) and hf_lm.counters["prefill_graphs"] == 0
    for a, b in zip(got.step_logits, want.step_logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.cuda
@torch.no_grad()
def test_on_cuda_shared_window_graphs_equal_eager(cuda_qwen3):
    graphed, eager = cuda_qwen3
    frames = make_frames(4, 64, 96, seed=25)
    keep = keep_fraction(graphed, frames, 0.3, seed=26)
    questions = ["a?", QUESTION, "what colour is it?"]
    windows = [v.prepare([request(frames, keep)])[0].window for v in (graphed, eager)]
    got = graphed.generate(graphed.question_prefixes(windows[0], questions), max_new_tokens=4, return_logits=True)
    want = eager.generate([dataclasses.replace(p, window=None) for p in eager.question_prefixes(windows[1], questions)],
                          max_new_tokens=4, return_logits=True)
    assert torch.equal(got.tokens, want.tokens)
    for a, b in zip(got.step_logits, want.step_logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert any(isinstance(k, tuple) and k[0] == "window" for d in graphed.pool._decoders.values()
               for k in d.prefill_graphs)


@pytest.mark.cuda
@torch.no_grad()
def test_on_cuda_vision_graphs_equal_the_eager_tower(cuda_qwen3):
    """encode: all replays a whole-grid vision graph; encode: kept a padded kept-tower graph (bf16,
    varlen flash attention): tokens and DeepStack features as the eager towers give them."""
    graphed, eager = cuda_qwen3
    frames = make_frames(6, 64, 96, seed=27)
    got, want = graphed.encoder.merged_tokens([frames])[0], eager.encoder.merged_tokens([frames])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphed.encoder._vision_graphs.enabled and graphed.encoder._vision_graphs.captured == 1
    half = build("cuda", torch.bfloat16)
    kept, kept_eager = rewrap(half, encode="kept"), rewrap(half, encode="kept", cuda_graphs=False)
    for seed in (28, 29, 28):
        keep = keep_fraction(half, frames, 0.3, seed=seed)
        a, b = kept.encode_cells(frames, keep), kept_eager.encode_cells(frames, keep)
        assert torch.equal(a.index, b.index)
        torch.testing.assert_close(a.tokens.float(), b.tokens.float(), rtol=3e-2, atol=3e-2)
    assert kept.kept_encoder.graphs.enabled and kept.kept_encoder.graphs.captured >= 1
