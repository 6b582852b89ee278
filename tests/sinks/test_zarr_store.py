"""The zarr output store: public schema, chunked appends, answers, lifecycle, crash safety, concurrency."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr

from sinks.schema import ANSWERS, FORMAT, FRAMES, GAPS
from sinks.zarr_store import SinkError, ZarrStore, read_stream, validate_store

REPO = Path(__file__).resolve().parents[2]
GRID = (3, 4)
META = dict(source="clip.mp4", query="where is the red square?", fps=25.0, width=64, height=48,
            grid=GRID, vlm="none")


def columns(start: int, n: int, grid=GRID, seed: int = 0) -> dict[str, np.ndarray]:
    """n frames numbered from start; relevance deliberately exceeds [0, 1] to exercise clipping."""
    rng = np.random.default_rng(seed + start)
    idx = np.arange(start, start + n)
    return dict(pts=idx / 25.0, frame_index=idx * 2,
                relevance=rng.uniform(-0.5, 1.5, size=(n, *grid)),
                tokens=(idx[:, None, None] + np.arange(grid[0] * grid[1]).reshape(grid)) % 7,
                scene_change=idx % 50 == 0, motion=rng.uniform(0, 1, size=n))


def expected(n: int, batch: int = 10, grid=GRID) -> dict[str, np.ndarray]:
    parts = [columns(s, min(batch, n - s), grid) for s in range(0, n, batch)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def write_frames(writer, n: int, batch: int = 10) -> None:
    for start in range(0, n, batch):
        writer.append(**columns(start, min(batch, n - start), writer.grid))


def spawn(tmp_path: Path, body: str, stdin: bool = False) -> subprocess.Popen:
    """A Python process that opens the store tmp_path/out.zarr and runs body (META, columns imported)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        from sinks.zarr_store import SinkError, ZarrStore
        from test_zarr_store import META, columns
        store = ZarrStore.open({str(tmp_path / "out.zarr")!r}, config={{}})
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.PIPE if stdin else None)


def kill_when_ready(proc: subprocess.Popen) -> None:
    """kill -9 a spawned writer once it printed "ready" (killed all the same if it never does)."""
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


@pytest.fixture
def store(tmp_path):
    return ZarrStore.open(tmp_path / "out.zarr", config={"vlm": {"id": "none"}, "budget": 64})


class TestSchema:
    def test_layout_dtypes_shapes_and_attrs(self, store):
        writer = store.stream("video7", **META, chunk_frames=16)
        write_frames(writer, 40)
        writer.close(complete=True)
        assert validate_store(store.path) == []

        root = zarr.open_group(store.path, mode="r")
        assert root.attrs.asdict() == {"format": "arr-coc/1", "config": {"vlm": {"id": "none"}, "budget": 64}}
        group = root["streams/video7"]
        assert group.attrs.asdict() == {**META, "grid": [3, 4], "complete": True, "frames": 40, "answer_count": 0}
        want = {"pts": ("float64", (40,)), "frame_index": ("int64", (40,)), "relevance": ("float16", (40, 3, 4)),
                "tokens": ("uint16", (40, 3, 4)), "scene_change": ("bool", (40,)), "motion": ("float16", (40,))}
        for name, (dtype, shape) in want.items():
            assert (group[name].dtype, group[name].shape) == (np.dtype(dtype), shape), name
        assert group["relevance"].chunks == (16, 3, 4) and group["pts"].chunks == (16,)
        answers = {"t_start": "float64", "t_end": "float64", "tokens_kept": "int32", "tokens_full": "int32",
                   "latency_s": "float32", "passes": "uint8", "tokens_spent": "int32", "confidence": "float32"}
        for name, dtype in answers.items():
            assert (group[f"answers/{name}"].dtype, group[f"answers/{name}"].shape) == (np.dtype(dtype), (0,))
        for name in ("question", "text", "no_answer"):  # zarr v3 variable-length UTF-8
            meta = json.loads((store.path / "streams/video7/answers" / name / "zarr.json").read_text())
            assert meta["data_type"] == "string" and group[f"answers/{name}"].shape == (0,)
        assert {s.name for s in FRAMES.fields} == set(want)
        assert {s.name for s in ANSWERS.fields} == set(answers) | {"question", "text", "no_answer"}
        dims = {"relevance": ["frame", "y", "x"], "tokens": ["frame", "y", "x"], "pts": ["frame"],
                "answers/text": ["answer"], "gaps/reason": ["gap"]}
        for name, want_dims in dims.items():
            meta = json.loads((store.path / "streams/video7" / name / "zarr.json").read_text())
            assert meta["dimension_names"] == want_dims, name

    def test_xarray_opens_a_stream_its_answers_and_gaps_as_datasets(self, store):
        xr = pytest.importorskip("xarray")
        writer = store.stream("video7", **META, chunk_frames=16)
        write_frames(writer, 40)
        writer.add_answers([dict(t_start=0.0, t_end=1.6, question="where?", text="left", tokens_kept=5,
                                 tokens_full=12, latency_s=0.2),
                            dict(t_start=1.6, t_end=3.2, question="where?", text="right", tokens_kept=4,
                                 tokens_full=12, latency_s=0.3, passes=2, tokens_spent=9)])
        writer.add_gap(0.8, 1.2, 100.0, 100.5, "rtsp drop-out")
        writer.close(complete=True)

        frames = xr.open_zarr(store.path, group="streams/video7", consolidated=False)
        assert dict(frames.sizes) == {"frame": 40, "y": GRID[0], "x": GRID[1]}
        for f in FRAMES.fields:
            assert frames[f.name].dims == f.dims and frames[f.name].dtype == np.dtype(f.dtype), f.name
        np.testing.assert_array_equal(frames["frame_index"].values, np.arange(40) * 2)
        np.testing.assert_array_equal(frames["tokens"].values, expected(40)["tokens"])   # zeros stay zeros, not NaN
        assert frames.attrs["source"] == META["source"] and frames.attrs["complete"] is True

        answers = xr.open_zarr(store.path, group="streams/video7/answers", consolidated=False)
        assert dict(answers.sizes) == {"answer": 2} and set(answers.data_vars) == set(ANSWERS.names)
        assert answers["text"].values.tolist() == ["left", "right"]
        np.testing.assert_array_equal(answers["passes"].values, [1, 2])
        np.testing.assert_array_equal(answers["tokens_spent"].values, [5, 9])
        gaps = xr.open_zarr(store.path, group="streams/video7/gaps", consolidated=False)
        assert dict(gaps.sizes) == {"gap": 1} and gaps["reason"].values.tolist() == ["rtsp drop-out"]

    def test_validate_store_reports_schema_breaks(self, store):
        writer = store.stream("a", **META)
        write_frames(writer, 20)
        writer.close(complete=True)
        group = zarr.open_group(store.path / "streams/a", mode="r+")
        del group["tokens"]
        group.create_array("tokens", shape=(20, 3, 4), dtype="float32")       # wrong dtype
        del group["answers/text"]                                              # missing array
        group["motion"].resize((19,))                                          # shorter than committed
        problems = validate_store(store.path)
        assert any("'tokens' has dtype float32, expected uint16" in p for p in problems), problems
        assert any("missing array 'answers/text'" in p for p in problems), problems
        assert any("'motion' has 19 rows but 20 are committed" in p for p in problems), problems
        assert len(problems) == 3
        group.attrs["grid"] = [3, 5]
        assert any("'relevance' has shape (20, 3, 4)" in p for p in validate_store(store.path))

    def test_validate_store_reports_wrong_dimension_names(self, store):
        store.stream("a", **META).close(complete=True)
        meta_file = store.path / "streams/a/relevance/zarr.json"
        meta = json.loads(meta_file.read_text())
        meta["dimension_names"] = ["frame", "x", "y"]
        meta_file.write_text(json.dumps(meta))
        assert validate_store(store.path) == ["streams/a: 'relevance' has dimension names ('frame', 'x', 'y'), "
                                              "expected ('frame', 'y', 'x')"]

    def test_validate_store_on_foreign_or_missing_store(self, tmp_path):
        assert "not a zarr store" in validate_store(tmp_path / "nothing.zarr")[0]
        zarr.open_group(tmp_path / "other.zarr", mode="w", attributes={"format": "other/2"})
        assert "'other/2'" in validate_store(tmp_path / "other.zarr")[0]


