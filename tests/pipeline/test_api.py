"""The Python API (pipeline.Pipeline), the console script, and the README's Python examples."""
from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arr_coc._validate import ConfigError
from pipeline import FrameAllocation, Pipeline, PipelineConfig, VideoAnswers
from sinks import read_stream, validate_store
from sources import SourceError
from sources.synthetic import Shot, render_clip, write_video

ROOT = Path(__file__).resolve().parents[2]
CUT_AT = 10      # the clip's second shot starts at this frame
FRAMES = 20
QUESTION = "where is the square?"


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    clip = render_clip([Shot("moving_object", CUT_AT, speed=2.0), Shot("pan", FRAMES - CUT_AT, speed=1.0)],
                       height=96, width=128, seed=5)
    return write_video(tmp_path_factory.mktemp("api") / "clip.mp4", clip.frames, fps=10)


@pytest.fixture(scope="module")
def allocating() -> Pipeline:
    return Pipeline(device="cpu", overrides={"runtime.batch_size": 4})


@pytest.fixture(scope="module")
def answering() -> Pipeline:
    return Pipeline(vlm="tiny-random", device="cpu", every=1.0,
                    overrides={"runtime.batch_size": 4, "vlm.max_new_tokens": 4})


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, allocating: Pipeline, video: Path) -> Path:
    out = tmp_path_factory.mktemp("api_store") / "clip.zarr"
    allocating.run(video, QUESTION, out=out)
    return out


