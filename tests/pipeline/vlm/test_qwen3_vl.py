"""Qwen3-VL through transformers' own forward (pipeline/vlm/hf_forward.py: what runs Qwen3-VL-MoE)
with ARR-COC's kept tokens, against transformers on tiny random Qwen3-VL models built here
(DeepStack from two vision blocks into the first two of three LM layers, interleaved M-RoPE, a
tokenizer built in code). Dense Qwen3-VL loads into the fast engine (test_qwen3_fast.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from conftest import make_frames, request
from pipeline.vlm import VLMLoadError, load_vlm, qwen3_vl
from pipeline.vlm.builtin import build_model
from pipeline.vlm_config import TemperingConfig, VLMConfig
from pipeline.vlm.frame_groups import group_timestamps, kept_slots, video_layout
from pipeline.vlm.hf_forward import HFForwardVLM, model_card
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm.model import VLM

QUESTION = "what moves?"
TEMPLATE = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{q}<|im_end|>\n<|im_start|>assistant\n"


def fallback(config: VLMConfig) -> HFForwardVLM:
    """transformers' forward over the tiny dense model (which loads into the fast engine)."""
    engine = build_tiny_vlm("qwen3_vl", config=VLMConfig(max_new_tokens=4))
    return HFForwardVLM(engine.model, engine.tokenizer, family="qwen3_vl", name=engine.name, config=config,
                        preprocessor=engine.preprocessor)


@pytest.fixture(scope="module")
def vlm() -> HFForwardVLM:
    return fallback(VLMConfig(max_new_tokens=4))


@contextlib.contextmanager
def configured(vlm, **fields):
    """While inside: the (module-wide) VLM with these config fields changed."""
    previous, vlm.config = vlm.config, dataclasses.replace(vlm.config, **fields)
    try:
        yield vlm
    finally:
        vlm.config = previous


