"""vlm.encode: kept: the vision tower on the kept cells only (pipeline.vlm.kept_vision), at the
stock positions, and live reuse of unchanged cells' features (pipeline.vlm.feature_cache)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import make_frames, mixed_requests, random_keep, request, rewrap
from transformers import vision_utils

from arr_coc._validate import ConfigError
from arr_coc.lod import pair_lod
from pipeline.runtime.cuda import read_back
from pipeline.vlm import hf
from pipeline.vlm.builtin import build_model, build_tokenizer, tiny_config
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.kept_graph import CELL_BUCKETS, KeptGraphs, cell_bucket
from pipeline.vlm.kept_vision import context_cells, nonzero_each, patch_positions, window_order
from pipeline.vlm.loading import _wrap
from pipeline.runtime.requests import AnswerRequest
from pipeline.vlm.selection import snap_to_windows, token_cells
from pipeline.vlm.vision_attention import varlen_attention

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
ATOL = 1e-4                  # float32 tokens of magnitude ~1 (the towers below)


def tiny(family: str, device: str = "cpu", dtype: torch.dtype = torch.float32, **vision):
    """A tiny VLM with `vlm.encode: kept` (no context ring) whose vision weights have std 0.3, not 0.02: attention
    then depends on each patch's position and company, so a wrong position or a missing
    neighbour shows in the tokens. `vision` overrides the vision config."""
    tokenizer = build_tokenizer()
    cfg = tiny_config(family, tokenizer)
    for k, v in vision.items():
        setattr(cfg.vision_config, k, v)
    model = build_model(cfg, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.vision_tower(model).named_parameters():
            if "norm" not in name and "ln_" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    # kept_context 0: these tests are about the kept cells alone (TestContext adds the ring itself)
    return _wrap(model, tokenizer, family, "tiny", VLMConfig(encode="kept", kept_context=0, max_new_tokens=6), {}, None)


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request):
    return tiny(request.param)


def kept(vlm, **config):
    """The same model behind a fresh VLM (its own counters and feature cache), encode: kept."""
    return rewrap(vlm, encode="kept", **config)


def every_patch(vlm):
    return rewrap(vlm, encode="all")


def stock_tokens(vlm, frames) -> torch.Tensor:
    with torch.no_grad():
        return vlm.encoder.merged_tokens([frames])[0]                              # (T', gh, gw, D), every patch


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=ATOL)


class TestPositions:
    """Each encoded patch gets the 2-D rotary position and window place the stock forward gives it."""

    @pytest.mark.parametrize("grid", [(2, 4, 6), (3, 5, 3)])
    def test_patch_positions_are_hfs(self, grid):
        Tp, gh, gw = grid
        stock = vision_utils.get_vision_position_ids(torch.tensor([[Tp, 2 * gh, 2 * gw]]), 2)  # (N, 2)
        cells = np.arange(Tp * gh * gw)
        assert torch.equal(torch.from_numpy(patch_positions(cells, gh, gw, 2)), stock)
        some = np.sort(np.random.default_rng(0).permutation(cells.size)[:7])
        rows = torch.from_numpy((some[:, None] * 4 + np.arange(4)).ravel())
        assert torch.equal(torch.from_numpy(patch_positions(some, gh, gw, 2)), stock[rows])

    @pytest.mark.parametrize("grid, side", [((2, 4, 6), 2), ((3, 5, 7), 2), ((1, 9, 8), 4)])
    def test_window_order_is_hfs(self, grid, side):
        Tp, gh, gw = grid
        index, cu = vision_utils.get_vision_window_index(torch.tensor([[Tp, 2 * gh, 2 * gw]]), 2, side * 28, 14)
        order, lengths = window_order(np.arange(Tp * gh * gw), gh, gw, side)
        assert torch.equal(torch.from_numpy(order), index)
        assert torch.equal(torch.nn.functional.pad(torch.from_numpy(lengths).cumsum(0) * 4, (1, 0)).int(), cu)


class TestEveryCellKept:
    def test_tokens_equal_the_stock_encoder(self, vlm):
        frames = make_frames(5, 112, 168)
        features = kept(vlm).encode_cells(frames, None)
        assert close(features.dense(), stock_tokens(vlm, frames))
        assert features.index.numel() == features.tokens.shape[0] == 3 * 4 * 6

    def test_answers_equal_encode_all(self, vlm):
        frames = make_frames(4, 84, 112, seed=3)
        keep = np.ones((4, *vlm.geometry.grid(84, 112)), dtype=np.int64)
        keep[:, 0, 0] = 2                                                    # a pooled cell: LOD 2 is kept too
        reqs = [request(frames), request(frames, keep, "what is left?")]
        a, b = every_patch(vlm).answer(reqs), kept(vlm).answer(reqs)
        assert [r.text for r in a] == [r.text for r in b]
        assert [r.tokens_kept for r in a] == [r.tokens_kept for r in b]

    def test_a_batch_of_frame_sizes_is_one_tower_call(self, vlm):
        """Videos of several sizes, stock and pruned, through one ragged call: the stock one is
        encoded as by encode: all, every request keeps the tokens it keeps there."""
        reqs = mixed_requests(vlm, seed=20)
        a, b = every_patch(vlm).answer(reqs), kept(vlm).answer(reqs)
        assert [r.tokens_kept for r in a] == [r.tokens_kept for r in b]
        assert a[0].text == b[0].text
        fresh = kept(vlm).kept_encoder.encode_many([r.frames for r in reqs], [r.keep for r in reqs])
        assert close(fresh[0].dense(), stock_tokens(vlm, reqs[0].frames))

    def test_answer_questions_encodes_the_kept_cells(self, vlm):
        frames = make_frames(4, 84, 112, seed=4)
        keep = random_keep(vlm, frames, seed=5)
        k = kept(vlm)
        results = k.answer_questions(frames, keep, ["a?", "what moves?"])
        assert len(results) == 2 and results[0].tokens_kept < results[0].tokens_full
        assert 0 < k.kept_encoder.counters["cells_encoded"] <= 2 * 3 * 4


def test_on_cuda_every_cell_kept_equals_the_graphed_tower(cuda_pair):
    """On CUDA `all` replays a vision graph; `kept` runs the tower eagerly on the gathered patches."""
    graphed, _ = cuda_pair
    frames = make_frames(6, 84, 112, seed=12)
    want = graphed.encoder.merged_tokens([frames])[0]
    assert graphed.encoder._vision_graphs.captured == 1
    torch.testing.assert_close(graphed.encode_cells(frames, None).dense(), want, rtol=1e-4, atol=1e-4)
    keep = random_keep(graphed, frames, seed=13)
    got = graphed.encode_cells(frames, keep)
    assert got.index.numel() == int(torch.from_numpy((keep.reshape(3, 2, 3, 4) != 0).any(1)).sum())
    assert graphed.encoder._vision_graphs.captured == 1                              # kept: no graph


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_kept_graphs_equal_the_eager_kept_tower(family):
    """bf16 on CUDA: kept windows of one padded shape replay one captured graph (varlen flash
    attention) and give the eager ragged tower's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vlm = tiny(family, "cuda", torch.bfloat16, **({"fullatt_block_indexes": [1]} if family == "qwen2_5_vl" else {}))
    graphed = rewrap(vlm, encode="kept", dtype="bfloat16")
    eager = rewrap(vlm, encode="kept", dtype="bfloat16", cuda_graphs=False)
    assert graphed.kept_encoder.graphs is not None and graphed.kept_encoder.graphs.enabled
    frames = make_frames(8, 112, 168, seed=50)
    graphs = graphed.kept_encoder.graphs
    for seed in (51, 52, 53, 51):
        keep = random_keep(vlm, frames, seed=seed, p=(0.6, 0.3, 0.1))
        captured = graphs.captured
        want, got = eager.encode_cells(frames, keep), graphed.encode_cells(frames, keep)
        assert torch.equal(got.index, want.index)
        torch.testing.assert_close(got.tokens.float(), want.tokens.float(), rtol=3e-2, atol=3e-2)
    assert captured == graphs.captured == len(graphs.graphs) <= 3            # the repeated shape: replayed


