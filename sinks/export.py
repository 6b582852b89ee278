"""Flat exports of a store: one row per answer and per scene change, as JSON lines or CSV.

Rows are per stream (sorted by id), in the order things happen in the video: a scene change at
its frame's time, an answer at the end of the window it covers. Every row has `kind` ("answer"
or "scene_change") and `stream`; the other columns are the kind's own (EXPORT_COLUMNS). JSON lines
carry only a row's own columns; CSV has every column, empty where a kind has none.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Literal, TextIO

from sinks.schema import ANSWERS
from sinks.zarr_store import SinkError, ZarrStore

ExportFormat = Literal["jsonl", "csv"]
EXPORT_FORMATS = ("jsonl", "csv")
SCENE_CHANGE_COLUMNS = ("pts", "frame_index")
EXPORT_COLUMNS = ("kind", "stream", *SCENE_CHANGE_COLUMNS, *ANSWERS.names)
# a live stream's times are arrival clocks (0.004954099655151367 s): a millisecond is finer than any
# frame interval a store holds, and the store keeps the exact values
TIME_DECIMALS = 3


def export_rows(store: str | os.PathLike, stream_id: str | None = None) -> list[dict[str, Any]]:
    """The rows of one stream (or of every stream when None), plain Python values."""
    opened = ZarrStore.open(store, mode="r")
    rows: list[dict[str, Any]] = []
    for sid in [stream_id] if stream_id is not None else opened.stream_ids():
        data = opened.read(sid, frame_arrays=("pts", "frame_index", "scene_change"))
        events: list[tuple[float, int, dict[str, Any]]] = []
        cuts = data["scene_change"].nonzero()[0]
        for k in cuts:
            events.append((float(data["pts"][k]), 0, {"kind": "scene_change", "stream": sid,
                                                      "pts": round(float(data["pts"][k]), TIME_DECIMALS),
                                                      "frame_index": int(data["frame_index"][k])}))
        answers = data["answers"]
        for k in range(len(answers["text"])):
            row = {"kind": "answer", "stream": sid}
            row.update((f.name, _plain(f.dtype, answers[f.name][k])) for f in ANSWERS.fields)
            events.append((row["t_end"], 1, row))
        rows += [row for _, _, row in sorted(events, key=lambda e: e[:2])]
    return rows


def _plain(dtype: str, value: Any) -> Any:
    """A stored value as JSON / CSV writes it."""
    if dtype == "str":
        return str(value)
    if dtype == "float64":  # times (s): to the millisecond, as run, live and the API print them
        return round(float(value), TIME_DECIMALS)
    if dtype == "float32":  # rounded, not its float64 expansion (0.1234 -> 0.1234000027179718)
        value = float(value)
        return round(value, 6) if math.isfinite(value) else None   # JSON has no NaN: null / an empty cell
    return value.item()


def write_rows(rows: list[dict[str, Any]], out: TextIO, format: ExportFormat) -> None:
    if format == "jsonl":
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif format == "csv":
        writer = csv.DictWriter(out, fieldnames=EXPORT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        raise ValueError(f"Invalid format ({format!r}). Supported values are {', '.join(EXPORT_FORMATS)}.")


def export_store(store: str | os.PathLike, out: str | os.PathLike | TextIO | None = None, *,
                 format: ExportFormat = "jsonl", stream_id: str | None = None) -> int:
    """Write the rows of `store` (one stream, or all) to `out`: a file path, an open text stream, or
    None for stdout. The store is read in full first, so a bad stream id writes nothing. Returns
    the number of rows."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"Invalid format ({format!r}). Supported values are {', '.join(EXPORT_FORMATS)}.")
    rows = export_rows(store, stream_id)
    if out is None or not isinstance(out, (str, os.PathLike)):
        write_rows(rows, sys.stdout if out is None else out, format)
        return len(rows)
    text = io.StringIO()
    write_rows(rows, text, format)
    path = Path(out)
    try:
        path.write_text(text.getvalue(), encoding="utf-8")
    except OSError as e:
        raise SinkError(f"cannot write the export {path}: {e.strerror or e}") from None
    return len(rows)
