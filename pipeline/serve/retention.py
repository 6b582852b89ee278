"""What the server keeps on disk, and for how long.

Uploads (POST /v1/files) and every answered request's homunculus (a stream of the server's store)
expire `--retention-s` after they were last written, and together with the fetches in flight they
stay under `--max-storage-gb`: before an upload or a fetch starts, the oldest items are removed
until its largest possible size fits; a sweep every few seconds removes what expired. Streams
still being written (requests in flight, live streams running) are never removed; when only they
are left and the new bytes do not fit, the request is refused with 507.

Only a local store is measured and pruned; the uploads directory belongs to one server (a lock
file says which), which clears the fetches a killed server left half-written.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from arr_coc._validate import ConfigError

from .errors import ApiError

STORED_ID = re.compile(r"(chatcmpl|live)-[0-9a-f]{24}")   # the streams the server itself wrote
UPLOAD_META = re.compile(r"(file-[0-9a-f]{24})\.json")
log = logging.getLogger("pipeline.serve.retention")


def claim_uploads(uploads: Path) -> IO:
    """Hold the uploads directory for this process (the open lock file; keep it referenced):
    ConfigError when another live server holds it."""
    path = uploads / ".server.lock"
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise ConfigError(f"the uploads directory {uploads} is in use by another running server (pid {owner}); "
                          f"give this one its own --out or --uploads") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


@dataclass(frozen=True)
class Item:
    kind: str          # "upload" or "stored" (a stream of the store)
    name: str          # file id or stream id
    bytes: int
    mtime: float


def _tree_bytes(path: Path) -> tuple[int, float]:
    """(bytes, newest mtime) of the files under path."""
    size, newest = 0, 0.0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    return size, newest


class Retention:
    """Expiry and a byte cap over the uploads and the stored homunculi (see the module doc).

    busy: the stream ids being written now (never removed)."""

    def __init__(self, uploads: Path, store: str, *, retention_s: float, max_bytes: int,
                 busy: Callable[[], set[str]]) -> None:
        self.uploads, self.retention_s, self.max_bytes, self.busy = uploads, retention_s, max_bytes, busy
        self.store = None if "://" in store else Path(store)
        self.reserved = 0
        self.evicted = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what is there ----
    def items(self) -> list[Item]:
        """Everything retention may remove, oldest first."""
        found: list[Item] = []
        for meta in self.uploads.glob("file-*.json"):
            match = UPLOAD_META.fullmatch(meta.name)
            try:
                if match is not None:
                    data = self.uploads / match.group(1)
                    size = meta.stat().st_size + (data.stat().st_size if data.exists() else 0)
                    found.append(Item("upload", match.group(1), size, meta.stat().st_mtime))
            except FileNotFoundError:
                continue
        streams = self.store / "streams" if self.store is not None else None
        if streams is not None and streams.is_dir():
            for group in streams.iterdir():
                if STORED_ID.fullmatch(group.name):
                    size, mtime = _tree_bytes(group)
                    found.append(Item("stored", group.name, size, mtime))
        return sorted(found, key=lambda i: i.mtime)

    def usage(self) -> int:
        """Bytes on disk now: everything under the uploads directory (fetches and uploads being
        written too) and under the store."""
        return _tree_bytes(self.uploads)[0] + (_tree_bytes(self.store)[0] if self.store is not None else 0)

    # ---- removing ----
    def _remove(self, item: Item) -> bool:
        try:
            if item.kind == "upload":
                (self.uploads / f"{item.name}.json").unlink(missing_ok=True)   # unlisted first, then gone
                (self.uploads / item.name).unlink(missing_ok=True)
                return True
            from sinks import SinkError, ZarrStore

            try:
                return ZarrStore.open(self.store).delete(item.name)
            except SinkError as e:       # its writer still holds it: next sweep
                log.info("retention: keeping %s (%s)", item.name, e)
                return False
        except OSError as e:
            log.warning("retention: cannot remove %s %s: %s", item.kind, item.name, e)
            return False

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove what expired, then the oldest until under the cap -> the names removed."""
        with self._lock:
            return self._sweep(0, time.time() if now is None else now)

    def _sweep(self, need: int, now: float) -> list[str]:
        busy = self.busy()
        items = [i for i in self.items() if i.name not in busy]
        removed = []
        total = self.usage() + self.reserved + need
        for item in items:
            expired = now - item.mtime > self.retention_s
            if not expired and total <= self.max_bytes:
                break
            if self._remove(item):
                removed.append(item.name)
                total -= item.bytes
        self.evicted += len(removed)
        return removed

    def room(self, nbytes: int) -> Callable[[], None]:
        """Make room for nbytes about to be written (oldest removed first) and hold it until the
        returned release is called; 507 when the cap cannot hold them."""
        with self._lock:
            self._sweep(nbytes, time.time())
            if self.usage() + self.reserved + nbytes > self.max_bytes:
                raise ApiError(507, f"the server's storage is full ({self.max_bytes / (1 << 30):g} GB, "
                                    f"--max-storage-gb); try again when running requests are done",
                               code="storage_full")
            self.reserved += nbytes
        done = [False]

        def release() -> None:
            with self._lock:
                if not done[0]:
                    done[0] = True
                    self.reserved -= nbytes
        return release

    # ---- the sweeper ----
    def start(self) -> "Retention":
        interval = max(0.5, min(30.0, self.retention_s / 4))

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.sweep()
                except Exception as e:  # noqa: BLE001 - a failed sweep is retried; serving goes on
                    log.warning("retention sweep failed: %s", e)
        self.sweep()
        self._thread = threading.Thread(target=loop, name="serve-retention", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

