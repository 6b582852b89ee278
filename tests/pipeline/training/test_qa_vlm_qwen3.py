"""The QA trainer's Qwen3-VL (model.arch=qwen3_vl): its input is the pipeline's (timestamps per
frame group, kept slots under either vlm.empty_frame_groups, DeepStack at the visual slots), and a
short CPU run writes a snapshot that load_vlm loads as a local Qwen3-VL and answers with."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.configio import load_config
from pipeline.runtime.requests import AnswerRequest
from pipeline.training.qa_forward import IGNORE, QAForward
from pipeline.training.qa_vlm import QAVLMConfig, build, step_data, train
from pipeline.vlm.model import VLM
from pipeline.vlm.selection import pair_lod
from pipeline.vlm_config import VLMConfig

sys.path.insert(0, str(Path(__file__).parent))
from qa_standin import make_clip  # noqa: E402

# 56 x 84 clips at 64 x 96 px: a 2 x 3 token grid of 32 px tokens, 3 frame groups of 6 frames
TINY = ["model.arch=qwen3_vl", "model.hidden=64", "model.intermediate=128", "model.layers=2", "model.heads=2",
        "model.kv_heads=1", "model.vision_depth=2", "model.vision_dim=32", "model.vision_heads=2",
        "model.deepstack=[0, 1]", "model.rope_theta=10000.0", "model.max_pixels=6144", "train.clips_per_step=3",
        "train.workers=0", "train.device=cpu", "train.warmup_steps=1", "train.jpeg_prob=0.0",
        "train.resize_prob=0.0", "val.first_seed=0", "val.clips=2"]


def tiny_config(*extra: str) -> QAVLMConfig:
    return load_config(QAVLMConfig, None, TINY + list(extra))


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config("drop.p_all=0.0", "drop.curriculum_steps=0", "drop.keep_min=0.1", "drop.keep_max=0.3")
    torch.manual_seed(0)
    model, tokenizer, preprocessor = build(cfg, torch.device("cpu"))
    model.eval()
    return cfg, model, tokenizer, preprocessor


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_training_rows_are_the_pipelines_prefixes(tiny, mode):
    """Each row is VLM.prepare's prefix (embeddings with timestamps and markers, M-RoPE positions,
    DeepStack features) under vlm.empty_frame_groups=mode, and its answer logits the pipeline's."""
    cfg, model, tokenizer, preprocessor = tiny
    forward = QAForward(model, tokenizer, preprocessor, fps=cfg.model.fps, empty_groups=mode)
    samples = step_data(cfg, make_clip)[0]
    batch = forward.batch(samples, forward.vision(samples))
    assert batch.deepstack is not None and batch.deepstack.shape[0] == 2
    logits, _ = forward.logits(batch)
    vlm = VLM(copy.deepcopy(model), tokenizer, family="qwen3_vl", name="tiny", preprocessor=preprocessor,
              config=VLMConfig(max_pixels=cfg.model.max_pixels, encode="all", empty_frame_groups=mode))
    rows, b, empty = [], 0, 0
    for s in samples:
        for question, answer, keep in zip(s.questions, s.answers, s.keeps):
            prefix = vlm.prepare([AnswerRequest("s", s.frames, keep, question, 0.0, 1.0)])[0]
            n = prefix.embeds.shape[0]
            torch.testing.assert_close(batch.embeds[b, :n], prefix.embeds, rtol=1e-4, atol=1e-5)
            assert torch.equal(batch.positions[:, b, :n], prefix.positions)
            assert int(batch.positions[0, b, n]) == prefix.next_position
            S = prefix.deepstack.shape[1]
            torch.testing.assert_close(batch.deepstack[:, b, :S], prefix.deepstack, rtol=1e-4, atol=1e-5)
            assert not batch.deepstack[:, b, S:].any()
            ids = tokenizer(answer + "<|im_end|>").input_ids
            assert batch.labels[b][batch.labels[b] != IGNORE].tolist() == ids
            rows.append(vlm.generator.logits_without_cache(prefix, torch.tensor(ids[:-1])))
            empty += int((pair_lod(torch.from_numpy(keep), 2).flatten(1).amax(1) == 0).any())
            b += 1
    assert empty, "no view left a frame group empty: the test would not see the two modes differ"
    torch.testing.assert_close(logits, torch.cat(rows), rtol=1e-4, atol=1e-4)


def test_modes_differ_only_in_the_empty_groups(tiny):
    """drop is keep without the slots of the empty groups (timestamps, markers); mix draws both."""
    cfg, model, tokenizer, preprocessor = tiny
    samples = step_data(cfg, make_clip)[0]
    lengths = {}
    for mode in ("keep", "drop"):
        forward = QAForward(model, tokenizer, preprocessor, fps=cfg.model.fps, empty_groups=mode)
        lengths[mode] = forward.batch(samples, forward.vision(samples)).lengths
    assert all(d <= k for d, k in zip(lengths["drop"], lengths["keep"])) and lengths["drop"] != lengths["keep"]
    with pytest.raises(ValueError, match="empty_groups"):
        QAForward(model, tokenizer, preprocessor, empty_groups="skip")


def test_trains_and_the_snapshot_answers_as_a_qwen3_vl(tmp_path):
    from pipeline.vlm.loading import load_vlm
    cfg = tiny_config("train.steps=2", "val.every=10", "val.final_keep_ratios=[0.5]")
    summary = train(cfg, tmp_path, make_clip=make_clip, log=lambda _: None)
    assert summary["complete"] and set(summary["val"]) == {"keep_0.5"}
    vlm = load_vlm(str(tmp_path / "snapshot"), device="cpu", dtype="float32")
    assert vlm.family == "qwen3_vl" and vlm.geometry.patch_size == 16 and vlm.geometry.max_pixels == 6144
    assert vlm.preprocessor.image_mean == (0.5, 0.5, 0.5)
    frames = np.full((6, 56, 84, 3), 128, np.uint8)
    keep = np.zeros((6, 2, 3), np.int8)
    keep[:2] = 1                                                        # the last two frame groups empty
    answers = vlm.answer_questions(frames, keep, ["what colour is the square?"])
    assert len(answers) == 1 and answers[0].tokens_kept == 6 and isinstance(answers[0].text, str)


def test_the_recipe_is_a_qwen3_vl_on_an_8_by_8_grid():
    from pipeline.training.qa_vlm import geometry
    cfg = load_config(QAVLMConfig, Path(__file__).resolve().parents[3] / "configs" / "qa_vlm_qwen3.yaml", [])
    assert cfg.model.arch == "qwen3_vl" and geometry(cfg).grid(256, 256) == (8, 8)
    assert cfg.train.time_limit_s == 400 and cfg.drop.empty_frame_groups == "mix"
