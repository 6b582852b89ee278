"""Live capture: source parsing, the latest-frame buffer, backoff, and real RTSP streams on loopback
(frames, reconnect after the server dies and returns, timeouts, giving up)."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from arr_coc._validate import ConfigError
from sources import SourceError, StreamInterruptedWarning
from sources.frame import Frame
from sources.live import Gap, LatestFrames, LiveConfig, open_live, parse_source, redact
from sources.synthetic import render_clip, Shot, write_video

sys.path.insert(0, str(Path(__file__).parents[1] / "live"))
from live_servers import FlappingServer, SilentServer, free_port, http_ts_server, rtsp_or_skip  # noqa: E402

FAST = LiveConfig(open_timeout_s=2.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.4)


def frame(i: int, sid: str = "s") -> Frame:
    return Frame(sid, i, i / 10, np.zeros((2, 2, 3), np.uint8), arrival_s=time.time())


def drain(source, seconds: float, *, until=None) -> tuple[list[Frame], list[tuple[float, Gap]]]:
    """Take frames as fast as they come for `seconds` (or until until(frames) is true)."""
    frames, gaps = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not source.finished:
        got, gap = source.take(8, timeout_s=0.05)
        if gap is not None:
            gaps.append((time.monotonic(), gap))
        frames += got
        if until is not None and until(frames):
            break
    return frames, gaps


class TestParse:
    @pytest.mark.parametrize("spec, kind, target, sid", [
        ("0", "camera", 0, "camera0"),
        ("/dev/video2", "camera", "/dev/video2", "video2"),
        ("rtsp://10.0.0.5:554/live/main", "network", "rtsp://10.0.0.5:554/live/main", "10.0.0.5_554_live_main"),
        ("rtsps://cam.local/a", "network", "rtsps://cam.local/a", "cam.local_a"),
        ("https://example.org/s.ts", "network", "https://example.org/s.ts", "example.org_s.ts"),
    ])
    def test_kinds(self, spec, kind, target, sid):
        parsed = parse_source(spec)
        assert (parsed.kind, parsed.target, parsed.stream_id) == (kind, target, sid)

    def test_password_never_shown(self):
        parsed = parse_source("rtsp://admin:hunter2@10.0.0.5/cam")
        assert "hunter2" not in parsed.name and "hunter2" not in parsed.stream_id
        assert redact("rtsp://admin:hunter2@10.0.0.5:8554/x") == "rtsp://admin:***@10.0.0.5:8554/x"

    def test_bad_specs(self, tmp_path):
        with pytest.raises(SourceError, match="unsupported live source scheme 'ftp'.*rtsp, rtsps, http, https"):
            parse_source("ftp://host/x")
        with pytest.raises(SourceError, match="not found"):
            parse_source(str(tmp_path / "missing.mp4"))
        video = tmp_path / "clip.mp4"
        video.write_bytes(b"x")
        with pytest.raises(SourceError, match="--realtime"):
            parse_source(str(video))
        assert parse_source(str(video), realtime=True).kind == "file"

    def test_config_validation(self):
        with pytest.raises(ConfigError, match="live.transport"):
            LiveConfig(transport="http")
        with pytest.raises(ConfigError, match="live.backoff_max_s"):
            LiveConfig(backoff_initial_s=2.0, backoff_max_s=1.0)

    def test_backoff_is_capped_exponential_with_jitter(self):
        cfg = LiveConfig(backoff_initial_s=0.1, backoff_max_s=1.0, backoff_jitter=0.2)
        rng = random.Random(0)
        delays = [[cfg.backoff_s(a, rng) for _ in range(200)] for a in range(8)]
        for attempt, ds in enumerate(delays):
            base = min(1.0, 0.1 * 2 ** attempt)
            assert base * 0.8 - 1e-9 <= min(ds) and max(ds) <= base * 1.2 + 1e-9
            assert np.std(ds) > 0.03 * base   # jittered, not lockstep
            # both ways: a jitter only upward would make every client wait longer than asked
            assert min(ds) < base * 0.9 and max(ds) > base * 1.1
            assert np.mean(ds) == pytest.approx(base, rel=0.05)
        assert max(delays[7]) <= 1.2

    def test_backoff_jitter_spreads_both_ways_around_the_delay(self):
        """Jitter scales a delay by a factor in [1 - j, 1 + j], centred on 1: as many reconnects come
        early as late, and the extremes are reached (a jitter that only lengthens would still pass
        the bounds check above)."""
        cfg = LiveConfig(backoff_initial_s=0.1, backoff_max_s=1.0, backoff_jitter=0.2)
        rng = random.Random(1)
        for attempt in (0, 3, 9):
            base = min(1.0, 0.1 * 2 ** attempt)
            factors = np.array([cfg.backoff_s(attempt, rng) for _ in range(2000)]) / base
            assert abs(factors.mean() - 1.0) < 0.01
            assert 0.4 < (factors < 1.0).mean() < 0.6
            assert factors.min() < 0.82 and factors.max() > 1.18


class TestLatestFrames:
    def test_keeps_newest_and_counts_drops(self):
        buf = LatestFrames(4)
        for i in range(10):
            buf.put(frame(i))
        got, gap = buf.take(100, 0.0)
        assert [f.index for f in got] == [6, 7, 8, 9] and gap is None
        assert buf.dropped == 6 and len(buf) == 0

    def test_gap_survives_drops_and_splits_batches(self):
        buf = LatestFrames(3)
        g = Gap("s", 1.0, 2.0, 10.0, 11.0, "test")
        buf.put(frame(0))
        buf.put(frame(1), g)
        for i in range(2, 4):
            buf.put(frame(i))
        assert buf.dropped == 1
        buf.put(frame(4))   # drops frame 1, which carried the gap: it moves on to frame 2 and ends there
        got, gap = buf.take(10, 0.0)
        assert [f.index for f in got] == [2, 3, 4]
        assert (gap.start_pts, gap.end_pts, gap.end_wall) == (1.0, got[0].pts_s, got[0].arrival_s)
        buf.put(frame(5))
        buf.put(frame(6), g)
        got, gap = buf.take(10, 0.0)
        assert [f.index for f in got] == [5] and gap is None   # a batch never spans a gap
        got, gap = buf.take(10, 0.0)
        assert [f.index for f in got] == [6] and gap is g

    def test_take_keeps_the_newest(self):
        buf = LatestFrames(8)
        for i in range(6):
            buf.put(frame(i))
        got, _ = buf.take(2, 0.0)
        assert [f.index for f in got] == [4, 5] and buf.dropped == 4

    def test_a_gap_no_frame_followed_comes_last_and_alone(self):
        buf = LatestFrames(4)
        for i in range(3):
            buf.put(frame(i))
        g = Gap("s", 0.2, 5.0, 10.0, 15.0, "server closed the connection; still down when the source closed")
        buf.close(g)
        assert not buf.drained
        got, gap = buf.take(2, 0.0)
        assert [f.index for f in got] == [1, 2] and gap is None    # frames before the gap first
        assert buf.take(2, 0.0) == ([], g) and buf.drained
        assert buf.take(2, 0.0) == ([], None)                      # once

    def test_take_waits_then_returns_empty(self):
        buf = LatestFrames(2)
        t = time.monotonic()
        assert buf.take(4, 0.1) == ([], None)
        assert 0.08 <= time.monotonic() - t < 1.0


class TestOpenErrors:
    def test_missing_camera_is_one_line(self):
        t = time.monotonic()
        with pytest.raises(SourceError) as e:
            open_live("/dev/video97", config=FAST)
        assert "/dev/video97" in str(e.value) and "cannot open the camera" in str(e.value)
        assert "\n" not in str(e.value) and time.monotonic() - t < 5

    @pytest.mark.parametrize("spec", ["97", "/dev/video97"])
    def test_missing_camera_prints_nothing_but_our_line(self, spec):
        """OpenCV's own warnings for each backend it tries (and its FFmpeg's) stay off."""
        script = ("import sys\n"
                  "from sources import SourceError\n"
                  "from sources.live import open_live\n"
                  "try:\n"
                  "    open_live(sys.argv[1])\n"
                  "except SourceError as e:\n"
                  "    print(e, file=sys.stderr)\n")
        done = subprocess.run([sys.executable, "-c", script, spec], capture_output=True, text=True, timeout=30,
                              cwd=Path(__file__).parents[2])
        assert done.returncode == 0 and done.stderr.splitlines() == [
            f"{parse_source(spec).name}: cannot open the camera (no such device, busy, or no permission)"], done.stderr

    def test_refused_url(self):
        url = f"rtsp://127.0.0.1:{free_port()}/cam"
        with pytest.raises(SourceError, match=r"rtsp://127\.0\.0\.1:\d+/cam: cannot open the stream \(.*refused"):
            open_live(url, config=FAST)

    @pytest.mark.parametrize("scheme", ["rtsp", "http"])
    def test_silent_server_times_out(self, scheme):
        with SilentServer() as server:
            t = time.monotonic()
            with pytest.raises(SourceError, match="no answer from the server within the 1 s open timeout"):
                open_live(f"{scheme}://127.0.0.1:{server.port}/cam",
                          config=LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0))
            assert 0.9 <= time.monotonic() - t < 4.0


class TestRealtimeFile:
    def test_played_at_its_frame_rate_then_finished(self, tmp_path):
        clip = render_clip([Shot("moving_object", 20, speed=1.0)], height=64, width=80, seed=1)
        path = write_video(tmp_path / "c.mp4", clip.frames, fps=20)
        t = time.monotonic()
        with open_live(str(path), config=LiveConfig(realtime=True, buffer_frames=64)) as src:
            assert (src.width, src.height, src.fps) == (80, 64, 20.0)
            frames, gaps = drain(src, 5.0)
            elapsed = time.monotonic() - t
        assert len(frames) == 20 and not gaps and src.finished and src.error is None
        assert 0.85 <= elapsed < 3.0                               # 20 frames at 20 fps: ~0.95 s
        assert all(f.arrival_s is not None for f in frames)
        arrivals = np.array([f.arrival_s for f in frames])
        assert np.all(np.diff(arrivals) > 0.02)                    # paced, not read as fast as possible


@pytest.mark.filterwarnings("ignore::sources.StreamInterruptedWarning")   # TestOutages checks them
class TestRTSP:
    def test_frames_arrive(self):
        with rtsp_or_skip(fps=20) as server, open_live(server.url(), config=FAST) as src:
            assert (src.width, src.height) == (160, 120) and src.stream_id == f"127.0.0.1_{server.port}_cam"
            frames, _ = drain(src, 2.0)
            stats = src.stats()
        assert len(frames) >= 20 and frames[0].rgb.shape == (120, 160, 3)
        pts = np.array([f.pts_s for f in frames])
        assert np.all(np.diff(pts) > 0)
        assert 0.02 < np.median(np.diff(pts)) < 0.08              # 20 fps stream timestamps
        assert [f.index for f in frames] == list(range(frames[0].index, frames[0].index + len(frames)))
        # frames the consumer took none of before its first read may be dropped (a loaded machine
        # starts reading late), none after it (the indices run on)
        assert stats.dropped <= frames[0].index and stats.reconnects == 0 and 12 < stats.fps_in < 30

    def test_reconnects_after_server_dies_and_returns(self):
        server = rtsp_or_skip(fps=20)
        try:
            with open_live(server.url(), config=FAST) as src:
                before, _ = drain(src, 1.5)
                server.kill()
                died = time.monotonic()
                more, gaps = drain(src, 1.5)
                assert not gaps
                server.start()   # same port
                after, gaps = drain(src, 6.0, until=lambda fs: len(fs) >= 10)
                stats = src.stats()
        finally:
            server.stop()
        assert len(before) >= 10 and len(after) >= 10
        assert len(gaps) == 1
        resumed, gap = gaps[0]
        assert resumed - server.ready_at < 2.0, f"resumed {resumed - server.ready_at:.2f} s after the server returned"
        last = (before + more)[-1]
        assert gap.start_pts == last.pts_s and gap.end_pts == after[0].pts_s
        assert gap.end_pts > gap.start_pts
        assert gap.end_wall - gap.start_wall >= resumed - died - 0.5   # the outage, on the wall clock
        assert after[0].arrival_s == gap.end_wall and last.arrival_s == gap.start_wall
        # nothing before the gap was lost: every frame delivered before it was taken, in order
        indices = [f.index for f in before + more + after]
        assert indices == list(range(indices[0], indices[0] + len(indices)))
        # frames the consumer took none of before its first read may be dropped (a loaded machine
        # starts reading late: 2 of them in one CI run), none after it (the indices run on)
        assert stats.dropped <= indices[0] and stats.reconnects == 1
        # how the stream ended depends on where in a packet the server died: at a boundary FFmpeg
        # sees the connection close, mid-packet (seen under load) invalid data
        assert re.fullmatch(r"(server closed the connection|stream error: invalid data found when processing input)"
                            r"; reconnect failed: connection refused \(\d+ attempts\)", gap.reason), gap.reason
        assert stats.gaps == 1 and stats.connected
        assert stats.outage_s == pytest.approx(gap.end_wall - gap.start_wall, abs=1e-6)

    def test_gives_up_after_max_reconnects(self):
        server = rtsp_or_skip(fps=20)
        cfg = LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.1,
                         max_reconnects=2)
        with open_live(server.url(), config=cfg) as src:
            drain(src, 0.5)
            server.kill()
            drain(src, 5.0)
            assert src.finished
        assert src.error is not None and "gave up after 2 failed reconnect attempts" in str(src.error)
        assert "\n" not in str(src.error)
        # the kill may land mid-packet: FFmpeg then reports invalid data instead of the closed connection
        assert re.search(r"last: (server closed the connection|stream error: invalid data found when processing "
                         r"input); reconnect failed: connection refused", str(src.error)), src.error


class TestOutages:
    """Every interruption longer than the read timeout is a Gap with a reason a person reads, and
    counted in stats(): a stall a little over the timeout (the server frozen with SIGSTOP), a long
    one, and an outage that never ends (the server killed, the source closed while it is down)."""

    CFG = LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.2)

    @pytest.mark.parametrize("frozen_s", [1.6, 2.8])
    def test_frozen_server_is_one_gap(self, frozen_s):
        # 1.6 s: under twice the timeout, PyAV's own read timeout misses it (FFmpeg answers the
        # interrupt with a packet its parser held back, then the next read starts a fresh timeout);
        # 2.8 s: the interrupt surfaces as FFmpeg's "Immediate exit requested"
        server = rtsp_or_skip(fps=20)
        try:
            with open_live(server.url(), config=self.CFG) as src, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                before, _ = drain(src, 1.0)
                os.kill(server.proc.pid, signal.SIGSTOP)
                frozen = time.time()
                try:
                    during, gaps = drain(src, frozen_s)
                    stats_down = src.stats()
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
                after, gaps_after = drain(src, 6.0, until=lambda fs: len(fs) >= 10)
                stats = src.stats()
        finally:
            server.stop()
        gaps += gaps_after
        assert len(before) >= 10 and len(after) >= 10 and len(gaps) == 1
        gap = gaps[0][1]
        length = gap.end_wall - gap.start_wall
        assert length >= frozen_s - 0.3 and gap.start_wall <= frozen + 0.1
        said = re.match(r"no frames for (\d+\.\d) s \(read timeout 1 s\)", gap.reason)
        assert said and float(said[1]) == pytest.approx(length, abs=0.15), gap.reason
        assert "Immediate exit" not in gap.reason
        assert not stats_down.connected and stats_down.gaps == 1 and stats_down.outage_s >= 0.9
        assert stats.connected and stats.gaps == 1 and stats.reconnects >= 1
        if stats.dropped == 0:
            assert stats.outage_s == pytest.approx(length, abs=1e-6)
        else:
            # a slow consumer (a loaded machine) let the buffer drop the frame that ended the outage:
            # the gap then ends at the next frame it sees (LatestFrames._drop_oldest), a little later
            assert 0.0 <= length - stats.outage_s <= stats.dropped / 20 + 0.05, (length, stats)
        messages = [str(w.message) for w in caught if w.category is StreamInterruptedWarning]
        assert len(messages) == 2 and "stream lost at" in messages[0] and "read timeout 1 s" in messages[0]
        assert re.search(r"stream back after \d+\.\d s without frames$", messages[1])

    def test_outage_that_never_ends_is_a_gap_when_the_source_closes(self):
        server = rtsp_or_skip(fps=20)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                src = open_live(server.url(), config=self.CFG)
                drain(src, 1.0)
                server.kill()      # and never back
                killed = time.time()
                time.sleep(2.0)
                down = src.stats()
                closing = time.time()
                src.close()
                frames, gaps = drain(src, 2.0)
        finally:
            server.stop()
        assert src.finished and len(gaps) == 1
        gap = gaps[0][1]
        assert killed - 0.5 <= gap.start_wall <= killed + 0.1 and closing <= gap.end_wall <= time.time()
        assert gap.end_pts - gap.start_pts == pytest.approx(gap.end_wall - gap.start_wall, abs=1e-3)
        # the kill may land mid-packet: FFmpeg then reports invalid data instead of the closed connection
        assert re.fullmatch(r"(server closed the connection|stream error: invalid data found when processing input)"
                            r"; reconnect failed: connection refused \(\d+ attempts\); "
                            r"still down when the source closed", gap.reason), gap.reason
        assert not down.connected and down.gaps == 1 and 1.5 <= down.outage_s <= 2.5
        assert src.stats().outage_s == pytest.approx(gap.end_wall - gap.start_wall, abs=1e-6)
        assert [str(w.message).split(" (")[0] for w in caught if w.category is StreamInterruptedWarning] == [
            f"{src.name}: stream lost at {gap.start_pts:.1f} s"]

    def test_giving_up_ends_the_gap_then(self):
        server = rtsp_or_skip(fps=20)
        cfg = LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.1,
                         max_reconnects=2)
        with open_live(server.url(), config=cfg) as src, warnings.catch_warnings():
            warnings.simplefilter("ignore", StreamInterruptedWarning)
            drain(src, 0.5)
            server.kill()
            _, gaps = drain(src, 5.0)
            assert src.finished
        # the kill may land mid-packet: FFmpeg then reports invalid data instead of the closed connection
        assert len(gaps) == 1 and re.fullmatch(
            r"(server closed the connection|stream error: invalid data found when processing input); "
            r"reconnect failed: connection refused \(2 attempts\); gave up", gaps[0][1].reason), gaps


class TestFlappingSource:
    """A source that opens and then fails at its first read (an HTTP server that answers each GET and
    closes before a frame) is one outage whose every attempt failed: the backoff grows with each
    failure, and --max-reconnects N gives up after N of them. (The attempt count used to start over
    at each successful open: GETs at the first step's rate forever, and never giving up.)"""

    @staticmethod
    def watch(tmp_path, cfg: LiveConfig, seconds: float):
        """Capture a flapping server for up to `seconds`: (frames, gaps, stats, source, GET times)."""
        with FlappingServer(tmp_path) as server, warnings.catch_warnings():
            warnings.simplefilter("ignore", StreamInterruptedWarning)
            with open_live(server.url(), config=cfg) as src:
                frames, gaps = drain(src, seconds)
                stats = src.stats()
            return frames, gaps, stats, src, list(server.gets)

    def test_backoff_grows_with_each_failed_read(self, tmp_path):
        cfg = LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.8,
                         backoff_jitter=0.2)
        frames, _, stats, _, gets = self.watch(tmp_path, cfg, 4.0)
        # delays 0.05, 0.1, 0.2, 0.4, then 0.8 (each +-20 %): about 8 GETs in 4 s, not one per 0.05 s
        assert frames == [] and not stats.connected and stats.gaps == 1
        assert 4 <= len(gets) <= 12, len(gets)
        waits = np.diff(gets)
        assert waits[3] > 4 * waits[0] and waits[-1] >= 0.8 * 0.8 - 0.05, waits

    def test_max_reconnects_counts_failed_reads(self, tmp_path):
        cfg = LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0, backoff_initial_s=0.02, backoff_max_s=0.05,
                         max_reconnects=3)
        _, gaps, stats, src, gets = self.watch(tmp_path, cfg, 10.0)
        assert src.finished, "the source never gave up"
        assert len(gets) == 1 + 3                         # the first open, then three failed reconnects
        assert src.error is not None and "\n" not in str(src.error)
        assert "gave up after 3 failed reconnect attempts (--max-reconnects 3)" in str(src.error)
        assert len(gaps) == 1 and gaps[0][1].reason.endswith("(3 attempts); gave up"), gaps[0][1].reason


