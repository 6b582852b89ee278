import numpy as np
import pytest
import torch

from conftest import make_frames, mixed_requests, random_keep, request, stock_inputs
from pipeline.vlm.selection import pair_lod, select_tokens


class TestStockEquivalence:
    """All tokens kept: our prefill + decoding loop is the stock HF model."""

    @pytest.mark.parametrize("shape", [(4, 56, 84), (3, 112, 112)])
    def test_logits_and_greedy_match_hf(self, vlm, shape):
        frames = make_frames(*shape, seed=1)
        question = "what is the person doing?"
        inputs = stock_inputs(vlm, frames, question)
        with torch.no_grad():
            stock_logits = vlm.model(**inputs).logits[0].float()             # (L, V)
            stock = vlm.model.generate(**inputs, max_new_tokens=8, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True)
        for keep in (None, np.ones((shape[0], *vlm.geometry.grid(*shape[1:])), dtype=np.int64)):
            prefix = vlm.prepare([request(frames, keep, question)])[0]
            assert prefix.tokens_kept == prefix.tokens_full == inputs["pixel_values_videos"].shape[0] // 4
            # every position of the prefill, not only the last
            hidden = vlm.pool.lm_step(prefix.embeds[None], None, prefix.positions[:, None], None)
            ours_all = vlm.model.lm_head(hidden[0]).float()
            torch.testing.assert_close(ours_all, stock_logits, atol=1e-5, rtol=1e-5)
            out = vlm.generate([prefix], max_new_tokens=8, return_logits=True)
            new = stock.sequences[0, inputs["input_ids"].shape[1]:]
            n = out.lengths[0]
            assert out.tokens[0, :n].tolist() == new[:n].tolist()
            for step in range(n):
                torch.testing.assert_close(out.step_logits[step][0], stock.logits[step][0].float(),
                                           atol=1e-5, rtol=1e-5)