class TestOlderStores:
    def test_a_store_without_dimension_names_new_fields_or_stream_config_reads_and_validates(self, store):
        writer = store.stream("v", **META)
        write_frames(writer, 12)
        writer.add_answer(0.0, 1.0, "q", "a", 7, 30, 0.1, passes=2, tokens_spent=9)
        writer.add_answer(1.0, 2.0, "q", "b", 3, 30, 0.1)
        writer.close(complete=True)
        # make it what the writer of an earlier version left: no passes / tokens_spent arrays, no
        # dimension_names, no stream config, no gaps/
        group = store.path / "streams/v"
        for name in ("answers/passes", "answers/tokens_spent", "gaps"):
            shutil.rmtree(group / name)
        for meta_file in group.rglob("zarr.json"):
            meta = json.loads(meta_file.read_text())
            meta.pop("dimension_names", None)
            meta_file.write_text(json.dumps(meta))
        meta = json.loads((group / "zarr.json").read_text())
        meta["attributes"].pop("gap_count", None)
        meta_file = group / "zarr.json"
        meta_file.write_text(json.dumps(meta))
        assert "config" not in meta["attributes"]

        assert validate_store(store.path) == []
        data = read_stream(store.path, "v")
        assert "gaps" not in data and data["answers"]["text"].tolist() == ["a", "b"]
        np.testing.assert_array_equal(data["answers"]["passes"], np.uint8([1, 1]))        # one pass each
        np.testing.assert_array_equal(data["answers"]["tokens_spent"], np.int32([7, 3]))  # = tokens_kept
        assert data["answers"]["passes"].dtype == np.uint8 and data["answers"]["tokens_spent"].dtype == np.int32
        np.testing.assert_array_equal(data["frame_index"], np.arange(12) * 2)


class TestAppend:
    def test_appends_across_chunk_boundaries_keep_order(self, store):
        writer = store.stream("v", **META, chunk_frames=64)
        write_frames(writer, 150, batch=10)
        # only whole chunks are on disk before close: 2 x 64
        assert writer.frames == 128 and read_stream(store.path, "v")["pts"].shape == (128,)
        writer.close(complete=True)
        data, want = read_stream(store.path, "v"), expected(150)
        assert data["attrs"]["frames"] == 150
        np.testing.assert_array_equal(data["pts"], want["pts"])
        np.testing.assert_array_equal(data["frame_index"], want["frame_index"])
        np.testing.assert_array_equal(data["tokens"], want["tokens"].astype(np.uint16))
        np.testing.assert_array_equal(data["scene_change"], want["scene_change"])
        np.testing.assert_array_equal(data["motion"], want["motion"].astype(np.float16))
        np.testing.assert_array_equal(data["relevance"], np.clip(want["relevance"], 0, 1).astype(np.float16))
        assert data["relevance"].min() == 0.0 and data["relevance"].max() == 1.0  # clipping happened

    def test_read_only_some_frame_arrays(self, store):
        with store.stream("v", **META) as writer:
            write_frames(writer, 20)
        data = store.read("v", frame_arrays=("pts", "scene_change"))
        assert set(data) - {"gaps"} == {"attrs", "pts", "scene_change", "answers"}
        np.testing.assert_array_equal(data["pts"], expected(20)["pts"])
        with pytest.raises(ValueError, match=r"Invalid frame array \('nope'\). Supported values are pts, "):
            store.read("v", frame_arrays=("pts", "nope"))

    def test_flush_writes_partial_chunk_and_writing_continues(self, store):
        writer = store.stream("v", **META, chunk_frames=16)
        write_frames(writer, 21, batch=7)
        assert writer.frames == 16
        writer.flush()
        assert read_stream(store.path, "v")["pts"].shape == (21,) and writer.frames == 21
        for start in range(21, 50, 7):
            writer.append(**columns(start, 7))
        writer.close(complete=True)
        np.testing.assert_array_equal(read_stream(store.path, "v")["frame_index"], np.arange(56) * 2)

    @pytest.mark.parametrize("field, value, message", [
        ("pts", np.zeros(4), "same number of frames"),
        ("relevance", np.zeros((5, 4, 3)), "relevance must have shape"),
        ("tokens", -np.ones((5, 3, 4), int), "tokens must be integers in [0, 65535]"),
        ("tokens", np.ones((5, 3, 4)), "tokens must be integers"),
        ("motion", np.full(5, np.nan), "motion contains NaN"),
    ])
    def test_bad_columns_are_refused(self, store, field, value, message):
        writer = store.stream("v", **META)
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            writer.append(**{**columns(0, 5), field: value})
        assert writer.frames == 0 and writer._pending_frames == 0


