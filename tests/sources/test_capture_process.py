"""Live sources captured in worker processes (live.capture_processes): the frames, stats and ends the
pipeline sees equal what capture threads give, failures are one line, and a worker that dies ends
its sources with an error instead of hanging the consumer."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from arr_coc._validate import ConfigError
from sources import SourceError, StreamInterruptedWarning
from sources.live import LiveConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "live"))
from live_servers import free_port, http_ts_server, rtsp_or_skip  # noqa: E402

from pipeline.runners.live import open_sources  # noqa: E402

CFG = LiveConfig(read_timeout_s=3.0, open_timeout_s=5.0, capture_processes=2)


def drain(source, until: int, seconds: float = 10.0) -> list:
    frames = []
    deadline = time.monotonic() + seconds
    while len(frames) < until and time.monotonic() < deadline and not source.finished:
        got, _ = source.take(8, timeout_s=0.05)
        frames += got
    return frames


def test_frames_come_from_the_workers(tmp_path):
    with http_ts_server(tmp_path, fps=30, seconds=4.0) as server:
        sources = open_sources([server.url(0), server.url(1), server.url(2)], CFG)
        try:
            assert len({s.group.pid for s in sources}) == 2 and all(s.group.pid != os.getpid() for s in sources)
            assert [(s.width, s.height) for s in sources] == [(160, 120)] * 3
            assert len({s.stream_id for s in sources}) == 3
            for source in sources:
                frames = drain(source, 20)
                assert len(frames) >= 20
                assert frames[0].rgb.shape == (120, 160, 3) and frames[0].rgb.dtype == np.uint8
                assert frames[0].rgb.std() > 0                              # pixels, not an empty slot
                assert np.all(np.diff([f.pts_s for f in frames]) > 0)
                assert [f.index for f in frames] == list(range(frames[0].index, frames[0].index + len(frames)))
            time.sleep(0.6)
            stats = sources[0].stats()
            assert stats.frames_in >= 20 and stats.connected and 10 < stats.fps_in < 45
        finally:
            for source in sources:
                source.close()
        for source in sources:            # closed: what is left is taken, then the source is finished
            drain(source, 10_000, seconds=2.0)
        assert all(s.finished for s in sources)
        assert not any(s.group.process.is_alive() for s in sources)


def test_a_source_that_cannot_open_is_one_line_and_nothing_stays_up(tmp_path):
    with http_ts_server(tmp_path) as server:
        bad = f"http://127.0.0.1:{free_port()}/none.ts"
        with pytest.raises(SourceError) as e:
            open_sources([server.url(0), bad], CFG)
    assert "\n" not in str(e.value) and "127.0.0.1" in str(e.value)
    time.sleep(0.5)
    import multiprocessing
    assert [p for p in multiprocessing.active_children() if p.name == "arrcoc-capture"] == []


def test_a_dead_worker_ends_its_sources_with_an_error(tmp_path):
    with http_ts_server(tmp_path, seconds=4.0) as server:
        (source,) = open_sources([server.url(0)], CFG)
        try:
            assert drain(source, 5)
            os.kill(source.group.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not source.finished and time.monotonic() < deadline:
                source.take(8, timeout_s=0.05)
            assert source.finished and "capture process exited" in str(source.error)
        finally:
            source.close()
    assert not Path("/dev/shm", source.group._shm[0].name.lstrip("/")).exists()   # this side unlinked the ring


def test_many_sources_are_captured_in_processes_unless_told(monkeypatch):
    """Unset, live.capture_processes means threads below AUTO_CAPTURE_MIN_SOURCES sources and
    AUTO_CAPTURE_PROCESSES workers from there on; a number given, NVDEC or a connection policy wins."""
    from pipeline.runners import live as live_runner
    from sources.live_connections import AUTO_CAPTURE_MIN_SOURCES as MIN, AUTO_CAPTURE_PROCESSES as AUTO

    auto = LiveConfig()
    assert auto.capture_processes is None
    assert [auto.capture_workers(n) for n in (1, MIN - 1, MIN, 48)] == [0, 0, AUTO, AUTO]
    assert LiveConfig(capture_processes=0).capture_workers(48) == 0
    assert LiveConfig(capture_processes=3).capture_workers(1) == 3
    assert LiveConfig(decoder="nvdec").capture_workers(48) == 0
    assert LiveConfig(connect=lambda url: None).capture_workers(48) == 0

    import sources.capture_process as capture_process
    seen = []
    monkeypatch.setattr(capture_process, "open_in_processes", lambda specs, sids, cfg, n: seen.append((len(specs), n)))
    live_runner.open_sources([f"http://127.0.0.1:9/{i}" for i in range(MIN)], auto)
    assert seen == [(MIN, AUTO)]


def test_nvdec_cannot_cross_processes():
    with pytest.raises(ConfigError, match="capture_processes needs live.decoder pyav"):
        LiveConfig(capture_processes=2, decoder="nvdec")


@pytest.mark.filterwarnings("ignore::sources.StreamInterruptedWarning")
def test_an_outage_in_a_worker_is_one_gap_and_its_warnings_here():
    """A stream that freezes and comes back: the gap, the stats and both warnings reach the pipeline's
    process as capture threads give them."""
    cfg = LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.2,
                     capture_processes=1)
    server = rtsp_or_skip(fps=20)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (source,) = open_sources([server.url()], cfg)
            try:
                assert len(drain(source, 10)) >= 10
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    time.sleep(2.2)
                    stats_down = source.stats()
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
                frames, gaps = [], []
                deadline = time.monotonic() + 8.0
                while len(frames) < 10 and time.monotonic() < deadline:
                    got, gap = source.take(8, timeout_s=0.05)
                    frames += got
                    gaps += [gap] if gap is not None else []
                time.sleep(0.6)                                   # the worker's next stats
                stats = source.stats()
            finally:
                source.close()
    finally:
        server.stop()
    assert len(frames) >= 10 and len(gaps) == 1 and gaps[0].end_wall - gaps[0].start_wall >= 1.5
    assert re.match(r"no frames for \d+\.\d s \(read timeout 1 s\)", gaps[0].reason), gaps[0].reason
    assert not stats_down.connected and stats.connected and stats.gaps == 1 and stats.reconnects >= 1
    messages = [str(w.message) for w in caught if w.category is StreamInterruptedWarning]
    assert len(messages) == 2 and "stream lost at" in messages[0] and "stream back after" in messages[1]


def test_a_file_played_through_a_worker_ends_with_every_frame_counted(tmp_path):
    from sources.synthetic import write_video

    rng = np.random.default_rng(0)
    path = write_video(tmp_path / "clip.mp4", (rng.random((30, 48, 64, 3)) * 255).astype(np.uint8), fps=30)
    cfg = LiveConfig(realtime=True, capture_processes=1, buffer_frames=64)
    (source,) = open_sources([str(path)], cfg)
    try:
        frames = drain(source, 10_000, seconds=10.0)
    finally:
        source.close()
    assert source.finished and source.reached_end and source.error is None
    assert [f.index for f in frames] == list(range(30))
    assert source.stats().frames_in == 30 and source.stats().dropped == 0