class TestSelection:
    def test_only_the_kept_cells_go_through_the_tower(self):
        vlm = tiny("qwen2_vl")
        frames = make_frames(4, 84, 112)
        keep = random_keep(vlm, frames, seed=1, p=(0.8, 0.1, 0.1))
        paired = (keep.reshape(2, 2, 3, 4) != 0).any(1)                     # (T', gh, gw)
        features = vlm.encode_cells(frames, keep)
        assert vlm.kept_encoder.counters["cells_encoded"] == features.index.numel() == paired.sum()
        assert torch.equal(features.index, torch.from_numpy(paired).flatten().nonzero().squeeze(1))

    def test_qwen2_vl_whole_frame_pairs_equal_stock(self):
        """Attention stays inside a frame pair: a pair kept whole is encoded exactly as in the stock
        forward, whatever is dropped from the other pairs."""
        vlm = tiny("qwen2_vl")
        frames = make_frames(6, 84, 112, seed=2)
        keep = np.zeros((6, 3, 4), dtype=np.int64)
        keep[2:4] = 1                                                        # pair 1 whole
        keep[4, 1, 2] = 1                                                    # one cell of pair 2
        features = vlm.encode_cells(frames, keep)
        stock = stock_tokens(vlm, frames)
        assert close(features.dense()[1], stock[1])
        # the lone cell of pair 2 attended to itself only: not the stock token (unkept cells are no context)
        assert not close(features.dense()[2, 1, 2], stock[2, 1, 2])

    def test_qwen2_5_whole_windows_equal_stock_in_windowed_layers(self):
        """Every block windowed: the windows holding a kept cell are encoded whole, so their tokens
        are the stock ones, however few windows are kept."""
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[])
        frames = make_frames(4, 112, 168, seed=6)                            # (T'=2, 4, 6): 2 x 6 windows of 2x2 cells
        keep = np.zeros((4, 4, 6), dtype=np.int64)
        keep[0, 0, 1] = keep[1, 3, 4] = keep[3, 2, 0] = 1                    # three windows
        features = vlm.encode_cells(frames, keep)
        assert vlm.kept_encoder.counters["cells_encoded"] == 3 * 4           # whole windows, no more
        stock = stock_tokens(vlm, frames).flatten(0, 2)
        assert features.index.tolist() == [1, 22, 24 + 12]                  # exactly the asked-for cells
        assert close(features.tokens, stock[features.index])

    def test_qwen2_5_full_attention_layers_see_the_encoded_windows_only(self):
        """With a full-attention block the kept windows' tokens miss the other windows' context (the
        documented deviation), unless every window of the pair is encoded."""
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[1])
        frames = make_frames(2, 112, 168, seed=6)
        keep = np.zeros((2, 4, 6), dtype=np.int64)
        keep[0, 0, 1] = 1
        stock = stock_tokens(vlm, frames).flatten(0, 2)
        assert not close(vlm.encode_cells(frames, keep).tokens, stock[[1]])
        assert close(vlm.encode_cells(frames, np.ones_like(keep)).tokens, stock)

    def test_qwen2_5_kept_windows_cells_encodes_the_kept_cells_only(self):
        """vlm.kept_windows: cells: no window is completed; a window kept whole is still the stock
        one in windowed-only blocks, a lone kept cell sees itself only."""
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[])
        cells = kept(vlm, kept_windows="cells")
        frames = make_frames(4, 112, 168, seed=6)                            # (T'=2, 4, 6): windows of 2x2 cells
        keep = np.zeros((4, 4, 6), dtype=np.int64)
        keep[0, 0:2, 0:2] = 1                                                # one window whole
        keep[1, 3, 4] = 1                                                    # one cell of another
        features = cells.encode_cells(frames, keep)
        assert cells.kept_encoder.counters["cells_encoded"] == 5 == features.index.numel()
        stock = stock_tokens(vlm, frames).flatten(0, 2)
        whole = [0, 1, 6, 7]
        assert close(features.tokens[:4], stock[whole])
        assert features.index[4] == 22 and not close(features.tokens[4], stock[22])
        assert kept(vlm).encode_cells(frames, keep).index.numel() == 5       # whole: 8 encoded, 5 returned

    def test_nothing_kept_encodes_nothing(self, vlm):
        k = kept(vlm)
        frames = make_frames(2, 56, 56)
        features = k.encode_cells(frames, np.zeros((2, 2, 2), dtype=np.int64))
        assert features.tokens.shape == (0, k.lm.embed_tokens.embedding_dim)
        assert k.kept_encoder.counters["cells_encoded"] == 0
        assert k.answer([request(frames, np.zeros((2, 2, 2), dtype=np.int64))])[0].tokens_kept == 0

    def test_a_keep_map_off_the_grid_is_one_clear_error(self, vlm):
        with pytest.raises(ValueError, match=r"keep map shape \(2, 3, 3\) does not match the VLM grid \(2, 2, 2\)"):
            kept(vlm).encode_cells(make_frames(2, 56, 56), np.ones((2, 3, 3), dtype=np.int64))


