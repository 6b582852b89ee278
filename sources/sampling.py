"""Which frames a read of a file keeps (Sampler), and those it will not keep left undecoded where
no other frame needs them (NonrefSkip).

With a target fps (decode.fps: 2 frames a second out of a 30 fps clip) most decoded frames are
thrown away. A frame that no other frame references (an H.264 / HEVC non-reference picture: most
B-frames of a usual encode) can go undecoded without changing any other frame. Once the sampler has
kept a frame, nothing presented before its next tick will be kept, so the packets of those frames go
to FFmpeg with skip_frame=NONREF, packet by packet: the reference frames among them decode as before,
the others are never decoded (nor converted). The frames kept are bitwise those of a full decode,
and their indices their places in the full stream: a skipped frame is counted as if it had come
out (tests/sources/test_sampling.py). At 2 fps out of 30, 132 of a 10-s clip's 300 frames stayed
undecoded, a 28% (240p) / 31% (720p) smaller CPU bill for the decode worker's read
(benchmarks/bench_sampled_decode.py, docs/performance.md).

Only PyAV's decoder (sources/video.py), only for these codecs, and only where a target fps is set.
"""
from __future__ import annotations

import collections
import math
from typing import Any

# Containers round timestamps to their time base (Matroska: 1 ms), so a frame that sits on a
# sampling tick or on start_s / end_s can read up to half a millisecond early.
PTS_TOL_S = 1e-3
NONREF_CODECS = ("h264", "hevc")


class Sampler:
    """Keeps frames with start_s <= pts < end_s; with a target fps only the first frame at or after
    each 1/fps tick (ticks at start_s + k / fps); at most max_frames."""

    def __init__(self, fps: float | None, start_s: float, end_s: float | None, max_frames: int | None):
        self.period = None if fps is None else 1.0 / fps
        self.start_s, self.end_s, self.max_frames = start_s, end_s, max_frames
        self.next_tick, self.kept = start_s, 0

    @property
    def full(self) -> bool:
        return self.max_frames is not None and self.kept >= self.max_frames

    def keep(self, pts_s: float) -> bool | None:
        """True: keep the frame, False: skip it, None: stop (end_s reached)."""
        if self.end_s is not None and pts_s >= self.end_s - PTS_TOL_S:
            return None
        if pts_s < self.next_tick - PTS_TOL_S:
            return False
        if self.period is not None:  # the next tick strictly after this frame: no frame twice
            ticks = math.floor((pts_s - self.start_s + PTS_TOL_S) / self.period) + 1
            self.next_tick = self.start_s + ticks * self.period
        self.kept += 1
        return True


class NonrefSkip:
    """The skip_frame setting of one PyAV video stream's decoder, packet by packet.

    `arm(below_s)`: frames presented before below_s (seconds from the stream's start) will not be
    kept. `before(packet)`: set the decoder for that packet. `came_out(pts)`: a decoded frame left the
    decoder. `skipped`: frames at or after start_s given to the decoder as droppable that have not
    come out (so far: skipped, since frames come out in presentation order and every one skipped was
    presented before anything the sampler keeps next). `last_s`: the latest such frame's time."""

    def __init__(self, stream: Any, start_s: float) -> None:
        self._ctx = stream.codec_context
        self._tb, self._t0 = float(stream.time_base), stream.start_time or 0
        self._start_s = start_s
        self._below: float | None = None
        self._mode = "DEFAULT"
        self._pending: collections.Counter[int] = collections.Counter()   # pts given as droppable, not out yet
        self.skipped = 0
        self.last_s: float | None = None

    def arm(self, below_s: float) -> None:
        self._below = below_s

    def before(self, packet: Any) -> None:
        t = None if packet.pts is None or self._below is None else (packet.pts - self._t0) * self._tb
        droppable = t is not None and t < self._below
        mode = "NONREF" if droppable else "DEFAULT"
        if mode != self._mode:
            self._ctx.skip_frame = self._mode = mode
        if droppable and t >= self._start_s:    # frames before start_s are not counted anyway
            self._pending[packet.pts] += 1
            self.skipped += 1
            self.last_s = t if self.last_s is None else max(self.last_s, t)

    def came_out(self, pts: int | None) -> None:
        if pts is not None and self._pending[pts] > 0:   # a reference frame: decoded after all
            self._pending[pts] -= 1
            self.skipped -= 1
