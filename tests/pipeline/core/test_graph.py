"""The staged graph: bounded channels, queue policies, error propagation, clean stop."""
from __future__ import annotations

import pickle
import signal
import threading
import time

import pytest

from pipeline.core.graph import _END, Channel, Graph, Policy, Stage, StageError, Workers


class Numbers(Stage):
    name = "numbers"

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay
        self.produced = 0

    def produce(self):
        for i in range(self.n):
            if self.delay:
                time.sleep(self.delay)
            self.produced += 1
            yield i


class Counted(Numbers):
    """Numbers that says whether its thread started."""

    started = False

    def produce(self):
        self.started = True
        yield from super().produce()


class Double(Stage):
    name = "double"

    def process(self, item):
        if item == "boom":
            raise ValueError("bad item")
        return (item * 2,)

    def describe(self, item):
        return f"item {item}"


class Collect(Stage):
    name = "collect"

    def __init__(self, delay: float = 0.0, fail_on: int | None = None) -> None:
        self.delay, self.fail_on = delay, fail_on
        self.items: list = []
        self.finished = self.closed = False

    def process(self, item):
        if item == self.fail_on:
            raise RuntimeError(f"cannot take {item}")
        if self.delay:
            time.sleep(self.delay)
        self.items.append(item)
        return ()

    def finish(self):
        self.finished = True
        return ()

    def close(self):
        self.closed = True

    def describe(self, item):
        return f"item {item}"


def chain(*stages: Stage, capacity: int = 2, policy: Policy = Policy.BLOCK) -> tuple[Graph, list[Channel]]:
    g, chans = Graph(), []
    for a, b in zip(stages, stages[1:]):
        chans.append(g.add_flow(a, b, Channel(capacity, policy)))
    return g, chans


class TestFlow:
    def test_items_arrive_in_order_and_finish_runs(self):
        sink = Collect()
        g, _ = chain(Numbers(50), Double(), sink)
        g.run()
        assert sink.items == [2 * i for i in range(50)]
        assert sink.finished and sink.closed
        report = {r["stage"]: r for r in g.report()}
        assert report["collect"]["items"] == 50 and report["numbers"]["items"] == 50

    def test_block_policy_applies_backpressure(self):
        # a slow sink must hold the producer back: the queue never exceeds its capacity
        src, sink = Numbers(40), Collect(delay=0.005)
        g, chans = chain(src, Double(), sink, capacity=3)
        g.run()
        assert len(sink.items) == 40
        assert all(c.max_depth <= 3 for c in chans)
        assert all(c.dropped == 0 for c in chans)

    def test_drop_oldest_discards_the_oldest_queued_item(self):
        ch = Channel(3, Policy.DROP_OLDEST)
        for i in range(6):
            assert ch.put(i)
        ch.put(_END)                                       # the end marker is never dropped
        ch.put(6)
        assert [ch.get() for _ in range(4)] == [4, 5, _END, 6] and ch.dropped == 4

    def test_drop_oldest_never_drops_the_end_marker_at_the_head(self):
        """A full queue whose oldest entry is the end marker drops the oldest item behind it; a
        queue holding only the marker takes the new item beside it (the consumer still ends)."""
        ch = Channel(2, Policy.DROP_OLDEST)
        ch.put(0)
        ch.put(_END)
        assert ch.get() == 0                              # the marker is now at the head
        ch.put(1)
        ch.put(2)                                          # full: 1 goes, the marker stays
        assert [ch.get() for _ in range(2)] == [_END, 2] and ch.dropped == 1
        only = Channel(1, Policy.DROP_OLDEST)
        only.put(_END)
        only.put(7)
        assert [only.get() for _ in range(2)] == [_END, 7] and only.dropped == 0

    def test_drop_oldest_keeps_newest_and_counts_drops(self):
        src, sink = Numbers(200), Collect(delay=0.002)
        g, chans = chain(src, sink, capacity=2, policy=Policy.DROP_OLDEST)
        g.run()
        assert chans[0].dropped > 0
        assert len(sink.items) + chans[0].dropped == 200
        assert sink.items[-1] == 199                       # the newest item always arrives
        assert sink.items == sorted(sink.items)
        assert chans[0].max_depth <= 2


