"""The video-QA VLM trainer: it feeds the model what the pipeline feeds it, its keep-map policies,
its config errors, and a short CPU run whose snapshot loads like a user's."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from pipeline.configio import load_config, to_dict
from pipeline.training.qa_data import (MOTIONS, POLICIES, cell_colors, keep_map, token_colors, token_objects,
                                       token_regions, vlm_frame_indices)
from pipeline.training.qa_forward import IGNORE, QAForward
from pipeline.training.qa_vlm import QAVLMConfig, build, main, step_data, train
from pipeline.vlm_config import VLMConfig
from pipeline.runtime.requests import AnswerRequest
from pipeline.vlm.model import VLM

sys.path.insert(0, str(Path(__file__).parent))
from qa_standin import make_clip  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TINY = ["model.hidden=64", "model.intermediate=128", "model.layers=2", "model.heads=4", "model.kv_heads=2",
        "model.vision_depth=1", "model.vision_dim=32", "model.vision_heads=2", "model.max_pixels=4704",
        "train.clips_per_step=3", "train.workers=0", "train.device=cpu", "train.warmup_steps=1",
        "train.jpeg_prob=0.5", "train.resize_prob=0.5", "val.first_seed=0", "val.clips=3"]


def tiny_config(*extra: str) -> QAVLMConfig:
    return load_config(QAVLMConfig, None, TINY + list(extra))


class TestFrameSampling:
    @pytest.mark.parametrize("fps,vlm_fps,n", [(10.0, 2.0, 35), (8.0, 2.0, 27), (29.97, 2.0, 100), (3.0, 2.0, 10),
                                               (1.0, 2.0, 5)])
    def test_matches_the_realize_stage(self, fps, vlm_fps, n):
        from pipeline.core.stages import RealizeStage
        stage = SimpleNamespace(vlm_fps=vlm_fps, next_vlm_pts={})
        item = SimpleNamespace(stream_id="s", frames=[SimpleNamespace(pts_s=i / fps) for i in range(n)])
        marks = RealizeStage.vlm_frames(stage, item).tolist()
        assert vlm_frame_indices(n, fps, vlm_fps) == [i for i, m in enumerate(marks) if m]

    def test_a_full_window_keeps_every_other_frame(self):
        # VLMStage: at max_frames, every other frame is dropped before the next one joins
        assert vlm_frame_indices(6, 2.0, 2.0, max_frames=4) == [1, 3, 4, 5]


def moving_square(T=6, H=56, W=84) -> np.ndarray:
    frames = np.full((T, H, W, 3), 120, np.uint8)
    for t in range(T):
        frames[t, 14:28, 7 * t:7 * t + 14] = (230, 30, 30)
    return frames


class TestKeepMaps:
    @pytest.mark.parametrize("policy", POLICIES)
    @pytest.mark.parametrize("ratio", [0.05, 0.3, 1.0])
    def test_shape_values_and_at_least_one_token(self, policy, ratio):
        cells = cell_colors(moving_square(), (4, 6))
        lod = keep_map(policy, cells, ratio, np.random.default_rng(0))
        assert lod.shape == (6, 4, 6) and lod.dtype == np.int8
        assert set(np.unique(lod)) <= {0, 1, 2} and lod.any()

    @pytest.mark.parametrize("policy", ["random", "blocks", "temporal", "salient"])
    def test_keeps_about_the_ratio(self, policy):
        cells = cell_colors(np.random.default_rng(1).integers(0, 255, (8, 64, 64, 3), dtype=np.uint8), (8, 8))
        share = np.mean([(keep_map(policy, cells, 0.3, np.random.default_rng(s)) > 0).mean() for s in range(20)])
        assert share == pytest.approx(0.3, abs=0.08)

    def test_frames_keeps_whole_frames(self):
        lod = keep_map("frames", cell_colors(moving_square(), (4, 6)), 0.5, np.random.default_rng(0))
        per_frame = lod.reshape(6, -1)
        assert set(per_frame.min(1) == per_frame.max(1)) == {True} and per_frame.any(1).sum() == 3

    def test_temporal_keeps_what_changed_and_salient_what_stands_out(self):
        frames = np.full((5, 56, 84, 3), 120, np.uint8)                   # 14-px cells: a 4 x 6 grid
        for t in range(5):
            frames[t, 14:42, 14 * t:14 * t + 28] = (230, 30, 30)           # a 2 x 2-cell square, one cell a frame
        cells = cell_colors(frames, (4, 6))
        changed = np.concatenate([np.ones((1, 4, 6), bool), np.abs(np.diff(cells, axis=0)).sum(-1) > 0])
        lod = keep_map("temporal", cells, changed.mean(), np.random.default_rng(0))
        assert np.array_equal(lod > 0, changed)
        red = (cells == (230, 30, 30)).all(-1)                              # 4 cells a frame
        lod = keep_map("salient", cells, red.mean(), np.random.default_rng(0))
        assert np.array_equal(lod > 0, red)

    def test_unknown_policy(self):
        with pytest.raises(ValueError, match=r"Invalid keep policy \('edges'\)\. Supported values are random"):
            keep_map("edges", np.zeros((2, 2, 2, 3), np.float32), 0.5, np.random.default_rng(0))


class TestTokenColors:
    def test_named_colour_per_token_over_its_frame_pair(self):
        from evaluation.scenes import COLORS
        frames = np.full((3, 56, 84, 3), 120, np.uint8)                   # 28-px tokens: a 2 x 3 grid
        frames[:2, 0:28, 0:28] = COLORS["blue"]                            # token (0, 0) of the first pair
        frames[1, 28:56, 56:84] = COLORS["yellow"]                         # half of the first pair's (1, 2)
        frames[2, 28:56, 28:35] = COLORS["red"]                            # a quarter of the last token (1, 1)
        labels = token_colors(frames, (2, 3))
        names, bg = list(COLORS), len(COLORS)
        assert labels.shape == (2, 2, 3) and labels.dtype == np.int8
        assert labels[0].tolist() == [[names.index("blue"), bg, bg], [bg, bg, names.index("yellow")]]
        assert labels[1].tolist() == [[bg, bg, bg], [bg, names.index("red"), bg]]   # the odd frame pairs with itself


class TestTokenObjects:
    def test_shape_and_motion_of_the_colours_object_background_and_unknown(self):
        from evaluation.scenes import COLORS, SHAPES
        names = list(COLORS)
        colors = np.array([[[names.index("red"), names.index("blue"), len(COLORS), names.index("green")]]],
                          np.int8)
        objects = (("red", "circle", "left"), ("blue", "car", "still"), ("blue", "square", "still"))
        shapes, motions = token_objects(colors, objects)
        # red is the circle moving left; blue names two shapes (no shape target) that both stand
        # still; green names no object
        assert shapes.tolist() == [[[SHAPES.index("circle"), -1, len(SHAPES), -1]]]
        assert motions.tolist() == [[[MOTIONS.index("left"), MOTIONS.index("still"), MOTIONS.index("still"), -1]]]

    def test_a_rendered_clips_tokens_carry_its_objects(self):
        from evaluation.scenes import COLORS, SHAPES
        from evaluation.synth_qa import direction_answer, make_qa_scene
        for seed in range(40):
            scene = make_qa_scene(seed)
            if any(t.travel != (0, 0) for t in scene.tracks):
                break
        frames = scene.clip.frames
        colors = token_colors(frames, (frames.shape[1] // 28, frames.shape[2] // 28))
        shapes, motions = token_objects(colors, scene.clip.objects)
        truth = {(t.color, t.shape, direction_answer(t.travel) if t.travel != (0, 0) else "still")
                 for t in scene.tracks}
        assert set(scene.clip.objects) == truth
        names = list(COLORS)
        seen = {(names[c], SHAPES[s], MOTIONS[m]) for c, s, m in zip(colors.ravel(), shapes.ravel(), motions.ravel())
                if 0 <= s < len(SHAPES)}
        assert seen and seen <= truth and any(m != "still" for _, _, m in seen)  # the mover's tokens say so
        assert (shapes[colors == len(COLORS)] == len(SHAPES)).all()

    def test_regions_of_cells(self):
        # an 8-wide grid: cells 0-2 left (centres below 8/3), 3-4 centre, 5-7 right
        assert token_regions((8, 8))[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
        assert token_regions((8, 8))[:, 0].tolist() == [0, 0, 0, 3, 3, 6, 6, 6]
        assert token_regions((3, 3)).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


class TestCurriculum:
    def test_first_steps_keep_only_salient_cells(self):
        data = step_data(tiny_config("drop.curriculum_steps=2", "drop.curriculum_keep=[0.2, 0.3]",
                                     "drop.p_all=1.0", "train.clips_per_step=4"), make_clip)
        early = [k for s in data[1] for k in s.keeps]
        late = [k for s in data[2] for k in s.keeps]
        assert all(0 < (k > 0).mean() < 0.5 for k in early)                 # salient, about 0.2-0.3 a frame
        assert all((k == 1).all() for k in late)                            # p_all = 1 after the curriculum


class TestDeterminism:
    def test_a_step_is_the_same_whoever_makes_it(self):
        data = step_data(tiny_config(), make_clip)
        a, b = data[3], data[3]
        assert [s.questions for s in a] == [s.questions for s in b]
        for x, y in zip(a, b):
            assert np.array_equal(x.frames, y.frames) and all(np.array_equal(k, m) for k, m in zip(x.keeps, y.keeps))
        assert [s.questions for s in data[4]] != [s.questions for s in a]


def with_colored_column(samples):
    """The stand-in's square covers too little of the tiny model's cells to colour a token: label
    each clip's first token column with the colour its direction question names."""
    from pipeline.training.qa_forward import named_color
    for s in samples:
        color = next(c for c in map(named_color, s.questions) if c is not None)
        s.colors[:, :, 0] = color
    return samples


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config("drop.p_all=0.0", "drop.curriculum_steps=0", "train.views_per_question=2")
    model, tokenizer, preprocessor = build(cfg, torch.device("cpu"))
    model.eval()
    return cfg, model, tokenizer, preprocessor


