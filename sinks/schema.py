"""The `arr-coc/1` output schema, declared once: what each array and attribute of a store is.

The writer, the reader and the validator (sinks/zarr_store.py) take names, dtypes, dimensions and
value rules from here; the README's "Output schema" block is checked against it by a test.

    OUT.zarr/                    ROOT_ATTRS
      streams/<stream_id>/       STREAM_ATTRS
        FRAMES.fields            dims (frame,) or (frame, y, x); rows committed by attr `frames`
        answers/ ANSWERS.fields  dims (answer,); rows committed by attr `answer_count`
        gaps/    GAPS.fields     dims (gap,); rows committed by attr `gap_count`

Every array carries its dims as zarr v3 `dimension_names`, so xarray opens a stream group (or its
`answers` / `gaps` group) as a Dataset. Arrays and fields may be added to the format, never changed:
a field added after the first stores were written has a default (`Field.default` or
`Field.default_from`), which a writer stores when it is not given and a reader fills in for stores
written before the field existed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

FORMAT = "arr-coc/1"

# Dimension names (zarr's dimension_names, xarray's dims) and the symbols the README writes for their sizes.
DIMS = {"frame": "T", "y": "gh", "x": "gw", "answer": "A", "gap": "G"}

_DTYPES = ("float64", "float32", "float16", "int64", "int32", "uint16", "uint8", "bool", "str")


@dataclass(frozen=True)
class Field:
    """One array: name, dtype (a numpy dtype name, or "str" for zarr v3's variable-length UTF-8
    strings), dims (names from DIMS, the first one the row dimension) and what a value means.

    valid: (low, high) a value must lie in (ints) or is clipped to (floats, with clip=True);
    default / default_from: for a field added to the format later, the value a writer stores when
    none is given (a constant, or the same row's value of another field), and what a reader returns
    for stores written before the field existed.
    """

    name: str
    dtype: str
    dims: tuple[str, ...]
    meaning: str
    valid: tuple[float, float] | None = None
    clip: bool = False
    default: Any = None
    default_from: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"Field {self.name!r}: invalid dtype ({self.dtype!r}). Supported values are "
                             f"{', '.join(_DTYPES)}.")
        unknown = [d for d in self.dims if d not in DIMS]
        if unknown:
            raise ValueError(f"Field {self.name!r}: invalid dims {unknown}. Supported values are {', '.join(DIMS)}.")

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of the values a writer hands to zarr (object for strings)."""
        return np.dtype(object) if self.dtype == "str" else np.dtype(self.dtype)

    @property
    def fill(self) -> Any:
        """zarr's fill value: "" or the dtype's zero."""
        return "" if self.dtype == "str" else np.zeros((), self.dtype).item()

    @property
    def added(self) -> bool:
        """Added to the format after its first stores: older stores may lack it."""
        return self.default is not None or self.default_from is not None

    def matches(self, dtype: np.dtype) -> bool:
        """Whether an array read back from zarr has this field's dtype (zarr 3 reads its "string"
        data type as numpy's StringDType, kind "T")."""
        return dtype.kind == "T" if self.dtype == "str" else dtype == np.dtype(self.dtype)

    def bounds(self) -> tuple[Any, Any]:
        """(low, high) of an integer field: `valid`, else the dtype's range."""
        info = np.iinfo(self.dtype)
        return self.valid if self.valid is not None else (int(info.min), int(info.max))

    def check_value(self, value: Any) -> Any:
        """One value of this field (an answer's or a gap's), checked: a ValueError names the field,
        the value and what is allowed."""
        kind = np.dtype(self.numpy_dtype).kind
        if kind == "O":
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be a string, got {type(value).__name__}")
        elif kind == "f":
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                raise ValueError(f"{self.name} must be a finite number, got {value!r}")
        elif kind in "iu":
            low, high = self.bounds()
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
                raise ValueError(f"{self.name} must be an int in [{low}, {high}], got {value!r}")
        return value

    def check_column(self, value: Any) -> np.ndarray:
        """A column of this field (n values, frame arrays), checked and cast to the dtype."""
        value = np.asarray(value)
        kind = np.dtype(self.dtype).kind
        if kind == "f":
            if value.dtype.kind in "fc" and not np.isfinite(value).all():
                raise ValueError(f"{self.name} contains NaN or inf")
            if self.clip and self.valid is not None:
                value = np.clip(value, *self.valid)
        elif kind in "iu":
            low, high = self.bounds()
            if value.size and (value.dtype.kind not in "iu" or value.min() < low or value.max() > high):
                got = f" range [{value.min()}, {value.max()}]" if value.dtype.kind in "iufb" else ""
                raise ValueError(f"{self.name} must be integers in [{low}, {high}], got dtype {value.dtype}{got}")
        return value.astype(self.dtype)

    def default_column(self, columns: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """What a reader returns for this added field of a store written before it: n defaults."""
        if self.default_from is not None:
            return np.asarray(columns[self.default_from]).astype(self.dtype)
        return np.full(n, self.default, dtype=self.dtype)


@dataclass(frozen=True)
class Table:
    """Arrays that share their row dimension and are committed together: rows [0, count) of
    every array are on disk once the stream attr `count_attr` says count."""

    group: str          # where under streams/<id>/: "" (the stream group itself), "answers", "gaps"
    dim: str            # the row dimension
    count_attr: str
    fields: tuple[Field, ...]
    optional: bool = False  # stores written before the table existed have none of it

    def __post_init__(self) -> None:
        wrong = [f.name for f in self.fields if f.dims[0] != self.dim]
        if wrong:
            raise ValueError(f"Table {self.group!r}: fields {wrong} do not have {self.dim!r} as first dim")

    @property
    def prefix(self) -> str:
        """The arrays' path prefix inside the stream group ("" or "answers/")."""
        return f"{self.group}/" if self.group else ""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r} in {self.group or 'frame arrays'}; fields: {', '.join(self.names)}")

    def check_row(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """One row by field name, checked, with the defaults of fields not given; declared order."""
        unknown = [k for k in row if k not in self.names]
        if unknown:
            raise ValueError(f"unknown {self.dim} field(s) {', '.join(map(repr, unknown))}; "
                             f"fields: {', '.join(self.names)}")
        out = {}
        for f in self.fields:
            if f.name in row and row[f.name] is not None:
                out[f.name] = f.check_value(row[f.name])
            elif f.default is not None:
                out[f.name] = f.default
            elif f.default_from is not None:
                out[f.name] = out[f.default_from]
            else:
                raise ValueError(f"{self.dim} field {f.name!r} is missing; fields: {', '.join(self.names)}")
        return out


FRAMES = Table("", "frame", "frames", (
    Field("pts", "float64", ("frame",), "presentation time (s) of each processed frame"),
    Field("frame_index", "int64", ("frame",), "index in the decoded stream", valid=(0, 2**63 - 1)),
    Field("relevance", "float16", ("frame", "y", "x"), "realized relevance in [0, 1]", valid=(0.0, 1.0),
          clip=True),
    Field("tokens", "uint16", ("frame", "y", "x"), "homunculus: VLM tokens spent on each cell (0 = none)"),
    Field("scene_change", "bool", ("frame",), "True on the first frame of each new shot/fixation"),
    Field("motion", "float16", ("frame",), "mean motion magnitude of the frame"),
))

ANSWERS = Table("answers", "answer", "answer_count", (
    Field("t_start", "float64", ("answer",), "start of the window of video the answer covers (s)"),
    Field("t_end", "float64", ("answer",), "end of that window (s)"),
    Field("question", "str", ("answer",), "the question"),
    Field("text", "str", ("answer",), "the VLM's answer"),
    Field("tokens_kept", "int32", ("answer",), "visual tokens sent to the VLM (the final pass's)",
          valid=(0, 2**31 - 1)),
    Field("tokens_full", "int32", ("answer",), "visual tokens a stock VLM gets for the same frames",
          valid=(0, 2**31 - 1)),
    Field("latency_s", "float32", ("answer",), "window end (or arrival) -> answer ready (s)"),
    Field("passes", "uint8", ("answer",), "allocation passes used", valid=(1, 255), default=1),
    Field("tokens_spent", "int32", ("answer",), "visual tokens over all passes", valid=(0, 2**31 - 1),
          default_from="tokens_kept"),
    Field("confidence", "float32", ("answer",), "the VLM's confidence in the answer's first token (NaN: unknown)",
          valid=(0.0, 1.0), clip=True, default=float("nan")),
    Field("no_answer", "str", ("answer",), "why the text is no answer: the model generated nothing, or words "
          "outside the answers it was trained to give (\"\": an answer)", default=""),
))

GAPS = Table("gaps", "gap", "gap_count", (
    Field("start_pts", "float64", ("gap",), "pts of the last frame before the interruption"),
    Field("end_pts", "float64", ("gap",), "pts of the first frame after it"),
    Field("start_wall", "float64", ("gap",), "arrival time (Unix s) of that last frame before"),
    Field("end_wall", "float64", ("gap",), "arrival time (Unix s) of that first frame after"),
    Field("reason", "str", ("gap",), "why the stream was interrupted"),
), optional=True)

TABLES = (FRAMES, ANSWERS, GAPS)


@dataclass(frozen=True)
class Attr:
    """One group attribute: its JSON type(s) and meaning; optional ones may be absent."""

    name: str
    types: tuple[type, ...]
    meaning: str
    optional: bool = False

    def problem(self, value: Any) -> str | None:
        """Why value cannot be this attribute, or None."""
        # bool is an int in Python: only a bool attribute may be one
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            kinds = " or ".join(t.__name__ for t in self.types)
            return f"attr {self.name!r} must be {kinds}, got {value!r}"
        return None


ROOT_ATTRS = (
    Attr("format", (str,), f"{FORMAT!r}"),
    Attr("config", (dict,), "the config of the run that created the store"),
)

STREAM_ATTRS = (
    Attr("source", (str,), "the file, camera or URL the stream came from"),
    Attr("query", (str,), "the question relevance was realized for"),
    Attr("fps", (int, float), "frames per second of the stream"),
    Attr("width", (int,), "frame width (pixels)"),
    Attr("height", (int,), "frame height (pixels)"),
    Attr("grid", (list,), "[gh, gw], the allocation grid (the VLM's merged-token grid)"),
    Attr("vlm", (str,), "the VLM that answered ('none': allocation only)"),
    Attr("complete", (bool,), "true only once the stream was processed to its end"),
    Attr("frames", (int,), "frame rows committed (safely written)"),
    Attr("answer_count", (int,), "answer rows committed"),
    Attr("gap_count", (int,), "gap rows committed (absent: 0)", optional=True),
    Attr("config", (dict,), "the config of the run that wrote this stream (absent in older stores: the root's)",
         optional=True),
    Attr("damaged", (bool,), "true: damage stopped decoding; processed up to it, done but not complete",
         optional=True),
    Attr("truncated_at_s", (int, float, type(None)), "damaged streams: pts of the last stored frame (s)",
         optional=True),
    Attr("stopped_by", (str,), "live streams: what ended it: end (the source ended: a --realtime file's last "
         "frame), duration (--duration), stop (asked to: the Python API, the server), interrupt (Ctrl-C, "
         "SIGTERM), gave_up (--max-reconnects)", optional=True),
    Attr("outage_s", (int, float), "live streams: seconds without frames, all its gaps together", optional=True),
)


def answer_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One answer by field name, checked; `passes` defaults to 1 and `tokens_spent` to
    `tokens_kept` when not given (or None)."""
    out = ANSWERS.check_row(row)
    if out["tokens_spent"] < out["tokens_kept"]:
        raise ValueError(f"tokens_spent ({out['tokens_spent']}) counts every pass, so it cannot be less "
                         f"than tokens_kept ({out['tokens_kept']}), the final pass's")
    return out


def gap_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One gap by field name, checked: it ends after it starts, in pts and in wall time."""
    out = GAPS.check_row(row)
    if out["end_pts"] < out["start_pts"] or out["end_wall"] < out["start_wall"]:
        raise ValueError(f"a gap must end after it starts, got pts {out['start_pts']}..{out['end_pts']}, "
                         f"wall {out['start_wall']}..{out['end_wall']}")
    return out