class TestContext:
    """vlm.kept_context: the cells around each kept cell go through the tower as context and are
    dropped afterwards; the LM gets the kept cells' tokens, computed with their surroundings."""

    def test_context_cells_are_a_clipped_square_around_each_kept_cell(self):
        wanted = torch.zeros(2, 4, 5, dtype=torch.bool)
        wanted[0, 0, 0] = wanted[1, 2, 3] = True
        ring = context_cells(wanted, 1)
        assert ring[0].nonzero().tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]          # cut by the corner
        assert ring[1].sum() == 9 and ring[1, 1:4, 2:5].all()                           # no spill across pairs
        assert torch.equal(context_cells(wanted, 0), wanted)
        assert context_cells(wanted, 4).all(dim=(1, 2)).tolist() == [True, True]

    def test_the_lm_gets_only_the_kept_cells(self):
        vlm = tiny("qwen2_vl")
        frames = make_frames(4, 84, 112, seed=3)                              # (T'=2, 3, 4)
        keep = np.zeros((4, 3, 4), dtype=np.int64)
        keep[0, 0, 0] = keep[3, 1, 2] = 1
        ctx = kept(vlm, kept_context=1)
        features = ctx.encode_cells(frames, keep)
        assert features.index.tolist() == [0, 12 + 6]                          # the kept cells, no more
        assert ctx.kept_encoder.counters["cells_encoded"] == 4 + 9            # with their rings
        result = ctx.answer([request(frames, keep)])[0]
        assert result.tokens_kept == 2

    def test_context_brings_the_kept_tokens_to_the_stock_ones(self):
        """Qwen2-VL attends within a frame pair: a ring covering the pair makes the kept tokens the
        stock tokens exactly; a smaller ring moves them toward the stock ones."""
        vlm = tiny("qwen2_vl")
        frames = make_frames(2, 84, 112, seed=4)                              # (T'=1, 3, 4)
        keep = np.zeros((2, 3, 4), dtype=np.int64)
        keep[0, 1, 1] = 1
        stock = stock_tokens(vlm, frames)[0, 1, 1]
        alone = kept(vlm).encode_cells(frames, keep).tokens[0]
        ring = kept(vlm, kept_context=1).encode_cells(frames, keep).tokens[0]
        whole = kept(vlm, kept_context=3).encode_cells(frames, keep).tokens[0]
        assert close(whole, stock) and not close(alone, stock)
        assert (ring - stock).norm() < (alone - stock).norm()

    def test_qwen2_5_completes_the_windows_of_the_ring(self):
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[])
        frames = make_frames(2, 112, 168, seed=6)                             # (T'=1, 4, 6): windows of 2x2
        keep = np.zeros((2, 4, 6), dtype=np.int64)
        keep[0, 1, 1] = 1                                                     # ring 0-2 x 0-2: 4 windows
        ctx = kept(vlm, kept_context=1)
        features = ctx.encode_cells(frames, keep)
        assert ctx.kept_encoder.counters["cells_encoded"] == 16 and features.index.tolist() == [7]
        assert close(features.tokens, stock_tokens(vlm, frames).flatten(0, 2)[[7]])