class TestTrainingInputsAreThePipelines:
    def test_prefix_positions_and_answer_logits(self, tiny):
        """Each training row is VLM.build_prefix's prefix (same kept tokens, same M-RoPE positions), and
        its answer logits are the pipeline's uncached logits over prefix + answer. Training encodes
        every patch and drops tokens after the tower: the pipeline's `vlm.encode: all`."""
        cfg, model, tokenizer, preprocessor = tiny
        forward = QAForward(model, tokenizer, preprocessor)
        samples = step_data(cfg, make_clip)[0]
        batch = forward.batch(samples, forward.vision(samples))
        logits, _ = forward.logits(batch)
        vlm = VLM(copy.deepcopy(model), tokenizer, family="qwen2_vl", name="tiny", preprocessor=preprocessor,
                  config=VLMConfig(max_pixels=cfg.model.max_pixels, encode="all"))
        rows, b = [], 0
        pooled = pruned = 0
        for s in samples:
            for question, answer, keep in zip(s.questions, s.answers, s.keeps):
                prefix = vlm.prepare([AnswerRequest("s", s.frames, keep, question, 0.0, 1.0)])[0]
                n = prefix.embeds.shape[0]
                torch.testing.assert_close(batch.embeds[b, :n], prefix.embeds, rtol=1e-4, atol=1e-5)
                assert torch.equal(batch.positions[:, b, :n], prefix.positions)
                assert int(batch.positions[0, b, n]) == prefix.next_position
                assert batch.tokens_kept[b] == prefix.tokens_kept
                pruned += prefix.tokens_kept < prefix.tokens_full
                ids = tokenizer(answer + "<|im_end|>").input_ids
                assert batch.labels[b][batch.labels[b] != IGNORE].tolist() == ids
                rows.append(vlm.generator.logits_without_cache(prefix, torch.tensor(ids[:-1])))
                pooled += int((keep == 2).any())
                b += 1
        assert pooled and pruned > b // 2, "the keep maps did not prune (or pool): the test would not see it"
        torch.testing.assert_close(logits, torch.cat(rows), rtol=1e-4, atol=1e-4)

    def test_region_probe_labels_each_kept_token_with_its_cells_region(self, tiny):
        cfg, model, tokenizer, preprocessor = tiny
        head = torch.nn.Linear(cfg.model.hidden, 9)
        forward = QAForward(model, tokenizer, preprocessor, region_head=head, region_weight=1.0, region_layer=1)
        samples = step_data(cfg, make_clip)[0]
        samples[0].keeps[0] = np.ones_like(samples[0].keeps[0])             # the first view keeps every token
        merged = forward.vision(samples)
        batch = forward.batch(samples, merged)
        labelled = (batch.regions >= 0).sum(1).tolist()
        assert labelled == batch.tokens_kept                                # every kept visual token, nothing else
        Tp, gh, gw = merged[0].shape[:3]
        first = batch.regions[0][batch.regions[0] >= 0].tolist()
        assert first == np.tile(token_regions((gh, gw)).ravel(), Tp).tolist()
        loss, stats = forward(samples)
        assert torch.isfinite(loss) and float(stats["aux"]) > 0
        loss.backward()
        assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0

    def test_grounding_loss_is_the_named_objects_share_of_the_questions_attention(self, tiny):
        """The grounding loss reads the attention that the question's tokens pay to the kept visual
        tokens at ground_layer (the LM's own, checked against HF's eager attention weights) and asks
        it to fall on the tokens of the named colour's object; its gradient reaches that layer."""
        cfg, model, tokenizer, preprocessor = tiny
        layer = 1
        forward = QAForward(model, tokenizer, preprocessor, ground_weight=1.0, ground_layer=layer)
        samples = with_colored_column(step_data(cfg, make_clip)[0])
        batch = forward.batch(samples, forward.vision(samples))
        question, visual, target = batch.ground
        views = [(s, q) for s in samples for q in s.questions]
        named = [b for b, (_, q) in enumerate(views) if "move?" in q and "which way" in q.lower()]
        assert named and target.any(-1).tolist() == [b in named and bool(target[b].any()) for b in range(len(views))]
        grounded = target.any(-1)
        assert 0 < int(grounded.sum()) < len(named), "some views should have dropped the named object's tokens"
        assert (target <= visual).all()
        assert visual.sum(-1).tolist() == [batch.tokens_kept[b] if grounded[b] else 0 for b in range(len(views))]
        for b in named:
            n_text = len(tokenizer("<|vision_end|>" + views[b][1] + "<|im_end|>\n<|im_start|>assistant\n").input_ids)
            assert int(question[b].sum()) == (n_text - 1 if target[b].any() else 0)
        forward._forward(batch)
        loss = forward.ground_loss(batch)
        # the reference: HF's own eager attention weights at that layer
        ref_model = copy.deepcopy(model)
        lm = ref_model.model.language_model
        lm.config._attn_implementation = "eager"
        with torch.no_grad():
            weights = lm(inputs_embeds=batch.embeds, position_ids=batch.positions, use_cache=False,
                         output_attentions=True).attentions[layer]               # (B, H, L, L)
        rows = target.any(-1)
        mean = (weights * question[:, None, :, None]).sum((1, 2)) / (weights.shape[1] * question.sum(-1))[:, None]
        share = (mean * target).sum(-1)[rows] / (mean * visual).sum(-1)[rows]
        torch.testing.assert_close(loss.detach(), -torch.log(share + 1e-6).mean(), rtol=1e-4, atol=1e-5)
        loss.backward()
        q_proj = model.model.language_model.layers[layer].self_attn.q_proj.weight
        assert q_proj.grad is not None and float(q_proj.grad.abs().sum()) > 0
        model.zero_grad(set_to_none=True)
        # and the model keeps its attention implementation
        assert model.model.language_model.config._attn_implementation == "sdpa"

    def test_grounding_steps_move_attention_to_the_named_object(self, tiny):
        cfg, model, tokenizer, preprocessor = tiny
        model = copy.deepcopy(model)
        forward = QAForward(model, tokenizer, preprocessor, ground_weight=1.0, ground_layer=1)
        samples = with_colored_column(step_data(cfg, make_clip)[0])
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            batch = forward.batch(samples, forward.vision(samples))
            forward._forward(batch)
            loss = forward.ground_loss(batch)
            losses.append(float(loss.detach()))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert losses[-1] < 0.5 * losses[0], losses

    def test_chat_template_renders_the_pipelines_prompt(self, tiny):
        _, model, tokenizer, preprocessor = tiny
        vlm = VLM(copy.deepcopy(model), tokenizer, family="qwen2_vl", name="tiny", preprocessor=preprocessor,
                  config=VLMConfig())
        before, after = vlm.prefixes.prompt_ids("Where is the red car?", 1)
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Where is the red car?"}]}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        video_pad = tokenizer.convert_ids_to_tokens(model.config.video_token_id)
        assert tokenizer(rendered).input_ids == before + tokenizer(video_pad).input_ids + after


