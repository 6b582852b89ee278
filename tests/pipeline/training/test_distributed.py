"""Data-parallel training of the video-QA VLM: two gloo processes under torchrun take their share of
every step's clips, stay in sync, and only rank 0 writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arr_coc._validate import ConfigError
from pipeline.configio import load_config
from pipeline.training import distributed
from pipeline.training.qa_vlm import QAVLMConfig, step_data

ROOT = Path(__file__).resolve().parents[3]
TINY = ["model.hidden=32", "model.intermediate=64", "model.layers=1", "model.heads=2", "model.kv_heads=1",
        "model.vision_depth=1", "model.vision_dim=32", "model.vision_heads=2", "model.vision_mlp_ratio=1",
        "model.max_pixels=12544", "train.steps=2", "train.clips_per_step=2", "train.views_per_question=1",
        "train.workers=0", "train.device=cpu", "train.warmup_steps=0", "train.aux_shape_weight=1.0",
        "drop.curriculum_steps=0", "val.clips=0", "val.periodic_clips=0", "data.renderers=[shapes, photo]"]


def test_two_gloo_ranks_train_in_sync(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "pipeline.training.qa_vlm", "--out-dir", str(out), *[a for kv in TINY for a in ("--set", kv)]]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "history.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 2 and summary["complete"]
    a, b = summary["rank_fingerprints"]
    assert a == pytest.approx(b, rel=1e-12, abs=0.0)
    # the steps changed the weights: the fingerprint is not the seed's initialisation
    from pipeline.training.qa_vlm import build
    model, _, _ = build(load_config(QAVLMConfig, None, TINY), torch.device("cpu"))
    assert distributed.fingerprint(model).sum(0).tolist() != pytest.approx(a, rel=1e-9)
    assert (out / "snapshot").is_dir() and (out / "checkpoint.pt").is_file()
    assert "2 data-parallel processes" in done.stdout


def test_ranks_share_each_step_and_together_see_every_clip():
    cfg = load_config(QAVLMConfig, None, TINY + ["train.clips_per_step=4", "data.renderers=[shapes]"])
    seen = []

    def make_clip(seed, split):
        seen.append(seed)
        from evaluation.synth_qa import make_qa_clip
        return make_qa_clip(seed, split=split)
    for rank in (0, 1):
        assert len(step_data(cfg, make_clip, rank, 2)[3]) == 2
    assert sorted(seen) == list(range(12, 16))


def test_held_out_renderer_refused_by_the_config():
    with pytest.raises(ConfigError, match="held-out renderer"):
        load_config(QAVLMConfig, None, TINY + ["data.renderers=[shapes, styled]"])
    with pytest.raises(ConfigError, match="leaves no renderer"):
        load_config(QAVLMConfig, None, TINY + ["data.renderers=[photo]", "data.leave_out=photo"])
    with pytest.raises(ConfigError, match="data.renderers"):
        load_config(QAVLMConfig, None, TINY + ["data.renderers=[nope]"])


def test_single_process_is_untouched(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks, device = distributed.setup(torch.device("cpu"))
    assert ranks == distributed.Ranks() and device == torch.device("cpu")
    forward = lambda batch: batch  # noqa: E731
    assert distributed.wrap(torch.nn.ModuleList(), forward, ranks, device) is forward