class TestSnapWindows:
    """vlm.snap_windows: each frame pair's tokens gathered into whole windows."""

    def test_each_pair_keeps_its_count_in_its_best_windows(self):
        g = torch.Generator().manual_seed(4)
        T, gh, gw, side = 5, 6, 7, 2                                          # odd frames, edge windows cut
        keep = torch.randint(0, 3, (T, gh, gw), generator=g)
        scores = torch.rand(T, gh, gw, generator=g)
        snapped = snap_to_windows(keep, scores, side)
        assert snapped.shape == keep.shape and snapped.dtype == keep.dtype
        assert set(snapped.unique().tolist()) <= {0, 1}                       # full tokens only
        assert torch.equal(snapped[0], snapped[1]) and torch.equal(snapped[2], snapped[3])
        before, after = pair_lod(keep), pair_lod(snapped)
        assert torch.equal(token_cells(after).flatten(1).sum(1), token_cells(before).flatten(1).sum(1))
        relevance = torch.cat([scores, scores[-1:]]).view(3, 2, gh, gw).amax(1)
        for p in range(3):
            wins = {}
            for h in range(gh):
                for w in range(gw):
                    wins.setdefault((h // side, w // side), []).append((h, w))
            kept_n = {k: sum(int(after[p, h, w]) for h, w in cells) for k, cells in wins.items()}
            partial = [k for k, cells in wins.items() if 0 < kept_n[k] < len(cells)]
            assert len(partial) <= 1                                           # whole windows but one
            mean = {k: float(np.mean([relevance[p, h, w] for h, w in cells])) for k, cells in wins.items()}
            touched = [k for k in wins if kept_n[k]]
            untouched = [k for k in wins if not kept_n[k]]
            if touched and untouched:                                          # the best windows are the kept ones
                assert min(mean[k] for k in touched) >= max(mean[k] for k in untouched)
            if partial:                                                        # its best cells
                cells = wins[partial[0]]
                got = [relevance[p, h, w] for h, w in cells if after[p, h, w]]
                rest = [relevance[p, h, w] for h, w in cells if not after[p, h, w]]
                assert min(got) >= max(rest)

    def test_qwen2_5_whole_windows_then_encode_the_kept_cells_only(self):
        """Snapped to Qwen2.5-VL's windows, encode: kept with whole windows encodes no cell to
        complete a window beyond each pair's one partial window, and answers as many tokens."""
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[1])
        frames = make_frames(4, 112, 168, seed=8)                            # (T'=2, 4, 6): windows of 2x2 cells
        keep = np.zeros((4, 4, 6), dtype=np.int64)
        keep[0, [0, 3, 1], [0, 5, 3]] = 1                                    # three scattered tokens in pair 0
        keep[3, [2, 0], [1, 4]] = 1                                          # two in pair 1
        scores = np.random.default_rng(2).random((4, 4, 6)).astype(np.float32)
        plain, snapped = kept(vlm), kept(vlm, snap_windows=2)
        a = plain.answer([request(frames, keep)])[0]
        b = snapped.answer([AnswerRequest("s0", frames, keep, "what moves?", 0.0, 1.0, scores=scores)])[0]
        assert a.tokens_kept == b.tokens_kept == 5
        assert plain.kept_encoder.counters["cells_encoded"] == 5 * 4          # five windows completed
        assert snapped.kept_encoder.counters["cells_encoded"] == 4 + 4        # a window and a part of one per pair
        c = snapped.answer([request(frames, keep)])[0]                       # no relevance: the map as given
        assert c.tokens_kept == 5

    def test_answer_questions_snaps_too(self):
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[1])
        frames = make_frames(4, 112, 168, seed=9)
        keep = np.zeros((4, 4, 6), dtype=np.int64)
        keep[1, [0, 3], [0, 5]] = 1
        scores = np.random.default_rng(3).random((4, 4, 6)).astype(np.float32)
        snapped = kept(vlm, snap_windows=2)
        out = snapped.answer_questions(frames, keep, ["what moves?", "what is red?"], scores=scores)
        assert [r.tokens_kept for r in out] == [2, 2]
        assert snapped.kept_encoder.counters["cells_encoded"] == 4              # one window of pair 0


