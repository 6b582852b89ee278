"""The zarr v3 output store. Its schema (`arr-coc/1`: every array's name, dtype, dims and meaning,
every attribute) is declared in sinks/schema.py; this module writes, reads and validates it.

    OUT.zarr/                attrs: ROOT_ATTRS (format, the first run's config)
      streams/<stream_id>/   attrs: STREAM_ATTRS (source, ..., this stream's own config)
        FRAMES arrays, answers/ ANSWERS arrays, gaps/ GAPS arrays (stores written before gaps
        existed have no `gaps/`, before passes / tokens_spent no such answers: read() fills
        them in). Every array names its dims (zarr v3 dimension_names), so
        xarray.open_zarr(OUT, group="streams/<id>") and group="streams/<id>/answers" are Datasets.

Writing. zarr creates each stream group's empty layout once per grid and chunking (a template);
a writer (sinks/stream_writer.py) then appends by writing the chunk files and metadata itself, as
zarr would write them (same codecs, the same chunk bytes: tests compare), without zarr's per-call
machinery (sinks/store_files.py). Reading, validation and everything else go through zarr.

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

Ownership. A writer owns its stream from ZarrStore.stream() to close(): in a local store it holds
filelock's lock on `.locks/<stream_id>.lock` and records itself (pid, host, since) in
`.locks/<stream_id>.owner` (sinks/stream_lock.py). A second writer of the same stream, in this
process or another, gets a SinkError naming the stream and the owner instead of interleaving its
rows with the first's. The kernel drops the lock when its process dies (kill -9 included), so a
dead writer's lock is simply taken over; on a filesystem without flock filelock's marker decides
(a pid that no longer runs on this host is dead). Object stores have no locks: there a stream must
have one writer by arrangement (batch does so).

Stores at fsspec URLs (s3://, gs://, memory://, ...; `file://` is a local path) are read through
zarr's FsspecStore and written with one put per file. Object stores have no atomic rename, so
there a stream group is written in place, its own zarr.json last (a listing never shows a group
without its arrays), after the incomplete group it replaces is deleted; the commit points
(`frames`, `answer_count`, `complete`) are the same.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import zarr
from zarr.errors import ContainsGroupError

from sinks.schema import FORMAT, FRAMES, ROOT_ATTRS, STREAM_ATTRS, TABLES, Table
from sinks.store_files import (Location, SinkError, cell_shape, json_bytes, local_part, make_dir, open_group,
                               stream_template, write_file)
from sinks.stream_lock import StreamLock
from sinks.stream_writer import ReplacedStream, StreamWriter

__all__ = ["DEFAULT_CHUNK_FRAMES", "ReplacedStream", "SinkError", "StreamWriter", "ZarrStore", "read_stream",
           "store_location", "validate_store", "validate_stream_id"]

STAGING = ".staging"  # inside the store, beside `streams/`: same filesystem, so a rename is atomic
DEFAULT_CHUNK_FRAMES = 64

StoreMode = Literal["r", "a", "w"]


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



def _open_root(path: Location, *, read_only: bool) -> zarr.Group:
    """Open an existing arr-coc store, refusing anything else with a one-line SinkError."""
    try:
        root = open_group(path, read_only=read_only)
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


def _create_root(path: Location, config: Mapping[str, Any]) -> zarr.Group:
    attrs = {"format": FORMAT, "config": _json_config(config)}
    if path.fs is None:
        path.path.mkdir(parents=True, exist_ok=True)
    try:
        return zarr.create_group(path.zarr_store(read_only=False), attributes=attrs, overwrite=False, zarr_format=3)
    except ContainsGroupError:  # another process created it between our check and now
        return _open_root(path, read_only=False)


class ZarrStore:
    """An arr-coc output store. Create with `ZarrStore.open(path, config=..., mode=...)`."""

    def __init__(self, loc: Location, root: zarr.Group, *, read_only: bool) -> None:
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
        path = Location(path)
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
            # another writer (a batch shard started beside this one) may have created it just now
            exists = path.is_file("zarr.json")
            if not exists:
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
               grid: tuple[int, int], vlm: str, config: Mapping[str, Any] | None = None,
               chunk_frames: int = DEFAULT_CHUNK_FRAMES, overwrite: bool = False) -> "StreamWriter":
        """Create `streams/<stream_id>` (empty arrays, complete=False) and return its writer, which
        owns the stream until it is closed (see Ownership in the module doc).

        config: the config of the run writing this stream, stored as its attr `config` (the root's
        stays the first run's), so that any stream of a store can be reproduced.
        An existing incomplete stream is replaced (a resumed batch redoes it); an existing
        complete one only with overwrite=True. The writer's `replaced` says what was there.
        Raises SinkError when another writer owns the stream.
        """
        if self.read_only:
            raise SinkError(f"{self.path} was opened read-only (mode='r'); cannot write stream {stream_id!r}")
        validate_stream_id(stream_id)
        attrs = _stream_attrs(source=source, query=query, fps=fps, width=width, height=height, grid=grid, vlm=vlm)
        if config is not None:
            attrs["config"] = _json_config(config)
        if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
            raise ValueError(f"chunk_frames must be an int >= 1, got {chunk_frames!r}")
        lock = StreamLock.acquire(self.path, stream_id) if self._loc.fs is None else None
        try:
            replaced = self._existing(stream_id)
            if replaced is not None and replaced.complete and not overwrite:
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
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        return StreamWriter(self._loc, f"streams/{stream_id}", files, stream_id=stream_id, store_path=self.path,
                            chunk_frames=chunk_frames, lock=lock, replaced=replaced)

    def _existing(self, stream_id: str) -> "ReplacedStream | None":
        """What is at streams/<stream_id> now (None: nothing)."""
        meta = self._loc.read(f"streams/{stream_id}/zarr.json")
        if meta is None:
            return None
        try:
            attrs = json.loads(meta)["attributes"]
            source, frames = attrs.get("source"), attrs.get("frames", 0)
            return ReplacedStream(stream_id, source if isinstance(source, str) else None,
                                  attrs.get("complete") is True, frames if isinstance(frames, int) else 0)
        except (ValueError, KeyError, TypeError, AttributeError):   # not a readable group: not complete
            return ReplacedStream(stream_id, None, False, 0)

    def _stage_stream(self, stream_id: str, files: Mapping[str, bytes]) -> None:
        """A local store's new stream: built in the staging directory, renamed into place."""
        target = self.path / "streams" / stream_id
        staging = self.path / STAGING
        new = staging / f"{stream_id}.{uuid.uuid4().hex}"
        make_dir(new)  # once it exists, staging is not empty: no other writer's rmdir below removes it
        for rel, data in files.items():
            write_file(new / rel, data)
        old = staging / f"{stream_id}.{uuid.uuid4().hex}.old"
        if target.exists():
            os.rename(target, old)  # the old stream vanishes in one step, never half-deleted
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)
        try:
            staging.rmdir()  # keep the store tidy; another writer may still be staging
        except OSError:
            pass

    def read(self, stream_id: str, frame_arrays: Sequence[str] | None = None) -> dict[str, Any]:
        """One stream's committed data: {"attrs": {...}, <frame array>: ndarray (T, ...), ...,
        "answers": {<answer field>: ndarray (A,)}, "gaps": {...} where the stream has gaps/}; strings
        come back as numpy StringDType arrays. Fields added to the format after a store was written
        (answers' passes, tokens_spent) read as their defaults there. frame_arrays: read only these
        frame arrays (default: all; the per-cell ones are the bulk). Reads from this open store: a
        caller reading many streams opens it once."""
        unknown = sorted(set(frame_arrays or ()) - set(FRAMES.names))
        if unknown:
            raise ValueError(f"Invalid frame array ({unknown[0]!r}). Supported values are {', '.join(FRAMES.names)}.")
        if not self._loc.is_file(f"streams/{validate_stream_id(stream_id)}/zarr.json"):
            raise SinkError(f"stream {stream_id!r} not found in {self._loc}; "
                            f"streams: {', '.join(self.stream_ids()) or 'none'}")
        group = open_group(self._loc, f"streams/{stream_id}", read_only=True)
        attrs = group.attrs.asdict()
        out: dict[str, Any] = {"attrs": attrs}
        for table in TABLES:
            if table.optional and table.group not in group:
                continue
            n = int(attrs.get(table.count_attr, 0))
            columns: dict[str, np.ndarray] = {}
            for f in table.fields:
                if table is FRAMES and frame_arrays is not None and f.name not in frame_arrays:
                    continue
                key = table.prefix + f.name
                # a field added to the format after this store was written: its defaults
                columns[f.name] = f.default_column(columns, n) if f.added and key not in group else group[key][:n]
            if table.group:
                out[table.group] = columns
            else:
                out.update(columns)
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
    files = dict(stream_template(tuple(grid), chunk_frames))
    meta = json.loads(files.pop("zarr.json"))
    meta["attributes"] = attrs
    files["zarr.json"] = json_bytes(meta)
    return files



