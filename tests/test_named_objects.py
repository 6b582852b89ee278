"""bench_accuracy's named-object measures: cells of a box, the share of stored tokens on the named
object, and accuracy split by whether a question names one object."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.named_objects import breakdown, named_share, object_cells  # noqa: E402
from sinks import ZarrStore  # noqa: E402


def test_object_cells_cover_a_quarter_or_the_centre():
    cells = object_cells((0, 0, 50, 50), (100, 100), (4, 4))      # 25 px cells: exactly the top-left 2 x 2
    assert cells.sum() == 4 and cells[:2, :2].all()
    cells = object_cells((10, 10, 20, 20), (100, 100), (4, 4))    # a sixth of one cell: its centre's cell
    assert cells.sum() == 1 and cells[0, 0]
    cells = object_cells((0, 0, 30, 30), (100, 100), (4, 4))      # 5 px of the next cells: < a quarter
    assert cells.sum() == 1


def test_named_share_counts_the_objects_tokens_on_the_frames_it_is_shown(tmp_path):
    store = ZarrStore.open(tmp_path / "s.zarr", config={})
    writer = store.stream("video7", source="x.mp4", query="q", fps=2.0, width=100, height=100, grid=(4, 4),
                          vlm="none")
    tokens = np.zeros((3, 4, 4), np.int64)
    tokens[:, 0, 0] = 3           # on the object (top-left cell) ...
    tokens[:, 3, 3] = 1           # ... and elsewhere
    tokens[2] = 0
    tokens[2, 3, 3] = 5           # frame 2: the object is not shown there, so it does not count
    writer.append(pts=np.array([0.0, 0.5, 1.0]), frame_index=np.arange(3), relevance=np.zeros((3, 4, 4)),
                  tokens=tokens, scene_change=np.zeros(3, bool), motion=np.zeros(3))
    writer.close(complete=True)
    box = [0, 0, 25, 25]
    videos = {"7": {"fps": 4.0, "size": [100, 100], "tracks": [{"boxes": [box, box, box, None, None]}]}}
    records = {"70": {"video_id": 7, "objects": [0], "one_object": True},
               "71": {"video_id": 7, "objects": [0, 0], "one_object": False}}
    out = named_share(tmp_path / "s.zarr", records, videos)
    assert out["questions"] == 1
    assert out["token_share"] == pytest.approx(0.75) and out["area_share"] == pytest.approx(1 / 16)


def test_breakdown_by_named_objects():
    def pred(qid, correct):
        return SimpleNamespace(question=SimpleNamespace(question_id=qid), correct=correct)
    report = SimpleNamespace(predictions=[pred("1", True), pred("2", False), pred("3", True), pred("9", False)])
    records = {"1": {"one_object": True}, "2": {"one_object": True}, "3": {"one_object": False}}
    out = breakdown(report, records)
    assert out == {"one_object": {"accuracy": 0.5, "questions": 2}, "other": {"accuracy": 1.0, "questions": 1}}


class _FakeAllocations:
    """Pipeline.allocations' shape: a context manager iterating frames (pts, frame_index, tokens)."""

    def __init__(self, frames):
        self.frames = frames

    def allocations(self, video, question):
        frames = self.frames

        class Stream:
            def __enter__(self):
                return iter(frames)

            def __exit__(self, *exc):
                return False
        return Stream()


def test_one_questions_share_of_tokens_and_its_best_frame():
    from benchmarks.named_object_sheet import question_run

    def frame(i, on, off):
        tokens = np.zeros((4, 4), np.int32)
        tokens[0, 0], tokens[3, 3] = on, off
        return SimpleNamespace(pts=i * 0.5, frame_index=i, tokens=tokens)

    box = [0, 0, 25, 25]                                     # the top-left cell of a 100 x 100 frame
    frames = [frame(0, 1, 3), frame(1, 4, 0), frame(2, 9, 9)]
    out = question_run(_FakeAllocations(frames), Path("x.mp4"), "q", [box, box, None], (100, 100), fps=2.0)
    assert out["frames"] == 2                                # frame 2 does not show the object
    assert out["token_share"] == pytest.approx(5 / 8) and out["area_share"] == pytest.approx(1 / 16)
    on, index, kept, best_box = out["best"]
    assert (on, index, best_box) == (4.0, 1, (0, 0, 25, 25)) and kept.sum() == 1 and kept[0, 0]