class TestAnswers:
    def test_answers_grow_and_strings_round_trip(self, store):
        writer = store.stream("v", **META)
        assert read_stream(store.path, "v")["answers"]["text"].shape == (0,)
        rows = [(0.0, 2.0, "what moves?", "a red square, left → right", 40, 300, 0.25),
                (2.0, 4.0, "colour?", "红色 (red) ✓", 12, 300, 0.5),
                (4.0, 6.0, "", "", 0, 300, 1.5)]
        for i, row in enumerate(rows, 1):
            writer.add_answer(*row)
            assert read_stream(store.path, "v")["answers"]["t_end"].shape == (i,)  # written immediately
        writer.close(complete=True)
        answers = read_stream(store.path, "v")["answers"]
        assert list(answers["question"]) == [r[2] for r in rows]
        assert list(answers["text"]) == [r[3] for r in rows]
        np.testing.assert_array_equal(answers["tokens_kept"], [40, 12, 0])
        np.testing.assert_array_equal(answers["latency_s"], np.float32([0.25, 0.5, 1.5]))
        assert answers["tokens_full"].dtype == np.int32 and validate_store(store.path) == []

    def test_bad_answer_is_refused_before_writing(self, store):
        writer = store.stream("v", **META)
        with pytest.raises(ValueError, match="tokens_kept"):
            writer.add_answer(0.0, 1.0, "q", "a", -1, 10, 0.1)
        with pytest.raises(ValueError, match="t_end"):
            writer.add_answer(0.0, float("nan"), "q", "a", 1, 10, 0.1)
        assert read_stream(store.path, "v")["answers"]["text"].shape == (0,)


    def test_many_answers_land_in_one_commit_after_earlier_ones(self, store):
        writer = store.stream("v", **META)
        writer.add_answer(0.0, 1.0, "first?", "one", 5, 300, 0.1)
        keys = ("t_start", "t_end", "question", "text", "tokens_kept", "tokens_full", "latency_s")
        rows = [dict(zip(keys, (1.0, 9.0, f"q{i}?", "ä" * i, i, 300, 0.5 + i))) for i in range(5)]
        writer.add_answers(rows)
        assert writer.answers == 6 and read_stream(store.path, "v")["attrs"]["answer_count"] == 6
        writer.close(complete=True)
        answers = read_stream(store.path, "v")["answers"]
        assert list(answers["question"]) == ["first?"] + [f"q{i}?" for i in range(5)]
        assert list(answers["text"]) == ["one"] + ["ä" * i for i in range(5)]
        np.testing.assert_array_equal(answers["tokens_kept"], [5, 0, 1, 2, 3, 4])
        np.testing.assert_array_equal(answers["latency_s"], np.float32([0.1, 0.5, 1.5, 2.5, 3.5, 4.5]))
        assert validate_store(store.path) == []

    def test_passes_and_tokens_spent_default_to_one_pass(self, store):
        writer = store.stream("v", **META)
        writer.add_answer(0.0, 1.0, "q", "one pass", 7, 30, 0.1)
        writer.add_answer(1.0, 2.0, "q", "three passes", 7, 30, 0.1, passes=3, tokens_spent=20)
        writer.add_answers([dict(t_start=2.0, t_end=3.0, question="q", text="none given", tokens_kept=4,
                                 tokens_full=30, latency_s=0.1, passes=None, tokens_spent=None)])
        writer.close(complete=True)
        answers = read_stream(store.path, "v")["answers"]
        assert answers["passes"].dtype == np.uint8 and answers["tokens_spent"].dtype == np.int32
        np.testing.assert_array_equal(answers["passes"], [1, 3, 1])
        np.testing.assert_array_equal(answers["tokens_spent"], [7, 20, 4])

    @pytest.mark.parametrize("extra, message", [
        (dict(passes=0), r"passes must be an int in \[1, 255\], got 0"),
        (dict(passes=256), r"passes must be an int in \[1, 255\]"),
        (dict(tokens_spent=6), r"tokens_spent \(6\) .* less than tokens_kept \(7\)"),
        (dict(tokens_used=9), r"unknown answer field\(s\) 'tokens_used'; fields: t_start, .*, tokens_spent"),
    ])
    def test_bad_new_fields_are_refused(self, store, extra, message):
        writer = store.stream("v", **META)
        good = dict(t_start=0.0, t_end=1.0, question="q", text="a", tokens_kept=7, tokens_full=10, latency_s=0.1)
        with pytest.raises(ValueError, match=message):
            writer.add_answers([{**good, **extra}])
        assert writer.answers == 0

    def test_one_bad_row_refuses_the_whole_group(self, store):
        writer = store.stream("v", **META)
        good = dict(t_start=0.0, t_end=1.0, question="q", text="a", tokens_kept=1, tokens_full=10, latency_s=0.1)
        with pytest.raises(ValueError, match="tokens_full"):
            writer.add_answers([good, {**good, "tokens_full": 2**31}])
        assert read_stream(store.path, "v")["answers"]["text"].shape == (0,) and writer.answers == 0


