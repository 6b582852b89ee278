"""Decode a video in a worker process, handing batches over through shared memory.

Why: decoding runs in Python's thread pool poorly. The other stages of the pipeline (model
launches, zarr writes, VLM generation) hold the GIL often, and a decode thread that needs it for
every frame starves: with one busy Python thread beside it, PyAV's decode rate here fell from
~740 to ~30 frames/s. In its own process the decoder keeps its rate whatever the stages do.

Protocol: the parent owns `slots` shared-memory batch buffers of (batch, H, W, 3) uint8. It
hands free slot numbers to the worker; the worker fills a slot with up to `batch` frames and
answers with their (index, pts) list. A short or empty batch ends the stream. The worker's
errors and warnings come back as messages and are raised / re-emitted in the parent.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import warnings
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import SourceError, VideoTruncatedWarning
from .video import open_video

_POLL_S = 0.5


@dataclass
class DecodedBatch:
    """Frames of one batch: `rgb` (n, H, W, 3) is a view into a shared slot, valid until release()."""

    indices: list[int]
    pts: list[float]
    rgb: np.ndarray
    slot: int


class ProcessSource:
    """Like `open_video(...)`, but decoding happens in a child process; iterate `batches()`."""

    def __init__(self, path: str | Path, *, batch_size: int, slots: int = 4, **open_kwargs: Any) -> None:
        if batch_size < 1 or slots < 2:
            raise ValueError(f"batch_size must be >= 1 and slots >= 2, got {batch_size} and {slots}")
        with open_video(path, **open_kwargs) as probe:  # errors (missing, corrupt, ...) surface here
            self.stream_id, self.fps, self.source_fps = probe.stream_id, probe.fps, probe.source_fps
            self.width, self.height, self.frame_count = probe.width, probe.height, probe.frame_count
        self.path, self.batch_size, self.slots = Path(path), batch_size, slots
        self.truncated = False
        shape = (slots, batch_size, self.height, self.width, 3)
        self._shm = SharedMemory(create=True, size=int(np.prod(shape)))
        self._buffers = np.ndarray(shape, dtype=np.uint8, buffer=self._shm.buf)
        # spawn, not fork: the parent runs threads (stages, FFmpeg, torch), and a forked child can
        # inherit a lock one of them held and hang (seen in the test suite). The worker starts a
        # fresh interpreter that imports only this module (~0.3 s).
        ctx = mp.get_context("spawn")
        self._free, self._filled = ctx.Queue(), ctx.Queue()
        for slot in range(slots):
            self._free.put(slot)
        kwargs = dict(open_kwargs, stream_id=self.stream_id)
        self._proc = ctx.Process(target=_worker, name=f"decode-{self.stream_id}", daemon=True,
                                 args=(str(path), kwargs, self._shm.name, shape, self._free, self._filled))
        with _main_not_reimported():
            self._proc.start()
        self._closed = False

    def batches(self) -> Iterator[DecodedBatch]:
        """Batches in order; call `release(batch)` once its frames are copied out."""
        while True:
            kind, *payload = self._next_message()
            if kind == "warning":
                warnings.warn(payload[0], VideoTruncatedWarning if payload[1] else UserWarning, stacklevel=2)
            elif kind == "error":
                raise SourceError(payload[0])
            elif kind == "end":
                self.truncated = bool(payload[0])
                return
            else:
                slot, indices, pts = payload
                yield DecodedBatch(indices, pts, self._buffers[slot, :len(indices)], slot)

    def release(self, batch: DecodedBatch) -> None:
        self._free.put(batch.slot)

    def _next_message(self) -> tuple:
        while True:
            try:
                return self._filled.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise SourceError(f"{self.path}: the decoder process died "
                                      f"(exit code {self._proc.exitcode})") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._free.put(None)  # ask the worker to stop
        self._proc.join(timeout=2.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=2.0)
        for q in (self._free, self._filled):
            q.close()
            q.cancel_join_thread()
        del self._buffers
        self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> "ProcessSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Spawn re-runs the caller's main script in the child unless __main__ has no __file__; the
    worker needs nothing from it (its target lives here), and a script importing torch would
    cost the child seconds. Hide __file__ while the child starts."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _next_slot(free: Any, parent: int) -> int | None:
    """A free slot, or None when the parent asks us to stop or has died (killed, say: then no
    one will ever free a slot, and an orphaned worker must not linger)."""
    while True:
        try:
            return free.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _worker(path: str, kwargs: dict, shm_name: str, shape: tuple, free: Any, filled: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    parent = os.getppid()
    shm = SharedMemory(name=shm_name)
    buffers = np.ndarray(shape, dtype=np.uint8, buffer=shm.buf)
    batch = shape[1]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with open_video(path, **kwargs) as source:
                frames = iter(source)
                while True:
                    slot = _next_slot(free, parent)
                    if slot is None:
                        return
                    indices, pts = [], []
                    for frame in frames:
                        if frame.rgb.shape != shape[2:]:
                            raise SourceError(f"{path}: frame size changed mid-stream at frame {frame.index}: "
                                              f"{shape[2:4]} -> {frame.rgb.shape[:2]}")
                        buffers[slot, len(indices)] = frame.rgb
                        indices.append(frame.index)
                        pts.append(frame.pts_s)
                        if len(indices) == batch:
                            break
                    if indices:
                        filled.put(("batch", slot, indices, pts))
                    if len(indices) < batch:
                        break
                for w in caught:
                    filled.put(("warning", str(w.message), issubclass(w.category, VideoTruncatedWarning)))
                filled.put(("end", source.truncated))
    except SourceError as e:
        filled.put(("error", str(e)))
    except Exception as e:  # anything else still reaches the parent as one line
        filled.put(("error", f"{path}: decoding failed: {type(e).__name__}: {e}"))
    finally:
        del buffers
        shm.close()