def store_location(out: str | os.PathLike) -> Path | str:
    """Where a store given on the command line lives: a local path (made absolute: Ray actors on
    other nodes must find it, on a filesystem every node mounts: NFS, Lustre, a FUSE-mounted
    bucket), a file:// URL (the same), or another fsspec URL (s3://, gs://, ...: zarr's
    FsspecStore, with the protocol's fsspec package installed wherever it is written), kept as given."""
    text = os.fspath(out)
    local = local_part(text)
    return text if local is None else Path(local).absolute()



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
    root_attrs = store._root.attrs.asdict()
    problems = [p for attr in ROOT_ATTRS if (p := attr.problem(root_attrs.get(attr.name))) is not None]
    for stream_id in store.stream_ids():
        try:
            group = open_group(store._loc, f"streams/{stream_id}", read_only=True)
        except Exception as e:
            problems.append(f"streams/{stream_id}: not a readable zarr group ({type(e).__name__}: {e})")
            continue
        problems += [f"streams/{stream_id}: {p}" for p in _stream_problems(group)]
    return problems


def _stream_problems(group: zarr.Group) -> list[str]:
    attrs = group.attrs.asdict()
    problems = []
    for attr in STREAM_ATTRS:
        if attr.name not in attrs:
            if not attr.optional:
                problems.append(f"missing attr {attr.name!r}")
        elif (problem := attr.problem(attrs[attr.name])) is not None:
            problems.append(problem)
    if problems:
        return problems
    grid = attrs["grid"]
    if len(grid) != 2 or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in grid):
        return [f"attr 'grid' must be [gh, gw] with ints >= 1, got {grid!r}"]
    for table in TABLES:
        if table.optional and table.group not in group:  # stores written before the table existed
            continue
        committed = attrs.get(table.count_attr, 0)
        if committed < 0:
            problems.append(f"attr {table.count_attr!r} must be >= 0, got {committed}")
            continue
        problems += _array_problems(group, table, committed, tuple(grid), attrs["complete"])
    return problems


