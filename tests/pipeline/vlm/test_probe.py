"""pipeline.vlm.probe: tempering's learned confidence (vlm.tempering.confidence: probe), its
features, fitting, file and place in the VLM."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import make_frames, random_keep, record_prefills, rewrap

from arr_coc._validate import ConfigError
from pipeline.vlm_config import TemperingConfig
from pipeline.runtime.requests import AnswerRequest
from pipeline.vlm.probe import FEATURES, FORMAT, Probe, fit_probe, probe_features


def probe_with(bias: float, weight=None) -> Probe:
    return Probe(torch.zeros(len(FEATURES)) if weight is None else torch.as_tensor(weight, dtype=torch.float32),
                 bias, {})


class TestFeatures:
    def test_summary_of_a_known_distribution(self):
        probs = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]])
        f = probe_features(probs.log())[0]
        entropy = float(-(probs * probs.log()).sum())
        expected = [0.5, 0.2, 0.1, 0.1, 0.05, 0.3, 1 - entropy / math.log(6), math.log(0.5), math.log(0.2)]
        torch.testing.assert_close(f, torch.tensor(expected), atol=1e-6, rtol=0)

    def test_any_vocabulary_same_features_and_offset_free(self):
        g = torch.Generator().manual_seed(0)
        for vocab in (5, 37, 2893):
            logits = torch.randn(3, vocab, generator=g)
            f = probe_features(logits)
            assert f.shape == (3, len(FEATURES)) and f.dtype == torch.float32
            torch.testing.assert_close(probe_features(logits + 5.0), f, atol=1e-5, rtol=0)

    def test_too_few_tokens(self):
        with pytest.raises(ValueError, match=r"logits must be \(B, V\) with V >= 5, got \(2, 4\)"):
            probe_features(torch.zeros(2, 4))


class TestFit:
    def data(self, n=600, seed=0):
        """Answers whose chance of being wrong falls with the first token's margin."""
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(n, 50, generator=g) * torch.rand(n, 1, generator=g) * 6
        margin = probe_features(logits)[:, FEATURES.index("margin")]
        wrong = torch.rand(n, generator=g) < 0.9 - 0.8 * margin
        return logits, wrong

    def test_separates_what_it_was_fit_on_and_new_answers(self):
        logits, wrong = self.data()
        probe = fit_probe(probe_features(logits), wrong, l2=1.0, fitted_on={"split": "synthetic"})
        for lg, wr in (self.data(), self.data(seed=1)):
            conf = probe.confidence(lg)
            assert ((conf >= 0) & (conf <= 1)).all()
            right, bad = conf[~wr], conf[wr]
            auc = float((right[:, None] > bad[None, :]).float().mean())          # P(a right answer ranks higher)
            assert auc > 0.75
        assert probe.fitted_on == {"split": "synthetic", "answers": 600, "ask_again": int(wrong.sum()), "l2": 1.0}

    def test_base_rate_without_signal(self):
        features = torch.ones(400, len(FEATURES))                             # nothing to tell answers apart
        wrong = torch.arange(400) % 4 == 0
        probe = fit_probe(features, wrong)
        conf = probe.confidence(torch.randn(3, 20))
        torch.testing.assert_close(conf, torch.full((3,), 0.75), atol=1e-3, rtol=0)

    @pytest.mark.parametrize("features, wrong, l2, match", [
        (torch.zeros(4, 3), torch.zeros(4, dtype=torch.bool), 1.0, r"features must be \(N, 9\)"),
        (torch.zeros(4, 9), torch.zeros(3, dtype=torch.bool), 1.0, r"as many correctness flags as feature rows"),
        (torch.zeros(4, 9), torch.zeros(4, dtype=torch.bool), 0.0, r"l2 must be > 0"),
    ])
    def test_bad_input(self, features, wrong, l2, match):
        with pytest.raises(ValueError, match=match):
            fit_probe(features, wrong, l2=l2)


class TestFile:
    def test_round_trip(self, tmp_path):
        probe = probe_with(-0.5, torch.linspace(-1, 1, len(FEATURES)))
        probe.save(tmp_path / "p.json")
        back = Probe.load(tmp_path / "p.json")
        torch.testing.assert_close(back.weight, probe.weight)
        assert back.bias == pytest.approx(-0.5)

    @pytest.mark.parametrize("content, match", [
        (None, r"vlm.tempering.probe='.*missing.json': no such file$"),
        ("{not json", r": not a probe file \(JSONDecodeError"),
        (json.dumps({"format": "other"}), r": format 'other', expected 'arrcoc-tempering-probe/1'"),
        (json.dumps({"format": FORMAT, "features": ["p1"], "weight": [0.0], "bias": 0.0}),
         r": features \['p1'\], expected"),
        (json.dumps({"format": FORMAT, "features": list(FEATURES), "weight": [0.0] * 3, "bias": 0.0}),
         r": bad weight or bias \(ValueError: Probe.weight must be a \(9,\) tensor"),
        (json.dumps({"format": FORMAT, "features": list(FEATURES), "weight": [0.0] * 9}),
         r": bad weight or bias \(KeyError"),
    ])
    def test_bad_files_are_one_config_error(self, tmp_path, content, match):
        path = tmp_path / ("missing.json" if content is None else "p.json")
        if content is not None:
            path.write_text(content)
        with pytest.raises(ConfigError, match=match) as e:
            Probe.load(path)
        assert "\n" not in str(e.value)


