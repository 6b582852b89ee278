"""YAML configs onto typed dataclasses, `--set` overrides, and the errors users see."""
from __future__ import annotations

from pathlib import Path

import pytest

from arr_coc._validate import ConfigError
from pipeline.config import PipelineConfig
from pipeline.configio import apply_overrides, load_config, to_dict

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    from pipeline.training.qa_vlm import QAVLMConfig  # configs/qa_vlm.yaml: python -m pipeline.training.qa_vlm
    from pipeline.training.outcome import OutcomeConfig  # configs/train_outcome.yaml: its own command
    from pipeline.training.train import TrainConfig  # configs/train_*.yaml configure `python -m pipeline train`
    kind = (OutcomeConfig if path.name == "train_outcome.yaml" else TrainConfig if path.name.startswith("train_")
            else QAVLMConfig if path.name.startswith("qa_vlm") else PipelineConfig)
    assert isinstance(load_config(kind, path), kind)


def test_defaults_round_trip_through_yaml(tmp_path):
    import yaml
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump(to_dict(PipelineConfig())))
    assert load_config(PipelineConfig, path) == PipelineConfig()


def test_overrides_are_typed():
    cfg = load_config(PipelineConfig, None, ["model.attending.retention=0.1", "decode.fps=5",
                                             "decode.end_s=null", "runtime.vlm=tiny-random",
                                             "model.realizing.redundancy=false"])
    assert cfg.model.attending.retention == 0.1
    assert cfg.decode.fps == 5.0 and isinstance(cfg.decode.fps, float)
    assert cfg.runtime.vlm == "tiny-random" and cfg.model.realizing.redundancy is False


@pytest.mark.parametrize("text, value", [("5e-2", 0.05), ("1E-1", 0.1), ("+2.5e-1", 0.25), (".5e0", 0.5)])
def test_scientific_numbers_without_a_dot_are_numbers(text, value):
    """YAML 1.1 reads 5e-2 (no dot in the mantissa) as a string: a float field takes the number it spells."""
    cfg = load_config(PipelineConfig, None, [f"model.attending.retention={text}"])
    assert cfg.model.attending.retention == value


def test_a_string_that_is_no_number_stays_an_error():
    with pytest.raises(ConfigError, match="must be a number, got '5e'"):
        load_config(PipelineConfig, None, ["model.attending.retention=5e"])


@pytest.mark.parametrize("override, message", [
    ("model.attending.retention=1.5", "attending.retention=1.5 is out of range; allowed: "),
    ("model.realizing.cut_threshold=0", "realizing.cut_threshold=0"),
    ("runtime.batch_size=0", "runtime.batch_size=0 is out of range; allowed: [1, 4096]"),
    ("decode.decoder=ffmpeg", "decode.decoder='ffmpeg' is not supported; allowed: pyav, decord, nvdec"),
    ("runtime.device=tpu", "runtime.device='tpu' is not supported; allowed: auto, cuda, cpu"),
    ("runtime.cuda_wait=spin", "runtime.cuda_wait='spin' is not supported; allowed: block, auto"),
    ("model.attending.curve=cubic", "cubic"),
    ("model.bogus=1", "unknown config key model.bogus; known keys: attending, balancing, knowing, realizing, texture"),
    ("runtime.batch_size=1.5", "runtime.batch_size must be an integer, got 1.5"),
    ("runtime=3", "runtime must be a mapping"),
    ("noequals", "--set expects key=value, got 'noequals'"),
])
def test_errors_name_field_value_and_range(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(PipelineConfig, None, [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(PipelineConfig, tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(PipelineConfig, bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(PipelineConfig, listy)


def test_apply_overrides_builds_nested_sections():
    assert apply_overrides({}, ["a.b.c=3"]) == {"a": {"b": {"c": 3}}}
    with pytest.raises(ConfigError, match="a is not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_the_default_config_file_states_the_defaults():
    """configs/default.yaml ("Default run configuration") sets only values the code defaults to: a
    run with it is a run without it (it once said encode: all where the default had become kept)."""
    import yaml

    data = yaml.safe_load(Path("configs/default.yaml").read_text())
    defaults = to_dict(PipelineConfig())

    def walk(node, ref, where):
        for key, value in node.items():
            assert key in ref, f"{where}{key}: not a config field"
            if isinstance(value, dict):
                walk(value, ref[key], f"{where}{key}.")
            else:
                assert value == ref[key], f"{where}{key}: the file says {value!r}, the default is {ref[key]!r}"

    walk(data, defaults, "")
