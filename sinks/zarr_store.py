"""The zarr v3 output store. Its schema (`arr-coc/1`: every array's name, dtype, dims and meaning,
every attribute) is declared in sinks/schema.py; this module writes, reads and validates it.

    OUT.zarr/                attrs: ROOT_ATTRS (format, the first run's config)
      streams/<stream_id>/   attrs: STREAM_ATTRS (source, ..., this stream's own config)
        FRAMES arrays, answers/ ANSWERS arrays, gaps/ GAPS arrays (stores written before gaps
        existed have no `gaps/`, before passes / tokens_spent no such answers: read() fills
        them in). Every array names its dims (zarr v3 dimension_names), so
        xarray.open_zarr(OUT, group="streams/<id>") and group="streams/<id>/answers" are Datasets.

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

Ownership. A writer owns its stream from ZarrStore.stream() to close(): in a local store it holds
an exclusive flock on `.locks/<stream_id>.lock`, a file naming the owner (pid, host, since). A
second writer of the same stream, in this process or another, gets a SinkError naming the stream
and the owner instead of interleaving its rows with the first's. The kernel drops the flock when
its process dies (kill -9 included), so a dead writer's lock file is simply taken over; on a
filesystem without flock the file's pid decides (a pid that no longer runs on this host is dead).
Object stores have no locks: there a stream must have one writer by arrangement (batch does so).

Stores at fsspec URLs (s3://, gs://, memory://, ...; `file://` is a local path) are read through
zarr's FsspecStore and written with one put per file. Object stores have no atomic rename, so
there a stream group is written in place, its own zarr.json last (a listing never shows a group
without its arrays), after the incomplete group it replaces is deleted; the commit points
(`frames`, `answer_count`, `complete`) are the same.
"""
from __future__ import annotations

import errno
import functools
import json
import math
import os
import shutil
import socket
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import zarr
import numcodecs
from numcodecs.vlen import VLenUTF8
from zarr.codecs import BytesCodec, VLenUTF8Codec, ZstdCodec
from zarr.errors import ContainsGroupError
from zarr.storage import LocalStore

from sinks.schema import (ANSWERS, FORMAT, FRAMES, GAPS, ROOT_ATTRS, STREAM_ATTRS, TABLES, Field, Table, answer_row,
                          gap_row)

try:
    import fcntl
except ImportError:  # not POSIX: ownership falls back to the lock file's pid
    fcntl = None

STAGING = ".staging"  # inside the store, beside `streams/`: same filesystem, so a rename is atomic
LOCKS = ".locks"      # beside `streams/`: one lock file per stream being written (local stores)
DEFAULT_CHUNK_FRAMES = 64
ANSWER_CHUNK = 64

StoreMode = Literal["r", "a", "w"]


class SinkError(Exception):
    """The output cannot be written or read as asked. The message is one line naming the path/value."""


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
        lock = _StreamLock.acquire(self.path, stream_id) if self._loc.fs is None else None
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

    def delete(self, stream_id: str) -> bool:
        """Remove a stream (a server's retention) -> whether it was there. SinkError when a writer
        owns it; locally the group vanishes in one rename, never half-deleted."""
        if self.read_only:
            raise SinkError(f"{self.path} was opened read-only (mode='r'); cannot delete stream {stream_id!r}")
        validate_stream_id(stream_id)
        if self._loc.fs is not None:
            found = self._loc.is_file(f"streams/{stream_id}/zarr.json")
            self._loc.remove(f"streams/{stream_id}")
            return found
        lock = _StreamLock.acquire(self.path, stream_id)
        try:
            target = self.path / "streams" / stream_id
            if not target.exists():
                return False
            _make_dir(self.path / STAGING)
            old = self.path / STAGING / f"{stream_id}.{uuid.uuid4().hex}.old"
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
            try:
                (self.path / STAGING).rmdir()
            except OSError:
                pass
            return True
        finally:
            lock.release()

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
        group = _open_group(self._loc, f"streams/{stream_id}", read_only=True)
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


