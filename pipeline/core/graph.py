"""A small staged producer-consumer graph: one thread per stage, bounded channels between them.

Stages declare what they do with one item (`process`) and at the end of the input (`finish`);
the application composes them in one place with `Graph.add_flow(a, b, Channel(...))`, where each
channel's capacity and policy is visible:
  - BLOCK: the producer waits when the channel is full (offline input: backpressure, never drop)
  - DROP_OLDEST: the oldest item is discarded to make room (live input: keep the newest)

An exception in any stage stops the whole graph; `Graph.run` re-raises it in the calling thread
as a `StageError` naming the stage and the item. `Graph.stop()` (e.g. on Ctrl-C) stops the source,
and everything already produced drains through to the sink, so the sink can close cleanly.
`Graph.abort()` (a second Ctrl-C) drops what is still queued instead: each stage ends after its
current item, without `finish`, and the stages still close.
"""
from __future__ import annotations

import collections
import contextlib
import enum
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


class Policy(enum.Enum):
    BLOCK = "block"
    DROP_OLDEST = "drop_oldest"


_END = object()  # end-of-stream marker that flows through every channel
_FINISHING = object()  # what a stage "works on" in finish(), after its last input (StageError names it)


class StageError(RuntimeError):
    """A stage raised; the message names the stage, the item and the original error in one line."""

    def __init__(self, stage: str, item: str, error: BaseException) -> None:
        self.stage, self.item, self.error = stage, item, error
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"stage '{stage}' failed on {item}: {type(error).__name__}: {detail}")

    def __reduce__(self):
        # rebuilt from its fields, so it crosses a process boundary (a Ray actor's, a process pool's)
        return type(self), (self.stage, self.item, self.error)


class Channel:
    """Bounded FIFO between two stages with an explicit overflow policy."""

    def __init__(self, capacity: int, policy: Policy = Policy.BLOCK) -> None:
        if capacity < 1:
            raise ValueError(f"Channel capacity must be >= 1, got {capacity}")
        self.capacity, self.policy = capacity, policy
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._aborted = False
        self.dropped = 0
        self.max_depth = 0

    def put(self, item: Any) -> bool:
        """Queue an item; False if the graph was aborted."""
        with self._cond:
            if item is not _END and self.policy is Policy.BLOCK:
                while len(self._items) >= self.capacity and not self._aborted:
                    self._cond.wait(0.1)
            if self._aborted:
                return False
            if item is not _END and len(self._items) >= self.capacity:  # DROP_OLDEST
                for i, old in enumerate(self._items):
                    if old is not _END:
                        del self._items[i]
                        self.dropped += 1
                        break
            self._items.append(item)
            if item is not _END:
                self.max_depth = max(self.max_depth, len(self._items))
            self._cond.notify_all()
            return True

    def get(self) -> Any:
        """Next item, or _END when the producer finished or the graph was aborted."""
        with self._cond:
            while not self._items and not self._aborted:
                self._cond.wait(0.1)
            if self._aborted:
                return _END
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._items.clear()
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        return len(self._items)


class Stage:
    """One step of the graph. Subclasses override `process` (and `finish`, `close` if needed).

    A stage with no input channel is a source: it overrides `produce` instead of `process`.
    `count(item)` says how many frames an item holds, for the frames/s metric.
    """

    name = "stage"

    def produce(self) -> Iterator[Any]:
        raise NotImplementedError(f"{type(self).__name__} has no input and must implement produce()")

    def process(self, item: Any) -> Iterable[Any]:
        return (item,)

    def finish(self) -> Iterable[Any]:
        """Called once after the last input item; may emit buffered items."""
        return ()

    def close(self) -> None:
        """Called once when the graph ends, normally or not (release files, devices)."""

    def count(self, item: Any) -> int:
        return int(getattr(item, "frames_count", 1))

    def describe(self, item: Any) -> str:
        return getattr(item, "description", type(item).__name__)