def grid_of(vlm, frames) -> tuple[int, int, int]:
    """(T', gh, gw) merged-token grid of frames."""
    gh, gw = vlm.geometry.grid(*frames.shape[1:3])
    return -(-frames.shape[0] // vlm.geometry.temporal_patch_size), gh, gw


def hf_full_logits(vlm, frames, question=QUESTION) -> torch.Tensor:
    """transformers' whole forward (its own vision tower, DeepStack, get_rope_index) on the full prompt."""
    pixels, grid = vlm.preprocessor(frames, vlm.device)
    ids = vlm.full_prompt_ids(question, frames.shape[0], *grid_of(vlm, frames)[1:])[None]
    with torch.no_grad():
        out = vlm.model(input_ids=ids, pixel_values_videos=pixels, video_grid_thw=grid[None],
                        mm_token_type_ids=(ids == vlm.video_token_id).int() * 2)
    return out.logits[0].float()                                            # (L, V)


def hf_reference_parts(vlm, frames, question=QUESTION):
    """Computed apart from hf_forward: the full prompt's ids and M-RoPE positions (get_rope_index
    over every video token), and transformers' vision outputs: merged tokens and DeepStack features
    (N, D) in raster order."""
    pixels, grid = vlm.preprocessor(frames, vlm.device)
    ids = vlm.full_prompt_ids(question, frames.shape[0], *grid_of(vlm, frames)[1:])[None]
    types = (ids == vlm.video_token_id).int() * 2
    positions, _ = vlm.model.model.get_rope_index(ids, types, video_grid_thw=grid[None])
    with torch.no_grad():
        out = vlm.model.model.visual(pixels, grid_thw=grid[None], return_dict=True)
    return ids[0], positions[:, 0], out.pooler_output, list(out.deepstack_features)


def hf_kept_logits(vlm, frames, cells: torch.Tensor, question=QUESTION, drop_groups=()) -> torch.Tensor:
    """transformers' forward given the kept tokens, their positions and DeepStack features: the
    full prompt with every video token not in `cells` (raster indices) removed (and the groups
    `drop_groups` whole: timestamp, markers), positions taken from the full prompt, and the kept
    rows of the tower's outputs handed in as its encoder outputs."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    ids, positions, merged, deepstack = hf_reference_parts(vlm, frames, question)
    video = (ids == vlm.video_token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[video] = False
    keep[video[cells]] = True
    starts = (ids == vlm.model.config.vision_start_token_id).nonzero().squeeze(1).tolist()   # outer, then a group's
    ends = (ids == vlm.model.config.vision_end_token_id).nonzero().squeeze(1).tolist()       # a group's, then outer
    for g in drop_groups:                  # group g: after the previous group's end (or the outer start)
        keep[(ends[g - 1] if g else starts[0]) + 1:ends[g] + 1] = False
    kept_ids = ids[keep][None]
    encoded = BaseModelOutputWithDeepstackFeatures(pooler_output=(merged[cells],),
                                                   deepstack_features=[(d[cells],) for d in deepstack])
    with torch.no_grad():
        out = vlm.model(input_ids=kept_ids, position_ids=positions[:, None, keep],
                        mm_encoder_outputs={"video": encoded})
    return out.logits[0].float()


def keep_fraction(vlm, frames, fraction: float, seed: int, drop_pair: int | None = None) -> np.ndarray:
    """A (T, gh, gw) 0/1 keep map holding about `fraction` of the cells, the same in both frames
    of a pair (so a kept token is exactly one kept cell); drop_pair: a frame pair left empty."""
    Tp, gh, gw = grid_of(vlm, frames)
    rng = np.random.default_rng(seed)
    pairs = (rng.random((Tp, gh, gw)) < fraction).astype(np.int64)
    pairs[:, 0, 0] = 1                                                       # at least one token a pair
    if drop_pair is not None:
        pairs[drop_pair] = 0
    return np.repeat(pairs, 2, axis=0)[:frames.shape[0]]


def kept_cells(keep: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(keep[::2].reshape(-1)).nonzero().squeeze(1)


class TestAgainstTransformers:
    @pytest.mark.parametrize("shape", [(4, 64, 96), (5, 96, 64)])   # 5 frames: the last group repeats a frame
    def test_every_token_equals_transformers_forward(self, vlm, shape):
        frames = make_frames(*shape, seed=sum(shape))
        ours = vlm.prompt_logits(vlm.prompt(vlm.window(frames, None), QUESTION))
        ref = hf_full_logits(vlm, frames)
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("empty_groups", ["keep", "drop"])
    def test_ten_percent_equals_transformers_given_the_same_kept_tokens(self, vlm, empty_groups):
        """At 10% (frame pair 1 with no kept token) the logits equal transformers' forward given the
        kept tokens, their full-prompt positions and their own DeepStack features."""
        frames = make_frames(6, 96, 128, seed=3)
        keep = keep_fraction(vlm, frames, 0.1, seed=4, drop_pair=1)
        with configured(vlm, empty_frame_groups=empty_groups):
            window = vlm.window(frames, keep)
            ours = vlm.prompt_logits(vlm.prompt(window, QUESTION))
        cells = kept_cells(keep)
        assert 0 < window.tokens_kept == cells.numel() < 0.2 * window.tokens_full
        ref = hf_kept_logits(vlm, frames, cells, drop_groups=(1,) if empty_groups == "drop" else ())
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("empty_groups", ["keep", "drop"])
    def test_no_kept_token_equals_transformers_without_video_tokens(self, vlm, empty_groups):
        frames = make_frames(4, 64, 96, seed=24)
        keep = np.zeros((4, *grid_of(vlm, frames)[1:]), dtype=np.int64)
        with configured(vlm, empty_frame_groups=empty_groups):
            window = vlm.window(frames, keep)
            ours = vlm.prompt_logits(vlm.prompt(window, QUESTION))
            assert vlm.answer([request(frames, keep)])[0].tokens_kept == window.tokens_kept == 0
        ref = hf_kept_logits(vlm, frames, torch.zeros(0, dtype=torch.long),
                             drop_groups=(0, 1) if empty_groups == "drop" else ())
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    def test_a_wrong_position_would_show(self, vlm):
        """The comparison above can fail: the same kept tokens at positions counted as if the
        dropped ones were not there (plain consecutive M-RoPE of the pruned prompt) differ."""
        frames = make_frames(4, 64, 96, seed=5)
        keep = keep_fraction(vlm, frames, 0.3, seed=6)
        prompt = vlm.prompt(vlm.window(frames, keep), QUESTION)
        ours = vlm.prompt_logits(prompt)
        prompt.positions = prompt.positions - prompt.positions[:, :1] + torch.arange(prompt.positions.shape[1])
        assert (vlm.prompt_logits(prompt)[-1] - ours[-1]).abs().max() > 1e-2


class TestDeepStack:
    def _perturbed(self, vlm, frames, keep, rows: torch.Tensor) -> torch.Tensor:
        """Last-position logits with every DeepStack merger's output made huge at `rows` (raster cells)."""
        def hook(module, args, output):
            output = output.clone()
            output[rows] += 1e3
            return output
        handles = [m.register_forward_hook(hook) for m in qwen3_vl.deepstack_mergers(vlm.model)]
        try:
            return vlm.prompt_logits(vlm.prompt(vlm.window(frames, keep), QUESTION))[-1]
        finally:
            for h in handles:
                h.remove()

    def test_a_dropped_tokens_deepstack_feature_never_reaches_the_lm(self, vlm):
        frames = make_frames(4, 64, 96, seed=7)
        keep = keep_fraction(vlm, frames, 0.25, seed=8)
        kept = kept_cells(keep)
        n = grid_of(vlm, frames)
        dropped = torch.ones(n[0] * n[1] * n[2], dtype=torch.bool)
        dropped[kept] = False
        base = vlm.prompt_logits(vlm.prompt(vlm.window(frames, keep), QUESTION))[-1]
        torch.testing.assert_close(self._perturbed(vlm, frames, keep, dropped.nonzero().squeeze(1)), base,
                                   atol=1e-5, rtol=1e-5)
        # and the hook does reach the LM through a kept token (else the check above proves nothing)
        assert (self._perturbed(vlm, frames, keep, kept[:1]) - base).abs().max() > 1e-2

    def test_every_deepstack_layer_carries_the_kept_tokens_own_features(self, vlm):
        frames = make_frames(4, 64, 96, seed=9)
        keep = keep_fraction(vlm, frames, 0.3, seed=10)
        window = vlm.window(frames, keep)
        _, _, _, deepstack = hf_reference_parts(vlm, frames)
        cells = kept_cells(keep)
        assert len(window.deepstack) == len(qwen3_vl.deepstack_layers(vlm.model)) == 2
        for ours, ref in zip(window.deepstack, deepstack):
            torch.testing.assert_close(ours, ref[cells])

    def test_a_pooled_token_carries_its_blocks_mean_feature(self, vlm):
        frames = make_frames(2, 64, 64, seed=11)                      # one pair, a 2 x 2 grid
        keep = np.full((2, 2, 2), 2, dtype=np.int64)                  # the whole block pooled: one token
        window = vlm.window(frames, keep)
        _, _, merged, deepstack = hf_reference_parts(vlm, frames)
        assert window.tokens_kept == 1
        torch.testing.assert_close(window.embeds[window.visual][0], merged.mean(0))
        for ours, ref in zip(window.deepstack, deepstack):
            torch.testing.assert_close(ours[0], ref.mean(0))


class TestPrompt:
    def _hf_prompt(self, vlm, T: int, grid: tuple[int, int, int]) -> list[int]:
        """The prompt transformers' Qwen3VLProcessor writes for T frames sampled at vlm.fps (its own
        replace_video_token and get_text_with_replacements, without the torchvision-only video processor)."""
        from transformers import Qwen3VLProcessor
        from transformers.video_utils import VideoMetadata

        processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
        processor.tokenizer = vlm.tokenizer
        processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
        processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        g = vlm.geometry
        processor.video_processor = SimpleNamespace(merge_size=g.merge_size, temporal_patch_size=g.temporal_patch_size)
        inputs = {"video_grid_thw": torch.tensor([[grid[0], grid[1] * 2, grid[2] * 2]]),
                  "video_metadata": [VideoMetadata(total_num_frames=T, fps=vlm.config.fps,
                                                   frames_indices=list(range(T)))]}
        text, _ = processor.get_text_with_replacements([TEMPLATE.format(q=QUESTION)],
                                                       videos_replacements=[processor.replace_video_token(inputs, 0)])
        return vlm.tokenizer(text[0]).input_ids

    @pytest.mark.parametrize("T", [4, 5, 8])
    def test_timestamped_prompt_equals_the_hf_processors(self, vlm, T):
        frames = make_frames(T, 64, 96)
        grid = grid_of(vlm, frames)
        ours = vlm.full_prompt_ids(QUESTION, T, grid[1], grid[2]).tolist()
        assert ours == self._hf_prompt(vlm, T, grid)
        assert "<1.2 seconds>" in vlm.tokenizer.decode(ours)                 # frames 2, 3 at 2 fps

    def test_with_hf_processor_itself(self, vlm):
        """The whole processor (pixels too), where its video processor's torchvision is installed."""
        pytest.importorskip("torchvision", reason="HF's Qwen3-VL video processor needs torchvision")
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
        from transformers.video_utils import VideoMetadata

        frames = make_frames(4, 64, 96)
        size = {"shortest_edge": 32 * 32, "longest_edge": 64 * 96 * 8}
        processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=vlm.tokenizer,
                                     video_processor=Qwen3VLVideoProcessor(size=size, cap_pixels_per_frame=False))
        ref = processor(text=[TEMPLATE.format(q=QUESTION)], videos=[frames], do_sample_frames=False,
                        video_metadata=[VideoMetadata(total_num_frames=4, fps=vlm.config.fps,
                                                      frames_indices=[0, 1, 2, 3])],
                        return_tensors="pt")
        grid = grid_of(vlm, frames)
        assert ref["input_ids"][0].tolist() == vlm.full_prompt_ids(QUESTION, 4, grid[1], grid[2]).tolist()
        pixels, _ = vlm.preprocessor(frames, "cpu")
        torch.testing.assert_close(pixels, ref["pixel_values_videos"])

    def test_group_timestamps_follow_hfs_rule(self):
        assert group_timestamps([0, 1, 2, 3, 4], 2.0, 2) == [0.25, 1.25, 2.0]
        assert group_timestamps([0, 10, 20, 30], 10.0, 2) == [0.5, 2.5]
        with pytest.raises(ValueError):
            group_timestamps([], 2.0, 2)

    def test_empty_frame_groups_keep_their_timestamp_or_go(self, vlm):
        frames = make_frames(6, 64, 96, seed=12)
        keep = keep_fraction(vlm, frames, 0.4, seed=13, drop_pair=1)
        texts = {}
        for choice in ("keep", "drop"):
            with configured(vlm, empty_frame_groups=choice):
                window = vlm.window(frames, keep)
            texts[choice] = vlm.tokenizer.decode(self._window_ids(vlm, window))
            assert window.tokens_kept == kept_cells(keep).numel()
        assert "<1.2 seconds><|vision_start|><|vision_end|>" in texts["keep"]   # group 1: no token, its time said
        assert "<1.2 seconds>" not in texts["drop"] and "<0.2 seconds>" in texts["drop"]

    @staticmethod
    def _window_ids(vlm, window) -> list[int]:
        """The ids of a window's slots, read back from its embeddings (text slots are embeddings of
        their ids; visual slots hold vision tokens and are read as <|video_pad|>)."""
        table = vlm._embed.weight                                            # (V, D)
        ids = torch.cdist(window.embeds, table).argmin(1)
        ids[window.visual] = vlm.video_token_id
        return ids.tolist()

    def test_kept_slots_drop_only_empty_groups(self):
        layout = video_layout([1, 2], [[7], [8]], 2, vision_start=3, vision_end=4, video_token=9)
        assert layout.ids.tolist() == [1, 2, 7, 3, 9, 9, 4, 8, 3, 9, 9, 4, 4]
        keep = kept_slots(layout, torch.tensor([1]), 2, "drop")               # group 0's second token only
        assert layout.ids[keep].tolist() == [1, 2, 7, 3, 9, 4, 4]
        keep = kept_slots(layout, torch.tensor([1]), 2, "keep")
        assert layout.ids[keep].tolist() == [1, 2, 7, 3, 9, 4, 8, 3, 4, 4]


