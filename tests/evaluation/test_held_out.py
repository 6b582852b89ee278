"""Leave-one-renderer-out: the held-out renderer never reaches training or tuning, and the dataset
command writes multi-renderer, leave-one-out and held-out splits a user can load."""
from __future__ import annotations

import json
import sys
import re
from pathlib import Path

import pytest
import yaml

import evaluation.renderers as renderers
from evaluation.renderers import HELD_OUT, RENDERERS, training_renderers
from evaluation.synth_qa import SPLIT_SEEDS, main

ROOT = Path(__file__).resolve().parents[2]
TRAINING_CODE = sorted((ROOT / "pipeline" / "training").glob("*.py"))
TRAINING_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


class TestTrainingNeverDrawsTheHeldOutRenderer:
    def test_no_training_module_asks_for_evaluation_clips_or_names_the_renderer(self):
        assert TRAINING_CODE
        for path in TRAINING_CODE:
            text = path.read_text()
            if path.name == "qa_eval.py":
                # the scoring command: its --held-out flag draws the held-out test split; training
                # imports only its validation (below), never the clip source behind that flag
                continue
            assert "evaluation=True" not in text, path
            assert "_clip_source" not in text and "held_out" not in text, path
            assert not re.search(rf"['\"]{HELD_OUT}['\"]", text), path
            assert "HELD_OUT" not in text or path.name == "qa_vlm.py", path   # qa_vlm refuses it by name

    def test_no_config_names_the_renderer(self):
        for path in TRAINING_CONFIGS:
            data = yaml.safe_load(path.read_text()) or {}
            named = (data.get("data") or {}).get("renderers") or []
            assert HELD_OUT not in named, path

    def test_every_qa_config_loads_and_draws_only_training_renderers(self, monkeypatch):
        """Each qa_vlm config's train and val clips, drawn through the trainer's own clip source,
        come from training renderers; the held-out one is never rendered."""
        from pipeline.configio import load_config
        from pipeline.training.qa_vlm import QAVLMConfig, clip_source, step_data

        drawn = []
        real = renderers._recipe_scene

        def spy(name, seed, split, draw_objects=True):
            drawn.append(name)
            assert name != HELD_OUT
            return real(name, seed, split, draw_objects)
        monkeypatch.setattr(renderers, "_recipe_scene", spy)
        configs = [p for p in TRAINING_CONFIGS if "qa_vlm" in p.name]
        assert any("multi" in p.name for p in configs)
        for path in configs:
            cfg = load_config(QAVLMConfig, path, ["train.workers=0", "train.clips_per_step=6"])
            source = clip_source(cfg)
            step = step_data(cfg, source)[0]
            assert len(step) == 6
            for seed in range(cfg.val.first_seed, cfg.val.first_seed + 3):
                source(seed, split="val")
        assert set(drawn) == {"photo", "busy"}

    def test_the_one_gate_refuses_every_non_evaluation_draw(self):
        for split in ("train", "val", "test"):
            with pytest.raises(renderers.HeldOutError):
                renderers.scene(HELD_OUT, SPLIT_SEEDS[split].start, split=split)
        assert HELD_OUT not in training_renderers() and HELD_OUT in RENDERERS


class TestDatasetCommand:
    def test_writes_every_renderer_with_tracks_and_loads(self, tmp_path, capsys):
        from sources.msrvtt import load_msrvtt

        assert main(["--root", str(tmp_path), "--renderers", "shapes,photo,busy", "--splits", "test",
                     "--count", "3", "--quiet"]) == 0
        records = json.loads((tmp_path / "test_qa.json").read_text())
        tracks = json.loads((tmp_path / "test_tracks.json").read_text())
        assert {r["renderer"] for r in records} == {"shapes", "photo", "busy"}
        assert len(tracks) == 3
        for r in records:
            video = tracks[str(r["video_id"])]
            assert r["one_object"] == (len(r["objects"]) == 1)
            assert all(0 <= i < len(video["tracks"]) for i in r["objects"])
            assert (tmp_path / "videos" / f"video{r['video_id']}.mp4").is_file()
        dataset = load_msrvtt(tmp_path, "test")
        assert len(dataset.questions) == len(records)

    def test_held_out_only_by_name_for_its_test_split(self, tmp_path, capsys):
        assert main(["--root", str(tmp_path), "--renderers", f"shapes,{HELD_OUT}", "--splits", "test"]) == 2
        assert "held out" in capsys.readouterr().err
        assert main(["--root", str(tmp_path), "--held-out", "--splits", "train,test"]) == 2
        assert "only the test split" in capsys.readouterr().err
        assert main(["--root", str(tmp_path), "--held-out", "--splits", "test", "--count", "2", "--quiet"]) == 0
        records = json.loads((tmp_path / "test_qa.json").read_text())
        assert {r["renderer"] for r in records} == {HELD_OUT}

    def test_leave_one_out_and_bad_names(self, tmp_path, capsys):
        assert main(["--root", str(tmp_path), "--leave-out", "photo", "--splits", "val", "--count", "2",
                     "--quiet"]) == 0
        assert {r["renderer"] for r in json.loads((tmp_path / "val_qa.json").read_text())} == \
            set(training_renderers("photo"))
        assert main(["--root", str(tmp_path), "--renderers", "nope"]) == 2
        assert "unknown renderer 'nope'" in capsys.readouterr().err
        assert main(["--root", str(tmp_path), "--renderers", "photo", "--leave-out", "busy"]) == 2

    def test_held_out_defaults_to_its_test_split_and_missing_scikit_image_is_one_line(self, tmp_path, capsys,
                                                                                       monkeypatch):
        assert main(["--root", str(tmp_path / "h"), "--held-out", "--count", "1", "--quiet"]) == 0
        assert (tmp_path / "h" / "test_qa.json").is_file() and not (tmp_path / "h" / "train_qa.json").exists()
        from evaluation import draw
        monkeypatch.setattr(draw, "_PHOTO_CACHE", {})
        monkeypatch.setitem(sys.modules, "skimage", None)
        monkeypatch.setitem(sys.modules, "skimage.data", None)
        assert main(["--root", str(tmp_path / "p"), "--renderers", "photo", "--splits", "test", "--count", "2",
                     "--quiet"]) == 1
        err = capsys.readouterr().err
        assert "scikit-image" in err and "Traceback" not in err
