"""What the server keeps on disk, and for how long.

Uploads (POST /v1/files) and every answered request's homunculus (a stream of the server's store)
expire `--retention-s` after they were last written, and together with the fetches in flight they
stay under `--max-storage-gb`: before an upload or a fetch is written, the oldest items are removed
until it fits; after each request, once its homunculus is written, and in a sweep every few
seconds, the oldest go while what is kept passes LOW_WATER of the cap (the margin the requests
in flight write into), and what expired goes. Streams still being written (requests in flight,
live streams running) are never removed; when only they are left and the new bytes do not fit,
the request is refused with 507.

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
LOW_WATER = 0.9       # what is kept stays under this share of the cap: requests in flight write the rest
RESCAN_S = 30.0       # a full walk this often; the index in between
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

    An index of the items (size, last write) is kept in memory: built by a full walk at start and
    every RESCAN_S, and told of each new item (`note`) as it is written, so that a check after
    every request costs nothing like a walk of the store. busy: the stream ids being written now
    (never removed)."""

    def __init__(self, uploads: Path, store: str, *, retention_s: float, max_bytes: int,
                 busy: Callable[[], set[str]]) -> None:
        self.uploads, self.retention_s, self.max_bytes, self.busy = uploads, retention_s, max_bytes, busy
        self.store = None if "://" in store else Path(store)
        self.reserved = 0
        self.evicted = 0
        self._items: dict[str, Item] = {}
        self._other = 0          # bytes that are no item and no fetch in flight (metadata, locks), at the last scan
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what is there ----
    def _measure(self, kind: str, name: str) -> Item | None:
        """One item as it is on disk now (None: not there)."""
        try:
            if kind == "upload":
                meta, data = self.uploads / f"{name}.json", self.uploads / name
                size = meta.stat().st_size + (data.stat().st_size if data.exists() else 0)
                return Item("upload", name, size, meta.stat().st_mtime)
        except FileNotFoundError:
            return None
        group = self.store / "streams" / name if self.store is not None else None
        if group is None or not group.is_dir():
            return None
        size, mtime = _tree_bytes(group)
        return Item("stored", name, size, mtime)

    def scan(self) -> None:
        """Walk the uploads and the store: the index from scratch."""
        names = [("upload", m.group(1)) for m in map(UPLOAD_META.fullmatch, os.listdir(self.uploads)) if m]
        streams = self.store / "streams" if self.store is not None else None
        if streams is not None and streams.is_dir():
            names += [("stored", g.name) for g in streams.iterdir() if STORED_ID.fullmatch(g.name)]
        items = {name: item for kind, name in names if (item := self._measure(kind, name)) is not None}
        total = _tree_bytes(self.uploads)[0] + (_tree_bytes(self.store)[0] if self.store is not None else 0)
        with self._lock:
            self._items = items
            self._other = max(0, total - sum(i.bytes for i in items.values()) - self._scratch())

    def items(self) -> list[Item]:
        """Everything retention may remove, oldest first."""
        with self._lock:
            return sorted(self._items.values(), key=lambda i: i.mtime)

    def _scratch(self) -> int:
        return _tree_bytes(self.uploads / "tmp")[0]

    def usage(self) -> int:
        """Bytes on disk now: the items, the fetches being written, and the rest (metadata, locks)."""
        return sum(i.bytes for i in self._items.values()) + self._other + self._scratch()

    def note(self, kind: str, name: str) -> None:
        """An item was written (an upload, a request's homunculus): index it, and keep the cap."""
        item = self._measure(kind, name)
        with self._lock:
            if item is not None:
                self._items[name] = item
            self._sweep(0, time.time())

    # ---- removing ----
    def _remove(self, item: Item) -> bool:
        try:
            if item.kind == "upload":
                (self.uploads / f"{item.name}.json").unlink(missing_ok=True)   # unlisted first, then gone
                (self.uploads / item.name).unlink(missing_ok=True)
                return True
            from sinks import SinkError, ZarrStore

            try:
                ZarrStore.open(self.store).delete(item.name)
                return True
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
        """(lock held) Remove what expired, and the oldest while what is kept passes LOW_WATER of
        the cap: the requests in flight write their homunculi into that margin."""
        busy = self.busy()
        total = self.usage() + self.reserved + need
        # what is written now stays under the cap; what is kept, under LOW_WATER of it
        target = min(self.max_bytes, int(LOW_WATER * self.max_bytes) + need + self.reserved)
        removed = []
        for item in sorted(self._items.values(), key=lambda i: i.mtime):
            if item.name in busy:
                continue
            if now - item.mtime <= self.retention_s and total <= target:
                break
            if self._remove(item):
                del self._items[item.name]
                removed.append(item.name)
                total -= item.bytes
        self.evicted += len(removed)
        return removed

    def room(self, nbytes: int, upload: str | None = None) -> Callable[[], None]:
        """Make room for nbytes about to be written (oldest removed first) and hold it until the
        returned release is called, which indexes `upload` (its file id) as it is then; 507 when
        the cap cannot hold them."""
        with self._lock:
            self._sweep(nbytes, time.time())
            if self.usage() + self.reserved + nbytes > self.max_bytes:
                raise ApiError(507, f"the server's storage is full ({self.max_bytes / (1 << 30):g} GB, "
                                    f"--max-storage-gb); try again when running requests are done",
                               code="storage_full")
            self.reserved += nbytes
        done = [False]

        def release() -> None:
            item = self._measure("upload", upload) if upload is not None else None
            with self._lock:
                if not done[0]:
                    done[0] = True
                    self.reserved -= nbytes
                    if item is not None:
                        self._items[item.name] = item
        return release

    # ---- the sweeper ----
    def start(self) -> "Retention":
        interval = max(0.5, min(5.0, self.retention_s / 4))

        def loop() -> None:
            last_scan = time.monotonic()
            while not self._stop.wait(interval):
                try:
                    if time.monotonic() - last_scan > RESCAN_S:   # what the index missed (live streams grow)
                        self.scan()
                        last_scan = time.monotonic()
                    self.sweep()
                except Exception as e:  # noqa: BLE001 - a failed sweep is retried; serving goes on
                    log.warning("retention sweep failed: %s", e)
        self.scan()
        self.sweep()
        self._thread = threading.Thread(target=loop, name="serve-retention", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
