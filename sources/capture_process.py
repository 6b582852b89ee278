"""Live sources captured in worker processes (`live.capture_processes` N > 0).

With one capture thread per source in the pipeline's own process, every stream's demuxing,
decoding and RGB conversion takes and gives back the interpreter lock several times a frame. At 48
720p30 streams on a 16-CPU H200 host the pipeline's threads then spent their time waiting to take
the lock back after each native call (their stacks: `gil_scoped_release::~gil_scoped_release`,
numpy's copies), the GPU sat idle and the streams were processed at under one frame a second
(docs/performance.md). Here N worker processes share the sources (round-robin) and run the same
LiveSource capture (reconnects, outages, gaps, drops) with their own interpreters; the pipeline's
process keeps one reader thread per worker.

A worker writes each frame the consumer may take into a slot of a shared-memory ring per source
and sends its place over a pipe; the reader copies it out and hands the slot back (credits: a
worker never overwrites a slot not yet copied; without a free slot its frames wait, and drop, in
its own buffer). `ProcessSource` has the LiveSource surface the pipeline uses (take, begin, stats,
close, finished, error, ...); a worker's StreamInterruptedWarnings are raised again here. The
frames' arrival times are the worker's (time.time() is the machine's clock).
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from sources.errors import SourceError, StreamInterruptedWarning
from sources.frame import Frame
from sources.live import OPEN_AT_ONCE, BufferedSource, Gap, LatestFrames, LiveConfig, SourceStats, open_many

SLOTS_EXTRA = 4          # shared slots per source beyond its buffer_frames
STATS_EVERY_S = 0.25     # a worker sends every source's stats this often
_IDLE_S = 0.002          # a worker with nothing to send sleeps this long


class ProcessSource(BufferedSource):
    """One source captured by a worker process: the LiveSource surface the pipeline uses."""

    def __init__(self, group: "CaptureProcess", index: int, info: dict[str, Any], config: LiveConfig) -> None:
        self.group, self.index, self.config = group, index, config
        self.spec = info["spec"]
        self.stream_id, self.name = self.spec.stream_id, self.spec.name
        self.width, self.height, self.fps = info["width"], info["height"], info["fps"]
        self.buffer = LatestFrames(config.buffer_frames)
        self.began_at: float | None = None
        self.error: SourceError | None = None
        self.truncated = False
        self.reached_end = False
        self._stats = SourceStats(0, 0, 0, 0.0)
        self._closed = False

    def begin(self) -> None:
        if self.began_at is None:
            self.began_at = time.time()
            self.buffer.clear()
            self.group.send(("begin", self.index))

    def stats(self) -> SourceStats:
        """The worker's latest figures, its drops and this side's added."""
        return replace(self._stats, dropped=self._stats.dropped + self.buffer.dropped)

    def close(self) -> None:
        """Stop capturing; returns once the worker closed the source (or died)."""
        if not self._closed:
            self._closed = True
            self.group.close_source(self.index)

    def __repr__(self) -> str:
        return f"ProcessSource({self.name!r}, stream_id={self.stream_id!r}, pid={self.group.pid})"


class CaptureProcess:
    """A worker process capturing `entries` ((spec, stream_id) pairs); `sources` once it is up.
    SourceError (the first source that cannot be opened, in order) if any cannot be opened."""

    def __init__(self, entries: list[tuple[str, str]], config: LiveConfig) -> None:
        if config.connect is not None:
            raise SourceError("live.capture_processes cannot carry a connection policy (live.connect) to its "
                              "workers; capture in threads (live.capture_processes 0)")
        ctx = mp.get_context("spawn")   # no fork of a process holding CUDA and threads
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()
        self.process = ctx.Process(target=_serve, args=(entries, config, child), name="arrcoc-capture", daemon=True)
        self.process.start()
        child.close()
        self.pid = self.process.pid
        self._open = set(range(len(entries)))
        self._closing: dict[int, threading.Event] = {}
        wait_s = config.open_timeout_s * (len(entries) // OPEN_AT_ONCE + 1) + 60.0   # + the worker's start
        try:
            message = self._conn.recv() if self._conn.poll(wait_s) else ("failed", "the capture process did not start")
        except (EOFError, OSError):
            self.process.join(timeout=5.0)
            message = ("failed", "the capture process exited before opening its sources "
                                 f"(code {self.process.exitcode})")
        if message[0] != "opened":
            self._stop_process()
            raise SourceError(message[1])
        self._shm = [SharedMemory(name=info["shm"]) for info in message[1]]
        self._rings = [np.ndarray((info["slots"], info["height"], info["width"], 3), np.uint8, buffer=shm.buf)
                       for info, shm in zip(message[1], self._shm)]
        self.sources = [ProcessSource(self, i, info, config) for i, info in enumerate(message[1])]
        self._reader = threading.Thread(target=self._read, name=f"capture-reader-{self.pid}", daemon=True)
        self._reader.start()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):   # the worker is gone: the reader closes its sources
                pass

    def close_source(self, index: int) -> None:
        done = self._closing.setdefault(index, threading.Event())
        self.send(("close", index))
        if not done.wait(self.sources[index].config.read_timeout_s + self.sources[index].config.open_timeout_s + 5.0):
            self._end(index, None)   # a worker that does not answer: the source ends here
        if not self._open:
            self._stop_process()

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "frames":
                    self._frames(*message[1:])
                elif kind == "stats":
                    for i, stats in message[1]:
                        self.sources[i]._stats = stats
                elif kind == "warn":
                    warnings.warn(message[1], StreamInterruptedWarning, stacklevel=1)
                elif kind == "end":
                    _, i, error, truncated, reached_end, last_gap, stats = message
                    source = self.sources[i]
                    source._stats = stats
                    source.error = None if error is None else SourceError(error)
                    source.truncated, source.reached_end = truncated, reached_end
                    self._end(i, last_gap)
                elif kind == "exit":
                    break
        except (EOFError, OSError):
            pass
        for i in list(self._open):   # the worker died: its sources end now
            if self.sources[i].error is None and not self.sources[i]._closed:
                self.sources[i].error = SourceError(f"{self.sources[i].name}: the capture process exited "
                                                    f"(code {self.process.exitcode})")
            self._end(i, None)

    def _frames(self, i: int, metas: list[tuple[int, int, float, float]], gap: Gap | None) -> None:
        source, ring = self.sources[i], self._rings[i]
        for k, (slot, index, pts, arrival) in enumerate(metas):
            rgb = ring[slot].copy()                                     # the slot is the worker's again
            source.buffer.put(Frame(source.stream_id, index, pts, rgb, arrival), gap if k == 0 else None)
        if metas:
            self.send(("credit", i, len(metas)))

    def _end(self, i: int, last_gap: Gap | None) -> None:
        if i in self._open:
            self._open.discard(i)
            self.sources[i].buffer.close(last_gap)
        self._closing.setdefault(i, threading.Event()).set()

    def _stop_process(self) -> None:
        self.send(("exit",))
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        for shm in getattr(self, "_shm", []):   # this side unlinks: a worker that was killed cannot
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def open_in_processes(specs: list[str], stream_ids: list[str], config: LiveConfig,
                      processes: int) -> list[ProcessSource]:
    """Open `specs` in `processes` worker processes (round-robin), in the order given; SourceError
    (the first failure, in order) closes every worker already up."""
    processes = max(1, min(processes, len(specs)))
    groups = [list(range(k, len(specs), processes)) for k in range(processes)]
    with ThreadPoolExecutor(max_workers=processes, thread_name_prefix="open-capture") as pool:
        futures = [pool.submit(CaptureProcess, [(specs[i], stream_ids[i]) for i in group], config)
                   for group in groups]
        done, failure = [], None
        for future in futures:
            try:
                done.append(future.result())
            except SourceError as e:
                failure = failure or e
    if failure is not None:
        for group in done:
            for source in group.sources:
                source.close()
        raise failure
    by_index: dict[int, ProcessSource] = {}
    for group, members in zip(done, groups):
        by_index.update(zip(members, group.sources))
    return [by_index[i] for i in range(len(specs))]


# ---- the worker process ---------------------------------------------------------------------------

def _serve(entries: list[tuple[str, str]], config: LiveConfig, conn: Any) -> None:
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    def forward(message, category, *args, **kwargs) -> None:   # noqa: ANN001 (warnings.showwarning's)
        if issubclass(category, StreamInterruptedWarning):
            send(("warn", str(message)))
    warnings.showwarning = forward
    warnings.simplefilter("always", StreamInterruptedWarning)   # the pipeline's process filters them
    try:
        sources = open_many(entries, config)
    except SourceError as e:
        send(("failed", str(e)))
        return
    except Exception as e:   # noqa: BLE001 (one line to the parent, never a traceback)
        send(("failed", f"cannot open a live source ({type(e).__name__}: {e})"))
        return
    try:
        slots = config.buffer_frames + SLOTS_EXTRA
        shms = [SharedMemory(create=True, size=slots * s.height * s.width * 3) for s in sources]
    except BaseException as e:   # noqa: BLE001
        for source in sources:
            source.close()
        send(("failed", f"the capture process could not start ({type(e).__name__}: {e})"))
        return
    handed = False
    try:
        rings = [np.ndarray((slots, s.height, s.width, 3), np.uint8, buffer=shm.buf) for s, shm in zip(sources, shms)]
        send(("opened", [{"spec": s.spec, "width": s.width, "height": s.height, "fps": s.fps, "slots": slots,
                          "shm": shm.name} for s, shm in zip(sources, shms)]))
        handed = True
        _pump(sources, rings, slots, conn, send)
    finally:
        for source in sources:
            source.close()
        for shm in shms:   # once handed over the parent unlinks them (it may outlive a killed worker)
            shm.close()
            if not handed:
                shm.unlink()


def _pump(sources: list, rings: list[np.ndarray], slots: int, conn: Any, send) -> None:
    """The worker's loop: frames of begun sources into free slots, stats, ends; messages from the parent."""
    n = len(sources)
    credits, open_ = [slots] * n, [True] * n
    next_slot = [0] * n
    last_stats = 0.0
    while True:
        busy = False
        while conn.poll(0):
            kind, *rest = conn.recv()
            if kind == "begin":
                sources[rest[0]].begin()
            elif kind == "credit":
                credits[rest[0]] += rest[1]
            elif kind == "close":
                i = rest[0]
                if open_[i]:
                    sources[i].close()
                    _drain_end(sources[i], i, send)
                    open_[i] = False
            elif kind == "exit":
                return
        for i, source in enumerate(sources):
            if not open_[i] or source.began_at is None:
                continue
            if credits[i] > 0:
                frames, gap = source.take(credits[i], timeout_s=0.0)
                metas = []
                for frame in frames:
                    slot = next_slot[i]
                    rings[i][slot] = frame.rgb
                    next_slot[i] = (slot + 1) % slots
                    metas.append((slot, frame.index, frame.pts_s, frame.arrival_s))
                if metas or gap is not None:
                    credits[i] -= len(metas)
                    send(("frames", i, metas, gap))
                    busy = True
            if source.finished:
                _drain_end(source, i, send, taken=True)
                open_[i] = False
        now = time.monotonic()
        if now - last_stats >= STATS_EVERY_S:
            send(("stats", [(i, s.stats()) for i, s in enumerate(sources) if open_[i]]))
            last_stats = now
        if not busy:
            time.sleep(_IDLE_S)


def _drain_end(source, i: int, send, taken: bool = False) -> None:
    """The source ended (or was closed): its last gap, error and how it ended, to the parent."""
    last_gap = None
    if not taken:
        while not source.finished:
            frames, gap = source.take(source.config.buffer_frames, timeout_s=0.05)
            if gap is not None and not frames:
                last_gap = gap
    error = None if source.error is None else str(source.error)
    send(("end", i, error, source.truncated, source.reached_end, last_gap, source.stats()))