class TestPaddedGraphShapes:
    """The kept tower at a padded shape (pipeline.vlm.kept_graph), run eagerly here (capture=False):
    the same tokens as the ragged eager tower, for windows of several sizes sharing one shape."""

    @staticmethod
    def padded(vlm):
        k = kept(vlm)
        k.kept_encoder.graphs = KeptGraphs(k.encoder._visual, k.dtype, None, capture_graphs=False)
        return k

    @pytest.mark.parametrize("family, vision", [("qwen2_vl", {}), ("qwen2_5_vl", {"fullatt_block_indexes": [1]})])
    def test_padded_tokens_equal_the_ragged_towers(self, family, vision):
        vlm = tiny(family, **vision)
        ragged, padded = kept(vlm), self.padded(vlm)
        frames = make_frames(6, 112, 168, seed=30)
        for seed, p in [(31, (0.6, 0.3, 0.1)), (32, (0.7, 0.2, 0.1)), (33, (0.0, 1.0, 0.0)), (34, (0.9, 0.1, 0.0))]:
            keep = random_keep(vlm, frames, seed=seed, p=p)
            want = ragged.encode_cells(frames, keep)
            got = padded.encode_cells(frames, keep)
            assert torch.equal(got.index, want.index)
            assert close(got.tokens, want.tokens)
        graphs = padded.kept_encoder.graphs
        assert graphs.enabled and 1 <= graphs.captured < 4 and len(graphs.graphs) == graphs.captured
        assert padded.kept_encoder.counters["graphs_captured"] == graphs.captured

    @pytest.mark.parametrize("family, vision", [("qwen2_vl", {}), ("qwen2_5_vl", {"fullatt_block_indexes": [1]})])
    def test_after_warm_up_every_window_replays_a_warm_shape(self, family, vision):
        """VisionEncoder.warm_up makes the graphs of every padded shape windows of these frames can
        ask for (on blank pixels); afterwards windows of any kept share replay one of them (none is
        added) and give the ragged tower's tokens."""
        vlm = tiny(family, **vision)
        ragged, padded = kept(vlm), self.padded(vlm)
        frames = make_frames(6, 112, 168, seed=50)
        padded.encoder.warm_up([(112, 168)], 6, 1)
        graphs = padded.kept_encoder.graphs
        warm = list(graphs.graphs)
        assert warm and graphs.free_captures == 0
        for key, graph in graphs.graphs.items():                            # blank pixels: finite tokens
            assert graph._forward().isfinite().all(), key
        for seed, T, p in [(51, 5, (0.95, 0.05, 0.0)), (52, 2, (0.6, 0.3, 0.1)), (53, 6, (0.0, 1.0, 0.0)),
                           (54, 3, (0.3, 0.5, 0.2))]:
            keep = random_keep(vlm, frames[:T], seed=seed, p=p)
            want = ragged.encode_cells(frames[:T], keep)
            got = padded.encode_cells(frames[:T], keep)
            assert close(got.tokens, want.tokens)
        assert sorted(graphs.graphs) == sorted(warm) and graphs.captured == len(warm)

    def test_several_videos_of_several_sizes_in_one_padded_call(self):
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[0])
        ragged, padded = kept(vlm), self.padded(vlm)
        videos = [make_frames(4, 112, 168, seed=40), make_frames(2, 84, 112, seed=41), make_frames(4, 56, 84, seed=42)]
        keeps = [random_keep(vlm, v, seed=43 + i) for i, v in enumerate(videos)]
        keeps[2] = None                                                      # every cell
        for want, got in zip(ragged.kept_encoder.encode_many(videos, keeps),
                             padded.kept_encoder.encode_many(videos, keeps)):
            assert close(got.tokens, want.tokens)
        assert padded.kept_encoder.graphs.captured == 1

    def test_a_larger_graph_serves_a_smaller_call(self):
        """Fewer cells, blocks or windows than a captured graph's (within MAX_PAD of its cells):
        that graph replays, padded, with the ragged tower's tokens; far fewer cells: a graph of their own."""
        vlm = tiny("qwen2_5_vl", fullatt_block_indexes=[1])
        ragged, padded = kept(vlm), self.padded(vlm)
        frames = make_frames(16, 112, 168, seed=60)                          # (T'=8, 4, 6): 192 cells
        graphs = padded.kept_encoder.graphs
        graphs.free_captures = 1                                             # reuse from the second shape on
        everything = np.ones((16, 4, 6), dtype=np.int64)
        assert close(padded.encode_cells(frames, everything).tokens, ragged.encode_cells(frames, everything).tokens)
        assert graphs.captured == 1 and next(iter(graphs.graphs))[0] == 192
        fewer = everything.copy()
        fewer[:6] = 0                                                        # three pairs less: 120 cells (bucket 128)
        got, want = padded.encode_cells(frames, fewer), ragged.encode_cells(frames, fewer)
        assert close(got.tokens, want.tokens) and graphs.captured == 1        # the 192-cell graph, padded
        few = np.zeros_like(everything)
        few[0, 0, 0] = 1                                                     # one window: 4 cells (bucket 64)
        got, want = padded.encode_cells(frames, few), ragged.encode_cells(frames, few)
        assert close(got.tokens, want.tokens) and graphs.captured == 2        # a 64-cell graph of its own

    def test_the_first_shapes_get_graphs_of_their_own(self):
        """Below free_captures graphs a smaller shape is captured unpadded (a recurring window of
        one size should not replay a larger graph forever)."""
        vlm = tiny("qwen2_vl")
        padded = self.padded(vlm)
        frames = make_frames(16, 112, 168, seed=61)
        everything = np.ones((16, 4, 6), dtype=np.int64)
        fewer = everything.copy()
        fewer[:6] = 0
        padded.encode_cells(frames, everything), padded.encode_cells(frames, fewer)
        graphs = padded.kept_encoder.graphs
        assert graphs.captured == 2 and sorted(k[0] for k in graphs.graphs) == [128, 192]

    def test_buckets(self):
        assert CELL_BUCKETS[:8] == [64, 96, 128, 192, 256, 384, 512, 736]
        assert [cell_bucket(n) for n in (1, 64, 65, 416, 1024, 1025)] == [64, 64, 96, 512, 1024, 1472]
        assert all(b / a <= 1.5 for a, b in zip(CELL_BUCKETS, CELL_BUCKETS[1:]))

    def test_varlen_attention_is_blockwise_sdpa(self):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(10, 2, 8, generator=g) for _ in range(3))
        cu = torch.tensor([0, 3, 3, 7, 7], dtype=torch.int32)                # an empty block; rows 7-9 in none
        out = varlen_attention(q, k, v, cu, 4, 0.5)
        for a, b in [(0, 3), (3, 7)]:
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=0.5).transpose(0, 1)
            assert torch.allclose(out[a:b], ref, atol=1e-6)
        assert not out[7:].any()


