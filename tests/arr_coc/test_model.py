"""ARRCOC.from_pretrained and the package's exported names."""
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import arr_coc
from arr_coc import ARRCOC, ARRCOCConfig, ConfigError
from arr_coc.checkpoint import DEFAULT_WEIGHTS, save_weights

ROOT = Path(__file__).resolve().parents[2]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(va, vb) for va, vb in zip(a.state_dict().values(), b.state_dict().values()))


class TestFromPretrained:
    @pytest.mark.skipif(not DEFAULT_WEIGHTS.is_file(), reason="the shipped checkpoint is not built yet")
    def test_default_loads_the_shipped_checkpoint_in_eval_mode(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")       # the default architecture takes every tensor
            model = ARRCOC.from_pretrained()
        assert isinstance(model, ARRCOC) and not model.training and model.query_dim == 384
        assert not _same_weights(model, ARRCOC())

    def test_a_path_loads_exactly(self, tmp_path):
        torch.manual_seed(3)
        src = ARRCOC(query_dim=16)
        with torch.no_grad():
            for p in src.parameters():
                p.add_(torch.randn_like(p))
        path = save_weights(src, tmp_path / "w.safetensors")
        model = ARRCOC.from_pretrained(path, query_dim=16)
        assert _same_weights(model, src)
        assert _same_weights(ARRCOC.from_pretrained(str(path), query_dim=16), src)

    def test_none_keeps_the_initial_values(self):
        torch.manual_seed(0)
        a = ARRCOC.from_pretrained("none", query_dim=8)
        torch.manual_seed(0)
        assert _same_weights(a, ARRCOC(query_dim=8))

    def test_config_is_used(self, tmp_path):
        cfg = ARRCOCConfig()
        cfg = replace(cfg, attending=replace(cfg.attending, retention=0.5))
        model = ARRCOC.from_pretrained("none", config=cfg, query_dim=8)
        assert model.cfg.attending.retention == 0.5

    @pytest.mark.skipif(not DEFAULT_WEIGHTS.is_file(), reason="the shipped checkpoint is not built yet")
    def test_default_into_another_query_width_is_an_error(self):
        with pytest.raises(ConfigError, match=r"weights=default: the shipped checkpoint fits the default "
                                              r"architecture with 384-d MiniLM queries.*shape mismatches \(balancer"):
            ARRCOC.from_pretrained("default", query_dim=64)

    def test_allocates_frames(self):
        model = ARRCOC.from_pretrained()
        frames = torch.rand(3, 3, 64, 96)
        allocation, state = model(frames, torch.nn.functional.normalize(torch.randn(384), dim=0), grid=(4, 6))
        assert allocation.tokens.shape == (3, 4, 6) and allocation.scene_change[0]

    @pytest.mark.parametrize("kwargs, message", [
        (dict(weights="missing.safetensors"), r"weights='missing.safetensors': no such file"),
        (dict(weights=3), r"weights must be 'default', 'none' or a .safetensors path, got 3"),
        (dict(query_dim=0), r"query_dim=0 is out of range"),
        (dict(query_dim=1.5), r"query_dim must be an integer"),
    ])
    def test_bad_arguments_name_the_value(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            ARRCOC.from_pretrained(**kwargs)

    def test_a_config_of_the_wrong_type(self):
        with pytest.raises(TypeError, match="config must be an ARRCOCConfig or None, got dict"):
            ARRCOC.from_pretrained(config={})


class TestPackage:
    def test_exports(self):
        for name in arr_coc.__all__:
            assert getattr(arr_coc, name) is not None
        assert arr_coc.ARRCOC is ARRCOC and "ARRCOC" in dir(arr_coc)
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            _ = arr_coc.Nope

    def test_validation_helpers_do_not_import_torch(self):
        """Every config imports arr_coc._validate; the package must not make that pull in torch."""
        code = "import sys, arr_coc._validate; print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False"