class TestConfig:
    def test_yamls_are_the_shipped_snapshots_four_stage_recipe(self):
        """configs/qa_vlm.yaml (stage 1, from scratch), configs/qa_vlm_ground.yaml (stage 2, on from
        stage 1's snapshot with the grounding loss), configs/qa_vlm_multi.yaml (stage 3: the training
        renderers, on from stage 2, data-parallel) and configs/qa_vlm_stage4.yaml (stage 4: the weak
        families, on from stage 3, one GPU) train what
        pipeline/vlm/weights/arrcoc-synth-qa was trained with, to its last step: the snapshot keeps
        every stage's summary. Workers do not change the data; stages 2 and 3 ran under a time limit
        that stopped them (stage 2 where stop_step now does); stages 3 and 4 are their yamls with the
        `--set`s of their recorded commands."""
        import shlex

        from pipeline.vlm.loading import SHIPPED
        root = SHIPPED["arrcoc-synth-qa"]
        recipe = {}
        # (yaml, summary, whether the summary's command ran that yaml: stage 2 ran as qa_vlm.yaml + --sets,
        # which its yaml now holds)
        for yaml_name, name, ran_yaml in (("qa_vlm.yaml", "training_summary_stage1.json", False),
                                          ("qa_vlm_ground.yaml", "training_summary_stage2.json", False),
                                          ("qa_vlm_multi.yaml", "training_summary_stage3.json", True),
                                          ("qa_vlm_stage4.yaml", "training_summary.json", True)):
            shipped = json.loads((root / name).read_text())
            sets = []
            if ran_yaml:
                argv = shlex.split(shipped["command"])
                sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
                assert argv[argv.index("--config") + 1] == f"configs/{yaml_name}", name
            recipe[name] = (to_dict(load_config(QAVLMConfig, ROOT / "configs" / yaml_name, sets)), shipped)
        stage1, stage2, stage3, stage4 = (recipe[n][0] for n in recipe)
        assert recipe["training_summary_stage3.json"][1]["processes"] == 2
        assert recipe["training_summary.json"][1]["processes"] == 1
        for name, (yaml_cfg, shipped) in recipe.items():
            t = shipped["config"]["train"]
            if yaml_cfg is stage3:   # stopped by its time limit (any rank's clock), before the schedule's end
                assert not shipped["complete"] and shipped["steps"] < yaml_cfg["train"]["steps"]
                assert abs(shipped["train_s"] - t["time_limit_s"]) < 5
            else:
                last = yaml_cfg["train"]["stop_step"] or yaml_cfg["train"]["steps"]
                assert shipped["steps"] == last and (shipped["complete"] or 0 < t["time_limit_s"] <= shipped["train_s"])
            for key in ("workers", "time_limit_s", "stop_step"):
                yaml_cfg["train"].pop(key)
                t.pop(key, None)
            shipped["config"].setdefault("data", {"renderers": [], "leave_out": ""})   # added since: the default
            for part, key, default in (("model", "arch", "qwen2_vl"), ("model", "deepstack", [1, 2]),
                                       ("drop", "empty_frame_groups", "mix"),   # added with model.arch=qwen3_vl
                                       ("drop", "keep_evidence", 0.0), ("train", "aux_centre_weight", 0.0),
                                       ("train", "aux_facts_weight", 0.0), ("train", "aux_facts_layer", 4),
                                       ("train", "family_views", []), ("data", "extra_questions", [])):  # stage 4's
                shipped["config"][part].setdefault(key, default)
            if yaml_cfg is stage2:   # stage 1's snapshot: then shipped under this name, now runs/qa_vlm's
                assert (yaml_cfg["train"].pop("init"), t.pop("init")) == ("runs/qa_vlm/snapshot", "arrcoc-synth-qa")
            elif yaml_cfg is stage1:
                t.setdefault("aux_ground_weight", 0.0)                       # fields added after stage 1 ran
                t.setdefault("aux_ground_layer", 4)
                t.setdefault("init", "")
            assert yaml_cfg == shipped["config"], name
        for stage in (stage3, stage4):
            assert stage["data"]["renderers"] == ["shapes", "photo", "busy"]
            assert stage["train"]["init"] == "arrcoc-synth-qa"
        assert stage2["train"]["aux_ground_weight"] > 0 and stage3["train"]["aux_ground_weight"] > 0
        assert stage4["train"]["aux_facts_weight"] > 0 and stage4["train"]["family_views"]
        saved = json.loads((root / "config.json").read_text())
        assert saved["arrcoc_pass2_layers"] == stage4["train"]["aux_ground_layer"]

    @pytest.mark.parametrize("override,message", [
        ("train.lr=0", "train.lr=0.0 is out of range; allowed: (0.0, 1.0]"),
        ("train.steps=0", "train.steps=0 is out of range; allowed: [1, 10000000]"),
        ("train.warmup_steps=5000", "train.warmup_steps=5000 is out of range; allowed: [0, 1200]"),
        ("train.stop_step=1300", "train.stop_step=1300 is out of range; allowed: [0, 1200]"),
        ("train.device=tpu", "train.device='tpu' is not supported; allowed: auto, cuda, cpu"),
        ("train.jpeg_quality=[90, 60]", "train.jpeg_quality=[90, 60] must be [low, high] with low <= high"),
        ("train.clips_per_step=2.5", "train.clips_per_step must be an integer, got 2.5"),
        ("drop.keep_min=0", "drop.keep_min=0.0 is out of range; allowed: (0.0, 1.0]"),
        ("drop.keep_max=0.01", "drop.keep_max=0.01 is out of range; allowed: [0.05, 1.0]"),
        ("drop.policies=[random, edges]", "drop.policies='edges' is not supported; allowed: random, frames"),
        ("drop.policies=[]", "drop.policies is empty"),
        ("model.heads=5", "model.hidden=384 must split into model.heads=5 heads"),
        ("model.kv_heads=4", "model.kv_heads=4 must divide model.heads=6"),
        ("model.max_pixels=100", "model.max_pixels=100 is out of range; allowed: [3136, 16777216]"),
        ("model.fps=0", "model.fps=0.0 is out of range; allowed: (0.0, 240.0]"),
        ("val.final_keep_ratios=[1.0, 0]", "val.final_keep_ratios=0.0 is out of range; allowed: (0.0, 1.0]"),
        ("val.bogus=1", "unknown config key val.bogus"),
    ])
    def test_errors_name_the_field_value_and_range(self, override, message):
        with pytest.raises(ConfigError) as info:
            load_config(QAVLMConfig, None, [override])
        assert message in str(info.value) and "\n" not in str(info.value)

    def test_command_line_error_is_one_line(self, capsys, tmp_path):
        assert main(["--set", "train.lr=-1", "--out-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: train.lr=-1.0 is out of range") and err.count("\n") == 1
        assert not any(tmp_path.iterdir())


class TestTrainRun:
    def test_trains_exports_resumes_and_ships_only_when_asked(self, tmp_path, monkeypatch):
        import pipeline.vlm.loading as loading
        shipped = tmp_path / "shipped" / "arrcoc-synth-qa"
        monkeypatch.setitem(loading.SHIPPED, "arrcoc-synth-qa", shipped)
        cfg = tiny_config("train.steps=2", "val.every=1", "val.periodic_clips=2", "val.final_keep_ratios=[1.0, 0.5]")
        out = tmp_path / "run"
        summary = train(cfg, out, make_clip=make_clip, log=lambda _: None)
        assert summary["complete"] and summary["steps"] == 2 and set(summary["val"]) == {"keep_1", "keep_0.5"}
        assert [h["step"] for h in summary["history"]] == [1]
        assert set(summary["val"]["keep_1"]) == {"color_moving", "direction", "overall"}
        assert not shipped.exists()                                         # training writes only under out
        snapshot = out / "snapshot"
        assert json.loads((snapshot / "preprocessor_config.json").read_text())["max_pixels"] == 4704
        assert json.loads((snapshot / "training_summary.json").read_text())["config"] == to_dict(cfg)
        vlm = loading.load_vlm(str(snapshot), device="cpu", dtype="float32")
        assert vlm.geometry.max_pixels == 4704 and vlm.model.dtype == torch.float32
        # a longer run resumes from the checkpoint and ships its snapshot when asked
        longer = tiny_config("train.steps=4", "val.every=1", "val.periodic_clips=2")
        summary = train(longer, out, resume=True, export_shipped=True, make_clip=make_clip, log=lambda _: None)
        assert summary["steps"] == 4 and [h["step"] for h in summary["history"]] == [1, 3]
        assert (shipped / "model.safetensors").is_file() and (shipped / "tokenizer.json").is_file()

    def test_stop_step_ends_the_run_on_the_full_schedule(self, tmp_path):
        from pipeline.training.qa_vlm import lr_at
        cfg = tiny_config("train.steps=4", "train.stop_step=2", "val.clips=0")
        summary = train(cfg, tmp_path, make_clip=make_clip, log=lambda _: None)
        assert summary["complete"] and summary["steps"] == 2
        assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 2
        assert lr_at(1, cfg.train) > lr_at(3, cfg.train) > cfg.train.lr * cfg.train.min_lr_ratio

    def test_init_starts_from_a_snapshot_and_names_the_grounded_layer(self, tmp_path):
        """train.init loads a snapshot's weights before the first step; a grounded run's snapshot
        names the layer pass 2 should read (config.json arrcoc_pass2_layers)."""
        first = tiny_config("train.steps=1", "val.clips=0")
        train(first, tmp_path / "a", make_clip=make_clip, log=lambda _: None)
        snap = tmp_path / "a" / "snapshot"
        model, _, _ = build(tiny_config(f"train.init={snap}"), torch.device("cpu"))
        from pipeline.training.qa_checkpoint import start_from
        start_from(model, snap)
        from transformers import Qwen2VLForConditionalGeneration
        saved = Qwen2VLForConditionalGeneration.from_pretrained(snap, dtype=torch.float32).state_dict()
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, saved[name]), name
        cfg = tiny_config("train.steps=1", "val.clips=0", f"train.init={snap}", "train.aux_ground_weight=1.0",
                          "train.aux_ground_layer=1", "train.lr=1e-9", "train.warmup_steps=0")
        logs = []
        train(cfg, tmp_path / "b", make_clip=make_clip, log=logs.append)
        assert f"started from {snap}" in logs
        config = json.loads((tmp_path / "b" / "snapshot" / "config.json").read_text())
        assert config["arrcoc_pass2_layers"] == 1
        assert "arrcoc_pass2_layers" not in json.loads((snap / "config.json").read_text())
        after = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "b" / "snapshot", dtype=torch.float32)
        name = "model.language_model.layers.0.self_attn.q_proj.weight"
        torch.testing.assert_close(after.state_dict()[name], saved[name], rtol=1e-2, atol=1e-3)
        with pytest.raises(ConfigError, match=r"train.init=.*: .* is shape .* the model fields give"):
            train(tiny_config("train.steps=1", "val.clips=0", f"train.init={snap}", "model.intermediate=96"),
                  tmp_path / "c", make_clip=make_clip, log=lambda _: None)
        with pytest.raises(ConfigError, match=r"train.init=.*nowhere: no \*.safetensors snapshot there"):
            train(tiny_config("train.steps=1", "val.clips=0", f"train.init={tmp_path}/nowhere"),
                  tmp_path / "d", make_clip=make_clip, log=lambda _: None)
        assert not (tmp_path / "d").exists()                                # nothing written
        with pytest.raises(ConfigError, match="train.aux_ground_layer=2 must be below model.layers=2"):
            train(tiny_config("train.steps=1", "val.clips=0", "train.aux_ground_weight=1", "train.aux_ground_layer=2"),
                  tmp_path / "e", make_clip=make_clip, log=lambda _: None)

    def test_resume_refuses_another_model(self, tmp_path):
        train(tiny_config("train.steps=1", "val.clips=0"), tmp_path, make_clip=make_clip, log=lambda _: None)
        with pytest.raises(ConfigError, match="trained with another model or seed"):
            train(tiny_config("train.steps=2", "val.clips=0", "model.layers=1"), tmp_path, resume=True,
                  make_clip=make_clip, log=lambda _: None)