class TestAnswering:
    def test_answers_report_kept_and_full_tokens(self, vlm):
        frames = make_frames(4, 64, 96, seed=14)
        keep = keep_fraction(vlm, frames, 0.3, seed=15)
        stock, pruned = vlm.answer([request(frames), request(frames, keep)])
        assert stock.tokens_kept == stock.tokens_full == pruned.tokens_full == 12
        assert pruned.tokens_kept == kept_cells(keep).numel() < 12
        assert isinstance(pruned.text, str) and 0.0 <= pruned.confidence <= 1.0

    def test_generation_equals_greedy_over_uncached_forwards(self, vlm):
        """The cached decoding loop emits what argmax over full uncached forwards emits."""
        frames = make_frames(4, 64, 96, seed=16)
        keep = keep_fraction(vlm, frames, 0.3, seed=17)
        prompt = vlm.prompt(vlm.window(frames, keep), QUESTION)
        tokens = vlm.generate(prompt, max_new_tokens=4).tokens
        expected = []
        for step in range(len(tokens)):
            logits = vlm.prompt_logits(prompt)[-1]
            expected.append(int(logits.argmax()))
            token = torch.tensor([expected[-1]])
            prompt.embeds = torch.cat([prompt.embeds, vlm._embed(token)])
            prompt.positions = torch.cat([prompt.positions, torch.full((3, 1), prompt.next_position + step)], 1)
        assert tokens == expected

    def test_questions_about_one_window_match_single_answers(self, vlm):
        frames = make_frames(4, 64, 96, seed=18)
        keep = keep_fraction(vlm, frames, 0.3, seed=19)
        together = vlm.answer_questions(frames, keep, ["a?", "what colour?"])
        alone = [vlm.answer([request(frames, keep, q)])[0] for q in ("a?", "what colour?")]
        assert [r.text for r in together] == [r.text for r in alone]

    def test_a_shared_window_prefill_equals_the_whole_prompts(self, vlm):
        """Questions about one window start from its prefilled cache: the first token's logits and
        the answer equal prefilling the whole prompt, and the window's cache is left as it was."""
        frames = make_frames(4, 64, 96, seed=25)
        window = vlm.window(frames, keep_fraction(vlm, frames, 0.3, seed=26))
        cache = vlm.window_cache(window)
        length = cache.get_seq_length()
        for question in ("a?", "what colour is it?"):
            prompt = vlm.prompt(window, question)
            shared, _ = vlm.first_logits(prompt, cache)
            whole, _ = vlm.first_logits(prompt)
            torch.testing.assert_close(shared, whole, atol=1e-4, rtol=1e-4)
            assert vlm.generate(prompt, window_cache=cache).tokens == vlm.generate(prompt).tokens
            assert cache.get_seq_length() == length == window.embeds.shape[0]

    def test_one_tower_call_for_windows_of_different_sizes(self, vlm):
        videos = [make_frames(4, 64, 96, seed=27), make_frames(3, 96, 64, seed=28)]
        together = vlm.features_of(videos)
        for video, (merged, deepstack) in zip(videos, together):
            alone_merged, alone_deepstack = vlm.features(video)
            torch.testing.assert_close(merged, alone_merged, atol=1e-5, rtol=1e-5)
            for a, b in zip(deepstack, alone_deepstack):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        keeps = [keep_fraction(vlm, v, 0.4, seed=29 + i) for i, v in enumerate(videos)]
        batched = vlm.answer([request(v, k) for v, k in zip(videos, keeps)])
        assert [r.text for r in batched] == [vlm.answer([request(v, k)])[0].text for v, k in zip(videos, keeps)]

    def test_a_keep_map_of_another_grid_is_one_line(self, vlm):
        frames = make_frames(4, 64, 96)
        with pytest.raises(ValueError, match="does not match the VLM grid"):
            vlm.answer([request(frames, np.ones((4, 3, 3), dtype=np.int64))])

    def test_pass2_and_tempering_are_refused_with_one_line(self):
        for config in (VLMConfig(pass2="attention"), VLMConfig(tempering=TemperingConfig(ladder=(0.1, 0.3)))):
            with pytest.raises(ConfigError) as err:
                fallback(config)
            assert "transformers' own forward" in str(err.value) and "\n" not in str(err.value)