class TestStreamTemplate:
    def test_streams_of_different_grids_and_chunks_each_get_their_own_layout(self, store):
        shapes = [((3, 4), 16), ((5, 7), 8), ((3, 4), 16)]
        for i, (grid, chunk) in enumerate(shapes):
            writer = store.stream(f"v{i}", **{**META, "grid": grid, "query": f"query {i}"}, chunk_frames=chunk)
            write_frames(writer, 20)
            writer.close(complete=True)
        assert validate_store(store.path) == []
        for i, (grid, chunk) in enumerate(shapes):
            group = zarr.open_group(store.path / "streams" / f"v{i}", mode="r")
            assert group["tokens"].shape == (20, *grid) and group["tokens"].chunks == (chunk, *grid)
            got = read_stream(store.path, f"v{i}")
            assert got["attrs"]["query"] == f"query {i}" and got["attrs"]["grid"] == list(grid)
            np.testing.assert_array_equal(got["tokens"], expected(20, grid=grid)["tokens"])


class TestDirectWrites:
    """StreamWriter writes chunk and metadata files itself (sinks.store_files.ArrayFiles): the files
    must be the ones zarr writes for the same data."""

    def test_chunks_and_metadata_equal_zarrs_own(self, store, tmp_path):
        from sinks.store_files import files_under, write_file
        from sinks.zarr_store import _stream_files

        writer = store.stream("v", **META, chunk_frames=16)
        write_frames(writer, 20)
        writer.flush()                                   # a partial chunk, rewritten whole by the next append
        write_frames(writer, 20)
        rows = [dict(t_start=float(i), t_end=i + 1.5, question=f"q{i} ¿dónde está? 日本", text="" if i % 3 else "é" * i,
                     tokens_kept=i, tokens_full=4 * i, latency_s=0.1 * i) for i in range(70)]   # answers span 2 chunks
        writer.add_answers(rows[:5])
        writer.add_answers(rows[5:])
        writer.add_gap(1.0, 2.0, 100.0, 101.5, "rtsp drop-out")
        writer.close(complete=True)
        direct = store.path / "streams/v"
        data = read_stream(store.path, "v")
        assert data["attrs"]["frames"] == 40 and data["attrs"]["answer_count"] == 70
        assert list(data["answers"]["text"]) == [r["text"] for r in rows]

        # the same rows written through zarr's own API into the same empty group
        ref = tmp_path / "ref"
        attrs = json.loads((direct / "zarr.json").read_text())["attributes"]
        for rel, blob in _stream_files(attrs, GRID, 16).items():
            write_file(ref / rel, blob)
        group = zarr.open_group(ref, mode="r+")
        for spec in FRAMES.fields:
            group[spec.name].resize(data[spec.name].shape)
            group[spec.name][:] = data[spec.name]
        for prefix, table, values in (("answers/", ANSWERS, data["answers"]), ("gaps/", GAPS, data["gaps"])):
            for spec in table.fields:
                group[prefix + spec.name].resize(values[spec.name].shape)
                group[prefix + spec.name][:] = values[spec.name]

        got, want = files_under(direct), files_under(ref)
        assert sorted(got) == sorted(want)              # same chunks written (and fill-only ones skipped)
        assert "scene_change/c/2" not in got and "scene_change/c/1" in got   # rows 32..39 all False: not written
        for rel in want:
            if rel.endswith("zarr.json"):
                assert json.loads(got[rel]) == json.loads(want[rel]), rel
            else:
                assert got[rel] == want[rel], rel

    def test_no_temporary_files_are_left(self, store):
        writer = store.stream("v", **META, chunk_frames=8)
        write_frames(writer, 30)
        writer.close(complete=True)
        assert not [f for f in (store.path / "streams/v").rglob("*") if f.name.endswith(".partial")]


