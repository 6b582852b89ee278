"""A question that is not text (bytes that are not UTF-8 on the command line: Python hands them on as
lone surrogates) is bad input like any other: one line naming it, exit 2, nothing written. It used to
reach the query encoder's tokenizer: `error: TypeError: TextEncodeInput must be ...`, exit 1, and a
leaked shared-memory warning (the serve side of it: tests/pipeline/serve/test_malformed_text.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import Pipeline
from sources.synthetic import Shot, render_clip, write_video
from arr_coc._validate import ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    return write_video(tmp_path_factory.mktemp("query_text") / "clip.mp4",
                       render_clip([Shot("static", 6)], height=64, width=64, seed=0).frames, fps=25)


def test_a_query_of_bytes_that_are_not_utf8_is_one_line_and_exit_2(tmp_path, clip):
    store = tmp_path / "o.zarr"
    run = subprocess.run([sys.executable, "-m", "pipeline", "run", str(clip), "--query", b"what \xff moves?",
                          "--out", str(store), "--device", "cpu", "--vlm", "none"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=300)
    err = run.stderr.decode(errors="replace").strip().splitlines()
    assert run.returncode == 2, err
    assert len(err) == 1 and err[0].startswith("error: question 'what \\udcff moves?' is not text"), err
    assert not store.exists()


@pytest.mark.parametrize("method", ["run", "live"])
def test_the_python_api_refuses_it_before_loading_anything(tmp_path, clip, method):
    pipe = Pipeline(vlm="none", device="cpu", overrides={"runtime.model_weights": "none"})
    with pytest.raises(ConfigError, match="is not text"):
        getattr(pipe, method)(str(clip), "what \udcff moves?", out=tmp_path / "o.zarr",
                              **({"realtime": True, "duration": 1.0} if method == "live" else {}))
    assert not (tmp_path / "o.zarr").exists()
