"""Checkpoints: a round trip is exact, a misfit is a clear error, the shipped default loads (or
warns) as documented."""
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
        assert load_weights(b, path) == []
        for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(va, vb), k

    def test_shape_mismatch_is_a_clear_error(self, tmp_path):
        path = save_weights(ARRCOC(query_dim=16), tmp_path / "w.safetensors")
        with pytest.raises(ConfigError, match=r"shape mismatches \(first: balancer.policy.0.weight is \(64, 25\) in the file, \(64, 41\) in the model\)"):
            load_weights(ARRCOC(query_dim=32), path)

    def test_partial_keeps_only_misfits_at_init(self, tmp_path):
        src = ARRCOC(query_dim=16)
        with torch.no_grad():
            src.realizer.decay_logit.fill_(2.0)
        path = save_weights(src, tmp_path / "w.safetensors")
        dst = ARRCOC(query_dim=32)
        skipped = load_weights(dst, path, partial=True)
        assert skipped and all(k.startswith(("knowing.participatory.project", "balancer.")) for k in skipped)
        assert dst.realizer.decay_logit.item() == 2.0

    def test_bad_path_names_the_spec_as_the_caller_calls_it(self, tmp_path):
        with pytest.raises(ConfigError, match=r"runtime.model_weights='.*missing.safetensors': no such file"):
            load_pretrained(ARRCOC(query_dim=384), str(tmp_path / "missing.safetensors"), "runtime.model_weights")

    def test_none_means_the_initial_values(self):
        assert resolve_weights("none") is None
        assert load_pretrained(ARRCOC(query_dim=8), "none") == []

    def test_a_damaged_file_is_a_clear_error(self, tmp_path):
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"not a checkpoint")
        with pytest.raises(ConfigError, match="bad.safetensors is not a readable safetensors checkpoint"):
            load_weights(ARRCOC(query_dim=8), bad)


@pytest.mark.skipif(not DEFAULT_WEIGHTS.is_file(), reason="the shipped checkpoint is not built yet")
class TestShippedDefault:
    def test_default_is_trained_and_loads_strictly_for_minilm(self):
        m = ARRCOC(query_dim=384)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert load_pretrained(m, "default") == []
        assert not torch.equal(m.state_dict()["knowing.participatory.log_scale"],
                               ARRCOC(query_dim=384).state_dict()["knowing.participatory.log_scale"])

    def test_other_query_width_warns(self):
        with pytest.warns(UserWarning, match="keep their untrained initial values"):
            skipped = load_pretrained(ARRCOC(query_dim=64), "default")
        assert skipped