class TestLifecycle:
    def test_complete_only_after_close_true(self, store):
        writer = store.stream("v", **META)
        write_frames(writer, 5)
        assert not store.is_complete("v") and read_stream(store.path, "v")["attrs"]["complete"] is False
        writer.close(complete=True)
        assert store.is_complete("v")
        with pytest.raises(SinkError, match="already closed"):
            writer.append(**columns(5, 1))

    def test_a_stream_with_unreadable_metadata_is_incomplete_and_redone(self, store):
        writer = store.stream("v", **META)
        write_frames(writer, 5)
        writer.close(complete=True)
        (store.path / "streams/v/zarr.json").write_text('{"attributes": {"complete": tr')   # torn by hand
        assert not store.is_complete("v")
        writer = store.stream("v", **META)                                   # replaced, not refused
        write_frames(writer, 3)
        writer.close(complete=True)
        assert store.is_complete("v") and read_stream(store.path, "v")["attrs"]["frames"] == 3
        assert validate_store(store.path) == []

    def test_with_block_closes_incomplete(self, store):
        with store.stream("v", **META) as writer:
            write_frames(writer, 5)
        assert not store.is_complete("v") and read_stream(store.path, "v")["pts"].shape == (5,)

    def test_redo_replaces_incomplete_stream(self, store):
        writer = store.stream("v", **META)
        write_frames(writer, 100)
        writer.add_answer(0.0, 1.0, "q", "old", 1, 2, 0.1)
        writer.close(complete=False)
        redo = store.stream("v", **{**META, "query": "new question"})
        data = read_stream(store.path, "v")
        assert data["pts"].shape == (0,) and data["answers"]["text"].shape == (0,)
        assert data["attrs"]["query"] == "new question" and store.stream_ids() == ["v"]
        write_frames(redo, 30)
        redo.close(complete=True)
        assert store.is_complete("v") and read_stream(store.path, "v")["pts"].shape == (30,)
        assert not (store.path / ".staging").exists() and validate_store(store.path) == []

    def test_staging_removed_by_another_writer_mid_mkdir(self, store, monkeypatch):
        """Writers of other streams remove the shared, empty `.staging` after their renames: a
        writer whose `mkdir -p` loses it between creating it and its own directory tries again."""
        from pathlib import Path

        real_mkdir, raced = Path.mkdir, []

        def mkdir(self, mode=0o777, parents=False, exist_ok=False):
            if self.parent.name == ".staging" and not raced:
                raced.append(self)
                real_mkdir(self.parent, exist_ok=True)
                self.parent.rmdir()                                          # another writer tidies up
                raise FileNotFoundError(2, "No such file or directory", str(self))
            return real_mkdir(self, mode, parents, exist_ok)

        monkeypatch.setattr(Path, "mkdir", mkdir)
        writer = store.stream("v", **META)
        assert raced and writer.frames == 0 and store.stream_ids() == ["v"]
        write_frames(writer, 5)
        writer.close(complete=True)
        assert validate_store(store.path) == []

    def test_staging_recreated_and_removed_again_mid_mkdir(self, store, monkeypatch):
        """Three writers at once: our `mkdir -p` finds `.staging` gone, another writer recreates it
        (our mkdir of it fails: it exists) and a third removes it before pathlib looks again, so
        pathlib raises FileExistsError for a directory that is not there. Try again, as for the above."""
        from pathlib import Path

        real_mkdir, raced = Path.mkdir, []

        def mkdir(self, mode=0o777, parents=False, exist_ok=False):
            if self.parent.name == ".staging" and not raced:
                raced.append(self)
                raise FileExistsError(17, "File exists", str(self.parent))
            return real_mkdir(self, mode, parents, exist_ok)

        monkeypatch.setattr(Path, "mkdir", mkdir)
        writer = store.stream("v", **META)
        assert raced and store.stream_ids() == ["v"]
        writer.close(complete=True)

    def test_complete_stream_needs_overwrite(self, store):
        writer = store.stream("v", **META)
        write_frames(writer, 10)
        writer.close(complete=True)
        with pytest.raises(SinkError, match="already complete"):
            store.stream("v", **META)
        assert read_stream(store.path, "v")["pts"].shape == (10,)
        store.stream("v", **META, overwrite=True).close(complete=False)
        assert not store.is_complete("v") and read_stream(store.path, "v")["pts"].shape == (0,)

    def test_reopen_keeps_streams_and_config(self, store):
        store.stream("b", **META).close(complete=True)
        store.stream("a", **META).close(complete=False)
        again = ZarrStore.open(store.path, config={"different": True})
        assert again.config == {"vlm": {"id": "none"}, "budget": 64}
        assert again.stream_ids() == ["a", "b"] and again.is_complete("b") and not again.is_complete("a")
        assert not again.is_complete("missing")

    def test_mode_w_recreates_and_mode_r_is_read_only(self, store):
        store.stream("a", **META).close(complete=True)
        reader = ZarrStore.open(store.path, mode="r")
        with pytest.raises(SinkError, match="read-only"):
            reader.stream("b", **META)
        fresh = ZarrStore.open(store.path, config={"x": 1}, mode="w")
        assert fresh.stream_ids() == [] and fresh.config == {"x": 1}


class TestCrashSafety:
    def _assert_consistent_incomplete(self, path: Path, committed_at_least: int) -> int:
        assert validate_store(path) == []
        store = ZarrStore.open(path, mode="r")
        assert store.stream_ids() == ["v"] and not store.is_complete("v")
        data = read_stream(path, "v")
        lengths = {s.name: len(data[s.name]) for s in FRAMES.fields}
        assert len(set(lengths.values())) == 1, lengths
        t = data["attrs"]["frames"]
        assert t == lengths["pts"] >= committed_at_least
        np.testing.assert_array_equal(data["frame_index"], np.arange(t) * 2)  # the committed rows are real
        return t

    def test_dropped_writer_keeps_full_chunks(self, store):
        writer = store.stream("v", **META, chunk_frames=64)
        write_frames(writer, 150)
        writer.add_answer(0.0, 1.0, "q", "a", 1, 2, 0.1)
        del writer
        assert self._assert_consistent_incomplete(store.path, 128) == 128
        group = zarr.open_group(store.path / "streams/v", mode="r")
        assert all(group[s.name].shape[0] == 128 for s in FRAMES.fields)
        assert read_stream(store.path, "v")["answers"]["text"].tolist() == ["a"]

    def test_store_without_streams_group_is_valid_and_reopens(self, tmp_path):
        # what a creator killed between writing the root and `streams/` leaves behind
        zarr.open_group(tmp_path / "out.zarr", mode="w", attributes={"format": FORMAT, "config": {}})
        assert validate_store(tmp_path / "out.zarr") == []
        assert ZarrStore.open(tmp_path / "out.zarr", mode="r").stream_ids() == []
        store = ZarrStore.open(tmp_path / "out.zarr")
        store.stream("v", **META).close(complete=True)
        assert store.stream_ids() == ["v"] and validate_store(store.path) == []

    def test_sigkill_after_writes(self, tmp_path):
        proc = spawn(tmp_path, """
            w = store.stream("v", **META, chunk_frames=64)
            for s in range(0, 150, 10):
                w.append(**columns(s, 10))
            w.add_answer(0.0, 1.0, "q", "before the crash", 5, 10, 0.2)
            print("ready", flush=True)
            time.sleep(60)
        """)
        kill_when_ready(proc)
        path = tmp_path / "out.zarr"
        assert self._assert_consistent_incomplete(path, 128) == 128
        group = zarr.open_group(path / "streams/v", mode="r")
        assert {group[s.name].shape[0] for s in FRAMES.fields} == {128}
        assert read_stream(path, "v")["answers"]["text"].tolist() == ["before the crash"]

    def test_a_crash_at_any_write_leaves_a_consistent_store(self, tmp_path, monkeypatch):
        """The writer dies at its k-th file write (each file write is atomic: the k-th never lands,
        nothing after it happens), for every k of a run of appends and answers: the store is valid,
        every committed frame and answer is real, and a resumed run redoes the stream."""
        from sinks import store_files

        class Crash(BaseException):
            pass

        real_write, writes = store_files.Location.write, []

        def write(loc, rel, data):
            if len(writes) == crash_at:
                raise Crash
            writes.append(rel)
            real_write(loc, rel, data)

        def scenario(path: Path) -> None:
            """Two rounds of a chunk of frames (one commit each) and an answer after it."""
            writer = ZarrStore.open(path, config={}).stream("v", **META, chunk_frames=4)
            writes.clear()
            try:
                for s in (4, 8):
                    writer.append(**columns(s - 4, 4))
                    writer.add_answers([dict(t_start=0.0, t_end=s / 25, question="q", text=f"after {s}",
                                             tokens_kept=s, tokens_full=10 * s, latency_s=0.1)])
            except Crash:
                pass
            del writer                                    # the crashed process's lock goes with it

        monkeypatch.setattr(store_files.Location, "write", write)
        crash_at = -1
        scenario(tmp_path / "all.zarr")
        total = len(writes)
        assert total > 40 and sum(w.endswith("zarr.json") for w in writes) > 4
        for crash_at in range(total):
            path = tmp_path / f"crash{crash_at}.zarr"
            scenario(path)
            assert len(writes) == crash_at
            committed = self._assert_consistent_incomplete(path, 0)
            texts = read_stream(path, "v")["answers"]["text"].tolist()
            assert texts == [f"after {s}" for s in (4, 8)][:len(texts)], crash_at
            assert committed >= 4 * len(texts), crash_at          # an answer comes after its frames
        monkeypatch.undo()
        redo = ZarrStore.open(tmp_path / "crash20.zarr").stream("v", **META)  # the resumed batch redoes it
        redo.close(complete=True)
        assert validate_store(tmp_path / "crash20.zarr") == []