class TestDecodeDelay:
    """A network stream's frame arrives when its packet did: FFmpeg's frame threads hold frames back
    (one per thread, less one), and that wait belongs in every latency measured from arrival."""

    @staticmethod
    def held_back_s(url: str, threads: int, frames: int = 45) -> float:
        from sources.live_connections import NetworkConnection
        conn = NetworkConnection(parse_source(url), LiveConfig(decode_threads=threads, read_timeout_s=3.0), None)
        try:
            waits = []
            for k, (_, _, came) in enumerate(conn.frames()):
                waits.append(time.time() - came)
                if k == frames:
                    break
        finally:
            conn.close()
        return float(np.median(waits[15:]))                 # steady state, past the first keyframe

    def test_arrival_is_the_packets_so_the_decoders_hold_back_counts(self, tmp_path):
        with http_ts_server(tmp_path, fps=30) as server:
            one = self.held_back_s(server.url(), 1)
            eight = self.held_back_s(server.url(), 8)
        assert one < 0.1                                       # decoded as it comes
        assert eight > 0.15                                    # ~7 frames of 33 ms behind their packets

    def test_a_live_source_stamps_the_packet_arrival(self, tmp_path):
        with http_ts_server(tmp_path, fps=30) as server:
            with open_live(server.url(), config=LiveConfig(decode_threads=8, read_timeout_s=3.0)) as src:
                frames, _ = drain(src, 2.0, until=lambda f: len(f) >= 30)
                taken = time.time()
        assert len(frames) >= 30
        assert taken - frames[-1].arrival_s > 0.15            # the newest frame came in ~7 frames before it was out

    def test_frames_before_the_consumer_is_ready_are_not_converted(self, tmp_path, monkeypatch):
        """A stream is read from open() on (its decoder needs every packet), but the frames begin()
        forgets never cost an RGB conversion: with many streams opened side by side while the models
        warm up, those conversions took the CPU the warm-up needed."""
        import sources.live_connections as lc

        converted = []

        class Counting:
            def __init__(self, real=lc.VideoReformatter):
                self.real = real()

            def reformat(self, frame, *args, **kwargs):
                converted.append(kwargs.get("threads"))
                return self.real.reformat(frame, *args, **kwargs)

        monkeypatch.setattr(lc, "VideoReformatter", Counting)
        with http_ts_server(tmp_path, fps=30) as server:
            with open_live(server.url(), config=LiveConfig(read_timeout_s=3.0)) as src:
                deadline = time.monotonic() + 5.0
                while src._last is None and time.monotonic() < deadline:   # frames decoded, none wanted
                    time.sleep(0.05)
                time.sleep(0.3)
                assert src._last is not None and converted == []
                frames, _ = drain(src, 3.0, until=lambda f: len(f) >= 10)
        assert len(frames) >= 10 and frames[0].rgb.shape[2] == 3
        assert len(converted) >= len(frames) and frames[0].index == 0   # indices count from begin()
        # one swscale thread a stream where PyAV can say so (its default: a pool per stream as large as the machine)
        assert set(converted) == ({1} if lc.SCALING else {None})

    @pytest.mark.parametrize("value, message", [(-1, "live.decode_threads=-1 is out of range"),
                                                (1.5, "live.decode_threads must be an integer")])
    def test_decode_threads_are_checked(self, value, message):
        with pytest.raises(ConfigError, match=re.escape(message)):
            LiveConfig(decode_threads=value)
