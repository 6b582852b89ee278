"""`python -m pipeline eval`: exact-match scoring after normalization, per type, tokens, duplicates, judge export."""
from __future__ import annotations

import json

import pytest

from pipeline.commands.cli import main
from pipeline.runners.evaluate import evaluate, is_correct, normalize
from sinks import ZarrStore
from evaluation.fixtures import write_fixture
from sources.msrvtt import Question, load_msrvtt


def store_answers(out, by_video: dict[str, list[tuple[str, str, int, int]]], complete=True):
    store = ZarrStore.open(out, config={})
    for vid, rows in by_video.items():
        w = store.stream(vid, source=f"{vid}.mp4", query="q", fps=10.0, width=64, height=64, grid=(2, 2), vlm="x")
        for question, text, kept, full in rows:
            w.add_answer(t_start=0.0, t_end=1.0, question=question, text=text, tokens_kept=kept, tokens_full=full,
                         latency_s=0.1)
        w.close(complete=complete)


@pytest.fixture
def dataset(tmp_path):
    # 2 videos x 2 questions: video7010 what/who, video7011 who/how (answers square, nobody, nobody, pan)
    write_fixture(tmp_path / "ds", videos=2, questions_per_video=2, seconds=0.2, height=32, width=48)
    return load_msrvtt(tmp_path / "ds")


@pytest.mark.parametrize("pred, truth, ok", [("The Square.", "square", True), ("  a  PAN ", "pan", True),
                                            ("squares", "square", False), ("", "square", False)])
def test_normalized_exact_match(pred, truth, ok):
    assert is_correct(pred, Question("1", "video1", "q?", truth, "what")) is ok
    assert normalize("An  Apple, the end!") == "apple end"


def test_accuracy_per_type_tokens_and_duplicates(tmp_path, dataset):
    q = {v.video_id: [x.question for x in v.questions] for v in dataset.videos()}
    out = tmp_path / "run.zarr"
    store_answers(out, {"video7010": [(q["video7010"][0], "Square", 10, 40), (q["video7010"][1], "someone", 10, 40),
                                      (q["video7010"][1], "again", 10, 40)],          # a duplicate answer
                        "video7011": [(q["video7011"][0], "nobody.", 30, 40), (q["video7011"][1], "pan", 30, 40)]})
    row = evaluate(out, dataset).to_dict()
    assert row["answered"] == 4 and row["coverage"] == 1.0 and row["duplicates"] == 1
    assert row["accuracy"] == 0.75
    assert row["accuracy_by_type"] == {"how": {"accuracy": 1.0, "questions": 1},
                                       "what": {"accuracy": 1.0, "questions": 1},
                                       "who": {"accuracy": 0.5, "questions": 2}}
    assert row["tokens"] == {"kept_over_full": 0.5, "spent_over_full": 0.5, "mean_kept_per_video": 20.0,
                             "mean_spent_per_video": 20.0, "mean_full_per_video": 40.0}


def test_tokens_are_means_over_answers_and_spent_counts_every_pass(tmp_path, dataset):
    """Pass 2 keeps each question's own tokens; tempering spends more than the final pass keeps."""
    video = dataset.videos()[0]
    store = ZarrStore.open(tmp_path / "run.zarr", config={})
    w = store.stream(video.video_id, source="v.mp4", query="q", fps=10.0, width=64, height=64, grid=(2, 2), vlm="x")
    w.add_answers([dict(t_start=0.0, t_end=1.0, question=q.question, text="x", tokens_kept=kept, tokens_full=40,
                        latency_s=0.1, passes=passes, tokens_spent=spent)
                   for q, kept, passes, spent in zip(video.questions, (10, 20), (1, 2), (10, 30))])
    w.close(complete=True)
    tokens = evaluate(tmp_path / "run.zarr", dataset).to_dict()["tokens"]
    assert tokens == {"kept_over_full": 0.375, "spent_over_full": 0.5, "mean_kept_per_video": 15.0,
                      "mean_spent_per_video": 20.0, "mean_full_per_video": 40.0}


def test_incomplete_streams_do_not_count(tmp_path, dataset):
    out = tmp_path / "run.zarr"
    first = dataset.videos()[0]
    store_answers(out, {first.video_id: [(x.question, x.answer, 1, 4) for x in first.questions]}, complete=False)
    row = evaluate(out, dataset).to_dict()
    assert row["answered"] == 0 and row["videos_incomplete"] == 1 and row["coverage"] == 0.0