def test_a_relative_name_is_read_from_the_snapshot(tmp_path, monkeypatch):
    """Probe.load(name, snapshot): a path that exists is read as given; a relative one that does not
    is read from the VLM's snapshot directory; found in neither, the error names the path given."""
    snapshot, here = tmp_path / "snapshot", tmp_path / "here"
    snapshot.mkdir()
    here.mkdir()
    fit_probe(torch.randn(40, 9), torch.arange(40) % 2 == 0, l2=1.0).save(snapshot / "p.json")
    monkeypatch.chdir(here)
    shipped = Probe.load("p.json", snapshot=snapshot)
    assert torch.equal(shipped.weight, Probe.load(snapshot / "p.json").weight)
    fit_probe(torch.randn(40, 9), torch.arange(40) % 3 == 0, l2=1.0).save(here / "p.json")
    local = Probe.load("p.json", snapshot=snapshot)                           # the working directory's first
    assert not torch.equal(local.weight, shipped.weight)
    with pytest.raises(ConfigError, match=r"^vlm.tempering.probe='q.json': no such file$"):
        Probe.load("q.json", snapshot=snapshot)


class TestConfig:
    def test_probe_needs_its_file_and_the_file_needs_probe(self):
        with pytest.raises(ConfigError, match=r"^vlm.tempering.confidence=probe needs vlm.tempering.probe, "
                                              r"the probe file"):
            TemperingConfig(confidence="probe")
        with pytest.raises(ConfigError, match=r"^vlm.tempering.probe is read only with vlm.tempering.confidence=probe, "
                                              r"got confidence=margin$"):
            TemperingConfig(probe="p.json")
        with pytest.raises(ConfigError, match=r"^vlm.tempering.probe must be a file path, got 3$"):
            TemperingConfig(confidence="probe", probe=3)
        assert TemperingConfig(confidence="probe", probe="p.json").probe == "p.json"

    def test_a_missing_file_stops_the_vlm_from_loading(self, vlm, tmp_path):
        with pytest.raises(ConfigError, match=r"no such file"):
            rewrap(vlm, tempering=TemperingConfig(ladder=(0.2, 1.0), confidence="probe",
                                                  probe=str(tmp_path / "no.json")))


class TestInTempering:
    """The probe's confidence decides tempering's passes and is what answers report."""

    def answer(self, vlm, tmp_path, monkeypatch, bias):
        probe_with(bias).save(tmp_path / "p.json")
        v = rewrap(vlm, tempering=TemperingConfig(ladder=(0.2, 1.0), threshold=0.5, confidence="probe",
                                                  probe=str(tmp_path / "p.json"), rank="relevance"))
        frames = make_frames(4, 112, 140, seed=11)
        keep = random_keep(vlm, frames, seed=12, p=(0.1, 0.7, 0.2))
        scores = np.random.default_rng(13).random(keep.shape).astype(np.float32)
        calls = record_prefills(v, monkeypatch)
        request = AnswerRequest("s0", frames, keep, "what colour is the car?", 0.0, 1.0, scores=scores)
        return v.answer([request])[0], calls

    def test_sure_answers_once(self, vlm, tmp_path, monkeypatch):
        result, calls = self.answer(vlm, tmp_path, monkeypatch, bias=-4.0)          # P(ask again) 0.018
        assert result.passes == 1 and len(calls) == 1
        assert result.confidence == pytest.approx(1 / (1 + math.exp(-4.0)), abs=1e-5)

    def test_unsure_answers_again_with_more_tokens(self, vlm, tmp_path, monkeypatch):
        result, calls = self.answer(vlm, tmp_path, monkeypatch, bias=4.0)           # P(ask again) 0.982
        assert result.passes == 2 and calls[1][0].tokens_kept > calls[0][0].tokens_kept
        assert result.tokens_spent == calls[0][0].tokens_kept + calls[1][0].tokens_kept

    def test_single_pass_answers_report_it(self, vlm, tmp_path):
        probe_with(0.0, torch.eye(len(FEATURES))[FEATURES.index("margin")] * -3).save(tmp_path / "p.json")
        v = rewrap(vlm, tempering=TemperingConfig(confidence="probe", probe=str(tmp_path / "p.json")))
        frames = make_frames(4, 112, 140, seed=3)
        prefixes = v.prepare([AnswerRequest("s", frames, None, "how many cars?", 0.0, 1.0)])
        out = v.generate(prefixes, return_logits=True)
        margin = probe_features(out.step_logits[0])[0, FEATURES.index("margin")]
        assert out.confidence[0] == pytest.approx(float(torch.sigmoid(3 * margin)), abs=1e-5)


def test_the_shipped_models_probe_loads():
    from pipeline.vlm.loading import SHIPPED
    probe = Probe.load(SHIPPED["arrcoc-synth-qa"] / "tempering_probe.json")
    assert probe.fitted_on["ladder"] == [0.05, 0.25] and probe.fitted_on["vlm"] == "arrcoc-synth-qa"
    sure, flat = torch.tensor([[12.0] + [0.0] * 40]), torch.zeros(1, 41)
    assert float(probe.confidence(sure)) > float(probe.confidence(flat))    # a certain answer is trusted more