class TestOwnership:
    """A writer owns its stream until it closes: a second writer of the same stream is refused
    with one line naming the stream and the owner; a dead writer's lock is taken over."""

    def test_second_process_is_refused_while_the_first_writes_on(self, tmp_path):
        first = spawn(tmp_path, """
            w = store.stream("v", **META, chunk_frames=8)
            for s in range(0, 20, 5):
                w.append(**columns(s, 5))
            print("ready", flush=True)
            sys.stdin.readline()
            for s in range(20, 40, 5):
                w.append(**columns(s, 5))
            w.close(complete=True)
            print("done", flush=True)
        """, stdin=True)
        try:
            assert first.stdout.readline().strip() == "ready"
            assert json.loads((tmp_path / "out.zarr/.locks/v.owner").read_text())["pid"] == first.pid
            second = spawn(tmp_path, """
                try:
                    store.stream("v", **{**META, "source": "clip.mkv"}, overwrite=True)   # what `run` asks
                except SinkError as e:
                    print(e, flush=True)
                    sys.exit(2)
            """)
            out, _ = second.communicate(timeout=60)
            assert second.returncode == 2, out
            line = out.strip()
            assert "\n" not in line and line.startswith(f"stream 'v' in {tmp_path / 'out.zarr'} is being written "
                                                     f"by another writer (pid {first.pid} on {socket.gethostname()}")
            first.stdin.write("go\n")
            first.stdin.flush()
            assert first.stdout.readline().strip() == "done"
        finally:
            first.kill()
            first.wait()
            first.stdin.close()
            first.stdout.close()
        assert validate_store(tmp_path / "out.zarr") == []
        data = read_stream(tmp_path / "out.zarr", "v")
        assert data["attrs"]["complete"] is True and data["attrs"]["source"] == META["source"]
        np.testing.assert_array_equal(data["frame_index"], np.arange(40) * 2)    # the first writer's rows only
        assert not (tmp_path / "out.zarr/.locks/v.owner").exists()

    def test_a_killed_writers_lock_is_taken_over(self, tmp_path):
        proc = spawn(tmp_path, """
            w = store.stream("v", **META, chunk_frames=8)
            w.append(**columns(0, 20))
            print("ready", flush=True)
            time.sleep(60)
        """)
        kill_when_ready(proc)
        owner = tmp_path / "out.zarr/.locks/v.owner"
        assert json.loads(owner.read_text())["pid"] == proc.pid                 # left behind by kill -9
        store = ZarrStore.open(tmp_path / "out.zarr")
        writer = store.stream("v", **META)
        assert json.loads(owner.read_text())["pid"] == os.getpid()
        assert writer.replaced is not None and not writer.replaced.complete and writer.replaced.frames == 16
        write_frames(writer, 30)
        writer.close(complete=True)
        assert validate_store(store.path) == [] and read_stream(store.path, "v")["attrs"]["frames"] == 30
        assert not owner.exists()

    def test_in_one_process_the_stream_is_free_again_after_close_or_drop(self, store):
        writer = store.stream("v", **META)
        with pytest.raises(SinkError, match=f"stream 'v' in .* being written by another writer \\(pid {os.getpid()} "):
            store.stream("v", **META)
        other = store.stream("w", **META)                                    # another stream is not affected
        writer.close(complete=False)
        again = store.stream("v", **META)
        del again                                                            # dropped unclosed: released too
        store.stream("v", **META).close(complete=True)
        other.close(complete=True)
        assert validate_store(store.path) == [] and not list((store.path / ".locks").glob("*.owner"))

    def test_a_failed_close_still_gives_the_stream_up(self, store, monkeypatch):
        writer = store.stream("v", **META)
        write_frames(writer, 5)
        monkeypatch.setattr(writer, "_set_attrs", lambda values: (_ for _ in ()).throw(OSError(28, "No space left")))
        with pytest.raises(SinkError, match="stream 'v' in .*: No space left"):
            writer.close(complete=True)
        monkeypatch.undo()
        assert writer.closed
        store.stream("v", **META).close(complete=True)

    def test_without_flock_a_dead_writers_lock_is_taken_over(self, tmp_path):
        """On a filesystem without flock filelock falls back to a marker file naming its pid: a live
        writer still refuses a second one, a killed one's marker is taken over."""
        def no_flock(body: str) -> str:
            return textwrap.dedent("""
                import errno
                import filelock._native._unix as unix
                def nosys(fd):
                    raise OSError(errno.ENOSYS, "flock not supported")
                unix.lock_fd_nonblocking = nosys
            """) + textwrap.dedent(body)

        proc = spawn(tmp_path, no_flock("""
            w = store.stream("v", **META, chunk_frames=8)
            w.append(**columns(0, 20))
            print("ready", flush=True)
            time.sleep(60)
        """))
        try:
            assert proc.stdout.readline().strip() == "ready"
            second = spawn(tmp_path, no_flock("""
                try:
                    store.stream("v", **META)
                except SinkError as e:
                    print(e, flush=True)
                    sys.exit(2)
            """))
            out, _ = second.communicate(timeout=60)
            assert second.returncode == 2 and f"being written by another writer (pid {proc.pid} " in out, out
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        third = spawn(tmp_path, no_flock("""
            w = store.stream("v", **META)
            w.close(complete=True)
            print("taken", flush=True)
        """))
        out, err = third.communicate(timeout=60)
        assert third.returncode == 0 and out.strip() == "taken", err
        assert read_stream(tmp_path / "out.zarr", "v")["attrs"]["complete"] is True

    def test_a_full_disk_while_locking_is_one_line_naming_the_store(self, store, monkeypatch):
        """ENOSPC writing the owner record: a SinkError (exit 2 on the command line) naming the stream
        and the store, not a bare OSError; nothing is left held."""
        import sinks.stream_lock as stream_lock

        def full(target, data, atomic=False):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

        monkeypatch.setattr(stream_lock, "write_file", full)
        with pytest.raises(SinkError) as caught:
            store.stream("v", **META)
        assert str(caught.value) == (f"cannot lock stream 'v' of {store.path} ({store.path / '.locks/v.lock'}): "
                                     f"No space left on device")
        monkeypatch.undo()
        store.stream("v", **META).close(complete=True)                        # the lock was given back


