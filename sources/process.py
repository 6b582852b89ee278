"""Decode a video in a worker process, handing batches over through shared memory.

Why: decoding runs in Python's thread pool poorly. The other stages of the pipeline (model
launches, zarr writes, VLM generation) hold the GIL often, and a decode thread that needs it for
every frame starves: one busy Python thread beside it cuts PyAV's decode rate by more than an
order of magnitude (docs/performance.md). In its own process the decoder keeps its rate whatever
the stages do. Not for decoder="nvdec": NVDEC's frames are CUDA tensors, and its thread needs ~1 ms
of CPU a frame; it decodes in the consumer's process, in a thread (pipeline/core/setup.open_source).

Protocol: the parent owns `slots` shared-memory batch buffers, of (batch, H, W, 3) uint8 RGB,
or with `device_color` and a PyAV stream of 8-bit YUV 4:2:0, of (batch, frame_bytes) raw planes
that the consumer converts on its device (sources/yuv.py: half the bytes, and the worker's thread
skips swscale, its most expensive step). The worker opens the video and says so ("ready"); from
the first `batches()` call the parent hands it free slot numbers; the worker fills a slot with up
to `batch` frames and answers with their (index, pts) list. A short or empty batch ends the
stream. The worker's errors and warnings come back as messages and are raised / re-emitted in
the parent.

A `DecodeWorker` is the process; it serves one video after another, so work over many short clips
(batch) pays its start-up (~0.3 s, a fresh interpreter) once, not per clip. Every message and
slot number carries its video's job id, so nothing left over from a video stopped early reaches
the next one.
"""
from __future__ import annotations

import contextlib
import functools
import mmap
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import DecoderCrashed, SourceError, VideoTruncatedWarning
from .video import open_video
from .yuv import YuvLayout, matches, write_planes, yuv_layout

_POLL_S = 0.5
# How far the prefetch thread may run ahead of the copies into the slots: in frames (PyAV), or in
# decord's chunks (each up to sources.video's 64 MB bound: with the one being decoded and the one
# being copied out, the worker holds 3; one ahead is enough, copying a chunk takes a fraction of its decoding).
_FRAMES_AHEAD = 8
_CHUNKS_AHEAD = 1
# The slots' memory (in /dev/shm) is sized from the frame size, within this many bytes by default:
# 6 slots of 16 frames of 1080p RGB take 0.6 GB, of 8000x8000 frames they took 18.4 GB.
DEFAULT_SHARED_BYTES = 1 << 30
_SPAWN_LOCK = threading.Lock()


@dataclass
class DecodedBatch:
    """Frames of one batch: `pixels` is a view into a shared slot, valid until release(): (n, H, W, 3)
    RGB, or (n, yuv.frame_bytes) planes when the source's `yuv` layout is set."""

    indices: list[int]
    pts: list[float]
    pixels: np.ndarray
    slot: int
    yuv: YuvLayout | None = None

    @property
    def rgb(self) -> np.ndarray:
        if self.yuv is not None:
            raise ValueError("this batch holds YUV planes; convert them with sources.yuv.yuv_to_rgb")
        return self.pixels