class TestFailures:
    def test_error_names_stage_and_item(self):
        sink = Collect(fail_on=14)
        g, _ = chain(Numbers(100), Double(), sink)
        with pytest.raises(StageError) as info:
            g.run()
        assert info.value.stage == "collect"
        assert "stage 'collect' failed on item 14: RuntimeError: cannot take 14" == str(info.value)
        assert sink.closed and not sink.finished
        # it crosses a process boundary whole (a Ray actor's, a process pool's): pickled and back
        again = pickle.loads(pickle.dumps(info.value))
        assert (type(again), str(again), again.stage, again.item) == (StageError, str(info.value), "collect", "item 14")
        assert type(again.error) is RuntimeError and str(again.error) == "cannot take 14"

    def test_error_in_finish_names_it(self):
        """A stage that fails after its last input (a batch video's VLM answers in finish()) says
        so, not "start-up"."""
        class Closing(Collect):
            def finish(self):
                raise RuntimeError("the VLM process exited")
        g, _ = chain(Numbers(5), Closing())
        with pytest.raises(StageError) as info:
            g.run()
        assert str(info.value) == "stage 'collect' failed on finishing: RuntimeError: the VLM process exited"

    def test_error_in_source_stops_everything(self):
        class Broken(Numbers):
            def produce(self):
                yield 1
                raise OSError("device unplugged")
        sink = Collect()
        g, _ = chain(Broken(0), Double(), sink)
        with pytest.raises(StageError, match="stage 'numbers' failed.*OSError: device unplugged"):
            g.run()

    def test_stop_drains_what_was_produced(self):
        src, sink = Numbers(10_000, delay=0.001), Collect()
        g, _ = chain(src, Double(), sink)
        timer = threading.Timer(0.2, g.stop)
        timer.start()
        g.run()
        assert 0 < len(sink.items) == src.produced < 10_000
        assert sink.finished

    def test_channel_rejects_bad_capacity(self):
        with pytest.raises(ValueError, match="capacity must be >= 1"):
            Channel(0)


class TestWorkers:
    def test_jobs_run_at_once_and_threads_are_kept_for_the_next_ones(self):
        workers = Workers("t")
        started, release = threading.Barrier(4, timeout=5), threading.Event()

        def job(i):
            started.wait()                  # all four must be running at the same time
            release.wait(5)
            return i, threading.get_ident()
        first = [workers.submit(job, i) for i in range(3)]
        started.wait()
        release.set()
        idents = {f.result(5)[1] for f in first}
        assert [f.result()[0] for f in first] == [0, 1, 2] and len(idents) == 3
        time.sleep(0.05)                    # the threads are idle again
        again = [workers.submit(lambda: threading.get_ident()) for _ in range(3)]
        assert {f.result(5) for f in again} <= idents  # no new thread
        workers.close()

    def test_one_thread_runs_jobs_in_order_and_errors_reach_the_future(self):
        workers, order = Workers("vlm", max_threads=1), []

        def job(i):
            time.sleep(0.01)
            order.append((i, threading.get_ident()))
            if i == 2:
                raise ValueError("bad job")
            return i
        jobs = [workers.submit(job, i) for i in range(4)]
        assert [j.exception(5) is None for j in jobs] == [True, True, False, True]
        with pytest.raises(ValueError, match="bad job"):
            jobs[2].result()
        assert [i for i, _ in order] == [0, 1, 2, 3] and len({t for _, t in order}) == 1
        workers.close()

    def test_rejects_bad_max_threads(self):
        with pytest.raises(ValueError, match="max_threads"):
            Workers("x", max_threads=0)

    def test_graphs_run_on_kept_workers_give_the_same_result(self):
        workers = Workers("stage")
        for _ in range(3):
            sink = Collect()
            g, _ = chain(Numbers(20), Double(), sink)
            g.run(workers=workers)
            assert sink.items == [2 * i for i in range(20)] and sink.finished and sink.closed
        sink = Collect(fail_on=6)
        g, _ = chain(Numbers(20), Double(), sink)
        with pytest.raises(StageError, match="cannot take 6"):
            g.run(workers=workers)
        assert workers._threads == 3    # one per stage, reused by every run
        workers.close()


class SlowFinish(Collect):
    """A sink whose end-of-input work takes long (a VLM answering the last window)."""

    name = "slow"

    def __init__(self, finish_s: float) -> None:
        super().__init__()
        self.finish_s = finish_s
        self.finish_started = threading.Event()

    def finish(self):
        self.finish_started.set()
        time.sleep(self.finish_s)
        self.finished = True
        return ()