def static_then_changed(T: int = 4):
    """A window of a still view, and the next one where the top-left 56x56 px changed."""
    frames = make_frames(T, 112, 168, seed=8)
    frames[:] = frames[:1]                                                   # a still camera
    changed = frames.copy()
    changed[:, :56, :56] = 255 - changed[:, :56, :56]
    return frames, changed


class TestLiveReuse:
    def test_nothing_changed_reuses_every_cell_and_equals_a_fresh_encode(self, vlm):
        """A still view kept the same way in every frame: the second window encodes nothing, and its
        tokens are what encoding it afresh gives."""
        k = kept(vlm)
        frames, _ = static_then_changed()
        keep = np.repeat(random_keep(k, frames[:1], seed=9), 4, axis=0)      # (T, gh, gw), the same each frame
        first = k.kept_encoder.encode_many([frames], [keep], [("cam", True)])[0]
        encoded = k.kept_encoder.counters["cells_encoded"]
        again = k.kept_encoder.encode_many([frames], [keep], [("cam", False)])[0]
        assert k.kept_encoder.counters["cells_encoded"] == encoded                       # nothing re-encoded
        assert k.kept_encoder.counters["cells_reused"] == again.index.numel() > 0
        fresh = k.encode_cells(frames, keep)                                 # no stream: encoded afresh
        assert torch.equal(again.index, fresh.index)
        assert close(again.tokens, fresh.tokens)
        assert close(first.tokens, fresh.tokens)

    def test_a_reused_token_keeps_the_context_it_was_encoded_in(self):
        """Pairs that keep different cells encode a cell in different company: the cache holds the
        latest pair's token of each cell, which serves every pair of the next window."""
        k = tiny("qwen2_vl")
        frames, _ = static_then_changed()
        keep = np.ones((4, 4, 6), dtype=np.int64)
        keep[:2, 0, :3] = 0                                                  # pair 0 drops three cells
        first = k.kept_encoder.encode_many([frames], [keep], [("cam", True)])[0].dense()
        again = k.kept_encoder.encode_many([frames], [keep], [("cam", False)])[0].dense()
        assert k.kept_encoder.counters["cells_encoded"] == 48 - 3
        kept_in_0 = torch.from_numpy(keep[0] != 0)                           # (gh, gw)
        assert torch.equal(again[0][kept_in_0], first[1][kept_in_0]) and torch.equal(again[1], first[1])
        assert not close(first[0][kept_in_0], first[1][kept_in_0])  # pair 0 saw fewer cells

    def test_changed_cells_are_encoded_again(self):
        k = tiny("qwen2_vl")
        frames, changed = static_then_changed()
        keep = np.ones((4, 4, 6), dtype=np.int64)
        first = k.kept_encoder.encode_many([frames], [keep], [("cam", True)])[0].dense()
        second = k.kept_encoder.encode_many([changed], [keep], [("cam", False)])[0].dense()
        # the top-left 2x2 cells of both pairs changed; the other 20 cells per pair are reused as cached
        assert k.kept_encoder.counters["cells_encoded"] == 48 + 2 * 4
        assert k.kept_encoder.counters["cells_reused"] == 2 * 20
        assert torch.equal(second[:, 2:], first[:, 2:]) and torch.equal(second[:, :2, 2:], first[:, :2, 2:])
        assert not close(second[:, :2, :2], first[:, :2, :2])

    def test_qwen2_5_reencodes_whole_windows(self):
        k = tiny("qwen2_5_vl", fullatt_block_indexes=[1])
        frames, changed = static_then_changed()
        keep = np.ones((4, 4, 6), dtype=np.int64)
        k.kept_encoder.encode_many([frames], [keep], [("cam", True)])
        changed[:, 60:70, 60:70] = 0                                         # inside cell (2, 2): window (1, 1)
        k.kept_encoder.encode_many([changed], [keep], [("cam", False)])
        # two changed windows of 2x2 cells per pair (top-left, and the one holding cell (2, 2))
        assert k.kept_encoder.counters["cells_encoded"] == 48 + 2 * 2 * 4
        assert k.kept_encoder.counters["cells_reused"] == 2 * 4 * 4          # the other four windows of each pair

    def test_a_scene_change_drops_the_streams_features(self, vlm):
        k = kept(vlm)
        frames, _ = static_then_changed()
        k.kept_encoder.encode_many([frames], [None], [("cam", True)])
        assert k.kept_encoder.cache.cached("cam") == 4 * 6
        k.kept_encoder.encode_many([frames], [None], [("cam", True)])        # same pixels, but after a cut
        assert k.kept_encoder.counters["cells_reused"] == 0
        assert k.kept_encoder.counters["cells_encoded"] == 2 * 48

    def test_the_cache_is_bounded_per_stream_and_by_streams(self):
        k = kept(tiny("qwen2_vl"), reuse_cells=5)
        k.kept_encoder.cache.max_streams = 2
        frames, changed = static_then_changed()
        for n, video in enumerate([frames, changed, frames]):
            k.kept_encoder.encode_many([video], [None], [("cam", n == 0)])
            assert k.kept_encoder.cache.cached("cam") == 5
        for key in ("b", "c"):
            k.kept_encoder.encode_many([frames], [None], [(key, True)])
        assert k.kept_encoder.cache.cached("cam") == 0 and len(k.kept_encoder.cache) == 10
        assert k.kept_encoder.cache.nbytes == 2 * 5 * (64 + 4 * 1176) * 4   # features + patches, float32

    def test_a_new_frame_size_starts_the_stream_over(self, vlm):
        k = kept(vlm)
        k.kept_encoder.encode_many([make_frames(2, 56, 56)], [None], [("cam", True)])
        k.kept_encoder.encode_many([make_frames(2, 56, 84)], [None], [("cam", False)])
        assert k.kept_encoder.counters["cells_reused"] == 0 and k.kept_encoder.cache.cached("cam") == 6

    def test_off_with_reuse_cells_zero_or_encode_all(self, vlm):
        assert kept(vlm, reuse_cells=0).kept_encoder.cache is None
        assert every_patch(vlm).kept_encoder.cache is None


