"""An empty generation, or words outside the answers a model was trained to give, is recorded and
shown as "no answer" with the reason: in `run`'s summary, `live`'s answer lines and the store."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.commands.cli import main
from pipeline.runtime.answer_words import EMPTY, WORDS_FILE, answer_words, no_answer, shown
from pipeline.vlm.loading import SHIPPED
from sinks import export_store, read_stream, validate_store
from sources.synthetic import Shot, render_clip, write_video

SHIPPED_QA = str(SHIPPED["arrcoc-synth-qa"])
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    frames = render_clip([Shot("moving_object", 30, speed=2.0)], height=96, width=128, seed=7).frames
    return write_video(tmp_path_factory.mktemp("no_answer") / "clip.mp4", frames, fps=10)


class TestReason:
    def test_the_shipped_models_answer_words_are_its_training_answers(self):
        from evaluation.synth_qa import ANSWER_WORDS

        assert answer_words(SHIPPED_QA) == frozenset(ANSWER_WORDS)
        assert json.loads((Path(SHIPPED_QA) / WORDS_FILE).read_text()) == list(ANSWER_WORDS)

    @pytest.mark.parametrize("text, model, reason", [
        ("", None, EMPTY), ("  \n", SHIPPED_QA, EMPTY),
        ("Blue ", SHIPPED_QA, ""), ("top left", SHIPPED_QA, ""),
        ("a bicycle", SHIPPED_QA, "'a bicycle' is not one of the 30 answers arrcoc-synth-qa was trained to give"),
        ("a bicycle", None, ""),            # free text: only an empty answer is none
        ("a bicycle", "tiny-random (qwen2_vl)", ""),
    ])
    def test_reasons(self, text, model, reason):
        assert no_answer(text, model) == reason
        assert shown(text, reason) == (f"no answer ({reason})" if reason else text)


def test_run_records_and_shows_an_empty_generation_as_no_answer(capsys, tmp_path, clip, silent_vlms):
    out = tmp_path / "o.zarr"
    with silent_vlms():
        code = main(["run", str(clip), "--query", "what moves?", "--vlm", "tiny-random", "--device", "cpu",
                     "--out", str(out), "--no-progress", "--set", "vlm.max_new_tokens=2"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    answer = json.loads(stdout.strip().splitlines()[-1])["answers"][0]
    assert answer["text"] == "" and answer["no_answer"] == EMPTY
    assert f"no answer ({EMPTY})" in err
    assert validate_store(out) == []
    assert read_stream(out, "clip")["answers"]["no_answer"].tolist() == [EMPTY]
    rows = io.StringIO()
    export_store(out, rows, format="jsonl")
    assert f'"no_answer": "{EMPTY}"' in rows.getvalue()


def test_run_says_when_the_shipped_model_answers_outside_its_words(capsys, tmp_path, clip):
    """A snapshot that lists its answers (here the shipped model's files with a list it never says):
    what it generates outside the list is recorded as text and shown as no answer."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for f in Path(SHIPPED_QA).iterdir():
        if f.name != WORDS_FILE:
            os.symlink(f, snapshot / f.name)
    (snapshot / WORDS_FILE).write_text(json.dumps(["zebra"]))
    code = main(["run", str(clip), "--query", "what color is the moving object?", "--vlm", str(snapshot),
                 "--device", "cpu", "--out", str(tmp_path / "o.zarr"), "--no-progress"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    answer = json.loads(stdout.strip().splitlines()[-1])["answers"][0]
    assert answer["text"] and answer["no_answer"] == (f"{answer['text'].strip()!r} is not one of the 1 answers "
                                                      "snapshot was trained to give")


def test_live_lines_say_no_answer(capsys, tmp_path, clip, silent_vlms):
    out = tmp_path / "o.zarr"
    with silent_vlms():
        code = main(["live", str(clip), "--realtime", "--query", "what moves?", "--vlm", "tiny-random", "--device",
                     "cpu", "--every", "1", "--out", str(out), "--set", "vlm.max_new_tokens=2",
                     "--set", "runtime.model_weights=none"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert lines and all(line["text"] == "" and line["no_answer"] == EMPTY for line in lines)


def test_live_without_a_vlm_says_what_it_does(tmp_path, clip):
    """As a user sees it (a process of its own: the warning is printed, not caught by pytest)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "live", str(clip), "--realtime", "--query", "q",
                           "--device", "cpu", "--out", str(tmp_path / "o.zarr"), "--duration", "1",
                           "--set", "runtime.model_weights=none"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    first = proc.stderr.splitlines()[0]
    assert first.startswith("warning: no VLM is loaded (--vlm none): allocation only"), proc.stderr
    assert "no answers are printed" in first and "--vlm arrcoc-synth-qa" in first