class TestInterrupts:
    """Ctrl-C in the thread that runs the graph: the first drains, a second aborts the drain, and
    run() returns only after every stage thread ended and every stage closed."""

    @pytest.fixture(autouse=True)
    def _ctrl_c_raises(self):
        """A run started in the background of a non-interactive shell inherits SIGINT ignored, and
        Python then installs no KeyboardInterrupt handler: give these tests Ctrl-C's default."""
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        yield
        signal.signal(signal.SIGINT, previous)

    def test_a_ctrl_c_at_the_edges_of_a_wait_is_never_dropped(self):
        """While waiting() installs its queueing handler, the wait counts as running (a Ctrl-C is
        queued, then raised at the wait's end); the handler outside a wait raises like the default.
        Before, a signal between installing the handler and marking the wait (or between unmarking
        and restoring) set `interrupted` and neither queued nor raised: the command ran on."""
        from pipeline.core.graph import INTERRUPTS, _queue_signal

        INTERRUPTS.reset()
        seen = []
        original = signal.signal

        def spy(sig, handler):   # what the wait's state is at each handler swap
            if sig == signal.SIGINT:
                seen.append((handler, INTERRUPTS._waiting))
            return original(sig, handler)

        signal.signal = spy
        try:
            with pytest.raises(KeyboardInterrupt):
                with INTERRUPTS.waiting():
                    _queue_signal(signal.SIGINT, None)       # queued while the wait runs
        finally:
            signal.signal = original
        assert seen == [(_queue_signal, 1), (signal.default_int_handler, 1)]
        INTERRUPTS.reset()
        with pytest.raises(KeyboardInterrupt):
            _queue_signal(signal.SIGINT, None)               # no wait: not dropped
        INTERRUPTS.reset()

    def _interrupt_main(self, when: threading.Event, delay: float = 0.0) -> threading.Thread:
        main = threading.main_thread().ident

        def send():
            when.wait(10)
            time.sleep(delay)
            signal.pthread_kill(main, signal.SIGINT)
        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        return thread

    def test_second_interrupt_aborts_the_drain_and_waits_for_the_threads(self):
        src, sink = Numbers(10_000, delay=0.001), SlowFinish(finish_s=2.0)
        g, _ = chain(src, Double(), sink)
        produced, calls = threading.Event(), []
        timer = threading.Timer(0.2, produced.set)
        timer.start()
        first = self._interrupt_main(produced)
        second = self._interrupt_main(sink.finish_started, delay=0.1)   # while the sink drains
        with pytest.raises(KeyboardInterrupt):
            g.run(on_interrupt=lambda: calls.append("interrupt"))
        first.join(5), second.join(5)
        assert calls == ["interrupt"]                     # the second one aborted instead
        assert sink.finished and sink.closed              # run() waited for the sink's finish
        for thread in threading.enumerate():              # (a thread ends just after its job)
            if thread.name.startswith("stage-"):
                thread.join(0.5)
                assert not thread.is_alive(), f"{thread.name} outlived Graph.run"

    def test_a_signal_at_any_instruction_of_the_wait_stops_the_graph_cleanly(self):
        """SIGTERM through the CLI's handler, delivered at each bytecode in turn of Graph.run and its
        waits (a trace function raises it there, as a signal handler would run there): run() ends
        only after every stage closed, and then raises KeyboardInterrupt. A KeyboardInterrupt that
        landed on the wait loop's backward jump, outside its `try`, used to leave run() with the
        stages still running; the process then exited under them (exit 134, 1 run in ~30)."""
        import functools
        import sys

        from pipeline.commands.cli import _raise_interrupt
        from pipeline.core.graph import INTERRUPTS, wait_through_interrupts

        watched = {Graph.run.__code__, wait_through_interrupts.__code__}

        def run_with_signal_at(k: int) -> tuple[bool, bool, Counted, Collect]:
            """(signalled, raised KeyboardInterrupt, source, sink) with SIGTERM at the k-th bytecode."""
            src, sink = Counted(30, delay=0.001), Collect()
            g, _ = chain(src, Double(), sink)
            seen, signalled = [0], [False]

            def trace(frame, event, arg):
                if frame.f_code not in watched:
                    return None
                frame.f_trace_opcodes = True
                if event == "opcode":
                    seen[0] += 1
                    if seen[0] == k:
                        signalled[0] = True
                        signal.raise_signal(signal.SIGTERM)
                return trace
            INTERRUPTS.reset()
            sys.settrace(trace)
            try:
                g.run()
                raised = False
            except KeyboardInterrupt:
                raised = True
            finally:
                sys.settrace(None)
            return signalled[0], raised, src, sink

        previous = signal.signal(signal.SIGTERM, functools.partial(_raise_interrupt, INTERRUPTS))
        try:
            k, checked = 0, 0
            while True:
                k += 1
                signalled, raised, src, sink = run_with_signal_at(k)
                if not signalled:
                    break
                checked += 1
                # before the stages start, the signal may simply end run(); after, never before they closed
                assert raised and (sink.closed or not src.started), \
                    f"a signal at bytecode {k} of Graph.run or its waits left the stages running"
        finally:
            signal.signal(signal.SIGTERM, previous)
        assert checked > 50   # every bytecode of at least one turn of the wait, and the closing

    def test_abort_skips_finish_and_still_closes(self):
        src, sink = Numbers(10_000, delay=0.001), Collect()
        g, _ = chain(src, Double(), sink)
        threading.Timer(0.1, g.abort).start()
        g.run()
        assert sink.closed and not sink.finished
        assert 0 < len(sink.items) < 10_000