@dataclass
class StageMetrics:
    name: str
    items: int = 0
    frames: int = 0
    busy_s: float = 0.0
    wall_s: float = 0.0

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def busy(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


class Workers:
    """Daemon threads kept from job to job (Graph.run's stages, video after video; a VLM's calls).

    CUDA libraries keep per-thread state: cuDNN's attention graphs, cuBLAS handles and their
    workspaces. A fresh thread builds its own on first use, so a video whose stages and VLM ran in
    new threads paid it every time (the vision tower took about 4x as long in a new thread as in a
    warm one). submit() runs each job at once in an idle thread, or in a new one
    (up to max_threads; beyond that jobs wait their turn: max_threads=1 runs jobs one at a time)."""

    def __init__(self, name: str, max_threads: int | None = None, *, keep: bool = True) -> None:
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"max_threads must be >= 1 or None, got {max_threads}")
        self.name, self.max_threads, self.keep = name, max_threads, keep  # keep=False: a thread per job
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._started: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            elif self.max_threads is None or self._threads < self.max_threads:
                self._threads += 1
                thread = threading.Thread(target=self._serve, name=f"{self.name}-{self._threads}", daemon=True)
                thread.start()
                if self.keep:
                    self._started.append(thread)
        self._jobs.put((future, fn, args))
        return future

    def close(self, timeout: float | None = 10.0) -> None:
        """End the threads once the jobs already submitted are done, and wait for them (up to
        timeout): a thread that ran torch code must not end while the interpreter shuts down,
        when its C++ thread-local state would be torn down against already destroyed globals
        (seen as "terminate called without an active exception" at exit)."""
        with self._lock:
            threads, self._started = self._started, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(timeout)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the submitter sees it through the future
                    future.set_exception(e)
            if not self.keep:
                return
            with self._lock:
                self._idle += 1


class Interrupts:
    """Ctrl-C and SIGTERM, for the main thread's waits (`wait_through_interrupts`, `Graph.run`), as
    counts the wait acts on rather than as a KeyboardInterrupt. A handler's exception lands at any
    bytecode, also just outside the wait's `try` (its loop's backward jump, or between Graph.run's
    two waits): it then leaves the wait with every stage still running, and the interpreter exits
    under threads in torch code ("terminate called without an active exception", exit 134, the
    decode worker's shared memory never unlinked).

    A signal handler asks `absorb()` first (the CLI's SIGTERM handler; while a wait runs, Ctrl-C's
    default handler is replaced by one that only does that): while a wait in the
    main thread runs, or once the process was interrupted, the signal is queued for a wait to take
    and the handler returns; only a first signal outside any wait (during set-up) should raise
    KeyboardInterrupt. The queue is a deque: the handler and the wait run in the same thread, and a
    deque's append and popleft are single steps a handler cannot cut in two."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new command: not interrupted, nothing queued (the CLI's main() calls this)."""
        self._queued: collections.deque = collections.deque()
        self._waiting = 0
        self.interrupted = False

    def absorb(self) -> bool:
        """From a signal handler: True when the signal was queued for a wait (one is running, or the
        process was already interrupted); False for the first signal outside a wait, which the
        handler turns into KeyboardInterrupt."""
        queue_it = bool(self._waiting) or self.interrupted
        self.interrupted = True
        if queue_it:
            self._queued.append(None)
        return queue_it

    def take(self) -> int:
        """How many signals were queued since the last take (they are the caller's to act on)."""
        taken = 0
        while True:
            try:
                self._queued.popleft()
            except IndexError:
                return taken
            taken += 1

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The main thread waits: signals are queued for it. Elsewhere, or inside a wait already,
        nothing changes (signals reach only the main thread). A signal queued after the wait's
        last look still interrupts: KeyboardInterrupt once the wait is over."""
        if threading.current_thread() is not threading.main_thread() or self._waiting:
            yield
            return
        ctrl_c = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # _waiting is set for as long as _queue_signal is installed (set before, cleared after), so
        # a Ctrl-C at either edge is queued or raised, never dropped
        self._waiting = 1
        try:
            if ctrl_c:   # the Python API's Ctrl-C, queued like the CLI's signals while the wait runs
                signal.signal(signal.SIGINT, _queue_signal)
            yield
        finally:
            if ctrl_c:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            self._waiting = 0
        if self.take():
            raise KeyboardInterrupt


INTERRUPTS = Interrupts()


def _queue_signal(signum: int, frame: Any) -> None:
    """Ctrl-C while a wait runs: queued for it; outside any wait (never, while waiting() installs
    this handler only inside one) the default's KeyboardInterrupt rather than a lost signal."""
    if not INTERRUPTS.absorb():
        raise KeyboardInterrupt


