"""A writer's ownership of one stream of a local store (Ownership in sinks/zarr_store.py).

filelock's lock on `.locks/<stream_id>.lock` (flock, which the kernel drops when its process dies,
kill -9 included; on a filesystem without flock, filelock's marker file, taken over once its pid no
longer runs on this host), held from ZarrStore.stream() to the writer's close(). Beside it,
`.locks/<stream_id>.owner` names the holder (pid, host, since) for the one line a second writer
gets. The lock files stay when released (filelock's design: waiters share one inode); the owner
record goes.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from sinks.store_files import SinkError, make_dir, write_file

LOCKS = ".locks"   # beside `streams/`: one lock file per stream written (local stores)


class StreamLock:
    """Held from acquire() until release(); a forked child's copy never releases its parent's."""

    def __init__(self, lock: FileLock, owner: Path) -> None:
        self._lock, self._owner = lock, owner
        self._pid = os.getpid()

    @classmethod
    def acquire(cls, store: Path, stream_id: str) -> "StreamLock":
        """Own stream_id of the store at `store`, or raise SinkError (one line): another live writer
        holds it (named), or the lock cannot be written (the OS's reason: a full disk, permissions)."""
        path = store / LOCKS / f"{stream_id}.lock"
        lock = FileLock(path, timeout=0, thread_local=False)   # one owner per writer object, not per thread
        owner = path.with_suffix(".owner")
        try:
            make_dir(path.parent)
            lock.acquire()
            try:
                record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
                write_file(owner, json.dumps(record).encode(), atomic=True)
            except BaseException:
                lock.release()
                raise
        except Timeout:
            raise SinkError(f"stream {stream_id!r} in {store} is being written by another writer "
                            f"({_describe(read_owner(owner))}); wait for it to finish or write to another output"
                            ) from None
        except OSError as e:
            raise SinkError(f"cannot lock stream {stream_id!r} of {store} ({path}): {e.strerror or e}") from e
        return cls(lock, owner)

    def release(self) -> None:
        """Give the stream up: the owner record first (while still held), then the lock."""
        if self._lock is None or os.getpid() != self._pid:
            return
        try:
            self._owner.unlink(missing_ok=True)
        finally:
            lock, self._lock = self._lock, None
            lock.release()


def read_owner(owner: Path) -> dict[str, Any] | None:
    """The owner record of a held lock, None while it is being written or unreadable."""
    try:
        record = json.loads(owner.read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "owner unknown"
    since = owner.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {owner.get('pid')} on {owner.get('host')}{when}"