class TestConstruction:
    def test_arguments_become_config_fields(self):
        pipe = Pipeline(vlm="tiny-random", device="cpu", decoder="decord", every=2.5,
                        overrides={"model.attending.retention": 0.2, "runtime.batch_size": 8})
        cfg = pipe.config
        assert (cfg.runtime.vlm, cfg.runtime.device, cfg.decode.decoder, cfg.runtime.every_s) == \
            ("tiny-random", "cpu", "decord", 2.5)
        assert cfg.model.attending.retention == 0.2 and cfg.runtime.batch_size == 8
        assert repr(pipe) == "Pipeline(vlm='tiny-random', device='cpu', decoder='decord')"

    def test_defaults_are_the_configs(self):
        assert Pipeline().config == PipelineConfig()

    def test_precedence_file_then_overrides_then_arguments(self, tmp_path):
        yaml = tmp_path / "c.yaml"
        yaml.write_text("runtime:\n  batch_size: 4\n  vlm: tiny-random\n  queue_capacity: 3\n")
        pipe = Pipeline(config=yaml, overrides={"runtime.batch_size": 8, "runtime.vlm": "none"}, vlm="tiny-random")
        rt = pipe.config.runtime
        assert (rt.queue_capacity, rt.batch_size, rt.vlm) == (3, 8, "tiny-random")

    def test_a_config_object_with_overrides(self):
        base = Pipeline(device="cpu", overrides={"runtime.batch_size": 2}).config
        cfg = Pipeline(config=base, overrides={"decode.max_frames": 5}).config
        assert (cfg.runtime.device, cfg.runtime.batch_size, cfg.decode.max_frames) == ("cpu", 2, 5)

    def test_keyword_only(self):
        with pytest.raises(TypeError):
            Pipeline("tiny-random")

    @pytest.mark.parametrize("kwargs, message", [
        (dict(device="gpu"), "device='gpu' is not supported; allowed: auto, cuda, cpu"),
        (dict(decoder="ffmpeg"), "decoder='ffmpeg' is not supported; allowed: pyav, decord, nvdec"),
        (dict(every=0), r"every=0 s is out of range: an answer period is at least 0.001 s"),
        (dict(vlm=""), "vlm must be an HF id, a local path, arrcoc-synth-qa, tiny-random or none, got ''"),
        (dict(vlm=3), "vlm must be .* got 3"),
        (dict(overrides={"model.attending.retention": 1.5}), r"model.attending.retention=1.5 is out of range"),
        (dict(overrides={"model.nope": 1}), "unknown config key model.nope"),
        (dict(overrides={"runtime.batch_size": "8"}), "runtime.batch_size must be an integer, got '8'"),
        (dict(overrides={"runtime..x": 1}), "config keys are dotted names"),
        (dict(overrides={"runtime.batch_size": 4, "runtime.batch_size.x": 1}),
         "runtime.batch_size.x: batch_size is not a section"),
        (dict(overrides=["runtime.batch_size=8"]), "overrides must be a mapping of dotted keys to values, got list"),
        (dict(config=3), "config must be a YAML path or a PipelineConfig, got int"),
        (dict(config="missing.yaml"), "config file not found: missing.yaml"),
    ])
    def test_bad_values_are_named(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            Pipeline(**kwargs)


class TestAllocations:
    def test_frames_as_the_store_holds_them(self, allocating, video, stored):
        frames = list(allocating.allocations(video, QUESTION))
        data = read_stream(stored, "clip")
        assert len(frames) == FRAMES and all(isinstance(f, FrameAllocation) for f in frames)
        assert [f.frame_index for f in frames] == data["frame_index"].tolist() == list(range(FRAMES))
        np.testing.assert_allclose([f.pts for f in frames], data["pts"])
        assert [f.frame_index for f in frames if f.scene_change] == [0, CUT_AT]
        assert {f.stream_id for f in frames} == {"clip"}
        gh, gw = data["attrs"]["grid"]
        for f, tokens, relevance in zip(frames, data["tokens"], data["relevance"]):
            assert f.tokens.shape == f.relevance.shape == (gh, gw)
            np.testing.assert_array_equal(f.tokens, tokens)
            np.testing.assert_allclose(f.relevance, relevance.astype(np.float32), atol=1e-3)
            assert f.tokens_kept == int(tokens.sum()) and f.tokens_full == gh * gw
        assert sum(f.tokens_kept for f in frames) > 0

    def test_no_store_unless_asked(self, allocating, video, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        stream = allocating.allocations(video, QUESTION)
        assert len(list(stream)) == FRAMES
        assert stream.result.out is None and stream.result.complete
        assert list(tmp_path.iterdir()) == []

    def test_with_out_the_store_is_written(self, allocating, video, tmp_path):
        out = tmp_path / "a.zarr"
        assert len(list(allocating.allocations(video, QUESTION, out=out))) == FRAMES
        assert validate_store(out) == [] and read_stream(out, "clip")["attrs"]["complete"] is True

    def test_stopping_early_stops_the_graph_and_leaves_an_incomplete_store(self, tmp_path):
        long = render_clip([Shot("moving_object", 300, speed=1.0)], height=96, width=128, seed=6)
        path = write_video(tmp_path / "long.mp4", long.frames, fps=25)
        pipe = Pipeline(device="cpu", overrides={"runtime.batch_size": 2, "runtime.queue_capacity": 1})
        out = tmp_path / "stopped.zarr"
        with pipe.allocations(path, QUESTION, out=out) as stream:
            first = next(stream)
        assert first.frame_index == 0
        assert list(stream) == []                             # closed: nothing more
        data = read_stream(out, "long")
        assert data["attrs"]["complete"] is False and stream.result.stopped
        assert 1 <= len(data["pts"]) < 300                    # the consumer held the decoder back

    def test_an_abandoned_iterator_stops_its_run(self, tmp_path):
        import gc
        import threading
        import time

        long = render_clip([Shot("moving_object", 300, speed=1.0)], height=96, width=128, seed=7)
        path = write_video(tmp_path / "long.mp4", long.frames, fps=25)
        pipe = Pipeline(device="cpu", overrides={"runtime.batch_size": 2, "runtime.queue_capacity": 1})
        for _frame in pipe.allocations(path, QUESTION, out=tmp_path / "dropped.zarr"):
            break                                             # the iterator is dropped here
        gc.collect()
        deadline = time.monotonic() + 30
        while any(t.name == "allocations" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.name == "allocations" for t in threading.enumerate())
        data = read_stream(tmp_path / "dropped.zarr", "long")
        assert data["attrs"]["complete"] is False and len(data["pts"]) < 300

    def test_setup_errors_are_raised_by_the_call(self, allocating, tmp_path):
        with pytest.raises(SourceError, match="nope.mp4"):
            allocating.allocations(tmp_path / "nope.mp4", QUESTION)

    @pytest.mark.parametrize("question", ["", "  ", None])
    def test_bad_question(self, allocating, video, question):
        with pytest.raises(ConfigError, match="question must be a non-empty string"):
            allocating.allocations(video, question)


class TestAnswer:
    def test_typed_answers_without_a_store(self, answering, video, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        result = answering.answer(video, "what moves?")
        assert isinstance(result, VideoAnswers)
        assert result.store is None and list(tmp_path.iterdir()) == []
        assert (result.stream_id, result.question, result.frames) == ("clip", "what moves?", FRAMES)
        assert [(a.t_start, a.t_end) for a in result.answers] == [(0.0, 1.0), (1.0, pytest.approx(1.5))]
        for a in result.answers:
            assert isinstance(a.text, str) and a.question == "what moves?"
            assert 0 < a.tokens_kept < a.tokens_full and a.latency_s > 0
        assert result.text == "\n".join(a.text for a in result.answers)
        assert result.tokens_kept == sum(a.tokens_kept for a in result.answers)
        assert all(a.passes == 1 and a.tokens_spent == a.tokens_kept and 0 <= a.confidence <= 1
                   for a in result.answers)
        assert result.tokens_spent == result.tokens_kept
        assert any("meaningless" in note for note in result.notes)

    @pytest.mark.parametrize("ranking", [{"vlm.pass2": "attention", "vlm.tempering.rank": "attention"}, {}])
    def test_tempering_answers_record_their_passes(self, video, ranking):
        """Either ranking (pass 2's attention; pass 1's relevance, handed over by run's VLM stage)."""
        pipe = Pipeline(vlm="tiny-random", device="cpu",
                        overrides={"vlm.max_new_tokens": 2, **ranking,
                                   "vlm.tempering.ladder": (0.05, 0.1, 0.25), "vlm.tempering.threshold": 1.0})
        result = pipe.answer(video, "what moves?")
        assert all(a.passes == 3 and a.tokens_spent > a.tokens_kept for a in result.answers)
        assert result.tokens_spent > result.tokens_kept

    def test_a_query_encoder_replaces_minilm(self, video, tmp_path):
        import torch

        asked = []
        pipe = Pipeline(device="cpu", overrides={"runtime.batch_size": 4},
                        query_encoder=lambda q: asked.append(q) or torch.nn.functional.normalize(torch.ones(384),
                                                                                                 dim=0))
        pipe.run(video, "where is the square?", out=tmp_path / "q.zarr")
        assert asked == ["where is the square?"]
        bad = Pipeline(device="cpu", query_encoder=lambda q: torch.ones(3))
        with pytest.raises(ValueError, match=r"query_embedding must be a \(384,\) float tensor"):
            bad.run(video, "q", out=tmp_path / "bad.zarr")
        with pytest.raises(ConfigError, match="query_encoder must be a callable"):
            Pipeline(query_encoder="minilm")

    def test_the_vlm_is_loaded_once(self, video, monkeypatch):
        import pipeline.vlm.loading as loading

        loads = []
        real = loading.load_answerer
        monkeypatch.setattr(loading, "load_answerer", lambda cfg, device: loads.append(cfg) or real(cfg, device))
        pipe = Pipeline(vlm="tiny-random", device="cpu", overrides={"vlm.max_new_tokens": 2})
        first = pipe.answer(video, "q")
        second = pipe.answer(video, "q")
        assert len(loads) == 1 and len(first.answers) == len(second.answers) == 1

    def test_store_when_asked(self, answering, video, tmp_path):
        result = answering.answer(video, "what moves?", out=tmp_path / "ans.zarr")
        assert result.store == tmp_path / "ans.zarr"
        answers = read_stream(result.store, "clip")["answers"]
        assert answers["text"].tolist() == [a.text for a in result.answers]

    def test_needs_a_vlm(self, allocating, video):
        with pytest.raises(ConfigError, match=r"answer\(\) needs a VLM, and this Pipeline has vlm='none'"):
            allocating.answer(video, "q")


class TestRun:
    def test_the_command_line_writes_the_same_store(self, allocating, video, stored, tmp_path, capsys):
        from pipeline.commands.cli import main

        out = tmp_path / "cli.zarr"
        assert main(["run", str(video), "--query", QUESTION, "--out", str(out), "--device", "cpu",
                     "--set", "runtime.batch_size=4"]) == 0
        capsys.readouterr()
        api, cli = read_stream(stored, "clip"), read_stream(out, "clip")
        for name in ("pts", "frame_index", "tokens", "relevance", "scene_change"):
            np.testing.assert_array_equal(api[name], cli[name])

    def test_default_store_is_the_stem_in_the_working_directory(self, allocating, video, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        result = allocating.run(video, QUESTION)
        assert result.out == tmp_path / "clip.zarr" and result.frames == FRAMES and result.complete
        assert validate_store(tmp_path / "clip.zarr") == []


class TestLiveAndBatch:
    def test_live_on_a_realtime_file(self, video, tmp_path):
        pipe = Pipeline(vlm="tiny-random", device="cpu", every=1.0, overrides={"vlm.max_new_tokens": 2})
        lines = io.StringIO()
        result = pipe.live(str(video), "what moves?", out=tmp_path / "live.zarr", realtime=True, answers_out=lines)
        assert result.stream_ids == ["clip"] and result.answers
        assert '"text"' in lines.getvalue()
        assert read_stream(tmp_path / "live.zarr", "clip")["attrs"]["frames"] > 0

    def test_batch_needs_a_dataset_root(self, tmp_path):
        with pytest.raises(SourceError, match="is not a directory"):
            Pipeline(vlm="tiny-random").batch(tmp_path / "nope")

    @pytest.mark.parametrize("call, message", [
        (lambda p: p.live([], "q"), "sources must be a source string or a list of them"),
        (lambda p: p.live("0", "q", transport="quic"), "transport='quic' is not supported; allowed: tcp, udp"),
        (lambda p: p.batch(".", dataset="kinetics"), "dataset='kinetics' is not supported; allowed: msrvtt"),
    ])
    def test_bad_arguments(self, call, message):
        with pytest.raises(ConfigError, match=message):
            call(Pipeline())


class TestImports:
    def test_import_pipeline_is_light(self):
        code = ("import sys, pipeline; light = 'torch' not in sys.modules; from pipeline import Pipeline; "
                "Pipeline(vlm='tiny-random', device='cpu'); print(light, 'transformers' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["True", "False"]

    def test_exports(self):
        import pipeline

        for name in pipeline.__all__:
            assert getattr(pipeline, name) is not None
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            _ = pipeline.Nope


class TestConsoleScript:
    def test_pyproject_installs_arrcoc_as_the_cli(self, monkeypatch, capsys):
        import importlib

        tomllib = pytest.importorskip("tomllib")
        scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
        module, _, name = scripts["arrcoc"].partition(":")
        main = getattr(importlib.import_module(module), name)
        monkeypatch.setattr(sys, "argv", ["/venv/bin/arrcoc", "--help"])
        with pytest.raises(SystemExit) as exit:
            main()
        assert exit.value.code == 0
        usage = capsys.readouterr().out
        assert usage.startswith("usage: arrcoc")
        for command in ("run", "live", "batch", "export", "render"):
            assert re.search(rf"\b{command}\b", usage)

    def test_module_keeps_its_own_name(self, capsys):
        from pipeline.commands.cli import main

        assert main(["export"]) == 2
        assert "python -m pipeline export: the following arguments are required" in capsys.readouterr().err


def _readme_python_blocks(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end >= 0 else None], re.S)


def test_readme_python_api_examples_run(video, tmp_path, monkeypatch):
    """Every python block of the README's "Python API" section, in order, in one namespace, in a
    directory holding the video.mp4 the examples read."""
    blocks = _readme_python_blocks("Python API")
    assert len(blocks) >= 3
    (tmp_path / "video.mp4").write_bytes(video.read_bytes())
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)
    output = printed.getvalue()
    assert re.search(r"0\.0-1\.0 s, \d+/\d+ tokens", output)          # answer()
    assert "new shot at 0.00 s" in output and "new shot at 1.00 s" in output   # allocations()
    assert namespace["run"].complete and validate_store(tmp_path / "video.zarr") == []
    assert "torch.Size([8, 8, 8])" in output                            # ARRCOC.from_pretrained