class _StreamLock:
    """A writer's ownership of one stream of a local store (Ownership in the module doc): an
    exclusive flock on `.locks/<stream_id>.lock`, held until release(), and in the file the owner
    (pid, host, since) for the message another writer gets."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd
        self._pid = os.getpid()  # a forked child's copy must not unlink its parent's lock

    @classmethod
    def acquire(cls, store: Path, stream_id: str) -> "_StreamLock":
        path = store / LOCKS / f"{stream_id}.lock"
        for _ in range(20):
            try:
                _make_dir(path.parent)
                try:
                    fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
                except FileExistsError:
                    fd, created = os.open(path, os.O_RDWR), False
            except FileNotFoundError:                    # released (unlinked) meanwhile: try again
                continue
            except OSError as e:
                raise SinkError(f"cannot lock stream {stream_id!r} of {store} ({path}): {e.strerror or e}") from e
            try:
                if cls._claim(fd, created, path, stream_id, store):
                    return cls(path, fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise SinkError(f"cannot lock stream {stream_id!r} of {store}: its lock file {path} keeps changing")

    @staticmethod
    def _claim(fd: int, created: bool, path: Path, stream_id: str, store: Path) -> bool:
        """Take the opened lock file: True when it is ours (its owner record written), False when
        it was released meanwhile (open it again); SinkError when a live writer holds it."""
        held = _flock(fd)
        if held is None:      # no flock on this filesystem: whoever created the file, or its pid is dead
            held = created or not _owner_alive(_read_owner(fd))
        if not held:
            raise SinkError(f"stream {stream_id!r} in {store} is being written by another writer "
                            f"({_describe(_read_owner(fd))}); wait for it to finish or write to another output")
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                return False  # its owner released it between our open and our flock: a new file is there
        except FileNotFoundError:
            return False
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode())
        return True

    def release(self) -> None:
        """Give the stream up: the file goes first (while still held, so nobody takes a file that is
        about to vanish), then the lock; the empty `.locks` directory last."""
        if self._fd is None:
            return
        try:
            if os.getpid() == self._pid:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
        try:
            self.path.parent.rmdir()  # keep the store tidy; another writer's lock may still be there
        except OSError:
            pass


def _flock(fd: int) -> bool | None:
    """Try to lock fd exclusively: True when locked, False when someone else holds it, None when the
    filesystem (or the platform) has no flock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _read_owner(fd: int) -> dict[str, Any] | None:
    """The owner record of a lock file, None while it is empty or unreadable."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 4096))
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _owner_alive(owner: dict[str, Any] | None) -> bool:
    """Whether a lock file's owner may still run: unknown owners and other hosts' count as alive."""
    if (owner is None or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int)
            or os.name != "posix"):                                     # os.kill(pid, 0) is no probe elsewhere
        return True
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it runs, as another user
        return True
    return True


def _describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "owner unknown"
    since = owner.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {owner.get('pid')} on {owner.get('host')}{when}"


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

            for table in TABLES:
                where = group.create_group(table.group) if table.group else group
                rows = chunk_frames if table is FRAMES else ANSWER_CHUNK
                for f in table.fields:
                    cells = _cell_shape(f, grid)
                    strings = f.dtype == "str"
                    where.create_array(f.name, shape=(0, *cells), chunks=(rows, *cells),
                                       dtype=str if strings else f.dtype, fill_value=f.fill, dimension_names=f.dims,
                                       serializer=VLenUTF8Codec() if strings else BytesCodec(endian="little"),
                                       compressors=ZstdCodec(level=0, checksum=False))
            _TEMPLATES[key] = _files_under(root)
    return _TEMPLATES[key]


def _cell_shape(f: Field, grid: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one row of f: () or (gh, gw) for a field of dims (frame, y, x)."""
    sizes = {"y": grid[0], "x": grid[1]} if len(grid) == 2 else {}
    return tuple(sizes[d] for d in f.dims[1:])


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

    def __init__(self, loc: _Location, rel: str, meta: bytes, field: Field) -> None:
        self._loc, self._rel, self._field = loc, rel, field
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
        self._strings = field.dtype == "str"
        self.length = int(self._meta["shape"][0])
        if self.length:
            raise ValueError(f"{rel}: a direct writer starts from an empty array")
        self._tail = self._empty()                                           # rows of the partial last chunk

    def _empty(self) -> np.ndarray:
        if self._strings:
            return np.empty(0, dtype=object)
        return np.empty((0, *self._chunk[1:]), dtype=self._field.dtype)

    def append(self, values: np.ndarray) -> None:
        """Rows [length, length + len(values)): the chunks they touch, then the shape."""
        n = len(values)
        if n == 0:
            return
        values = np.asarray(values, dtype=self._field.numpy_dtype)
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
        fill = self._field.fill
        if self._strings:
            if all(v == fill for v in block):
                return
            full = np.full(self._chunk, fill, dtype=object)
            full[:len(block)] = block
            raw = _VLEN_UTF8.encode(full)
        else:
            if not block.any():                                              # only the fill (0, False; -0.0 == 0 too)
                return
            full = np.zeros(self._chunk, dtype=np.dtype(self._field.dtype).newbyteorder("<"))
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
    """Appends one stream's per-frame arrays and answers; made by ZarrStore.stream. It owns its
    stream (in a local store) until close(), or until it is garbage-collected unclosed. One thread
    at a time.

    replaced: the stream this one replaced (ReplacedStream; str() is a line for the user), or None.
    """

    def __init__(self, loc: _Location, rel: str, files: Mapping[str, bytes], *, stream_id: str,
                 store_path: Path | str, chunk_frames: int, lock: _StreamLock | None = None,
                 replaced: ReplacedStream | None = None) -> None:
        self.stream_id = stream_id
        self.replaced = replaced
        # the lock goes with the writer: at close(), or when an unclosed writer is collected
        self._release = weakref.finalize(self, lock.release) if lock is not None else None
        self.chunk_frames = chunk_frames
        self._where = f"stream {stream_id!r} in {store_path}"
        self._loc, self._rel = loc, rel
        self._meta = json.loads(files["zarr.json"])                          # the group's, attributes included

        def arrays(table: Table) -> dict[str, _ArrayFiles]:
            return {f.name: _ArrayFiles(loc, f"{rel}/{table.prefix}{f.name}",
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
        commit: each array is resized and written once (a batch video's questions, ~1 ms instead
        of ~17 each). One bad row refuses them all, before anything is written."""
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

    def close(self, complete: bool, *, damaged: bool = False, truncated_at_s: float | None = None) -> None:
        """Flush, then record `complete` (True only when the stream was processed to its end), and
        give the stream up (also when that fails: the writer is closed either way).

        damaged: the input's damage stopped decoding and everything before it was processed; the
        stream is then recorded as `damaged` (done: nothing more can be decoded) but not complete,
        with `truncated_at_s`, the pts of its last frame. Rows are committed before that is written."""
        self._check_open()
        if damaged and complete:
            raise ValueError("a damaged stream is not complete: pass complete=False with damaged=True")
        try:
            self._write(full_chunks_only=False)
            attrs: dict[str, Any] = {"complete": bool(complete), "frames": self.frames}
            if damaged:
                attrs.update(damaged=True, truncated_at_s=None if truncated_at_s is None else float(truncated_at_s))
            try:
                self._set_attrs(attrs)
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
        self._loc.write(f"{self._rel}/zarr.json", _json_bytes(self._meta))

    def _check_open(self) -> None:
        if self.closed:
            raise SinkError(f"{self._where} is already closed")

    def _convert(self, **columns: Any) -> dict[str, np.ndarray]:
        shapes: dict[str, np.ndarray] = {}
        for f in FRAMES.fields:
            value = np.asarray(columns[f.name])
            want = ("n", *_cell_shape(f, self.grid))
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
    root_attrs = store._root.attrs.asdict()
    problems = [p for attr in ROOT_ATTRS if (p := attr.problem(root_attrs.get(attr.name))) is not None]
    for stream_id in store.stream_ids():
        try:
            group = _open_group(store._loc, f"streams/{stream_id}", read_only=True)
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
        cells = _cell_shape(f, grid)
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
