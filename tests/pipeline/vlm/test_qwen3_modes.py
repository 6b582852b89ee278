"""Every mode reaches dense Qwen3-VL through the fast engine: `run` (with pass 2 and tempering too),
`live`, `batch`, `serve` and the Python API, on a tiny random Qwen3-VL saved as a local snapshot and
generated video."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.api import Pipeline
from pipeline.commands.cli import main
from pipeline.config import DecodeConfig, PipelineConfig, RuntimeConfig
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import build_tiny_vlm
from sinks import read_stream, validate_store
from evaluation.fixtures import write_fixture
from sources.synthetic import Shot, render_clip, write_video

from test_qwen3_vl import save_snapshot

FALLBACK = "Qwen3-VL runs through transformers' own forward"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("qwen3_snapshot")
    save_snapshot(build_tiny_vlm("qwen3_vl"), root)
    return str(root)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    shots = [Shot("moving_object", 20, speed=2.0), Shot("pan", 20, speed=1.0), Shot("fast_object", 20, speed=3.0)]
    clip = render_clip(shots, height=144, width=192, seed=11)          # the run tests' clip: 2.4 s, two cuts
    return write_video(tmp_path_factory.mktemp("qwen3_video") / "clip.mp4", clip.frames, fps=25)


def runtime(**fields) -> RuntimeConfig:
    return RuntimeConfig(device="cpu", batch_size=4, model_weights="none", **fields)


def test_run_answers_from_a_local_snapshot(capsys, tmp_path, snapshot, video):
    out = tmp_path / "run.zarr"
    code = main(["run", str(video), "--query", "what moves?", "--out", str(out), "--vlm", snapshot, "--every", "1",
                 "--device", "cpu", "--set", "vlm.max_new_tokens=3"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert FALLBACK not in err                                              # dense: the fast engine
    assert validate_store(out) == []
    answers = read_stream(out, "clip")["answers"]
    assert len(answers["text"]) == 3                                        # 2.4 s of video, 1 s windows
    assert np.all((answers["tokens_kept"] > 0) & (answers["tokens_kept"] < answers["tokens_full"]))


def test_pass2_and_tempering_run(capsys, tmp_path, snapshot, video):
    out = tmp_path / "p2.zarr"
    code = main(["run", str(video), "--query", "what moves?", "--out", str(out), "--vlm", snapshot, "--every", "1",
                 "--device", "cpu", "--set", "vlm.max_new_tokens=2", "--set", "vlm.pass2=attention",
                 "--set", "vlm.tempering.ladder=[0.5,1.0]", "--set", "vlm.tempering.rank=attention",
                 "--set", "vlm.tempering.threshold=1.0"])
    err = capsys.readouterr().err
    assert code == 0, err
    answers = read_stream(out, "clip")["answers"]
    assert len(answers["text"]) == 3 and np.all(answers["passes"] == 2)
    assert np.all(answers["tokens_spent"] > answers["tokens_kept"])


def test_python_api(snapshot, video):
    pipe = Pipeline(vlm=snapshot, device="cpu", every=1.0, overrides={"runtime.batch_size": 4, "vlm.max_new_tokens": 3})
    result = pipe.answer(video, "what moves?")
    assert len(result.answers) == 3
    assert all(0 < a.tokens_kept < a.tokens_full for a in result.answers)


def test_batch(capsys, tmp_path, snapshot):
    root, out = tmp_path / "ds", tmp_path / "batch.zarr"
    write_fixture(root, layout="msrvtt-qa", videos=2, questions_per_video=1, seconds=0.6, seed=0)
    code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), "--vlm", snapshot,
                 "--device", "cpu", "--set", "vlm.max_new_tokens=2", "--no-progress"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["answered"] == 2 and summary["missing"] == 0
    assert validate_store(out) == []


def test_live(tmp_path, snapshot, video):
    from pipeline.core.live_stages import LiveOptions
    from pipeline.runners.live import run_live
    from sources.live import LiveConfig

    out = io.StringIO()
    cfg = PipelineConfig(runtime=runtime(vlm=snapshot), vlm=VLMConfig(max_new_tokens=3))
    result = run_live([str(video)], "what moves?", tmp_path / "live.zarr", cfg,
                      live=LiveConfig(realtime=True, buffer_frames=32), options=LiveOptions(every_s=1.0),
                      answers_out=out, status_out=io.StringIO())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == len(result.answers) >= 1
    assert all(0 < line["tokens_kept"] <= line["tokens_full"] for line in lines)


def test_serve_lists_the_architecture_and_answers(tmp_path, video, monkeypatch):
    # only for this test: left on sys.path, serve's conftest would shadow this folder's in the
    # processes later tests spawn (they import their test module, which imports `conftest`)
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "serve"))
    from serve_client import API_KEY, call, chat_body

    from pipeline.serve.app import create_app
    from pipeline.serve.options import ServeOptions
    from pipeline.serve.server import BackgroundServer, build_engine

    cfg = PipelineConfig(runtime=runtime(vlm="tiny-random-qwen3_vl"), vlm=VLMConfig(max_new_tokens=3),
                         decode=DecodeConfig(process=False))
    options = ServeOptions(allow_dirs=(video.parent,), api_key=API_KEY, store=str(tmp_path / "serve.zarr"))
    server = BackgroundServer(create_app(build_engine(cfg, options))).start()
    try:
        status, models = call(server, "GET", "/v1/models")
        assert status == 200
        (entry,) = models["data"]
        assert entry["id"] == "tiny-random-qwen3_vl" and entry["architecture"] == "Qwen3VLForConditionalGeneration"
        assert entry["family"] == "qwen3_vl" and entry["engine"] == "fast engine"
        body = dict(chat_body(video.as_uri()), model="tiny-random-qwen3_vl")
        status, completion = call(server, "POST", "/v1/chat/completions", body)
        assert status == 200, completion
        assert 0 < completion["usage"]["tokens_kept"] <= completion["usage"]["tokens_full"]
    finally:
        server.stop()