def _array_problems(group: zarr.Group, table: Table, committed: int, grid: tuple[int, int],
                    complete: bool) -> list[str]:
    problems = []
    for f in table.fields:
        name = table.prefix + f.name
        try:
            array = group[name]
        except KeyError:
            if not f.added:  # an added field is absent from stores written before it
                problems.append(f"missing array {name!r}")
            continue
        if not isinstance(array, zarr.Array):
            problems.append(f"{name!r} is a group, expected an array")
            continue
        if not f.matches(array.dtype):
            problems.append(f"{name!r} has dtype {array.dtype}, expected {f.dtype}")
        cells = cell_shape(f, grid)
        if array.ndim != 1 + len(cells) or tuple(array.shape[1:]) != cells:
            problems.append(f"{name!r} has shape {array.shape}, expected ({table.dim}, {', '.join(map(str, cells))})"
                            if cells else f"{name!r} has shape {array.shape}, expected ({table.dim},)")
            continue
        dims = array.metadata.dimension_names
        if dims is not None and tuple(dims) != f.dims:  # stores written before dims were named have none
            problems.append(f"{name!r} has dimension names {tuple(dims)}, expected {f.dims}")
        if array.shape[0] < committed or (complete and array.shape[0] != committed):
            problems.append(f"{name!r} has {array.shape[0]} rows but {committed} are committed"
                            f"{' (stream complete)' if complete else ''}")
    return problems