class DecodeWorker:
    """A spawned decode process that decodes the videos of successive ProcessSources, one at a time.

    spawn, not fork: the parent runs threads (stages, FFmpeg, torch), and a forked child can
    inherit a lock one of them held and hang (seen in the test suite). The worker starts a fresh
    interpreter that imports only this module (~0.3 s)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.jobs, self.free, self.filled = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_serve, name="decode-worker", daemon=True,
                                args=(self.jobs, self.free, self.filled))
        # one start at a time: _main_not_reimported edits the process-wide __main__, and threads
        # starting workers at the same moment (videos in flight) hung in spawnv_passfds
        with _SPAWN_LOCK, _main_not_reimported():
            self.proc.start()
        self._last_job = 0
        self.closed = False

    def submit(self, path: str, kwargs: dict, shm_name: str, shape: tuple, yuv: YuvLayout | None) -> int:
        """Queue a video; -> its job id. The worker opens it now and decodes once given slots."""
        self._last_job += 1
        self.jobs.put((self._last_job, path, kwargs, shm_name, shape, yuv))
        return self._last_job

    @property
    def alive(self) -> bool:
        return not self.closed and self.proc.is_alive()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.jobs.put(None)
        self.proc.join(timeout=2.0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=2.0)
        for q in (self.jobs, self.free, self.filled):
            q.close()
            q.cancel_join_thread()


class ProcessSource:
    """Like `open_video(...)`, but decoding happens in a child process; iterate `batches()`.

    device_color: hand over YUV 4:2:0 planes instead of RGB where the stream allows it (PyAV,
    8-bit 4:2:0, BT.601/709, even size); `yuv` is then the layout, else None.
    worker: a DecodeWorker to decode in (it stays open after close(), for the next video; it must
    not serve another source until this one is closed); None: a worker of its own, closed with it.
    shared_bytes: memory for the slots. When `slots` batches of `batch_size` frames of this video
    would take more, fewer slots (down to 2) and then fewer frames per batch (down to 1) are used:
    `slots` and `batch_size` are what this source uses. Two frames are the least, whatever the budget
    (open_video's max_pixels bounds a frame; it is passed on with the other keywords).
    """

    def __init__(self, path: str | Path, *, batch_size: int, slots: int = 4, device_color: bool = False,
                 worker: DecodeWorker | None = None, shared_bytes: int = DEFAULT_SHARED_BYTES,
                 **open_kwargs: Any) -> None:
        if batch_size < 1 or slots < 2 or shared_bytes < 1:
            raise ValueError(f"batch_size must be >= 1, slots >= 2 and shared_bytes >= 1, "
                             f"got {batch_size}, {slots} and {shared_bytes}")
        if open_kwargs.get("decoder") == "nvdec":
            raise ValueError("decoder='nvdec' decodes in the consumer's process (open_video in a thread): its "
                             "frames are CUDA tensors, which shared memory would carry only through the host")
        # errors (missing, corrupt, ...) surface here. The probe decodes its first frame on one thread:
        # FFmpeg's frame threads (up to 16) would each take a packet before the first frame came out
        with open_video(path, **{**open_kwargs, "threads": 1}) as probe:
            self.stream_id, self.fps, self.source_fps = probe.stream_id, probe.fps, probe.source_fps
            self.width, self.height, self.frame_count = probe.width, probe.height, probe.frame_count
            info = probe.info
        self.path = Path(path)
        self.truncated = False
        self.yuv: YuvLayout | None = None
        if device_color and open_kwargs.get("decoder", "pyav") == "pyav":
            coded = (self.width, self.height) if info.rotation % 180 else (self.height, self.width)
            self.yuv = yuv_layout(info.pixel_format, info.colorspace, info.color_range, *coded, info.rotation)
        frame_shape = (self.yuv.frame_bytes,) if self.yuv is not None else (self.height, self.width, 3)
        self.slots, self.batch_size = slot_layout(slots, batch_size, int(np.prod(frame_shape)), shared_bytes)
        shape = (self.slots, self.batch_size) + frame_shape
        self._shm = SharedMemory(create=True, size=int(np.prod(shape)))
        self._buffers = np.ndarray(shape, dtype=np.uint8, buffer=self._shm.buf)
        self._own = worker is None
        self._worker = DecodeWorker() if worker is None else worker
        if not self._worker.alive:
            raise ValueError("the decode worker was closed or has died")
        kwargs = dict(open_kwargs, stream_id=self.stream_id)
        self._job = self._worker.submit(str(path), kwargs, self._shm.name, shape, self.yuv)
        self._closed = False
        self._ready = self._started = self._finished = False

    @property
    def buffer(self) -> np.ndarray:
        """All slots, (slots, batch, ...) uint8: the memory a consumer may page-lock (cudaHostRegister)."""
        return self._buffers

    def wait_ready(self) -> None:
        """Block until the worker has opened the video (it starts a fresh interpreter: ~0.3-0.6 s).
        Call it after other setup work so that the two overlap; `batches()` calls it too."""
        if not self._ready:
            kind, *payload = self._next_message()
            if kind == "error":
                raise SourceError(payload[0])
            if kind != "ready":
                raise RuntimeError(f"decode worker protocol: expected 'ready', got {kind!r}")
            self._ready = True

    def batches(self) -> Iterator[DecodedBatch]:
        """Batches in order; call `release(batch)` once its frames are copied out."""
        self.wait_ready()
        if not self._started:  # decoding starts now, not during the caller's setup
            self._started = True
            for slot in range(self.slots):
                self._worker.free.put((self._job, slot))
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
                yield DecodedBatch(indices, pts, self._buffers[slot, :len(indices)], slot, self.yuv)

    def release(self, batch: DecodedBatch) -> None:
        self._worker.free.put((self._job, batch.slot))

    def _next_message(self) -> tuple:
        """This video's next message (a stopped earlier video's leftovers are skipped)."""
        while True:
            try:
                job, *message = self._worker.filled.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._worker.proc.is_alive():
                    raise DecoderCrashed(f"{self.path}: the decoder process died "
                                      f"({_exit_status(self._worker.proc.exitcode)})") from None
                continue
            if job == self._job:
                if message[0] in ("end", "error"):
                    self._finished = True
                return tuple(message)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._finished and not self._worker.closed:
            self._worker.free.put((self._job, None))  # stop this video; the worker waits for the next
        if self._own:
            self._worker.close()
        del self._buffers
        self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> "ProcessSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def slot_layout(slots: int, batch_size: int, frame_bytes: int, budget: int) -> tuple[int, int]:
    """(slots, frames per slot) within `budget` bytes: as asked when it fits; else fewer slots while
    each still holds a whole batch (two are enough to overlap decoding and the consumer's copy out),
    else two slots of as many frames as fit (at least one each)."""
    if slots * batch_size * frame_bytes <= budget:
        return slots, batch_size
    fitting = budget // (batch_size * frame_bytes)
    if fitting >= 2:
        return int(fitting), batch_size
    return 2, int(max(1, min(batch_size, budget // (2 * frame_bytes))))


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


def _exit_status(code: int | None) -> str:
    """A process's exit code in words: a signal by name (the kernel's OOM killer sends SIGKILL)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (", out of memory?" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


def _next_slot(free: Any, parent: int, job: int) -> int | None:
    """A free slot of this job, or None when the parent asks us to stop it or has died (killed,
    say: then no one will ever free a slot, and an orphaned worker must not linger). Entries of
    other (earlier) jobs are dropped."""
    while True:
        try:
            owner, slot = free.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return None
            continue
        if owner == job:
            return slot


def _serve(jobs: Any, free: Any, filled: Any) -> None:
    """The worker process: one video per job, until the parent sends None or dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    parent = os.getppid()
    while True:
        try:
            job = jobs.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if job is None:
            return
        job_id, *args = job
        _worker(job_id, *args, free, _Tagged(filled, job_id), parent)


class _Tagged:
    """A queue's put() that prefixes every message with the job id."""

    def __init__(self, q: Any, job: int) -> None:
        self._q, self._job = q, job

    def put(self, message: tuple) -> None:
        self._q.put((self._job, *message))


def _worker(job: int, path: str, kwargs: dict, shm_name: str, shape: tuple, yuv: YuvLayout | None,
            free: Any, filled: Any, parent: int) -> None:
    try:
        shm = SharedMemory(name=shm_name)
    except FileNotFoundError:
        # the parent closed this video (and unlinked its slots) before we reached it: e.g.
        # SIGTERM while videos were in flight. Nothing listens for it any more; serve the next.
        return
    buffers = np.ndarray(shape, dtype=np.uint8, buffer=shm.buf)
    batch = shape[1]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # the stack (the prefetch thread) closes before the source it reads
            with open_video(path, **kwargs) as source, contextlib.ExitStack() as stack:
                # fault every page of the slots in now, while the parent sets up, not while decoding
                buffers.reshape(-1)[::mmap.PAGESIZE] = 0
                filled.put(("ready",))
                if yuv is not None:
                    runs, depth = _planes(source, yuv, path), min(_FRAMES_AHEAD, batch)
                elif source.decoder == "decord":
                    runs, depth = _decord_chunks(source, shape[2:], path), _CHUNKS_AHEAD
                else:
                    runs, depth = _rgb(source, shape[2:], path), min(_FRAMES_AHEAD, batch)
                runs = stack.enter_context(_Prefetched(runs, depth))
                run, done = None, 0  # the run being copied out, and how many of its frames are
                while True:
                    slot = _next_slot(free, parent, job)
                    if slot is None:
                        return
                    indices, pts = [], []
                    while len(indices) < batch:
                        if run is None:
                            run, done = next(runs, None), 0
                            if run is None:
                                break
                        run_indices, run_pts, write = run
                        n = min(batch - len(indices), len(run_indices) - done)
                        write(buffers[slot, len(indices):len(indices) + n], done)
                        indices += run_indices[done:done + n]
                        pts += run_pts[done:done + n]
                        done += n
                        if done == len(run_indices):
                            run = None
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


class _Prefetched:
    """Iterate `items` in a thread up to `depth` ahead, so that decoding (FFmpeg's and decord's
    own threads, with the GIL released) overlaps the copies into the slots: the worker then runs
    at the slower of the two, not their sum. Leaving the `with` stops and joins the thread before
    the caller closes the decoder under it."""

    _END = object()

    def __init__(self, items: Iterator, depth: int) -> None:
        self._items, self._queue = items, queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-prefetch", daemon=True)

    def __enter__(self) -> Iterator:
        self._thread.start()
        return self._iterate()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # re-raised in the consuming thread
            self._put(e)

    def _iterate(self) -> Iterator:
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def _rgb(source: Any, shape: tuple, path: str) -> Iterator[tuple[list[int], list[float], Any]]:
    """One-frame runs ([index], [pts], write(out (1, H, W, 3), 0)) of RGB frames."""
    for frame in source:
        if frame.rgb.shape != shape:
            raise SourceError(f"{path}: frame size changed mid-stream at frame {frame.index}: "
                              f"{shape[:2]} -> {frame.rgb.shape[:2]}")
        yield [frame.index], [frame.pts_s], functools.partial(_copy_rows, frame.rgb[None])


def _decord_chunks(source: Any, shape: tuple, path: str) -> Iterator[tuple[list[int], list[float], Any]]:
    """Runs of the chunks decord decodes at once: (indices, pts, write(out (k, H, W, 3), start))
    copies the chunk's frames start:start + k. The chunk is decord's own memory (no asnumpy copy),
    and the prefetch thread hands it over whole, so decord decodes the next chunk while this one
    is copied out."""
    for indices, pts, rgb in source.decoded_chunks():
        if rgb.shape[1:] != shape:
            raise SourceError(f"{path}: frame size changed mid-stream at frame {indices[0]}: "
                              f"{shape[:2]} -> {rgb.shape[1:3]}")
        yield indices, pts, functools.partial(_copy_rows, rgb)


def _planes(source: Any, yuv: YuvLayout, path: str) -> Iterator[tuple[list[int], list[float], Any]]:
    """One-frame runs ([index], [pts], write(out (1, frame_bytes), 0)) of Y, U, V planes."""
    for index, pts_s, frame in source.decoded_frames():
        if not matches(yuv, frame):
            raise SourceError(f"{path}: pixel format or size changed mid-stream at frame {index}: "
                              f"{frame.format.name} {frame.width}x{frame.height}")
        yield [index], [pts_s], functools.partial(_write_planes, frame, yuv)


def _copy_rows(rgb: np.ndarray, out: np.ndarray, start: int) -> None:
    np.copyto(out, rgb[start:start + len(out)])


def _write_planes(frame: Any, yuv: YuvLayout, out: np.ndarray, start: int) -> None:
    write_planes(frame, out[0], layout=yuv)