def test_cli_prints_report_and_exports_judge_format(capsys, tmp_path, dataset):
    out = tmp_path / "run.zarr"
    store_answers(out, {v.video_id: [(x.question, x.answer, 5, 20) for x in v.questions] for v in dataset.videos()})
    judge = tmp_path / "judge.json"
    code = main(["eval", str(out), "--dataset", "msrvtt", "--root", str(dataset.root), "--export-judge", str(judge)])
    printed = capsys.readouterr().out
    assert code == 0 and printed.startswith("accuracy 1.0000 over 4 of 4 questions")
    assert "tokens kept/full 0.2500" in printed
    report = json.loads((tmp_path / "run.zarr.eval.json").read_text())
    assert report["accuracy"] == 1.0 and report["layout"] == "msrvtt-qa"
    rows = json.loads(judge.read_text())
    assert len(rows) == 4 and set(rows[0]) >= {"video_name", "Q", "A", "pred", "id", "question", "answer"}
    assert all(r["pred"] == r["A"] for r in rows)


def test_cli_bad_store(capsys, tmp_path, dataset):
    code = main(["eval", str(tmp_path / "nope.zarr"), "--dataset", "msrvtt", "--root", str(dataset.root)])
    assert code == 2 and "nope.zarr is not a zarr store" in capsys.readouterr().err


class TestCalibrate:
    """eval --calibrate: the tempering threshold from the stored confidences of a validation run."""

    def write(self, tmp_path, dataset, confidences, right):
        store = ZarrStore.open(tmp_path / "val.zarr", config={})
        questions = [(v.video_id, q) for v in dataset.videos() for q in v.questions]
        for video in dataset.videos():
            w = store.stream(video.video_id, source="v.mp4", query="q", fps=10.0, width=64, height=64, grid=(2, 2),
                             vlm="x")
            w.add_answers([dict(t_start=0.0, t_end=1.0, question=q.question, text=q.answer if ok else "wrong",
                                tokens_kept=5, tokens_full=20, latency_s=0.1, confidence=c)
                           for (v, q), c, ok in zip(questions, confidences, right) if v == video.video_id])
            w.close(complete=True)
        return tmp_path / "val.zarr"

    def test_threshold_separates_right_from_wrong(self, tmp_path, dataset, capsys):
        # right answers at 0.9 and 0.7, wrong ones at 0.2 and 0.4: the best cut lies between 0.4 and 0.7
        out = self.write(tmp_path, dataset, [0.9, 0.2, 0.7, 0.4], [True, False, True, False])
        report = evaluate(out, dataset)
        assert [p.confidence for p in report.predictions] == pytest.approx([0.9, 0.2, 0.7, 0.4])
        assert main(["eval", str(out), "--dataset", "msrvtt", "--root", str(dataset.root), "--calibrate"]) == 0
        printed = capsys.readouterr().out
        assert "vlm.tempering.threshold=0.55 " in printed and "2 accepted, 1.0000 of them right" in printed
        row = json.loads((tmp_path / "val.zarr.eval.json").read_text())
        assert row["tempering"]["threshold"] == pytest.approx(0.55) and row["tempering"]["asked_again"] == 2

    def test_precision_target(self, tmp_path, dataset):
        from pipeline.runners.evaluate import calibrate_threshold
        out = self.write(tmp_path, dataset, [0.9, 0.6, 0.7, 0.4], [True, False, True, True])
        # accepting from 0.5 up takes 3 answers, 2 right (0.67); from 0.65 up 2 of 2
        assert calibrate_threshold(evaluate(out, dataset), 0.9)["threshold"] == pytest.approx(0.65)

    def test_stores_without_confidences_are_one_clear_error(self, tmp_path, dataset, capsys):
        out = tmp_path / "run.zarr"
        store_answers(out, {v.video_id: [(x.question, x.answer, 5, 20) for x in v.questions]
                            for v in dataset.videos()})
        assert main(["eval", str(out), "--dataset", "msrvtt", "--root", str(dataset.root), "--calibrate"]) == 2
        err = capsys.readouterr().err
        assert "no answer of this store has a confidence" in err and "Traceback" not in err

    def test_bad_precision_is_a_usage_error(self, tmp_path, dataset, capsys):
        assert main(["eval", "x.zarr", "--dataset", "msrvtt", "--root", str(dataset.root), "--calibrate", "1.5"]) == 2
        assert "must be in (0, 1]" in capsys.readouterr().err
