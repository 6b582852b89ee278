"""The files of a store, below zarr: where a store lives (a local directory or an fsspec URL), atomic
local writes, and the direct writer of one array's chunk and metadata files.

A writer appends by writing an array's chunk files and metadata itself, as zarr would write them
(same codecs, the same chunk bytes: tests compare), without zarr's per-call machinery. zarr itself
makes each stream group's empty layout once per grid and chunking (stream_template).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Mapping

import numcodecs
import numpy as np
import zarr
from numcodecs.vlen import VLenUTF8
from zarr.codecs import BytesCodec, VLenUTF8Codec, ZstdCodec
from zarr.storage import LocalStore

from sinks.schema import FRAMES, TABLES, Field

ANSWER_CHUNK = 64   # rows per chunk of the answers and gaps arrays


class SinkError(Exception):
    """The output cannot be written or read as asked. The message is one line naming the path/value."""



class Location:
    """Where a store lives: a local directory (or a file:// URL), written through zarr's LocalStore
    with atomic renames, or any other fsspec URL (s3://, gs://, memory://, ...; the protocol's
    fsspec package must be installed), written through zarr's FsspecStore. Paths below it are
    '/'-separated, relative to its root."""

    def __init__(self, where: str | os.PathLike) -> None:
        text = os.fspath(where)
        local = local_part(text)
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
            write_file(self.path / rel, data, atomic=True)
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


def open_group(loc: Location, group: str = "", *, read_only: bool) -> zarr.Group:
    return zarr.open_group(loc.zarr_store(read_only), path=group, mode="r" if read_only else "r+", zarr_format=3)



def local_part(text: str) -> str | None:
    """The local path a store location names (a plain path, or a file:// URL's), None for other URLs."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    return rest if scheme == "file" else None


def make_dir(directory: Path, tries: int = 50) -> None:
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


def write_file(target: Path, data: bytes, atomic: bool = False) -> None:
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


def stream_template(grid: tuple[int, int], chunk_frames: int) -> dict[str, bytes]:
    """The metadata files (relative path -> bytes) zarr writes for an empty stream group of this
    grid and chunking, made by zarr itself once per process and shape (a stream per video would
    otherwise pay zarr's ~20 array creations every time). The codecs are named, not
    zarr's defaults of the day: ArrayFiles encodes chunks with exactly these."""
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
                    cells = cell_shape(f, grid)
                    strings = f.dtype == "str"
                    where.create_array(f.name, shape=(0, *cells), chunks=(rows, *cells),
                                       dtype=str if strings else f.dtype, fill_value=f.fill, dimension_names=f.dims,
                                       serializer=VLenUTF8Codec() if strings else BytesCodec(endian="little"),
                                       compressors=ZstdCodec(level=0, checksum=False))
            _TEMPLATES[key] = files_under(root)
    return _TEMPLATES[key]


def cell_shape(f: Field, grid: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one row of f: () or (gh, gw) for a field of dims (frame, y, x)."""
    sizes = {"y": grid[0], "x": grid[1]} if len(grid) == 2 else {}
    return tuple(sizes[d] for d in f.dims[1:])


def files_under(root: Path) -> dict[str, bytes]:
    """Every file below a local directory: '/'-relative path -> bytes, in sorted path order."""
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


class ArrayFiles:
    """One array of a stream group this process created, appended to by writing its files the way
    zarr writes them, without zarr's per-call machinery (each zarr resize or write runs Python on an
    event-loop thread, holding the GIL every stage of the process shares, and a batch video made
    dozens of them). Chunks: the rows padded with the fill value to the chunk shape, through
    the array's own codecs (little-endian bytes or vlen-utf8, then zstd), at zarr's default chunk
    keys; a chunk of fill values only is not written (zarr's write_empty_chunks=False). Then the
    array's zarr.json with the new shape (one-line JSON; zarr indents it). The rows of the last,
    partial chunk are kept, so a later append rewrites that chunk whole (chunks are the bytes zarr
    writes: tests compare them)."""

    def __init__(self, loc: Location, rel: str, meta: bytes, field: Field) -> None:
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
        self._loc.write(f"{self._rel}/zarr.json", json_bytes(self._meta))

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


def json_bytes(meta: Mapping[str, Any]) -> bytes:
    """Metadata as JSON on one line: json's C encoder (zarr's indent=2 runs the pure-Python one,
    most of a stream writer's own CPU time); readers parse either."""
    return json.dumps(meta).encode()