def wait_through_interrupts(jobs: Iterable[Future], on_interrupt: Callable[[int], None]) -> int:
    """Wait until every job is done, whatever signals arrive; return how many interrupts came.

    A signal (Ctrl-C; SIGTERM through the CLI's handler: INTERRUPTS) does not end the wait: it calls
    `on_interrupt(n)` (n = 1 for the first, 2 for the second ...), which should make the jobs end
    sooner, and the wait goes on. A KeyboardInterrupt that still reaches this thread (a handler of
    the caller's own) counts the same. Polls `done()` rather than blocking in `futures.wait`, so
    that such an exception never lands inside a lock's bookkeeping."""
    pending, count, handled = list(jobs), 0, 0
    with INTERRUPTS.waiting():
        while pending:
            try:
                count += INTERRUPTS.take()
                while handled < count:   # here, so that a signal during a callback is caught too
                    handled += 1
                    on_interrupt(handled)
                pending = [job for job in pending if not job.done()]
                if pending:
                    time.sleep(0.02)
            except KeyboardInterrupt:
                count += 1
        return count + INTERRUPTS.take()


class Graph:
    """A chain or tree of stages joined by channels; `run` blocks until everything drained."""

    def __init__(self) -> None:
        self.stages: list[Stage] = []
        self.inputs: dict[int, Channel] = {}
        self.outputs: dict[int, list[Channel]] = {}
        self.metrics: dict[str, StageMetrics] = {}
        self._error: StageError | None = None
        self._stop = threading.Event()
        self._aborted = False
        self._lock = threading.Lock()

    def add(self, stage: Stage) -> Stage:
        if stage not in self.stages:
            self.stages.append(stage)
            self.outputs.setdefault(id(stage), [])
            self.metrics[stage.name] = StageMetrics(stage.name)
        return stage

    def add_flow(self, src: Stage, dst: Stage, channel: Channel) -> Channel:
        self.add(src)
        self.add(dst)
        if id(dst) in self.inputs:
            raise ValueError(f"stage '{dst.name}' already has an input")
        self.outputs[id(src)].append(channel)
        self.inputs[id(dst)] = channel
        return channel

    def channels(self) -> dict[str, Channel]:
        names = {id(s): s.name for s in self.stages}
        return {f"{names[sid]}->{s.name}": self.inputs[id(s)]
                for s in self.stages if id(s) in self.inputs
                for sid, outs in self.outputs.items() if self.inputs[id(s)] in outs}

    def stop(self) -> None:
        """Ask the sources to stop; what they already produced still flows to the end."""
        self._stop.set()

    def abort(self) -> None:
        """Stop now: the sources stop, queued items are dropped, and each stage ends after the item
        it is working on without `finish` (a stage that writes closes as incomplete)."""
        self._aborted = True
        self._stop.set()
        for ch in self.inputs.values():
            ch.abort()

    def run(self, on_progress: Callable[[Stage, Any], None] | None = None,
            on_interrupt: Callable[[], None] | None = None, workers: Workers | None = None) -> None:
        """Run every stage in its own thread until all drained, close the stages, then re-raise the
        first failure. workers: take the threads from there (kept warm across runs) instead of new ones.

        Ctrl-C or the CLI's SIGTERM (queued for this wait: Interrupts; or a KeyboardInterrupt in this
        thread) calls `on_interrupt` and stops the sources; what they produced drains. A second one
        aborts the drain (`abort`).
        Either way run() returns only once every stage thread has ended and every stage is closed,
        then re-raises KeyboardInterrupt: threads that ran torch code must not outlive the
        interpreter ("terminate called without an active exception", exit 134), and a close cut
        short would leave the store's last rows unwritten.
        """
        workers = Workers("stage", keep=False) if workers is None else workers

        def interrupted(count: int) -> None:
            if count > 1:
                self.abort()
                return
            if on_interrupt is not None:
                on_interrupt()
            self.stop()
        with INTERRUPTS.waiting():   # from the first stage's start to the last stage's close
            signals = wait_through_interrupts([workers.submit(self._work, s, on_progress) for s in self.stages],
                                              interrupted)
            # closed in a thread of its own, which a signal cannot interrupt (it lands in this one), and
            # not one of `workers`: their owner may be closing them (a batch stopped by Ctrl-C)
            closing = Workers("close", keep=False).submit(self._close_stages)
            signals += wait_through_interrupts([closing], lambda count: interrupted(signals + count))
        if signals:
            raise KeyboardInterrupt
        if self._error is not None:
            raise self._error

    def _close_stages(self) -> None:
        for s in self.stages:
            try:
                s.close()
            except Exception as e:  # closing must not mask the original error
                if self._error is None:
                    self._error = StageError(s.name, "close", e)

    def _fail(self, stage: Stage, item: Any, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                described = ("start-up" if item is None else "finishing" if item is _FINISHING
                             else stage.describe(item))
                self._error = StageError(stage.name, described, error)
        self._stop.set()
        for ch in self.inputs.values():
            ch.abort()

    def _emit(self, stage: Stage, items: Iterable[Any]) -> bool:
        for out in items:
            for ch in self.outputs[id(stage)]:
                if not ch.put(out):
                    return False
        return True

    def _work(self, stage: Stage, on_progress: Callable[[Stage, Any], None] | None) -> None:
        m = self.metrics[stage.name]
        start = time.perf_counter()
        item: Any = None
        try:
            inp = self.inputs.get(id(stage))
            if inp is None:
                produced = iter(stage.produce())
                while not self._stop.is_set():
                    t0 = time.perf_counter()
                    item = next(produced, _END)
                    if item is _END:
                        break
                    m.busy_s += time.perf_counter() - t0
                    m.items += 1
                    m.frames += stage.count(item)
                    if not self._emit(stage, (item,)):
                        return
            else:
                while True:
                    item = inp.get()
                    if item is _END:
                        break
                    t0 = time.perf_counter()
                    outs = list(stage.process(item))
                    m.busy_s += time.perf_counter() - t0
                    m.items += 1
                    m.frames += stage.count(item)
                    if on_progress is not None:
                        on_progress(stage, item)
                    if not self._emit(stage, outs):
                        return
            item = _FINISHING
            if self._error is None and not self._aborted:
                t0 = time.perf_counter()
                tail = list(stage.finish())
                m.busy_s += time.perf_counter() - t0
                self._emit(stage, tail)
            for ch in self.outputs[id(stage)]:
                ch.put(_END)
        except BaseException as e:  # any failure stops the graph and surfaces in run()
            self._fail(stage, item, e)
        finally:
            m.wall_s = time.perf_counter() - start

    def report(self) -> list[dict[str, Any]]:
        """Per-stage metrics: frames/s, busy share, input queue depth (max) and drops."""
        rows = []
        for s in self.stages:
            m = self.metrics[s.name]
            ch = self.inputs.get(id(s))
            rows.append({"stage": s.name, "items": m.items, "frames": m.frames, "fps": round(m.fps, 2),
                         "busy": round(m.busy, 3), "queue_max": ch.max_depth if ch else 0,
                         "queue_capacity": ch.capacity if ch else 0, "dropped": ch.dropped if ch else 0})
        return rows