class TestConfig:
    @pytest.mark.parametrize("field, value, message", [
        ("encode", "some", "vlm.encode='some' is not supported; allowed: all, kept"),
        ("reuse_cells", -1, "vlm.reuse_cells=-1 is out of range"),
        ("reuse_cells", 1.5, "vlm.reuse_cells must be an integer"),
        ("reuse_threshold", 2.0, "vlm.reuse_threshold=2.0 is out of range"),
        ("kept_context", -1, "vlm.kept_context=-1 is out of range"),
        ("kept_context", 1.5, "vlm.kept_context must be an integer"),
        ("snap_windows", -1, "vlm.snap_windows=-1 is out of range"),
        ("snap_windows", 2.5, "vlm.snap_windows must be an integer"),
    ])
    def test_bad_values_name_the_field(self, field, value, message):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            VLMConfig(**{field: value})

    def test_kept_windows_is_checked(self):
        with pytest.raises(ConfigError, match="vlm.kept_windows"):
            VLMConfig(kept_windows="some")
        assert VLMConfig().kept_windows == "whole"

    def test_default_encodes_the_kept_cells_with_a_ring_of_context(self):
        assert VLMConfig().encode == "kept" and VLMConfig().kept_context == 1

    def test_set_from_the_command_line_config(self):
        from pipeline.config import PipelineConfig
        from pipeline.configio import load_config
        cfg = load_config(PipelineConfig, overrides=["vlm.encode=kept", "vlm.reuse_cells=64"])
        assert cfg.vlm == replace(VLMConfig(), encode="kept", reuse_cells=64)
        with pytest.raises(ConfigError, match="vlm.encode='both' is not supported; allowed: all, kept"):
            load_config(PipelineConfig, overrides=["vlm.encode=both"])


def test_nonzero_each_splits_one_nonzero_per_mask():
    g = torch.Generator().manual_seed(0)
    masks = [torch.rand(n, generator=g) < 0.4 for n in (7, 0, 12, 5)] + [torch.zeros(3, dtype=torch.bool)]
    got = nonzero_each(masks)
    assert len(got) == len(masks)
    for mask, index in zip(masks, got):
        assert torch.equal(index, mask.nonzero().squeeze(1))
    assert nonzero_each([]) == [] and torch.equal(nonzero_each(masks[:1])[0], masks[0].nonzero().squeeze(1))


class CountOps:
    """Counts calls of aten ops (one or a list; aten.nonzero by default: each one is a host sync on
    a GPU) while active."""

    def __init__(self, op=torch.ops.aten.nonzero.default):
        self.ops, self.calls = (op if isinstance(op, list) else [op]), 0

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in counter.ops:
                    counter.calls += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("family, size", [("qwen2_vl", (84, 112)), ("qwen2_5_vl", (112, 168))])
def test_a_batch_of_videos_reads_the_host_once(monkeypatch, family, size):
    """Each host read is a sync on a GPU (and, under live load, a wait for the interpreter lock):
    the kept encoder reads a whole batch's masks back once and plans the call (blocks, Qwen2.5-VL's
    windows) on the host, with no nonzero, item or unique_consecutive on the device."""
    import pipeline.vlm.kept_vision as kv
    extra = {"fullatt_block_indexes": [1]} if family == "qwen2_5_vl" else {}
    vlm = TestPaddedGraphShapes.padded(tiny(family, **extra))           # the GPU's path: the graphed tower
    videos = [make_frames(4, *size, seed=70 + i) for i in range(5)]
    keeps = [random_keep(vlm, v, seed=80 + i) for i, v in enumerate(videos)]
    reads = []
    monkeypatch.setattr(kv, "read_back", lambda tensors: reads.append(len(tensors)) or read_back(tensors))
    ops = [torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
           torch.ops.aten.unique_consecutive.default]
    with torch.no_grad(), CountOps(ops) as count:
        got = vlm.kept_encoder.encode_many(videos, keeps)
    assert count.calls == 0 and reads == [10]
    for features, video, keep in zip(got, videos, keeps):                # what each video alone gets
        alone = vlm.kept_encoder.encode(video, keep)
        assert torch.equal(features.index, alone.index) and close(features.tokens, alone.tokens)