class TestPruned:
    @pytest.mark.parametrize("temperature", [0.0, 1.3])
    def test_cached_decoding_equals_full_recomputation(self, vlm, temperature):
        frames = make_frames(5, 112, 84, seed=2)
        prefix = vlm.prepare([request(frames, random_keep(vlm, frames, seed=3))])[0]
        assert 0 < prefix.tokens_kept < prefix.tokens_full
        out = vlm.generate([prefix], max_new_tokens=10, temperature=temperature, top_p=0.9, seed=7,
                           return_logits=True)
        n = out.lengths[0]
        assert n >= 2
        reference = vlm.generator.logits_without_cache(prefix, out.tokens[0, :n - 1])   # (n, V)
        for step in range(n):
            torch.testing.assert_close(out.step_logits[step][0], reference[step], atol=2e-5, rtol=1e-4)

    def test_sampling_is_seeded(self, vlm):
        frames = make_frames(2, 56, 56, seed=4)
        prefix = vlm.prepare([request(frames)])[0]
        a, b, c = (vlm.generate([prefix], max_new_tokens=12, temperature=1.5, top_p=0.95, seed=s).tokens
                   for s in (1, 1, 2))
        assert torch.equal(a, b)
        assert not torch.equal(a, c)

    def test_positions_of_kept_tokens_equal_stock(self, vlm):
        frames = make_frames(3, 84, 112, seed=5)
        keep = random_keep(vlm, frames, seed=6)
        question = "where is the ball?"
        inputs = stock_inputs(vlm, frames, question)
        captured = {}

        def capture(module, args, kwargs):
            captured["pos"] = kwargs["position_ids"]

        hook = vlm.lm.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            with torch.no_grad():
                vlm.model(**inputs)
        finally:
            hook.remove()
        stock_pos = captured["pos"][-3:, 0]                                   # (3, L_full)
        ids = inputs["input_ids"][0]
        is_video = ids == vlm.video_token_id
        v0, n_full = int(is_video.nonzero()[0]), int(is_video.sum())
        prefix = vlm.prepare([request(frames, keep, question)])[0]
        _, index = select_tokens(torch.zeros(*pair_lod(torch.as_tensor(keep)).shape, 1),
                                 pair_lod(torch.as_tensor(keep)))
        kept = torch.cat([torch.arange(v0), v0 + index, torch.arange(v0 + n_full, ids.numel())])
        assert torch.equal(prefix.positions, stock_pos[:, kept])
        # the first generated token continues where the stock model's would (rope_deltas)
        assert prefix.next_position == ids.numel() + int(vlm.model.model.rope_deltas[0])
        # a pooled token sits at its block's anchor cell: check one by hand (t, h, w of that cell)
        lod = pair_lod(torch.as_tensor(keep))
        gh, gw = lod.shape[1:]
        pooled_cells = (lod == 2).flatten().nonzero().squeeze(1)
        anchor = int(pooled_cells[0])                      # raster-first lod-2 cell is always an anchor
        slot = v0 + int((index == anchor).nonzero())
        t, h, w = anchor // (gh * gw), anchor // gw % gh, anchor % gw
        video_pos = stock_pos[:, v0:v0 + n_full].view(3, -1, gh, gw)
        assert prefix.positions[:, slot].tolist() == video_pos[:, t, h, w].tolist()

    def test_batched_equals_unbatched(self, vlm):
        reqs = mixed_requests(vlm, seed=8)
        prefixes = vlm.prepare(reqs)
        assert len({p.embeds.shape[0] for p in prefixes}) == 3                # real left padding
        batched = vlm.generate(prefixes, max_new_tokens=8, return_logits=True)
        for b, prefix in enumerate(prefixes):
            alone = vlm.generate([prefix], max_new_tokens=8, return_logits=True)
            n = alone.lengths[0]
            assert batched.lengths[b] == n
            assert batched.tokens[b, :n].tolist() == alone.tokens[0, :n].tolist()
            for step in range(n):
                torch.testing.assert_close(batched.step_logits[step][b], alone.step_logits[step][0],
                                           atol=2e-5, rtol=1e-4)

    def test_answer_records_token_counts(self, vlm):
        frames = make_frames(3, 112, 112, seed=13)                           # odd T: last frame repeated
        gh, gw = vlm.geometry.grid(112, 112)
        keep = np.zeros((3, gh, gw), dtype=np.int64)
        keep[0, 0, 0] = 1                    # pair 0: one full token
        keep[1, 2:4, 2:4] = 2                # pair 0: one pooled token for the 2x2 block
        keep[2, 1, 1] = 1                    # pair 1 (frame 2 twice): one full token
        res_pruned, res_stock = vlm.answer([request(frames, keep), request(frames)])
        assert (res_pruned.tokens_kept, res_pruned.tokens_full) == (3, 2 * gh * gw)
        assert (res_stock.tokens_kept, res_stock.tokens_full) == (2 * gh * gw, 2 * gh * gw)
        assert isinstance(res_pruned.text, str) and res_pruned.latency_s > 0

    def test_keep_map_on_wrong_grid_is_rejected(self, vlm):
        frames = make_frames(2, 56, 84)
        with pytest.raises(ValueError, match="does not match the VLM grid"):
            vlm.prepare([request(frames, np.ones((2, 3, 3), dtype=np.int64))])


class TestHooks:
    def test_text_and_visual_tokens_share_the_lm_space(self, vlm):
        frames = make_frames(4, 56, 84, seed=14)
        text = vlm.text_embeddings("red car")
        visual = vlm.visual_tokens(frames)
        gh, gw = vlm.geometry.grid(56, 84)
        D = vlm.model.config.text_config.hidden_size
        assert text.shape == (len("red car"), D)                              # byte-level tiny tokenizer
        assert visual.shape == (2, gh * gw, D)
        prefix = vlm.prepare([request(frames)])[0]
        v0 = len(vlm.prefixes.prompt_ids("q", 0)[0])
        torch.testing.assert_close(prefix.embeds[v0:v0 + 2 * gh * gw], visual.reshape(-1, D))
