"""`export STORE --format jsonl|csv`: one row per answer and per scene change, and bad input."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.commands.cli import main
from sinks import ZarrStore, export_store
from sinks.export import EXPORT_COLUMNS

GRID = (2, 3)


def _stream(store: ZarrStore, sid: str, cuts: list[int], answers: list[dict], frames: int = 6) -> None:
    writer = store.stream(sid, source=f"{sid}.mp4", query="q", fps=2.0, width=48, height=32, grid=GRID,
                          vlm="tiny-random")
    scene_change = np.zeros(frames, bool)
    scene_change[cuts] = True
    writer.append(pts=np.arange(frames) / 2.0, frame_index=np.arange(frames) * 3,
                  relevance=np.full((frames, *GRID), 0.5, np.float32), tokens=np.ones((frames, *GRID), np.int32),
                  scene_change=scene_change, motion=np.zeros(frames, np.float32))
    writer.add_answers(answers)
    writer.close(complete=True)


def _answer(t_start: float, t_end: float, text: str) -> dict:
    return dict(t_start=t_start, t_end=t_end, question="what, \"exactly\", moves?", text=text, tokens_kept=4,
                tokens_full=30, latency_s=0.1234)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "s.zarr"
    opened = ZarrStore.open(path, config={"test": True})
    # frames at 0, 0.5, ... 2.5 s; cuts at frames 0 and 4 (2.0 s); answers end at 1.0 and 2.5 s
    tempered = dict(_answer(1.0, 2.5, "ünïcode"), passes=2, tokens_spent=9, confidence=0.75)
    _stream(opened, "b_clip", [0, 4], [_answer(0.0, 1.0, "a red square,\nthen a pan"), tempered])
    _stream(opened, "a_clip", [0], [])
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class TestExport:
    def test_jsonl_rows_in_video_order_per_stream(self, capsys, store):
        code, out, err = run(capsys, "export", str(store), "--format", "jsonl")
        assert code == 0 and err == ""
        rows = [json.loads(line) for line in out.splitlines()]
        assert [(r["stream"], r["kind"]) for r in rows] == [
            ("a_clip", "scene_change"),
            ("b_clip", "scene_change"), ("b_clip", "answer"), ("b_clip", "scene_change"), ("b_clip", "answer")]
        assert rows[1] == {"kind": "scene_change", "stream": "b_clip", "pts": 0.0, "frame_index": 0}
        assert rows[3] == {"kind": "scene_change", "stream": "b_clip", "pts": 2.0, "frame_index": 12}
        assert rows[2] == {"kind": "answer", "stream": "b_clip", "t_start": 0.0, "t_end": 1.0,
                           "question": "what, \"exactly\", moves?", "text": "a red square,\nthen a pan",
                           "tokens_kept": 4, "tokens_full": 30, "latency_s": 0.1234, "passes": 1,
                           "tokens_spent": 4, "confidence": None, "no_answer": ""}   # none stored: null, not NaN
        assert rows[4]["text"] == "ünïcode" and rows[4]["confidence"] == 0.75

    def test_csv_round_trips_through_a_csv_reader(self, capsys, store):
        code, out, _ = run(capsys, "export", str(store), "--stream", "b_clip", "--format", "csv")
        assert code == 0
        rows = list(csv.DictReader(io.StringIO(out)))
        assert tuple(rows[0]) == EXPORT_COLUMNS
        assert [r["kind"] for r in rows] == ["scene_change", "answer", "scene_change", "answer"]
        assert rows[1]["text"] == "a red square,\nthen a pan" and rows[1]["question"] == "what, \"exactly\", moves?"
        assert rows[1]["pts"] == "" and rows[0]["text"] == ""            # a kind's foreign columns are empty
        assert float(rows[2]["pts"]) == 2.0 and int(rows[2]["frame_index"]) == 12
        assert float(rows[3]["t_end"]) == 2.5 and int(rows[3]["tokens_full"]) == 30
        assert (rows[3]["passes"], rows[3]["tokens_spent"], rows[3]["confidence"]) == ("2", "9", "0.75")
        assert rows[1]["confidence"] == ""

    def test_out_file(self, capsys, store, tmp_path):
        out = tmp_path / "rows.jsonl"
        code, stdout, _ = run(capsys, "export", str(store), "--stream", "a_clip", "--format", "jsonl", "--out",
                              str(out))
        assert code == 0 and stdout == ""
        assert [json.loads(line)["kind"] for line in out.read_text(encoding="utf-8").splitlines()] == ["scene_change"]

    def test_the_python_function_writes_to_a_stream(self, store):
        text = io.StringIO()
        assert export_store(store, text, format="csv", stream_id="a_clip") == 1
        assert text.getvalue().splitlines()[1].startswith("scene_change,a_clip,0.0,0,")
        with pytest.raises(ValueError, match=r"Invalid format \('xml'\). Supported values are jsonl, csv."):
            export_store(store, text, format="xml")


class TestBadInput:
    @pytest.mark.parametrize("case, args, message", [
        ("missing store", ["export", "{tmp}/nope.zarr", "--format", "csv"], "nope.zarr is not a zarr store"),
        ("unknown stream", ["export", "{store}", "--stream", "c_clip", "--format", "csv"],
         "stream 'c_clip' not found in .*s.zarr; streams: a_clip, b_clip"),
        ("bad stream id", ["export", "{store}", "--stream", "../x", "--format", "csv"], "../x"),
        ("bad format", ["export", "{store}", "--format", "xml"],
         r"invalid choice: 'xml' \(choose from 'jsonl', 'csv'\)"),
        ("no format", ["export", "{store}"], "the following arguments are required: --format"),
        ("unwritable out", ["export", "{store}", "--format", "csv", "--out", "{tmp}/no/dir/rows.csv"],
         "cannot write the export .*rows.csv"),
    ])
    def test_one_line_and_exit_2(self, capsys, store, tmp_path, case, args, message):
        import re

        code, out, err = run(capsys, *[a.format(tmp=tmp_path, store=store) for a in args])
        assert code == 2, (case, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and re.search(message, lines[0]), (case, err)
        assert out == "" and "Traceback" not in err
        assert not (tmp_path / "no").exists()


def test_times_are_exported_to_the_millisecond(capsys, tmp_path):
    """A live stream's times come from arrival clocks: exported to the millisecond, not as
    0.004954099655151367 (the store keeps the exact values)."""
    path = tmp_path / "live.zarr"
    writer = ZarrStore.open(path, config={}).stream("cam", source="rtsp://cam", query="q", fps=25.0, width=48,
                                                    height=32, grid=GRID, vlm="tiny-random")
    pts = np.array([0.004954099655151367, 0.0441239, 2.0004954099655])
    writer.append(pts=pts, frame_index=np.arange(3), relevance=np.full((3, *GRID), 0.5, np.float32),
                  tokens=np.ones((3, *GRID), np.int32), scene_change=np.ones(3, bool), motion=np.zeros(3, np.float32))
    writer.add_answers([_answer(0.004954099655151367, 2.0004954099655, "a")])
    writer.close(complete=True)
    code, out, err = run(capsys, "export", str(path), "--format", "jsonl")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["pts"] for r in rows if r["kind"] == "scene_change"] == [0.005, 0.044, 2.0]
    answer = next(r for r in rows if r["kind"] == "answer")
    assert (answer["t_start"], answer["t_end"]) == (0.005, 2.0)