class TestStreamConfig:
    def test_each_stream_records_its_own_config_and_the_root_keeps_the_first(self, store):
        store.stream("a", **META, config={"model": {"retention": 0.3}}).close(complete=True)
        again = ZarrStore.open(store.path, config={"model": {"retention": 0.5}})
        again.stream("b", **META, config={"model": {"retention": 0.5}}).close(complete=True)
        assert read_stream(store.path, "a")["attrs"]["config"] == {"model": {"retention": 0.3}}
        assert read_stream(store.path, "b")["attrs"]["config"] == {"model": {"retention": 0.5}}
        assert again.config == {"vlm": {"id": "none"}, "budget": 64}
        assert validate_store(store.path) == []
        with pytest.raises(SinkError, match="config cannot be stored as JSON"):
            store.stream("c", **META, config={"f": object()})
        assert "c" not in store.stream_ids() and not list((store.path / ".locks").glob("*.owner"))

    def test_a_replaced_stream_is_reported(self, store):
        first = store.stream("v", **META)
        assert first.replaced is None
        write_frames(first, 10)
        first.close(complete=True)
        second = store.stream("v", **{**META, "source": "clip.mkv"}, overwrite=True)
        assert second.replaced is not None and second.replaced.source == "clip.mp4"
        assert str(second.replaced) == "replacing stream 'v' (was clip.mp4, complete, 10 frames)"
        second.close(complete=False)
        resumed = store.stream("v", **META)                                  # a resumed batch redoes it
        assert str(resumed.replaced) == "replacing stream 'v' (was clip.mkv, incomplete, 0 frames)"
        resumed.close(complete=False)
        (store.path / "streams/v/zarr.json").write_text("{torn")
        assert str(store.stream("v", **META).replaced) == "replacing stream 'v' (was unreadable)"


