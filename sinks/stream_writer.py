"""The writer of one stream of a store (ZarrStore.stream makes it): frames buffered and written a
whole chunk at a time, answers and gaps written at once, each behind its commit point (the
`frames`, `answer_count`, `gap_count` attrs; see Crash safety in sinks/zarr_store.py)."""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from sinks.schema import ANSWERS, FRAMES, GAPS, Table, answer_row, gap_row
from sinks.store_files import ArrayFiles, Location, SinkError, cell_shape, json_bytes
from sinks.stream_lock import StreamLock


@dataclass(frozen=True)
class ReplacedStream:
    """The stream a new one replaced (StreamWriter.replaced): its source (None where its metadata
    was unreadable), whether it was complete, its committed frames. str(): one line for the user."""

    stream_id: str
    source: str | None
    complete: bool
    frames: int

    def __str__(self) -> str:
        if self.source is None:
            return f"replacing stream {self.stream_id!r} (was unreadable)"
        state = "complete" if self.complete else "incomplete"
        return f"replacing stream {self.stream_id!r} (was {self.source}, {state}, {self.frames} frames)"


class StreamWriter:
    """Appends one stream's per-frame arrays and answers; made by ZarrStore.stream. It owns its
    stream (in a local store) until close(), or until it is garbage-collected unclosed. One thread
    at a time.

    replaced: the stream this one replaced (ReplacedStream; str() is a line for the user), or None.
    """

    def __init__(self, loc: Location, rel: str, files: Mapping[str, bytes], *, stream_id: str,
                 store_path: Path | str, chunk_frames: int, lock: StreamLock | None = None,
                 replaced: ReplacedStream | None = None) -> None:
        self.stream_id = stream_id
        self.replaced = replaced
        # the lock goes with the writer: at close(), or when an unclosed writer is collected
        self._release = weakref.finalize(self, lock.release) if lock is not None else None
        self.chunk_frames = chunk_frames
        self._where = f"stream {stream_id!r} in {store_path}"
        self._loc, self._rel = loc, rel
        self._meta = json.loads(files["zarr.json"])                          # the group's, attributes included

        def arrays(table: Table) -> dict[str, ArrayFiles]:
            return {f.name: ArrayFiles(loc, f"{rel}/{table.prefix}{f.name}",
                                        files[f"{table.prefix}{f.name}/zarr.json"], f) for f in table.fields}

        self._frames = arrays(FRAMES)
        self._answers = arrays(ANSWERS)
        self._gaps = arrays(GAPS)
        self.grid = tuple(self._meta["attributes"]["grid"])
        self.frames = 0   # committed: rows on disk and recorded in the `frames` attr
        self.answers = 0  # committed answers (`answer_count` attr)
        self.gaps = 0     # committed gaps (`gap_count` attr)
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_frames = 0
        self.closed = False

    def append(self, pts: Any, frame_index: Any, relevance: Any, tokens: Any, scene_change: Any,
               motion: Any) -> None:
        """Buffer n frames; whole chunks are written as soon as they fill.

        pts (n,), frame_index (n,), relevance (n, gh, gw) clipped to [0, 1], tokens (n, gh, gw)
        integers in [0, 65535], scene_change (n,) bool, motion (n,).
        """
        self._check_open()
        batch = self._convert(pts=pts, frame_index=frame_index, relevance=relevance, tokens=tokens,
                              scene_change=scene_change, motion=motion)
        n = len(batch["pts"])
        if n == 0:
            return
        self._pending.append(batch)
        self._pending_frames += n
        self._write(full_chunks_only=True)

    def flush(self) -> None:
        """Write every buffered frame, including a partial last chunk."""
        self._check_open()
        self._write(full_chunks_only=False)

    def add_answer(self, t_start: float, t_end: float, question: str, text: str, tokens_kept: int,
                   tokens_full: int, latency_s: float, *, passes: int | None = None,
                   tokens_spent: int | None = None) -> None:
        """Write one answer immediately (answers are rare and must survive a crash). passes and
        tokens_spent default to 1 and tokens_kept (sinks.schema.ANSWERS)."""
        self.add_answers([dict(t_start=t_start, t_end=t_end, question=question, text=text, tokens_kept=tokens_kept,
                               tokens_full=tokens_full, latency_s=latency_s, passes=passes,
                               tokens_spent=tokens_spent)])

    def add_answers(self, rows: list[Mapping[str, Any]]) -> None:
        """Write several answers (dicts by field name, sinks.schema.answer_row) immediately, in one
        commit: each array is resized and written once for all of them (a batch video's questions).
        One bad row refuses them all, before anything is written."""
        self._check_open()
        checked = [answer_row(row) for row in rows]
        self.answers = self._append_rows(self._answers, self.answers, checked, ANSWERS.count_attr, "an answer")

    def add_gap(self, start_pts: float, end_pts: float, start_wall: float, end_wall: float,
                reason: str) -> None:
        """Record immediately that a live stream was cut off between two frames (sinks.schema.GAPS)."""
        self._check_open()
        row = gap_row(dict(start_pts=start_pts, end_pts=end_pts, start_wall=start_wall, end_wall=end_wall,
                           reason=reason))
        self.gaps = self._append_rows(self._gaps, self.gaps, [row], GAPS.count_attr, "a gap")

    def _append_rows(self, arrays: dict[str, Any], n: int, rows: list[dict[str, Any]], count_attr: str,
                     what: str) -> int:
        """Write rows at [n, n + len(rows)) of every array, then raise the count attr (the commit
        point, after every array holds the rows); returns the new count."""
        k = len(rows)
        if k == 0:
            return n
        try:
            for name, array in arrays.items():
                array.append([row[name] for row in rows])
            self._set_attrs({count_attr: n + k})
        except OSError as e:
            raise SinkError(f"cannot write {what} of {self._where}: {e.strerror or e}") from e
        return n + k

    def close(self, complete: bool, *, damaged: bool = False, truncated_at_s: float | None = None,
              attrs: Mapping[str, Any] | None = None) -> None:
        """Flush, then record `complete` (True only when the stream was processed to its end), and
        give the stream up (also when that fails: the writer is closed either way).

        damaged: the input's damage stopped decoding and everything before it was processed; the
        stream is then recorded as `damaged` (done: nothing more can be decoded) but not complete,
        with `truncated_at_s`, the pts of its last frame. Rows are committed before that is written.
        attrs: more of sinks.schema.STREAM_ATTRS, written with `complete` (live: stopped_by, outage_s)."""
        self._check_open()
        if damaged and complete:
            raise ValueError("a damaged stream is not complete: pass complete=False with damaged=True")
        try:
            self._write(full_chunks_only=False)
            final: dict[str, Any] = {**(attrs or {}), "complete": bool(complete), "frames": self.frames}
            if damaged:
                final.update(damaged=True, truncated_at_s=None if truncated_at_s is None else float(truncated_at_s))
            try:
                self._set_attrs(final)
            except OSError as e:
                raise SinkError(f"cannot finish {self._where}: {e.strerror or e}") from e
        finally:
            self.closed = True
            if self._release is not None:
                self._release()

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        # Leaving a `with` block never claims completeness: only an explicit close(True) does.
        if not self.closed:
            self.close(complete=False)

    def _set_attrs(self, values: Mapping[str, Any]) -> None:
        """Update the group's attributes: its zarr.json rewritten whole (as zarr does)."""
        self._meta["attributes"].update(values)
        self._loc.write(f"{self._rel}/zarr.json", json_bytes(self._meta))

    def _check_open(self) -> None:
        if self.closed:
            raise SinkError(f"{self._where} is already closed")

    def _convert(self, **columns: Any) -> dict[str, np.ndarray]:
        shapes: dict[str, np.ndarray] = {}
        for f in FRAMES.fields:
            value = np.asarray(columns[f.name])
            want = ("n", *cell_shape(f, self.grid))
            if value.ndim != len(want) or value.shape[1:] != want[1:]:
                raise ValueError(f"{f.name} must have shape {want}, got {value.shape}")
            shapes[f.name] = value
        counts = {name: len(v) for name, v in shapes.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(f"append needs the same number of frames in every column, got {counts}")
        return {f.name: f.check_column(shapes[f.name]) for f in FRAMES.fields}

    def _write(self, *, full_chunks_only: bool) -> None:
        start = self.frames
        total = start + self._pending_frames
        # Writes end on chunk boundaries, so each chunk file is written once (after an explicit
        # flush() the partial chunk is rewritten once more when it fills).
        end = (total // self.chunk_frames) * self.chunk_frames if full_chunks_only else total
        if end <= start:
            return
        batch = {name: np.concatenate([p[name] for p in self._pending]) for name in self._frames}
        n = end - start
        try:
            for name, array in self._frames.items():
                array.append(batch[name][:n])
            self._set_attrs({"frames": end})  # commit point: every array already holds [0, end)
        except OSError as e:
            raise SinkError(f"cannot write frames of {self._where}: {e.strerror or e}") from e
        rest = {name: column[n:] for name, column in batch.items()}
        self._pending = [rest] if total > end else []
        self._pending_frames = total - end
        self.frames = end

