"""Checkpoints: a round trip is exact, a misfit is a clear error naming the tensors (never a
partial load), the shipped default loads as documented."""
import warnings

import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.checkpoint import DEFAULT_WEIGHTS, load_pretrained, load_weights, resolve_weights, save_weights
from arr_coc.model import ARRCOC


class TestCheckpoint:
    def test_round_trip(self, tmp_path):
        torch.manual_seed(1)
        a = ARRCOC(query_dim=16)
        with torch.no_grad():
            for p in a.parameters():
                p.add_(torch.randn_like(p))
        path = save_weights(a, tmp_path / "w.safetensors", {"note": "x"})
        b = ARRCOC(query_dim=16)
        load_weights(b, path)
        for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(va, vb), k

    def test_shape_mismatch_is_a_clear_error(self, tmp_path):
        path = save_weights(ARRCOC(query_dim=16), tmp_path / "w.safetensors")
        with pytest.raises(ConfigError, match=r"shape mismatches \(balancer.policy.0.weight is \(64, 25\) in the file, "
                                              r"\(64, 41\) in the model, balancer.query_norm.bias is \(16,\)"):
            load_weights(ARRCOC(query_dim=32), path)

    def test_missing_and_unexpected_keys_are_named(self, tmp_path):
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in ARRCOC(query_dim=16).state_dict().items()}
        tensors["extra.weight"] = tensors.pop("realizer.decay_logit")
        save_file(tensors, str(tmp_path / "w.safetensors"))
        with pytest.raises(ConfigError, match=r"1 missing keys \(realizer.decay_logit\); "
                                              r"1 unexpected keys \(extra.weight\)"):
            load_weights(ARRCOC(query_dim=16), tmp_path / "w.safetensors")

    def test_bad_path_names_the_spec_as_the_caller_calls_it(self, tmp_path):
        with pytest.raises(ConfigError, match=r"runtime.model_weights='.*missing.safetensors': no such file"):
            load_pretrained(ARRCOC(query_dim=384), str(tmp_path / "missing.safetensors"), "runtime.model_weights")

    def test_none_means_the_initial_values(self):
        assert resolve_weights("none") is None
        torch.manual_seed(0)
        model = ARRCOC(query_dim=8)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        load_pretrained(model, "none")
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    def test_a_damaged_file_is_a_clear_error(self, tmp_path):
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"not a checkpoint")
        with pytest.raises(ConfigError, match="bad.safetensors is not a readable safetensors checkpoint"):
            load_weights(ARRCOC(query_dim=8), bad)


@pytest.mark.skipif(not DEFAULT_WEIGHTS.is_file(), reason="the shipped checkpoint is not built yet")
class TestShippedDefault:
    def test_default_is_trained_and_loads_every_tensor_for_minilm(self):
        from arr_coc.checkpoint import read_weights

        m = ARRCOC(query_dim=384)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_pretrained(m, "default")
        tensors, _ = read_weights(DEFAULT_WEIGHTS)
        assert all(torch.equal(v, tensors[k]) for k, v in m.state_dict().items())
        assert not torch.equal(m.state_dict()["knowing.participatory.log_scale"],
                               ARRCOC(query_dim=384).state_dict()["knowing.participatory.log_scale"])

    def test_synth_qa_is_trained_through_arrcoc_synth_qa_answers(self):
        """runtime.model_weights=synth-qa: relevance on the QA renderers, then trained through
        arrcoc-synth-qa's answers by configs/train_renderers_vlm_qa.yaml (its metadata records that
        config and the relevance weights it started from); not the default's values."""
        import json
        from arr_coc.checkpoint import NAMED_WEIGHTS, read_weights

        m = ARRCOC(query_dim=384)
        load_pretrained(m, "synth-qa")
        tuned, meta = read_weights(NAMED_WEIGHTS["synth-qa"])
        assert all(torch.equal(v, tuned[k]) for k, v in m.state_dict().items())
        config = json.loads(meta["train_config"])
        assert config["vlm"] == "arrcoc-synth-qa" and config["init"].endswith("arrcoc_relevance.safetensors")
        assert [s["name"] for s in config["stages"]] == ["vlm_qa"]
        default, _ = read_weights(DEFAULT_WEIGHTS)
        assert any(not torch.equal(v, default[k]) for k, v in tuned.items() if k in default)
        with pytest.raises(ConfigError, match="allowed: default, synth-qa, none or a .safetensors path"):
            load_pretrained(m, "synth-qa-missing", "runtime.model_weights")

    def test_auto_weights_are_the_answer_models_own(self):
        """runtime.model_weights "auto" (the default): synth-qa under arrcoc-synth-qa, default under any
        other VLM; a name given is kept."""
        from arr_coc.checkpoint import NAMED_WEIGHTS, read_weights
        from pipeline.config import PipelineConfig, RuntimeConfig
        from pipeline.core.setup import build_model

        assert RuntimeConfig().model_weights == "auto"
        assert RuntimeConfig(vlm="arrcoc-synth-qa").arrcoc_weights == "synth-qa"
        assert RuntimeConfig(vlm="Qwen/Qwen2-VL-2B-Instruct").arrcoc_weights == "default"
        assert RuntimeConfig(vlm="arrcoc-synth-qa", model_weights="default").arrcoc_weights == "default"
        model = build_model(PipelineConfig(runtime=RuntimeConfig(vlm="arrcoc-synth-qa")), torch.device("cpu"))
        tuned, _ = read_weights(NAMED_WEIGHTS["synth-qa"])
        assert all(torch.equal(v, tuned[k]) for k, v in model.state_dict().items())
        with pytest.raises(ConfigError, match="allowed: auto, default, synth-qa, none or a .safetensors path"):
            build_model(PipelineConfig(runtime=RuntimeConfig(model_weights="autoo")), torch.device("cpu"))

    def test_other_query_width_is_an_error_not_a_partial_load(self):
        with pytest.raises(ConfigError, match=r"runtime.model_weights=default: .*5 shape mismatches .*"
                                              r"use runtime.model_weights=none"):
            load_pretrained(ARRCOC(query_dim=64), "default", "runtime.model_weights")
