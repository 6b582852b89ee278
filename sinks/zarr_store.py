"""The zarr v3 output store (public schema: "Output schema" in DESIGN.md / the README).

    OUT.zarr/                attrs: format "arr-coc/1", config {...}
      streams/<stream_id>/   attrs: source, query, fps, width, height, grid, vlm, complete,
                                    frames (T committed), answer_count (A committed)
        pts float64 [T], frame_index int64 [T], relevance float16 [T, gh, gw],
        tokens uint16 [T, gh, gw], scene_change bool [T], motion float16 [T]
        answers/ t_start float64 [A], t_end float64 [A], question str [A], text str [A],
                 tokens_kept int32 [A], tokens_full int32 [A], latency_s float32 [A]
        gaps/    (added array group; attr gap_count = G committed, absent = 0) where a live stream was cut off:
                 start_pts float64 [G] pts of the last frame before, end_pts float64 [G] of the first
                 frame after, start_wall / end_wall float64 [G] their arrival times (Unix s),
                 reason str [G]; empty for files. Stores written before it existed have no `gaps/`.

Writing. zarr creates each stream group's empty layout once per grid and chunking (a template);
a writer then appends by writing the chunk files and metadata itself, as zarr would write them
(same codecs, the same chunk bytes: tests compare), without zarr's per-call machinery (~1 ms of
Python per call; a batch video made ~40). Reading, validation and everything else go through zarr.

Crash safety. Every local file write is atomic (write to a temporary, rename), so each metadata
or chunk file is either old or new, never torn. On top of that:
- a stream group is built complete (attrs + empty arrays) in a staging directory and renamed into
  `streams/` in one step, so a reader never sees a half-created stream;
- frames are buffered and written a whole chunk at a time; every array is resized and filled
  *before* the `frames` attr is raised to the new T. `frames` is the commit point: rows [0, frames)
  of every per-frame array are on disk. A crash between two array writes can leave some arrays up
  to one chunk longer than `frames` (never shorter); `read_stream` cuts them to `frames`.
- answers are committed the same way through `answer_count`.
Writers of different streams touch disjoint groups, so threads / processes / Ray actors can share
one store; the only shared writes are creating the root and `streams/` (both idempotent).

Stores at fsspec URLs (s3://, gs://, memory://, ...; `file://` is a local path) are read through
zarr's FsspecStore and written with one put per file. Object stores have no atomic rename, so
there a stream group is written in place, its own zarr.json last (a listing never shows a group
without its arrays), after the incomplete group it replaces is deleted; the commit points
(`frames`, `answer_count`, `complete`) are the same.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import zarr
import numcodecs
from numcodecs.vlen import VLenUTF8
from zarr.codecs import BytesCodec, VLenUTF8Codec, ZstdCodec
from zarr.errors import ContainsGroupError
from zarr.storage import LocalStore

FORMAT = "arr-coc/1"
STAGING = ".staging"  # inside the store, beside `streams/`: same filesystem, so a rename is atomic
DEFAULT_CHUNK_FRAMES = 64
ANSWER_CHUNK = 64

StoreMode = Literal["r", "a", "w"]


class SinkError(Exception):
    """The output cannot be written or read as asked. The message is one line naming the path/value."""


@dataclass(frozen=True)
class ArraySpec:
    name: str
    dtype: Any          # numpy dtype, or str for zarr's variable-length UTF-8 strings
    per_cell: bool = False  # shape (T, gh, gw) instead of (T,)

    @property
    def fill(self) -> Any:
        return "" if self.dtype is str else np.zeros((), self.dtype).item()

    def matches(self, dtype: np.dtype) -> bool:
        # zarr 3 reads its "string" data type back as numpy's StringDType (kind "T")
        return dtype.kind == "T" if self.dtype is str else dtype == np.dtype(self.dtype)

    @property
    def dtype_name(self) -> str:
        return "str" if self.dtype is str else np.dtype(self.dtype).name


FRAME_ARRAYS = (
    ArraySpec("pts", np.float64),
    ArraySpec("frame_index", np.int64),
    ArraySpec("relevance", np.float16, per_cell=True),
    ArraySpec("tokens", np.uint16, per_cell=True),
    ArraySpec("scene_change", np.bool_),
    ArraySpec("motion", np.float16),
)
ANSWER_ARRAYS = (
    ArraySpec("t_start", np.float64),
    ArraySpec("t_end", np.float64),
    ArraySpec("question", str),
    ArraySpec("text", str),
    ArraySpec("tokens_kept", np.int32),
    ArraySpec("tokens_full", np.int32),
    ArraySpec("latency_s", np.float32),
)
GAP_ARRAYS = (
    ArraySpec("start_pts", np.float64),
    ArraySpec("end_pts", np.float64),
    ArraySpec("start_wall", np.float64),
    ArraySpec("end_wall", np.float64),
    ArraySpec("reason", str),
)


def validate_stream_id(stream_id: Any) -> str:
    """Return stream_id if it can name a group under `streams/`, else raise SinkError saying why."""
    if not isinstance(stream_id, str):
        raise SinkError(f"stream id must be a string, got {type(stream_id).__name__} {stream_id!r}")
    why = None
    if not stream_id.strip():
        why = "it is empty"
    elif "/" in stream_id or "\\" in stream_id:
        why = "it contains a path separator"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in stream_id):
        why = "it contains control characters"
    elif stream_id.startswith("."):
        why = "it starts with '.' (hidden / relative names)"
    elif stream_id.startswith("__"):
        why = "names starting with '__' are reserved by zarr v3"
    elif stream_id == "zarr.json":
        why = "it is zarr's metadata file name"
    if why:
        raise SinkError(f"invalid stream id {stream_id!r}: {why}; use a non-empty name without '/', '\\', "
                        f"control characters or a leading '.'/'__' (e.g. the file stem)")
    return stream_id


class _Location:
    """Where a store lives: a local directory (or a file:// URL), written through zarr's LocalStore
    with atomic renames, or any other fsspec URL (s3://, gs://, memory://, ...; the protocol's
    fsspec package must be installed), written through zarr's FsspecStore. Paths below it are
    '/'-separated, relative to its root."""

    def __init__(self, where: str | os.PathLike) -> None:
        text = os.fspath(where)
        local = _local_part(text)
        self.fs: Any = None
        self.url: str | None = None
        self.path: Path | None = None
        if local is None:
            try:
                import fsspec

                self.fs, self.root = fsspec.core.url_to_fs(text)
            except (ImportError, ValueError) as e:
                raise SinkError(f"cannot open the store {text!r}: {e}") from None
            self.url = text.rstrip("/")
        else:
            self.path = Path(local)

    def __str__(self) -> str:
        return self.url if self.url is not None else str(self.path)

    def zarr_store(self, read_only: bool) -> Any:
        if self.fs is None:
            return LocalStore(self.path, read_only=read_only)
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(self.url, read_only=read_only)

    def _full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def is_file(self, rel: str) -> bool:
        return (self.path / rel).is_file() if self.fs is None else self.fs.isfile(self._full(rel))

    def occupied(self) -> bool:
        """Something other than an empty directory is at the root."""
        if self.fs is None:
            return self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir()))
        return self.fs.exists(self.root) and (not self.fs.isdir(self.root) or bool(self.fs.ls(self.root)))

    def groups(self, rel: str) -> list[str]:
        """Names of the zarr groups directly under rel (directories holding a zarr.json)."""
        if self.fs is None:
            d = self.path / rel
            return [p.name for p in d.iterdir() if (p / "zarr.json").is_file()] if d.is_dir() else []
        if not self.fs.isdir(self._full(rel)):
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self._full(rel), detail=True)
                 if e["type"] == "directory"]
        return [n for n in names if self.fs.isfile(self._full(f"{rel}/{n}/zarr.json"))]

    def remove(self, rel: str = "") -> None:
        if self.fs is None:
            shutil.rmtree(self.path / rel)
        elif self.fs.exists(self._full(rel)):
            self.fs.rm(self._full(rel), recursive=True)

    def write(self, rel: str, data: bytes) -> None:
        """Write a file whole: locally through a temporary and a rename (a reader or a crash sees
        the old file or the new one, as with zarr's LocalStore), else one object put."""
        if self.fs is None:
            _write_file(self.path / rel, data, atomic=True)
        else:
            self.fs.pipe_file(self._full(rel), data)

    def read(self, rel: str) -> bytes | None:
        """A file's bytes, None where there is none."""
        try:
            if self.fs is None:
                return (self.path / rel).read_bytes()
            return self.fs.cat_file(self._full(rel))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None


def _open_group(loc: _Location, group: str = "", *, read_only: bool) -> zarr.Group:
    return zarr.open_group(loc.zarr_store(read_only), path=group, mode="r" if read_only else "r+", zarr_format=3)


def _open_root(path: _Location, *, read_only: bool) -> zarr.Group:
    """Open an existing arr-coc store, refusing anything else with a one-line SinkError."""
    try:
        root = _open_group(path, read_only=read_only)
    except Exception as e:  # zarr raises several unrelated types for "this is not a group"
        raise SinkError(f"{path} is not a readable zarr v3 group ({type(e).__name__}: {e})") from e
    found = root.attrs.get("format")
    if found != FORMAT:
        raise SinkError(f"{path} is a zarr store of format {found!r}, not {FORMAT!r}; "
                        f"refusing to mix outputs, choose another output path")
    return root


def _json_config(config: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        raise SinkError(f"config must be a mapping (dict), got {type(config).__name__}")
    try:
        return json.loads(json.dumps(dict(config)))
    except (TypeError, ValueError) as e:
        raise SinkError(f"config cannot be stored as JSON zarr attrs: {e}") from e


def _create_root(path: _Location, config: Mapping[str, Any]) -> zarr.Group:
    attrs = {"format": FORMAT, "config": _json_config(config)}
    if path.fs is None:
        path.path.mkdir(parents=True, exist_ok=True)
    try:
        return zarr.create_group(path.zarr_store(read_only=False), attributes=attrs, overwrite=False, zarr_format=3)
    except ContainsGroupError:  # another process created it between our check and now
        return _open_root(path, read_only=False)


class ZarrStore:
    """An arr-coc output store. Create with `ZarrStore.open(path, config=..., mode=...)`."""

    def __init__(self, loc: _Location, root: zarr.Group, *, read_only: bool) -> None:
        self._loc = loc
        self.path: Path | str = loc.path if loc.path is not None else loc.url   # a local Path, or the URL
        self._root = root
        self.read_only = read_only

    @classmethod
    def open(cls, path: str | os.PathLike, *, config: Mapping[str, Any] | None = None,
             mode: StoreMode = "a") -> "ZarrStore":
        """Open or create the store at path.

        mode "r": read only, the store must exist. "a": open, or create with `config`.
        "w": delete an existing arr-coc store at path and create a new one (never deletes
        anything that is not an arr-coc store). An existing store keeps its stored config.
        """
        if mode not in ("r", "a", "w"):
            raise ValueError(f"Invalid mode ({mode!r}). Supported values are r, a, w.")
        path = _Location(path)
        exists = path.is_file("zarr.json")
        if mode == "r":
            if not exists:
                raise SinkError(f"{path} is not a zarr store (no zarr.json)")
            return cls(path, _open_root(path, read_only=True), read_only=True)
        if exists and mode == "w":
            _open_root(path, read_only=False)  # refuses to delete anything but an arr-coc store
            path.remove()
            exists = False
        elif not exists and path.occupied():
            raise SinkError(f"{path} exists and is not a zarr store; refusing to write into it")
        if not exists and config is None:
            raise ValueError("config is required to create a store")
        try:
            root = _open_root(path, read_only=False) if exists else _create_root(path, config)
            if not path.is_file("streams/zarr.json"):
                # absent only when a creator died between writing the root and `streams/`
                try:
                    root.create_group("streams")
                except ContainsGroupError:  # another process was quicker
                    pass
        except OSError as e:
            raise SinkError(f"cannot write the output store {path}: {e.strerror or e}") from e
        return cls(path, root, read_only=False)

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._root.attrs["config"])

    def stream_ids(self) -> list[str]:
        """Ids of the streams in the store (complete or not), sorted."""
        return sorted(self._loc.groups("streams"))

    def is_complete(self, stream_id: str) -> bool:
        """True only when the stream exists and was processed to its end."""
        meta = self._loc.read(f"streams/{validate_stream_id(stream_id)}/zarr.json")
        try:
            return meta is not None and json.loads(meta)["attributes"].get("complete") is True
        except (ValueError, KeyError, TypeError, AttributeError):   # not a readable group: not complete
            return False

    def stream(self, stream_id: str, *, source: str, query: str, fps: float, width: int, height: int,
               grid: tuple[int, int], vlm: str, chunk_frames: int = DEFAULT_CHUNK_FRAMES,
               overwrite: bool = False) -> "StreamWriter":
        """Create `streams/<stream_id>` (empty arrays, complete=False) and return its writer.

        An existing incomplete stream is replaced (a resumed batch redoes it); an existing
        complete one only with overwrite=True.
        """
        if self.read_only:
            raise SinkError(f"{self.path} was opened read-only (mode='r'); cannot write stream {stream_id!r}")
        validate_stream_id(stream_id)
        attrs = _stream_attrs(source=source, query=query, fps=fps, width=width, height=height, grid=grid, vlm=vlm)
        if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
            raise ValueError(f"chunk_frames must be an int >= 1, got {chunk_frames!r}")
        if self.is_complete(stream_id) and not overwrite:
            raise SinkError(f"stream {stream_id!r} is already complete in {self.path}; "
                            f"pass overwrite=True to replace it")
        files = _stream_files(attrs, tuple(attrs["grid"]), chunk_frames)   # the group's zarr.json last
        try:
            if self._loc.fs is None:
                self._stage_stream(stream_id, files)
            else:
                # object stores have no atomic rename: the old stream goes first, then the new one is
                # written with its group's zarr.json last, so a listing never shows a half-made group
                # (and an interrupted one is incomplete: a resumed batch redoes it)
                self._loc.remove(f"streams/{stream_id}")
                for rel, data in files.items():
                    self._loc.write(f"streams/{stream_id}/{rel}", data)
        except OSError as e:
            raise SinkError(f"cannot write stream {stream_id!r} into {self._loc}: {e.strerror or e}") from e
        return StreamWriter(self._loc, f"streams/{stream_id}", files, stream_id=stream_id, store_path=self.path,
                            chunk_frames=chunk_frames)

    def _stage_stream(self, stream_id: str, files: Mapping[str, bytes]) -> None:
        """A local store's new stream: built in the staging directory, renamed into place."""
        target = self.path / "streams" / stream_id
        staging = self.path / STAGING
        new = staging / f"{stream_id}.{uuid.uuid4().hex}"
        _make_dir(new)  # once it exists, staging is not empty: no other writer's rmdir below removes it
        for rel, data in files.items():
            _write_file(new / rel, data)
        old = staging / f"{stream_id}.{uuid.uuid4().hex}.old"
        if target.exists():
            os.rename(target, old)  # the old stream vanishes in one step, never half-deleted
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)
        try:
            staging.rmdir()  # keep the store tidy; another writer may still be staging
        except OSError:
            pass

    def read(self, stream_id: str) -> dict[str, Any]:
        """One stream's committed data: {"attrs": {...}, <frame array>: ndarray (T, ...), ...,
        "answers": {<answer array>: ndarray (A,)}}; strings come back as numpy StringDType arrays.
        Reads from this open store: a caller reading many streams opens it once."""
        if not self._loc.is_file(f"streams/{validate_stream_id(stream_id)}/zarr.json"):
            raise SinkError(f"stream {stream_id!r} not found in {self._loc}; "
                            f"streams: {', '.join(self.stream_ids()) or 'none'}")
        group = _open_group(self._loc, f"streams/{stream_id}", read_only=True)
        attrs = group.attrs.asdict()
        t, a = int(attrs["frames"]), int(attrs["answer_count"])
        out: dict[str, Any] = {"attrs": attrs}
        for spec in FRAME_ARRAYS:
            out[spec.name] = group[spec.name][:t]
        out["answers"] = {spec.name: group[f"answers/{spec.name}"][:a] for spec in ANSWER_ARRAYS}
        if "gaps" in group:
            g = int(attrs.get("gap_count", 0))
            out["gaps"] = {spec.name: group[f"gaps/{spec.name}"][:g] for spec in GAP_ARRAYS}
        return out

    def __repr__(self) -> str:
        return f"ZarrStore({str(self.path)!r}, read_only={self.read_only})"


def _stream_attrs(*, source: str, query: str, fps: float, width: int, height: int,
                  grid: tuple[int, int], vlm: str) -> dict[str, Any]:
    for name, value in (("source", source), ("query", query), ("vlm", vlm)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a finite number > 0, got {fps!r}")
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    grid_ok = (isinstance(grid, (tuple, list)) and len(grid) == 2
               and all(isinstance(g, (int, np.integer)) and not isinstance(g, bool) and g >= 1 for g in grid))
    if not grid_ok:
        raise ValueError(f"grid must be (gh, gw) with two ints >= 1, got {grid!r}")
    return {"source": source, "query": query, "fps": float(fps), "width": int(width), "height": int(height),
            "grid": [int(grid[0]), int(grid[1])], "vlm": vlm, "complete": False, "frames": 0, "answer_count": 0}


def _stream_files(attrs: dict[str, Any], grid: tuple[int, int], chunk_frames: int) -> dict[str, bytes]:
    """The files (relative path -> bytes, the group's own zarr.json last) of a complete, empty
    stream group of this grid and chunking with this stream's attrs."""
    files = dict(_stream_template(tuple(grid), chunk_frames))
    meta = json.loads(files.pop("zarr.json"))
    meta["attributes"] = attrs
    files["zarr.json"] = _json_bytes(meta)
    return files


def _make_dir(directory: Path, tries: int = 50) -> None:
    """mkdir -p that survives other writers removing an empty parent meanwhile (each writer removes
    the shared, empty staging directory after its rename: between mkdir -p creating it and creating
    our directory inside it, another writer's rmdir may take it away: FileNotFoundError; or the
    parent is recreated by one writer and removed by another between pathlib's mkdir of it and its
    check that it exists: FileExistsError for a directory that is not there). Many writers at once
    (a server creating a stream per request) make several such losses in a row possible."""
    for _ in range(tries - 1):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return
        except (FileNotFoundError, FileExistsError):
            continue
    directory.mkdir(parents=True, exist_ok=True)


def _write_file(target: Path, data: bytes, atomic: bool = False) -> None:
    """Write a file, making its directory when missing; atomic: through a temporary beside it and
    a rename."""
    path = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial") if atomic else target
    try:
        try:
            path.write_bytes(data)
        except FileNotFoundError:                                            # the directory, first time
            target.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if atomic:
            os.replace(path, target)
    except BaseException:
        if atomic:
            path.unlink(missing_ok=True)
        raise


_TEMPLATES: dict[tuple, dict[str, bytes]] = {}


def _stream_template(grid: tuple[int, int], chunk_frames: int) -> dict[str, bytes]:
    """The metadata files (relative path -> bytes) zarr writes for an empty stream group of this
    grid and chunking, made by zarr itself once per process and shape (a stream per video would
    otherwise pay zarr's ~20 array creations, ~50 ms, every time). The codecs are named, not
    zarr's defaults of the day: _ArrayFiles encodes chunks with exactly these."""
    key = (grid, chunk_frames)
    if key not in _TEMPLATES:
        with tempfile.TemporaryDirectory(prefix="arrcoc_stream_") as tmp:
            root = Path(tmp) / "stream"
            root.mkdir()
            group = zarr.create_group(LocalStore(root), attributes={}, zarr_format=3)

            def create(where: zarr.Group, spec: ArraySpec, shape: tuple[int, ...], chunks: tuple[int, ...]) -> None:
                where.create_array(spec.name, shape=shape, chunks=chunks, dtype=spec.dtype, fill_value=spec.fill,
                                   serializer=VLenUTF8Codec() if spec.dtype is str else BytesCodec(endian="little"),
                                   compressors=ZstdCodec(level=0, checksum=False))

            for spec in FRAME_ARRAYS:
                cell = grid if spec.per_cell else ()
                create(group, spec, (0, *cell), (chunk_frames, *cell))
            for sub, specs in (("answers", ANSWER_ARRAYS), ("gaps", GAP_ARRAYS)):
                child = group.create_group(sub)
                for spec in specs:
                    create(child, spec, (0,), (ANSWER_CHUNK,))
            _TEMPLATES[key] = _files_under(root)
    return _TEMPLATES[key]


def _files_under(root: Path) -> dict[str, bytes]:
    """Every file below a local directory: '/'-relative path -> bytes, in sorted path order."""
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


class _ArrayFiles:
    """One array of a stream group this process created, appended to by writing its files the way
    zarr writes them, without zarr's per-call machinery (each zarr resize or write is ~1 ms of
    Python on an event-loop thread; a batch video made ~40 of them, ~40 ms of a GIL every stage of
    the process shares). Chunks: the rows padded with the fill value to the chunk shape, through
    the array's own codecs (little-endian bytes or vlen-utf8, then zstd), at zarr's default chunk
    keys; a chunk of fill values only is not written (zarr's write_empty_chunks=False). Then the
    array's zarr.json with the new shape (one-line JSON; zarr indents it). The rows of the last,
    partial chunk are kept, so a later append rewrites that chunk whole (chunks are the bytes zarr
    writes: tests compare them)."""

    def __init__(self, loc: _Location, rel: str, meta: bytes, spec: ArraySpec) -> None:
        self._loc, self._rel, self._spec = loc, rel, spec
        self._meta = dict(_parsed(meta))                                     # "shape" is replaced, never mutated
        names = [c["name"] for c in self._meta["codecs"]]
        key = self._meta["chunk_key_encoding"]
        if (names not in (["bytes", "zstd"], ["vlen-utf8", "zstd"])
                or key != {"name": "default", "configuration": {"separator": "/"}}):
            raise ValueError(f"{rel}: no direct writer for codecs {names} / chunk keys {key}")
        if names[0] == "bytes" and self._meta["codecs"][0].get("configuration", {}).get("endian", "little") != "little":
            raise ValueError(f"{rel}: no direct writer for big-endian chunks")
        self._zstd = numcodecs.Zstd(**self._meta["codecs"][-1]["configuration"])
        self._chunk = tuple(self._meta["chunk_grid"]["configuration"]["chunk_shape"])
        self._strings = spec.dtype is str
        self.length = int(self._meta["shape"][0])
        if self.length:
            raise ValueError(f"{rel}: a direct writer starts from an empty array")
        self._tail = self._empty()                                           # rows of the partial last chunk

    def _empty(self) -> np.ndarray:
        if self._strings:
            return np.empty(0, dtype=object)
        return np.empty((0, *self._chunk[1:]), dtype=self._spec.dtype)

    def append(self, values: np.ndarray) -> None:
        """Rows [length, length + len(values)): the chunks they touch, then the shape."""
        n = len(values)
        if n == 0:
            return
        values = np.asarray(values, dtype=object if self._strings else self._spec.dtype)
        rows = self._chunk[0]
        first = self.length // rows                                          # chunk of the tail's first row
        data = np.concatenate([self._tail, values])
        end = self.length + n
        for index in range(first, -(-end // rows)):
            self._write_chunk(index, data[(index - first) * rows:(index - first + 1) * rows])
        self._tail = data[(end // rows - first) * rows:].copy()
        self.length = end
        self._meta["shape"] = [end, *self._meta["shape"][1:]]
        self._loc.write(f"{self._rel}/zarr.json", _json_bytes(self._meta))

    def _write_chunk(self, index: int, block: np.ndarray) -> None:
        fill = self._spec.fill
        if self._strings:
            if all(v == fill for v in block):
                return
            full = np.full(self._chunk, fill, dtype=object)
            full[:len(block)] = block
            raw = _VLEN_UTF8.encode(full)
        else:
            if not block.any():                                              # only the fill (0, False; -0.0 == 0 too)
                return
            full = np.zeros(self._chunk, dtype=np.dtype(self._spec.dtype).newbyteorder("<"))
            full[:len(block)] = block
            raw = full.tobytes()
        key = "/".join(["c", str(index)] + ["0"] * (len(self._chunk) - 1))
        self._loc.write(f"{self._rel}/{key}", bytes(self._zstd.encode(raw)))


_VLEN_UTF8 = VLenUTF8()


@functools.lru_cache(maxsize=256)
def _parsed(meta: bytes) -> dict[str, Any]:
    """A template's parsed zarr.json (shared: callers copy before changing a key)."""
    return json.loads(meta)


def _json_bytes(meta: Mapping[str, Any]) -> bytes:
    """Metadata as JSON on one line: json's C encoder (zarr's indent=2 runs the pure-Python one,
    most of a stream writer's own CPU time); readers parse either."""
    return json.dumps(meta).encode()


class StreamWriter:
    """Appends one stream's per-frame arrays and answers. One writer per stream, one thread at a time."""

    def __init__(self, loc: _Location, rel: str, files: Mapping[str, bytes], *, stream_id: str,
                 store_path: Path | str, chunk_frames: int) -> None:
        self.stream_id = stream_id
        self.chunk_frames = chunk_frames
        self._where = f"stream {stream_id!r} in {store_path}"
        self._loc, self._rel = loc, rel
        self._meta = json.loads(files["zarr.json"])                          # the group's, attributes included

        def arrays(prefix: str, specs: tuple[ArraySpec, ...]) -> dict[str, _ArrayFiles]:
            return {spec.name: _ArrayFiles(loc, f"{rel}/{prefix}{spec.name}", files[f"{prefix}{spec.name}/zarr.json"],
                                           spec) for spec in specs}

        self._frames = arrays("", FRAME_ARRAYS)
        self._answers = arrays("answers/", ANSWER_ARRAYS)
        self._gaps = arrays("gaps/", GAP_ARRAYS)
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
                   tokens_full: int, latency_s: float) -> None:
        """Write one answer immediately (answers are rare and must survive a crash)."""
        self.add_answers([dict(t_start=t_start, t_end=t_end, question=question, text=text,
                               tokens_kept=tokens_kept, tokens_full=tokens_full, latency_s=latency_s)])

    def add_answers(self, rows: list[Mapping[str, Any]]) -> None:
        """Write several answers (dicts of add_answer's arguments) immediately, in one commit: each
        array is resized and written once (a batch video's questions, ~1 ms instead of ~17 each)."""
        self._check_open()
        checked = []
        for row in rows:
            for name in ("t_start", "t_end", "latency_s"):
                value = row[name]
                if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                    raise ValueError(f"{name} must be a finite number, got {value!r}")
            for name in ("question", "text"):
                if not isinstance(row[name], str):
                    raise ValueError(f"{name} must be a string, got {type(row[name]).__name__}")
            for name in ("tokens_kept", "tokens_full"):
                value = row[name]
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**31:
                    raise ValueError(f"{name} must be an int in [0, 2**31), got {value!r}")
            checked.append({spec.name: row[spec.name] for spec in ANSWER_ARRAYS})
        self.answers = self._append_rows(self._answers, self.answers, checked, "answer_count", "an answer")

    def add_gap(self, start_pts: float, end_pts: float, start_wall: float, end_wall: float,
                reason: str) -> None:
        """Record immediately that a live stream was cut off between two frames (see module doc)."""
        self._check_open()
        row = {"start_pts": start_pts, "end_pts": end_pts, "start_wall": start_wall, "end_wall": end_wall}
        for name, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if end_pts < start_pts or end_wall < start_wall:
            raise ValueError(f"a gap must end after it starts, got pts {start_pts}..{end_pts}, "
                             f"wall {start_wall}..{end_wall}")
        if not isinstance(reason, str):
            raise ValueError(f"reason must be a string, got {type(reason).__name__}")
        row["reason"] = reason
        self.gaps = self._append_rows(self._gaps, self.gaps, [row], "gap_count", "a gap")

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

    def close(self, complete: bool) -> None:
        """Flush, then record `complete` (True only when the stream was processed to its end)."""
        self._check_open()
        self._write(full_chunks_only=False)
        try:
            self._set_attrs({"complete": bool(complete), "frames": self.frames})
        except OSError as e:
            raise SinkError(f"cannot finish {self._where}: {e.strerror or e}") from e
        self.closed = True

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        # Leaving a `with` block never claims completeness: only an explicit close(True) does.
        if not self.closed:
            self.close(complete=False)

    def _set_attrs(self, values: Mapping[str, Any]) -> None:
        """Update the group's attributes: its zarr.json rewritten whole (as zarr does)."""
        self._meta["attributes"].update(values)
        self._loc.write(f"{self._rel}/zarr.json", _json_bytes(self._meta))

    def _check_open(self) -> None:
        if self.closed:
            raise SinkError(f"{self._where} is already closed")

    def _convert(self, **columns: Any) -> dict[str, np.ndarray]:
        gh, gw = self.grid
        out: dict[str, np.ndarray] = {}
        for spec in FRAME_ARRAYS:
            value = np.asarray(columns[spec.name])
            want = ("n", gh, gw) if spec.per_cell else ("n",)
            if value.ndim != len(want) or (spec.per_cell and value.shape[1:] != (gh, gw)):
                raise ValueError(f"{spec.name} must have shape {want}, got {value.shape}")
            if value.dtype.kind in "fc" and not np.isfinite(value).all():
                raise ValueError(f"{spec.name} contains NaN or inf")
            out[spec.name] = value
        counts = {name: len(v) for name, v in out.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(f"append needs the same number of frames in every column, got {counts}")
        tokens = out["tokens"]
        if tokens.size and (tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() > 65535):
            raise ValueError(f"tokens must be integers in [0, 65535], got dtype {tokens.dtype}"
                             f" range [{tokens.min()}, {tokens.max()}]")
        if out["frame_index"].dtype.kind not in "iu":
            raise ValueError(f"frame_index must be integers, got dtype {out['frame_index'].dtype}")
        out["relevance"] = np.clip(out["relevance"], 0.0, 1.0)
        return {spec.name: out[spec.name].astype(spec.dtype) for spec in FRAME_ARRAYS}

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


def store_location(out: str | os.PathLike) -> Path | str:
    """Where a store given on the command line lives: a local path (made absolute: Ray actors on
    other nodes must find it, on a filesystem every node mounts: NFS, Lustre, a FUSE-mounted
    bucket), a file:// URL (the same), or another fsspec URL (s3://, gs://, ...: zarr's
    FsspecStore, with the protocol's fsspec package installed wherever it is written), kept as given."""
    text = os.fspath(out)
    local = _local_part(text)
    return text if local is None else Path(local).absolute()


def _local_part(text: str) -> str | None:
    """The local path a store location names (a plain path, or a file:// URL's), None for other URLs."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    return rest if scheme == "file" else None


def read_stream(path: str | os.PathLike, stream_id: str) -> dict[str, Any]:
    """Read one stream's committed data (ZarrStore.read) from the store at path."""
    return ZarrStore.open(path, mode="r").read(stream_id)


def validate_store(path: str | os.PathLike) -> list[str]:
    """Check a store against the public schema; return the problems found (empty when valid).

    Checks names, dtypes, ranks, per-cell shapes against the grid attr, and lengths against the
    committed counts: every array holds at least `frames` / `answer_count` rows, exactly that many
    once the stream is complete. Data values are not read.
    """
    try:
        store = ZarrStore.open(path, mode="r")
    except SinkError as e:
        return [str(e)]
    problems = []
    if not isinstance(store._root.attrs.get("config"), dict):
        problems.append(f"root attr 'config' must be a dict, got {store._root.attrs.get('config')!r}")
    for stream_id in store.stream_ids():
        try:
            group = _open_group(store._loc, f"streams/{stream_id}", read_only=True)
        except Exception as e:
            problems.append(f"streams/{stream_id}: not a readable zarr group ({type(e).__name__}: {e})")
            continue
        problems += [f"streams/{stream_id}: {p}" for p in _stream_problems(group)]
    return problems


_ATTR_TYPES = {"source": str, "query": str, "fps": (int, float), "width": int, "height": int,
               "grid": list, "vlm": str, "complete": bool, "frames": int, "answer_count": int}


def _stream_problems(group: zarr.Group) -> list[str]:
    attrs = group.attrs.asdict()
    problems = []
    for name, kind in _ATTR_TYPES.items():
        value = attrs.get(name)
        # bool is an int in Python; only `complete` may be one
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            problems.append(f"attr {name!r} must be {getattr(kind, '__name__', 'a number')}, got {value!r}")
    if problems:
        return problems
    grid = attrs["grid"]
    if len(grid) != 2 or not all(isinstance(g, int) and g >= 1 for g in grid):
        return [f"attr 'grid' must be [gh, gw] with ints >= 1, got {grid!r}"]
    complete = attrs["complete"]
    problems += _array_problems(group, "", FRAME_ARRAYS, attrs["frames"], tuple(grid), complete)
    problems += _array_problems(group, "answers/", ANSWER_ARRAYS, attrs["answer_count"], (), complete)
    if "gaps" in group:  # optional: stores written before gaps were recorded have none
        gap_count = attrs.get("gap_count", 0)
        if isinstance(gap_count, bool) or not isinstance(gap_count, int) or gap_count < 0:
            problems.append(f"attr 'gap_count' must be an int >= 0 when gaps/ exists, got {gap_count!r}")
        else:
            problems += _array_problems(group, "gaps/", GAP_ARRAYS, gap_count, (), complete)
    return problems


def _array_problems(group: zarr.Group, prefix: str, specs: tuple[ArraySpec, ...], committed: int,
                    grid: tuple[int, ...], complete: bool) -> list[str]:
    problems = []
    for spec in specs:
        name = prefix + spec.name
        try:
            array = group[name]
        except KeyError:
            problems.append(f"missing array {name!r}")
            continue
        if not isinstance(array, zarr.Array):
            problems.append(f"{name!r} is a group, expected an array")
            continue
        if not spec.matches(array.dtype):
            problems.append(f"{name!r} has dtype {array.dtype}, expected {spec.dtype_name}")
        want_cells = grid if spec.per_cell else ()
        if array.ndim != 1 + len(want_cells) or tuple(array.shape[1:]) != want_cells:
            problems.append(f"{name!r} has shape {array.shape}, expected (T, {', '.join(map(str, want_cells))})"
                            if want_cells else f"{name!r} has shape {array.shape}, expected (N,)")
            continue
        if array.shape[0] < committed or (complete and array.shape[0] != committed):
            problems.append(f"{name!r} has {array.shape[0]} rows but {committed} are committed"
                            f"{' (stream complete)' if complete else ''}")
    return problems
