"""benchmarks/fit_probe.py: the tempering probe fitted on a split's first-rung answers (tiny-random:
its answers are meaningless, the plumbing is not), and the matching of recorded features to eval's
answers."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import fit_probe  # noqa: E402
from benchmarks.fit_probe import match  # noqa: E402
from pipeline.vlm.probe import FEATURES, Probe  # noqa: E402


def prediction(video, question, margin, correct):
    return SimpleNamespace(question=SimpleNamespace(video_id=video, question=question), confidence=margin,
                           correct=correct)


def test_match_pairs_features_with_their_answers_by_question_and_margin():
    f = [torch.full((len(FEATURES),), float(i)) for i in range(3)]
    rows = [("how many?", float(np.float32(0.25)), f[0]), ("how many?", float(np.float32(0.5)), f[1]),
            ("what colour?", float(np.float32(0.25)), f[2])]
    preds = [prediction(2, "what colour?", 0.25, True), prediction(1, "how many?", 0.5, False),
             prediction(0, "how many?", 0.25, True)]
    features, answers = match(rows, preds)
    torch.testing.assert_close(features, torch.stack([f[2], f[1], f[0]]))
    assert [a.question.video_id for a in answers] == [2, 1, 0]
    with pytest.raises(SystemExit, match=r"no recorded features for 3: 'where\?'"):
        match(rows, [prediction(3, "where?", 0.25, True)])


def test_fits_a_probe_file_tempering_loads(tmp_path):
    from evaluation.synth_qa import write_split
    write_split(tmp_path / "calib", "val", 2, first_seed=1_900_000)
    out = tmp_path / "probe.json"
    # in this process: the script's start-up is its imports, which test_bench_common covers
    assert fit_probe.main(["--root", str(tmp_path / "calib"), "--vlm", "tiny-random", "--device", "cpu",
                           "--ladder", "0.1,0.25", "--out", str(out)]) == 0
    probe = Probe.load(out)
    questions = len(json.loads((tmp_path / "calib" / "val_qa.json").read_text()))
    assert probe.fitted_on["answers"] == questions and probe.fitted_on["ladder"] == [0.1, 0.25]
    assert probe.fitted_on["target"] == "wrong at the first rung and right at the top rung"
    assert 0.0 <= float(probe.confidence(torch.randn(1, 40))) <= 1.0