class TestLoading:
    def test_tiny_random_says_what_runs_it(self):
        vlm = load_vlm("tiny-random-qwen3_vl", device="cpu", dtype="float32")
        assert isinstance(vlm, VLM)                                          # dense: the fast engine
        assert "meaningless" in vlm.warning and "transformers' own forward" not in vlm.warning
        assert "\n" not in vlm.warning
        assert model_card(vlm) == {"family": "qwen3_vl", "architecture": "Qwen3VLForConditionalGeneration",
                                   "engine": "fast engine"}
        assert vlm.geometry.patch_size == 16 and vlm.preprocessor.image_mean == (0.5, 0.5, 0.5)

    def test_an_untested_transformers_is_said_too(self, monkeypatch):
        from pipeline.vlm import hf

        monkeypatch.setattr(hf, "installed_version", lambda: "9.0.0")
        warning = build_tiny_vlm("qwen3_vl").warning
        assert "outside the range" in warning and "transformers' own forward" in warning and "\n" not in warning

    def test_snapshot_round_trip(self, vlm, tmp_path):
        save_snapshot(vlm, tmp_path)
        loaded = load_vlm(str(tmp_path), device="cpu", dtype="float32",
                          config=VLMConfig(max_new_tokens=4, encode="all"))
        assert isinstance(loaded, VLM) and loaded.family == "qwen3_vl" and loaded.warning is None
        assert loaded.preprocessor == vlm.preprocessor
        frames = make_frames(4, 64, 96, seed=20)
        keep = keep_fraction(vlm, frames, 0.3, seed=21)
        want = vlm.prompt_logits(vlm.prompt(vlm.window(frames, keep), QUESTION))[-1]
        _, got = loaded.prefill(loaded.prepare([request(frames, keep)]), 2)
        torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)

    def test_moe_snapshot_loads_through_the_same_fallback(self, vlm, tmp_path):
        """Qwen3-VL-MoE: detected from config.json, answered through the same forward."""
        from transformers import Qwen3VLMoeConfig

        cfg = vlm.model.config.to_dict()
        text = dict(cfg["text_config"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    decoder_sparse_step=1, mlp_only_layers=[])
        for key in ("model_type", "architectures", "dtype", "transformers_version"):
            text.pop(key, None)
        drop = ("model_type", "dtype", "transformers_version")
        vision = {k: v for k, v in cfg["vision_config"].items() if k not in drop}
        ids = {k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
        moe = build_model(Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids))
        moe.save_pretrained(tmp_path)
        vlm.tokenizer.save_pretrained(tmp_path)
        assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_vl_moe"
        loaded = load_vlm(str(tmp_path), device="cpu", dtype="float32", config=VLMConfig(max_new_tokens=3))
        assert isinstance(loaded, HFForwardVLM) and "Qwen3-VL-MoE" in loaded.warning
        frames = make_frames(4, 64, 96, seed=22)
        ours = loaded.prompt_logits(loaded.prompt(loaded.window(frames, None), QUESTION))
        torch.testing.assert_close(ours, hf_full_logits(loaded, frames), atol=1e-4, rtol=1e-4)
        keep = keep_fraction(loaded, frames, 0.3, seed=23)
        assert loaded.answer([request(frames, keep)])[0].tokens_kept == kept_cells(keep).numel()

    def test_other_model_types_are_still_refused(self, tmp_path):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
        with pytest.raises(VLMLoadError) as err:
            load_vlm(str(tmp_path), device="cpu", dtype="float32")
        assert "qwen3_vl, qwen3_vl_moe" in str(err.value) and "\n" not in str(err.value)


def save_snapshot(vlm, path) -> None:
    """A local snapshot as the Hub ships one: weights + config, tokenizer, video processor config."""
    vlm.model.save_pretrained(path)
    vlm.tokenizer.save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "resample": 3,
         "rescale_factor": 1 / 255}))


class TestHubId:
    """`--vlm Qwen/Qwen3-VL-8B-Instruct` with the Hub unreachable: as for Qwen2-VL (test_vlm_hub_offline)."""

    def test_not_cached_is_one_line(self, tmp_path):
        from test_vlm_hub_offline import load_offline

        out, err, seconds = load_offline("Qwen/Qwen3-VL-8B-Instruct", tmp_path / "hf")
        assert out == [] and len(err) == 1, err
        assert err[0].startswith("VLM 'Qwen/Qwen3-VL-8B-Instruct' is not in the local Hugging Face cache")
        assert seconds < 10.0

    def test_cached_loads_through_transformers_forward(self, vlm, tmp_path):
        from test_vlm_hub_offline import load_offline

        repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-VL-8B-Instruct"
        snapshot = repo / "snapshots" / ("0" * 40)
        save_snapshot(vlm, snapshot)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
        out, err, _ = load_offline("Qwen/Qwen3-VL-8B-Instruct", tmp_path / "hf")
        assert out == ["loaded qwen3_vl"] and not any("Retrying" in line for line in err), err
