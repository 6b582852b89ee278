"""Targets from the objects' boxes (pipeline/training/qa_targets.py), the training-only extra
questions and views, and their losses in the training forward."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from evaluation.questions import _key, clip_questions
from evaluation.renderers import MultiRendererClips, scene
from evaluation.scenes import COLORS, SHAPES
from evaluation.synth_qa import SPLIT_SEEDS
from pipeline.configio import load_config, to_dict
from pipeline.training import qa_targets as qt
from pipeline.training.qa_data import vlm_frame_indices
from pipeline.training.qa_forward import QAForward
from pipeline.training.qa_vlm import QAVLMConfig, build, clip_source, step_data

TRAIN = SPLIT_SEEDS["train"].start + 7000
TINY = ["model.hidden=64", "model.intermediate=128", "model.layers=2", "model.heads=4", "model.kv_heads=2",
        "model.vision_depth=1", "model.vision_dim=32", "model.vision_heads=2", "train.clips_per_step=3",
        "train.workers=0", "train.device=cpu", "train.warmup_steps=1", "data.renderers=[shapes, photo, busy]"]


class TestFromBoxes:
    def test_centres_evidence_and_facts_of_two_boxes(self):
        # frame 64 x 64 on a 4 x 4 grid (16 px cells); object 0 at cells (0..1, 0..1) in both frames,
        # object 1 in cell (3, 3) in frame 1 only; three frames: the odd last one pairs with itself
        boxes = np.array([[[0, 0, 24, 24]] * 3, [[-1] * 4, [48, 50, 60, 62], [-1] * 4]], np.int32)
        centres = qt.centre_tokens(boxes, (64, 64), (4, 4))
        assert centres.shape == (2, 4, 4) and centres.dtype == np.int8
        assert np.argwhere(centres[0]).tolist() == [[0, 0], [3, 3]] and np.argwhere(centres[1]).tolist() == [[0, 0]]
        ev = qt.evidence_tokens(boxes, (0,), (64, 64), (4, 4))
        # 24 px covers cell 0 fully and half of cell 1 along each axis: shares 1, 0.5, 0.5, 0.25
        assert np.argwhere(ev[0]).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]] and (ev[0] == ev[1]).all()
        assert not qt.evidence_tokens(boxes, (), (64, 64), (4, 4)).any()
        objects = (("red", "circle", "still"), ("red", "car", "still"))
        facts = qt.question_facts((0, 1), "Is the red circle left of the red car?", boxes, (64, 64), objects)
        np.testing.assert_allclose(facts[:4], [12 / 64, 12 / 64, 54 / 64, 56 / 64])
        assert facts[4:].tolist() == [0.0, 1.0, 0.0, 1.0]              # square, circle, triangle, car
        none = qt.question_facts((0, 1, 0), "How many objects are there?", boxes, (64, 64), objects)
        assert np.isnan(none).all()
        absent = qt.question_facts((), "Is there a blue car?", boxes, (64, 64), objects)
        assert np.isnan(absent[:4]).all() and absent[4:].tolist() == [0.0] * 4

    def test_evidence_of_an_absent_shape_is_its_colours_objects(self):
        objects = (("red", "circle", "still"), ("blue", "car", "still"), ("red", "square", "still"))
        assert qt.evidence((), "Is there a red triangle?", objects) == (0, 2)
        assert qt.evidence((), "Is there a green triangle?", objects) == ()
        assert qt.evidence((1,), "Is there a blue car?", objects) == (1,)

    def test_force_keep_keeps_both_frames_of_a_pair_in_full(self):
        keep = np.zeros((3, 2, 2), np.int8)
        keep[2, 1, 1] = 2
        tokens = np.zeros((2, 2, 2), bool)
        tokens[0, 0, 1] = tokens[1, 1, 1] = True
        out = qt.force_keep(keep, tokens)
        assert out[:, 0, 1].tolist() == [1, 1, 0] and out[:, 1, 1].tolist() == [0, 0, 1] and out.sum() == 3

    @pytest.mark.parametrize("renderer", ["shapes", "photo", "busy"])
    def test_rendered_clips_one_centre_per_object_and_labels_inside_evidence(self, renderer):
        """On rendered clips, at the model's grid: every object shown has its own centre token (centres
        never share a cell, though objects do), and every cell a quarter covered by the renderer's
        object labels lies in a count question's evidence (all objects): the boxes are where the
        objects are drawn."""
        for seed in range(TRAIN, TRAIN + 6):
            clip = MultiRendererClips((renderer,))(seed)
            shown = vlm_frame_indices(len(clip.frames), clip.fps, 2.0)
            boxes, size, grid = clip.boxes[:, shown], clip.frames.shape[1:3], (8, 8)
            centres = qt.centre_tokens(boxes, size, grid)
            pairs = qt._pairs(boxes, 2)
            for p in range(len(centres)):
                objects = sum(len({tuple(b) for b in pairs[i, p] if b[0] >= 0}) for i in range(len(boxes)))
                assert int(centres[p].sum()) <= objects
                if all(len({tuple(b) for b in pairs[i, p]}) == 1 for i in range(len(boxes))):   # nothing moved
                    assert int(centres[p].sum()) == int((pairs[:, p, 0, 0] >= 0).sum())
            if clip.labels is not None:    # cells a quarter covered by an object's labelled pixels, either frame
                share = np.stack([cv2.resize((m != 255).astype(np.float32), grid[::-1], interpolation=cv2.INTER_AREA)
                                  for m in clip.labels[shown]])
                share = np.concatenate([share, share[-1:]]) if len(share) % 2 else share
                labelled = share.reshape(-1, 2, *grid).max(1) >= qt.EVIDENCE_SHARE
                everything = qt.evidence_tokens(boxes, tuple(range(len(boxes))), size, grid)
                assert labelled.any() and not (labelled & ~everything).any()


class TestMoreQuestions:
    def test_extra_questions_are_new_valid_and_only_in_training(self):
        plain = MultiRendererClips(("shapes", "photo", "busy"))
        more = MultiRendererClips(("shapes", "photo", "busy"), extra={"relation": 2, "exists": 2})
        added = 0
        for seed in range(TRAIN, TRAIN + 6):
            a, b = plain(seed), more(seed)
            assert b.qas[:len(a.qas)] == a.qas and np.array_equal(a.frames, b.frames)
            new = b.qas[len(a.qas):]
            added += len(new)
            assert {qa.family for qa in new} <= {"relation", "exists"}
            assert len({_key(qa) for qa in b.qas}) == len(b.qas)              # nothing asked twice
            for family in ("relation", "exists"):
                assert sum(qa.family == family for qa in new) <= 2
            # each extra is a question clip_questions asks of this clip (so its answer is exact)
            sc = scene(("shapes", "photo", "busy")[seed % 3], seed, split="train")
            rng = np.random.default_rng(0)
            moves = [m == "pan" for m in sc.motions]
            possible = {(qa.question, qa.answer, qa.names) for k in range(200) for qa in
                        clip_questions(rng, sc.tracks, sc.clip.frames.shape[1:3], moves, exists=k % 2 == 0,
                                       min_gap=int(np.ceil(0.75 * sc.clip.fps)))}
            assert all((qa.question, qa.answer, qa.names) in possible for qa in new)
        assert added >= 12
        val = SPLIT_SEEDS["val"].start
        assert more(val, split="val").qas == plain(val, split="val").qas

    def test_bad_extra_is_refused(self):
        with pytest.raises(ValueError, match="Invalid extra questions"):
            MultiRendererClips(("shapes",), extra={"colour": 1})


class TestStepData:
    def test_family_views_extra_questions_and_answerable_keeps(self):
        cfg = load_config(QAVLMConfig, None, TINY + ["train.views_per_question=1", "train.family_views=[relation=3]",
                                                     "data.extra_questions=[relation=1]", "drop.keep_evidence=1.0",
                                                     "drop.p_all=0.0", "drop.keep_max=0.1", "drop.curriculum_steps=0"])
        make = clip_source(cfg)
        samples = step_data(cfg, make)[0]
        for i, s in enumerate(samples):
            clip = make(cfg.train.first_seed + i)
            want = [qa.family for qa in clip.qas for _ in range(3 if qa.family == "relation" else 1)]
            assert s.families == want
            assert len(s.evidence) == len(s.questions) == len(s.facts) and s.facts.shape[1] == qt.FACTS
            assert s.centres.shape == s.colors.shape
            for keep, ev in zip(s.keeps, s.evidence):
                pairs = np.concatenate([keep, keep[-1:]]) if len(keep) % 2 else keep
                kept = pairs.reshape(-1, 2, *keep.shape[1:]).min(1) == 1
                assert not (ev & ~kept).any()                                 # every evidence cell in full
        assert sum(f == "relation" for s in samples for f in s.families) >= 6

    def test_config_errors_name_the_entry(self):
        for override, message in (("train.family_views=[relation]", "train.family_views: 'relation' is not family=N"),
                                  ("train.family_views=[colour=2]", "train.family_views='colour' is not supported"),
                                  ("train.family_views=[relation=0]", "train.family_views[relation]=0 is out of range"),
                                  ("data.extra_questions=[exists=1, exists=2]", "names exists twice"),
                                  ("drop.keep_evidence=2", "drop.keep_evidence=2.0 is out of range")):
            with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
                load_config(QAVLMConfig, None, TINY + [override])
        with pytest.raises(ConfigError, match="needs data.renderers"):
            load_config(QAVLMConfig, None, ["data.extra_questions=[exists=1]"])


class TestLosses:
    def test_facts_probe_and_centre_head_train_and_ground_on_the_evidence(self):
        cfg = load_config(QAVLMConfig, None, TINY + ["drop.curriculum_steps=0"])
        model, tokenizer, preprocessor = build(cfg, torch.device("cpu"))
        samples = step_data(cfg, clip_source(cfg))[0]
        head = torch.nn.Linear(64, len(COLORS) + 1 + 2)
        facts_head = torch.nn.Linear(64, qt.FACTS)
        forward = QAForward(model, tokenizer, preprocessor, head, 1.0, ground_weight=1.0, ground_layer=1,
                            centre_weight=1.0, facts_head=facts_head, facts_weight=1.0, facts_layer=2)
        batch = forward.batch(samples, forward.vision(samples))
        views = [(s, v) for s in samples for v in range(len(s.questions))]
        assert batch.facts.shape == (len(views), qt.FACTS)
        # the grounding target is each view's evidence among its kept tokens
        for b, (s, v) in enumerate(views):
            target = batch.ground[2][b]
            assert int(target.sum()) <= int(s.evidence[v].sum())
            assert bool(target.any()) == bool(batch.ground[0][b].any())
        loss, stats = forward(samples)
        loss.backward()
        assert torch.isfinite(loss)
        assert float(facts_head.weight.grad.abs().sum()) > 0
        assert float(head.weight.grad[-2:].abs().sum()) > 0                     # the centre classes
        lm_layer = model.model.language_model.layers[0].mlp.down_proj.weight
        assert lm_layer.grad is not None

    def test_facts_loss_ignores_what_is_undefined(self):
        predicted = torch.zeros(2, qt.FACTS, requires_grad=True)
        facts = torch.full((2, qt.FACTS), float("nan"))
        facts[0, :2] = torch.tensor([0.5, 0.25])
        loss = QAForward.facts_loss(predicted, facts)
        # smooth L1 in cells of an 8 x 8 grid: |8 * 0.5| = 4 -> 3.5, |8 * 0.25| = 2 -> 1.5, mean 2.5
        torch.testing.assert_close(loss, torch.tensor(2.5))
        loss.backward()
        assert predicted.grad[1].abs().sum() == 0 and predicted.grad[0, 2:].abs().sum() == 0
        facts[1, 4:] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        with_shapes = QAForward.facts_loss(predicted, facts)
        torch.testing.assert_close(with_shapes, torch.tensor(2.5 + np.log(2.0), dtype=torch.float32))
        assert len(SHAPES) == 4


class TestEvalCommand:
    def test_scores_a_snapshot_on_the_split_clips_and_refuses_bad_input(self, tmp_path, capsys):
        import json

        from pipeline.training.qa_eval import export_snapshot, main
        from pipeline.training.qa_vlm import video_preprocessor

        cfg = load_config(QAVLMConfig, None, TINY)
        model, tokenizer, _ = build(cfg, torch.device("cpu"))
        export_snapshot(model, tokenizer, video_preprocessor(cfg), cfg.model.fps, tmp_path / "snap", {})
        out = tmp_path / "r.json"
        assert main([str(tmp_path / "snap"), "--renderers", "shapes,busy", "--clips", "2", "--device", "cpu",
                     "--out", str(out)]) == 0
        result = json.loads(out.read_text())
        first = SPLIT_SEEDS["test"].start
        clips = [scene(("shapes", "busy")[s % 2], s, split="test").clip for s in (first, first + 1)]
        assert result["questions"] == sum(len(c.qas) for c in clips) and result["renderers"] == "shapes,busy"
        assert set(result["keep_1"]) == {qa.family for c in clips for qa in c.qas} | {"overall"}
        capsys.readouterr()
        assert main([str(tmp_path / "snap"), "--held-out", "--split", "val"]) == 2
        assert main([str(tmp_path / "snap"), "--renderers", "styled"]) == 2
        assert main([str(tmp_path / "nope")]) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        assert len(errors) == 3 and "held out" in errors[1] and "no snapshot" in errors[2]


def test_stage4_config_starts_from_the_shipped_snapshot_on_unseen_clips():
    import json
    from pathlib import Path

    from evaluation.renderers import HELD_OUT
    from pipeline.vlm.loading import SHIPPED

    path = Path(__file__).resolve().parents[3] / "configs" / "qa_vlm_stage4.yaml"
    cfg = load_config(QAVLMConfig, path)
    header = path.read_text().split("\nmodel:")[0]
    assert "torchrun --standalone --nproc_per_node 2" in header and "--config configs/qa_vlm_stage4.yaml" in header
    assert HELD_OUT not in cfg.data.renderers and cfg.train.init == "arrcoc-synth-qa"
    assert 400 <= cfg.train.time_limit_s <= 480
    stage3 = json.loads((SHIPPED["arrcoc-synth-qa"] / "training_summary_stage3.json").read_text())
    t3 = stage3["config"]["train"]
    assert cfg.train.first_seed >= t3["first_seed"] + stage3["steps"] * t3["clips_per_step"]
    model = to_dict(cfg)["model"]
    assert stage3["config"]["model"] == {k: model[k] for k in stage3["config"]["model"]}   # the same model