class TestConcurrency:
    def test_two_threads_write_two_streams_while_reading(self, store):
        errors: list[BaseException] = []

        def produce(stream_id: str, n: int) -> None:
            try:
                writer = store.stream(stream_id, **META, chunk_frames=8)
                write_frames(writer, n, batch=5)
                writer.close(complete=True)
            except BaseException as e:  # surfaced in the main thread below
                errors.append(e)

        threads = [threading.Thread(target=produce, args=(sid, n)) for sid, n in (("left", 120), ("right", 90))]
        for t in threads:
            t.start()
        reads = 0
        while any(t.is_alive() for t in threads):
            for sid in ZarrStore.open(store.path, mode="r").stream_ids():
                data = read_stream(store.path, sid)
                assert len({len(data[s.name]) for s in FRAMES.fields}) == 1
                reads += 1
        for t in threads:
            t.join()
        assert not errors, errors
        assert validate_store(store.path) == [] and store.stream_ids() == ["left", "right"]
        for sid, n in (("left", 120), ("right", 90)):
            assert store.is_complete(sid)
            np.testing.assert_array_equal(read_stream(store.path, sid)["pts"], expected(n, batch=5)["pts"])


    def test_many_threads_create_streams_at_once(self, store):
        """A server creates a stream per request, many at once: the shared staging directory comes
        and goes under every writer, and no creation may fail for it."""
        errors: list[BaseException] = []

        def create(k: int) -> None:
            try:
                for i in range(12):
                    store.stream(f"s{k}_{i}", **META).close(complete=True)
            except BaseException as e:  # noqa: BLE001 - collected for the assertion
                errors.append(e)
        threads = [threading.Thread(target=create, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(store.stream_ids()) == 96 and validate_store(store.path) == []


class TestErrors:
    def test_unwritable_path(self, tmp_path):
        blocker = tmp_path / "a_file"
        blocker.write_text("not a directory")
        with pytest.raises(SinkError, match="cannot write the output store .*a_file/out.zarr"):
            ZarrStore.open(blocker / "out.zarr", config={})

    def test_foreign_store_is_refused(self, tmp_path):
        zarr.open_group(tmp_path / "x.zarr", mode="w", attributes={"format": "someone-else/3"})
        for mode in ("a", "w", "r"):
            with pytest.raises(SinkError, match=r"format 'someone-else/3', not 'arr-coc/1'") as info:
                ZarrStore.open(tmp_path / "x.zarr", config={}, mode=mode)
            assert "\n" not in str(info.value)
        assert (tmp_path / "x.zarr" / "zarr.json").exists()  # mode "w" deleted nothing

    def test_non_zarr_directory_is_refused(self, tmp_path):
        (tmp_path / "photos").mkdir()
        (tmp_path / "photos" / "keep.jpg").write_bytes(b"x")
        with pytest.raises(SinkError, match="exists and is not a zarr store"):
            ZarrStore.open(tmp_path / "photos", config={}, mode="w")
        assert (tmp_path / "photos" / "keep.jpg").exists()

    def test_a_store_created_beside_us_just_now_is_opened(self, tmp_path, monkeypatch):
        """Shard processes started together on one fresh store: one that looked before another's
        root was written, and finds the directory filled after, opens that store (its config kept)."""
        from sinks import store_files
        first = ZarrStore.open(tmp_path / "s.zarr", config={"who": "first"})     # the quicker process
        real, looks = store_files.Location.is_file, []

        def late(loc, rel):                  # our first look came before the root's zarr.json was there
            looks.append(rel)
            return False if len(looks) == 1 else real(loc, rel)
        monkeypatch.setattr(store_files.Location, "is_file", late)
        second = ZarrStore.open(tmp_path / "s.zarr", config={"who": "second"})
        assert looks[0] == "zarr.json" and second.config == first.config == {"who": "first"}

    @pytest.mark.parametrize("bad", ["", "  ", "a/b", "a\\b", "..", ".hidden", "__meta", "zarr.json", "x\ny"])
    def test_invalid_stream_ids(self, store, bad):
        with pytest.raises(SinkError, match="invalid stream id"):
            store.stream(bad, **META)
        assert store.stream_ids() == []

    def test_bad_stream_attrs(self, store):
        with pytest.raises(ValueError, match="grid must be"):
            store.stream("v", **{**META, "grid": (3, 0)})
        with pytest.raises(ValueError, match="fps must be"):
            store.stream("v", **{**META, "fps": 0})
        with pytest.raises(SinkError, match="config cannot be stored as JSON"):
            ZarrStore.open(store.path.parent / "y.zarr", config={"f": object()})
        assert FORMAT == "arr-coc/1"


class TestFsspecURL:
    """A store at an fsspec URL (here fsspec's in-memory filesystem; s3://, gs://... the same way
    once their fsspec package is installed): the same schema, written through zarr's FsspecStore."""

    @pytest.fixture
    def url(self):
        import fsspec

        url = f"memory://arrcoc-test-{uuid.uuid4().hex}/out.zarr"
        yield url
        fs = fsspec.filesystem("memory")
        root = url.removeprefix("memory://").split("/")[0]
        if fs.exists(f"/{root}"):
            fs.rm(f"/{root}", recursive=True)

    def test_write_read_validate_and_resume(self, url):
        store = ZarrStore.open(url, config={"vlm": {"id": "none"}})
        assert store.path == url and store.stream_ids() == []
        writer = store.stream("video7", **META)
        write_frames(writer, 40)
        writer.add_answers([{"t_start": 0.0, "t_end": 1.0, "question": "q?", "text": "a", "tokens_kept": 3,
                             "tokens_full": 12, "latency_s": 0.1}])
        writer.close(complete=True)
        half = store.stream("video8", **META)                                # left incomplete
        write_frames(half, 10)
        half.close(complete=False)
        assert store.stream_ids() == ["video7", "video8"]
        assert store.is_complete("video7") and not store.is_complete("video8")
        assert validate_store(url) == []
        data = read_stream(url, "video7")
        np.testing.assert_array_equal(data["frame_index"], np.arange(40) * 2)
        assert data["answers"]["text"].tolist() == ["a"] and data["attrs"]["complete"] is True
        again = ZarrStore.open(url, mode="a")                                 # a resumed run
        redo = again.stream("video8", **META)                                # replaces the incomplete one
        assert again.stream_ids() == ["video7", "video8"] and redo.frames == 0
        assert read_stream(url, "video8")["pts"].shape == (0,)
        with pytest.raises(SinkError, match="already complete"):
            again.stream("video7", **META)

    def test_refuses_what_is_not_an_arr_coc_store(self, url):
        import fsspec

        fs, root = fsspec.core.url_to_fs(url)
        fs.pipe_file(f"{root}/notes.txt", b"x")
        with pytest.raises(SinkError, match="exists and is not a zarr store"):
            ZarrStore.open(url, config={"a": 1})
        assert validate_store(url) == [f"{url} is not a zarr store (no zarr.json)"]

    def test_unknown_protocols_and_missing_backends_are_one_line_errors(self):
        with pytest.raises(SinkError, match="cannot open the store 'nosuchproto://b/x.zarr'"):
            ZarrStore.open("nosuchproto://b/x.zarr", config={"a": 1})
        try:
            import s3fs  # noqa: F401
        except ImportError:
            with pytest.raises(SinkError, match="s3fs"):
                ZarrStore.open("s3://bucket/x.zarr", config={"a": 1})