@pytest.mark.parametrize("on_device, want", [(True, ["index", "tower"]), (False, ["tower", "index"])])
def test_prepare_reads_the_token_index_before_the_tower_runs(monkeypatch, on_device, want):
    """VLM.prepare's one read of the kept tokens' cells from maps on a device comes before the
    vision tower is queued: read after it, the host waited for the tower and then built the prefix
    with the GPU idle. Maps on the host read nothing: the tower is queued first, and the host works
    the index out while it runs."""
    import pipeline.vlm.model as model_mod
    vlm = kept(tiny("qwen2_vl"))
    frames = make_frames(4, 84, 112, seed=5)
    events = []
    # on a CPU every map is on the host: where a map is only decides the order here
    monkeypatch.setattr(model_mod, "any_on_device", lambda maps: on_device)
    index_of, tokens_of = model_mod.read_back, vlm.encoder.window_tokens
    monkeypatch.setattr(model_mod, "read_back", lambda masks: events.append("index") or index_of(masks))
    monkeypatch.setattr(vlm.encoder, "window_tokens", lambda *a, **k: events.append("tower") or tokens_of(*a, **k))
    prefix, = vlm.prepare([request(frames, random_keep(vlm, frames, seed=6))])
    assert events == want
    assert prefix.tokens_kept == int(token_cells(pair_lod(torch.as_tensor(random_keep(vlm, frames, seed=6)))).sum())


def test_prepare_selects_every_windows_tokens_with_one_read(monkeypatch):
    """VLM.prepare reads the kept tokens' positions of all its requests back at once (one
    read_back, no nonzero on the device), and the prefixes are those built one request at a time."""
    import pipeline.vlm.model as model_mod
    vlm = every_patch(tiny("qwen2_vl"))
    frames = [make_frames(4, 84, 112, seed=90 + i) for i in range(5)]
    reqs = [request(f, random_keep(vlm, f, seed=95 + i) if i else None) for i, f in enumerate(frames)]
    reads = []
    monkeypatch.setattr(model_mod, "read_back", lambda tensors: reads.append(len(tensors)) or read_back(tensors))
    with torch.no_grad():
        merged = vlm.encoder.window_tokens(reqs)
        with CountOps() as count:
            batched = vlm.prepare(reqs)
    assert count.calls == 0 and reads == [len(reqs)]
    for req, m, got in zip(reqs, merged, batched):
        want = vlm.build_prefix(req, m)
        assert torch.equal(got.positions, want.positions) and torch.equal(got.embeds, want.embeds)


class TestHostPlan:
    """The tower call's plan comes from the cell maps alone. Maps on a device are read back before
    any frame is preprocessed (a read queued after the preprocessing waits for it on a GPU); maps
    on the host read nothing, so the frames go first and the GPU works on them while the host
    plans. Positions are worked out on the host."""

    @pytest.mark.parametrize("on_device, want", [(True, ["read", "preprocess"]), (False, ["preprocess", "read"])])
    def test_plan_is_read_before_the_frames_are_preprocessed(self, vlm, monkeypatch, on_device, want):
        from pipeline.vlm import kept_vision
        model = kept(vlm)
        encoder = model.kept_encoder
        order = []
        real_read, real_pre = kept_vision.read_back, encoder.preprocessor
        # on a CPU every map is on the host: where a map is only decides the order here
        monkeypatch.setattr(kept_vision, "any_on_device", lambda maps: on_device)

        def read(tensors):
            order.append("read")
            return real_read(tensors)

        class Pre:
            geometry = real_pre.geometry

            def __call__(self, frames, device):
                order.append("preprocess")
                return real_pre(frames, device)
        monkeypatch.setattr(kept_vision, "read_back", read)
        encoder.preprocessor = Pre()
        frames = make_frames(4, 56, 84, seed=2)
        keep = random_keep(model, frames, seed=3)
        got = encoder.encode(frames, keep)
        assert order == want
        encoder.preprocessor = real_pre
        want = kept(vlm).kept_encoder.encode(frames, keep)
        assert torch.equal(got.index, want.index)
        torch.testing.assert_close(got.tokens, want.tokens, atol=ATOL, rtol=0)

    @pytest.mark.cuda
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_host_keep_maps_need_no_device_read(self, vlm, monkeypatch):
        """Keep maps from the host (as the pipeline's stages hand them over) have their masks worked
        out on the host: prepare() reads nothing back from the GPU before the tower, and the
        prefixes equal those of the same maps given on the device."""
        from pipeline.vlm import kept_vision, model as model_module
        model = tiny(vlm.family, device="cuda")
        frames = make_frames(6, 56, 84, seed=6)
        keep = random_keep(model, frames, seed=7)
        device_reads = []

        def spy(real):
            def read(tensors):
                device_reads.extend(t for t in tensors if t.is_cuda)
                return real(tensors)
            return read
        for module in (kept_vision, model_module):
            monkeypatch.setattr(module, "read_back", spy(module.read_back))
        host = model.prepare([request(frames, keep)])[0]
        assert device_reads == []
        on_device = model.prepare([request(frames, torch.as_tensor(keep, device="cuda"))])[0]
        assert device_reads                                                  # the device map is read back
        assert host.tokens_kept == on_device.tokens_kept
        torch.testing.assert_close(host.embeds, on_device.embeds)

    def test_mask_source_is_the_host_map_unless_snapping_changes_it(self, vlm):
        keep, scores = np.zeros((4, 2, 3), np.int64), np.zeros((4, 2, 3), np.float32)
        on_device = torch.ones(4, 2, 3, dtype=torch.int64)                  # stands for the uploaded map
        src = kept(vlm).prefixes.mask_source(keep, scores, on_device)
        assert isinstance(src, torch.Tensor) and src.device.type == "cpu" and src is not on_device
        assert kept(vlm, snap_windows=2).prefixes.mask_source(keep, scores, on_device) is on_device
        assert kept(vlm, snap_windows=2).prefixes.mask_source(keep, None, on_device) is not on_device
        assert kept(vlm).prefixes.mask_source(None, None, None) is None
