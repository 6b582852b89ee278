"""Live status: frame rates are measured over a time window, so a burst (frames a server buffered
during an outage, delivered at once) raises them by what it adds to the window, never to the
rate at which the burst came in."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import sources.live
import sources.live_connections
from pipeline.core.live_stages import StreamCounters
from pipeline.core.live_status import snapshot
from sources.live import LiveConfig, LiveSource, SourceSpec, window_rate

WINDOW_S = 2.0


class Burst(sources.live_connections.Connection):
    """A stream that delivers 10 frames at 20 fps, goes silent for longer than the rate window
    (an outage its connection survives), then delivers 30 buffered frames at once."""

    width, height, fps = 4, 4, 20.0
    burst_done = threading.Event()
    release = threading.Event()

    def __init__(self, spec, cfg, size) -> None:
        pass

    def frames(self):
        rgb = np.zeros((4, 4, 3), np.uint8)
        for _ in range(10):
            time.sleep(0.05)
            yield None, rgb, None
        time.sleep(WINDOW_S + 0.3)
        for _ in range(30):
            yield None, rgb, None
        Burst.burst_done.set()
        Burst.release.wait(10)

    def close(self) -> None:
        pass


def test_fps_in_after_a_burst_is_the_windows_own_rate(monkeypatch):
    monkeypatch.setitem(sources.live_connections.CONNECTIONS, "network", Burst)
    Burst.burst_done.clear(), Burst.release.clear()
    source = LiveSource(SourceSpec("network", "burst", "burst", "burst"),
                        LiveConfig(buffer_frames=64, max_reconnects=0)).start()
    try:
        source.begin()
        assert Burst.burst_done.wait(10)
        streams = snapshot([source], {"burst": StreamCounters()})["streams"]
    finally:
        Burst.release.set()
        source.close()
    # the window holds the 30 burst frames only: 15 frames/s (the burst itself came in at thousands)
    assert streams["burst"]["frames_in"] == 40
    assert streams["burst"]["fps_in"] == pytest.approx(30 / WINDOW_S, abs=0.5)


def test_fps_out_after_a_burst_is_the_windows_own_rate():
    class Started:   # a source that began long ago
        stream_id, began_at = "s", time.time() - 60

        def stats(self):
            return sources.live.SourceStats(0, 0, 0, 0.0)
    counters = StreamCounters()
    now = time.time()
    counters.out_times.extend([now - 10 + 0.1 * i for i in range(20)])   # long before the window
    counters.out_times.extend([now - 0.01 * i for i in range(30)][::-1])  # 30 frames in 0.3 s
    fps_out = snapshot([Started()], {"s": counters})["streams"]["s"]["fps_out"]
    assert fps_out == pytest.approx(30 / WINDOW_S, abs=0.5)


class TestWindowRate:
    def test_steady_rate(self):
        times = [100 + i / 25 for i in range(250)]       # 10 s at 25 fps
        assert window_rate(times, times[-1]) == pytest.approx(25.0, abs=0.5)

    def test_just_after_the_start_is_measured_since_then_without_a_spike(self):
        times = [100 + i / 25 for i in range(25)]        # the first second
        assert window_rate(times, times[-1] + 0.02, since=100.0) == pytest.approx(25.0, abs=1.0)
        assert window_rate(times[:2], 100.05, since=100.0) == pytest.approx(2 / 0.5)  # at least 0.5 s

    def test_nothing_in_the_window_is_zero(self):
        assert window_rate([1.0, 2.0], 10.0) == 0.0 and window_rate([], 10.0) == 0.0
