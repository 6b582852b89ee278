"""Live sources: cameras (OpenCV), network streams (PyAV) and files played at their real frame rate.

    with open_live("rtsp://10.0.0.5/cam", config=LiveConfig(read_timeout_s=3)) as cam:
        while not cam.finished:
            frames, gap = cam.take(max_frames=8, timeout_s=0.1)   # the newest frames, oldest first

One capture thread per source reads as fast as the source delivers and keeps only the newest
`buffer_frames` frames: when the consumer (GPU, VLM) is slower, the oldest frames are dropped and
counted, so neither latency nor memory grows. Each Frame carries its wall-clock arrival time
(`arrival_s`, time.time()) and its pts.

Capture serves the consumer from when it is ready (`begin()`, or its first `take()`), not from
when the source was opened, which may be seconds earlier (models load in between): a file starts
playing then, and a stream (read from the start, which keeps its connection alive) forgets what
arrived before, without counting it as dropped.

pts of a live stream are seconds on the session's timeline: within one connection they follow the
stream's own timestamps, and each (re)connection starts at its arrival time since the session
began (or just after the last frame, if the stream's clock ran ahead). So pts never go backwards
across a reconnect; the exact outage is in the Gap's wall-clock times.

When a stream stalls (no frame for more than read_timeout_s, measured from the last frame, so a
stall just over the timeout counts too) or drops, the thread reconnects with capped exponential
backoff and jitter, forever unless `max_reconnects` attempts in a row fail (sources/reconnect.py).
Every such outage is a `Gap` with a reason a person can read ("no frames for 8.0 s (read timeout
5 s)", "server closed the connection; reconnect failed: connection refused (4 attempts)"); a
StreamInterruptedWarning says when it begins and ends. The first frames after a reconnect carry
the Gap (last frame before, first frame after), which is never dropped: it moves to the next
surviving frame. An outage still
open when the capture ends (closed, or gave up) is a Gap that ends then: `take()` returns it with
no frames once the frames before it are taken. stats() counts the gaps and the seconds without
frames. Failing to open a source at start is a SourceError.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import random
import re
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from sources import nvdec
from sources.errors import SourceError, StreamInterruptedWarning
from sources.frame import Frame
from sources.live_connections import (CONNECTIONS, NETWORK_SCHEMES, TRANSPORTS, Connection, LiveConfig, Lost,
                                      SourceKind, SourceSpec, Stalled)
from sources.reconnect import Outage, Reconnect

__all__ = ["BufferedSource", "Gap", "LatestFrames", "LiveConfig", "LiveSource", "NETWORK_SCHEMES", "SourceKind",
           "SourceSpec", "SourceStats", "TRANSPORTS", "open_live", "open_many", "parse_source", "percentile", "redact",
           "window_rate"]

_RATE_WINDOW_S = 2.0  # rates (fps in, fps out) are measured over this many recent seconds
_RATE_MIN_SPAN_S = 0.5  # ... and over at least this long just after the start (no spike from 2 frames)


@dataclass(frozen=True)
class Gap:
    """A live stream was cut off: no frames between these two (pts on the session timeline)."""

    stream_id: str
    start_pts: float    # last frame before the outage
    end_pts: float      # first frame after the reconnect
    start_wall: float   # their arrival times (time.time())
    end_wall: float
    reason: str


@dataclass(frozen=True)
class SourceStats:
    frames_in: int      # frames the source delivered
    dropped: int        # of those, dropped because the consumer was slower
    reconnects: int     # successful reconnections
    fps_in: float       # frames delivered over the last _RATE_WINDOW_S seconds, per second
    gaps: int = 0       # outages so far (stalls, drops), the current one included
    outage_s: float = 0.0   # seconds without frames in those outages, up to now for a current one
    connected: bool = True  # False during an outage and once the capture ended


def redact(url: str) -> str:
    """The URL without a password (user:pass@host -> user:***@host), for messages and attrs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_.") or "live"


def parse_source(spec: str, *, realtime: bool = False) -> SourceSpec:
    """Classify a live SOURCE argument: camera index, device path, stream URL, or (realtime) file."""
    if not isinstance(spec, str) or not spec.strip():
        raise SourceError(f"invalid live source {spec!r}: expected a camera index (0), a device path "
                          f"(/dev/video0), an rtsp(s):// or http(s):// URL, or a file with --realtime")
    if spec.isdigit():
        return SourceSpec("camera", int(spec), f"camera{int(spec)}", f"camera {int(spec)}")
    try:
        parts = urlsplit(spec)
        scheme, port = parts.scheme.lower(), parts.port if "://" in spec else None
    except ValueError as e:   # "http://[::1", "http://cam:99999/": not a URL at all
        masked = re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", spec)
        raise SourceError(f"invalid live source URL {masked!r}: {e}") from None
    if scheme in NETWORK_SCHEMES:
        name = "_".join(str(v) for v in (parts.hostname, port, parts.path) if v)
        return SourceSpec("network", spec, _sanitize(name), redact(spec))
    if "://" in spec:
        raise SourceError(f"unsupported live source scheme {scheme!r} in {redact(spec)!r}; "
                          f"supported: {', '.join(NETWORK_SCHEMES)}")
    if spec.startswith("/dev/"):
        return SourceSpec("camera", spec, _sanitize(Path(spec).name), spec)
    path = Path(spec)
    if not path.exists():
        raise SourceError(f"live source {spec!r} not found: not a camera index, device, URL or file")
    if not realtime:
        raise SourceError(f"{spec} is a file; pass --realtime to play it as a live source at its frame rate "
                          f"(or use `python -m pipeline run` to process it offline)")
    return SourceSpec("file", str(path), _sanitize(path.stem), spec)


@dataclass(frozen=True)
class HeldFrame:
    """A frame in LatestFrames whose pixels are not RGB yet (NVDEC's NV12 copy, sources/nvdec.py):
    Frame's place in the stream, converted to a Frame when taken (frames_of)."""

    stream_id: str
    index: int
    pts_s: float
    pixels: Any
    arrival_s: float | None = None


def frames_of(items: list) -> list[Frame]:
    """The Frames of what LatestFrames.take returned: held frames converted together, each run of
    one stream connection's frames in one call (nvdec.convert_held); Frames as they are."""
    if not any(isinstance(f, HeldFrame) for f in items):
        return items
    out: list[Frame] = []
    for key, run in itertools.groupby(items, lambda f: (f.pixels.converter, f.pixels.size)
                                      if isinstance(f, HeldFrame) else None):
        if key is None:
            out.extend(run)
            continue
        held = list(run)
        rgb = nvdec.convert_held([f.pixels for f in held])                         # (n, H, W, 3)
        out.extend(Frame(f.stream_id, f.index, f.pts_s, rgb[k], f.arrival_s) for k, f in enumerate(held))
    return out


class LatestFrames:
    """The newest `capacity` frames of one source; older ones are dropped and counted.

    A Gap rides on the first frame after it; when that frame is dropped the gap moves to (and now
    ends at) the next one, so a consumer learns of every gap before the frames that follow it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.deque[tuple[Frame, Gap | None]] = collections.deque()
        self._cond = threading.Condition()
        self.dropped = 0
        self.closed = False
        self._last_gap: Gap | None = None   # an outage no frame followed (the capture ended in it)

    def put(self, frame: Frame, gap: Gap | None = None) -> None:
        with self._cond:
            self._items.append((frame, gap))
            while len(self._items) > self.capacity:
                self._drop_oldest()
            self._cond.notify_all()

    def _drop_oldest(self) -> None:
        _, carried = self._items.popleft()
        self.dropped += 1
        if carried is not None:
            # the gap now ends at the first frame a consumer will see after it
            nxt, own = self._items[0]
            self._items[0] = (nxt, own or dataclasses.replace(carried, end_pts=nxt.pts_s, end_wall=nxt.arrival_s))

    def clear(self) -> None:
        """Forget every buffered frame, and the drops so far (frames from before the consumer was ready)."""
        with self._cond:
            self._items.clear()
            self.dropped = 0

    def close(self, last_gap: Gap | None = None) -> None:
        """No more frames will come: wake the consumer. `last_gap`: the stream was down from then
        until now; `take` returns it, with no frames, after every frame before it."""
        with self._cond:
            if not self.closed:
                self._last_gap = last_gap
            self.closed = True
            self._cond.notify_all()

    def take(self, max_frames: int, timeout_s: float) -> tuple[list[Frame], Gap | None]:
        """The newest buffered frames, at most max_frames, oldest first (waiting up to timeout_s for
        one). Frames older than those are dropped: a consumer that fell behind catches up at once.
        A batch never spans a gap: the gap, if any, comes before the first returned frame; a gap
        that no frame followed comes last, alone: ([], gap)."""
        with self._cond:
            if not self._items and not self.closed:
                self._cond.wait(timeout_s)
            if not self._items and self._last_gap is not None:
                gap, self._last_gap = self._last_gap, None
                return [], gap
            while len(self._items) > max_frames:
                self._drop_oldest()
            frames: list[Frame] = []
            gap = None
            while self._items and len(frames) < max_frames:
                frame, item_gap = self._items[0]
                if item_gap is not None and frames:
                    break
                self._items.popleft()
                gap = gap or item_gap
                frames.append(frame)
            return frames, gap

    def __len__(self) -> int:
        return len(self._items)

    @property
    def drained(self) -> bool:
        """Closed, and every frame and gap was taken."""
        return self.closed and not self._items and self._last_gap is None


class BufferedSource:
    """What a consumer calls on a live source, whatever captures it (a thread here, a worker process:
    sources/capture_process.py): the newest frames in `buffer`, from `begin()` on."""

    buffer: LatestFrames
    began_at: float | None

    def begin(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @property
    def finished(self) -> bool:
        """The capture ended (file at its end, gave up, or closed) and every frame and gap was taken."""
        return self.buffer.drained

    def take(self, max_frames: int, timeout_s: float = 0.05) -> tuple[list[Frame], Gap | None]:
        if self.began_at is None:
            self.begin()
        frames, gap = self.buffer.take(max_frames, timeout_s)
        return frames_of(frames), gap

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LiveSource(BufferedSource):
    """A live source with its capture thread (build and start with `open_live`)."""

    def __init__(self, spec: SourceSpec, config: LiveConfig) -> None:
        self.spec, self.config = spec, config
        self.stream_id, self.name = spec.stream_id, spec.name
        self.buffer = LatestFrames(config.buffer_frames)
        self.frames_in = 0
        self.reconnects = 0
        self.error: SourceError | None = None   # why the source gave up, if it did
        self.truncated = False                   # a file whose decoding damage stopped early (warned)
        self.reached_end = False                 # the source ended by itself (a file played to its end)
        self._stop = threading.Event()
        self._rng = random.Random()
        self._policy = Reconnect(lambda failures: config.backoff_s(failures, self._rng), config.max_reconnects)
        self._arrivals: collections.deque[float] = collections.deque(maxlen=512)
        self._thread: threading.Thread | None = None
        self._conn: Connection | None = None
        self._t0 = 0.0
        self._begin_lock = threading.Lock()
        self.began_at: float | None = None       # time.time() when the consumer became ready
        self._last: tuple[float, float] | None = None   # (pts, arrival) of the last frame
        self._outage: Outage | None = None             # the stream is down since then
        self._outages = 0
        self._outage_s = 0.0                            # seconds of the outages that ended
        self._lock = threading.Lock()                   # ends an open outage once (thread or close())
        self._ended = False
        self._closed_at: float | None = None

    def start(self) -> "LiveSource":
        """Open the source (SourceError if it cannot be opened). A stream is read from now on (that
        keeps its connection alive); a file starts playing at `begin()`."""
        self._conn = self._connect(None)
        self.width, self.height, self.fps = self._conn.width, self._conn.height, self._conn.fps
        self._t0 = time.time()
        if self.spec.kind != "file":
            self._start_capture()
        return self

    def begin(self) -> None:
        """The consumer is ready for frames (the first `take()` calls this too). A file starts
        playing now, at pts 0 of the session; a stream forgets the frames that arrived before,
        uncounted, so that the consumer's first frames are the newest (stats() count outages from here
        on, the one still open included)."""
        with self._begin_lock:
            if self.began_at is not None:
                return
            self.began_at = time.time()
            if self._thread is None:
                self._t0 = self.began_at
                if not self._stop.is_set():
                    self._start_capture()
            else:
                self.buffer.clear()
                with self._lock:   # and the outages that ended before (their gaps rode on those frames)
                    self._outages, self._outage_s = int(self._outage is not None), 0.0

    def _start_capture(self) -> None:
        self._thread = threading.Thread(target=self._capture, name=f"capture-{self.stream_id}", daemon=True)
        self._thread.start()

    def stats(self) -> SourceStats:
        now = time.time()
        fps = window_rate(list(self._arrivals), now, since=self.began_at)
        outage = self._outage
        current = max(0.0, now - outage.start_wall) if outage is not None else 0.0
        return SourceStats(self.frames_in, self.buffer.dropped, self.reconnects, fps, self._outages,
                           self._outage_s + current, outage is None and not self._ended)

    def close(self) -> None:
        """Stop capturing. An outage still open is recorded as a Gap ending now (see `take`)."""
        if self._closed_at is None:
            self._closed_at = time.time()
        with self._begin_lock:   # a begin() from now on starts nothing
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.read_timeout_s + self.config.open_timeout_s + 1.0)
        elif self._thread is None and self._conn is not None:
            self._conn.close()   # a file that never started playing
        self._end_capture(self._closed_at, "still down when the source closed")

    def __repr__(self) -> str:
        return f"LiveSource({self.name!r}, kind={self.spec.kind!r}, stream_id={self.stream_id!r})"

    def _capture(self) -> None:
        conn: Connection | None = self._conn
        try:
            while conn is not None and not self._stop.is_set():
                lost = self._pump(conn)
                conn.close()
                self.truncated = self.truncated or conn.truncated
                if self._stop.is_set() or self.spec.kind == "file":
                    self.reached_end = lost is not None and not self._stop.is_set()   # a file's last frame
                    break
                self._lose(lost)
                conn = self._reconnect()
        except SourceError as e:    # the source cannot go on (a stream NVDEC refuses, without fallback)
            self.error = e
            if conn is not None:
                conn.close()
        except BaseException as e:  # a bug here must not hang the consumer: it surfaces as error
            self.error = SourceError(f"{self.name}: capture failed ({type(e).__name__}: {e})")
        finally:
            if self._closed_at is not None:
                self._end_capture(self._closed_at, "still down when the source closed")
            else:
                self._end_capture(time.time(), "gave up" if self.error is not None else None)

    def _pump(self, conn: Connection) -> Lost | Stalled | None:
        """Deliver frames from one connection until it drops; return why (None: stopped)."""
        segment: tuple[float, float] | None = None   # (session pts, stream pts) of the first timed frame
        try:
            for stream_pts, rgb, came in conn.frames():
                if self._stop.is_set():
                    return None
                arrival = time.time() if came is None else came
                if segment is None and stream_pts is not None:
                    # a segment's clock may run ahead of arrival (frames buffered while the stream
                    # was probed): start it after the last frame so pts never go backwards
                    base = arrival - self._t0 if self._last is None else max(arrival - self._t0, self._last[0] + 1e-3)
                    segment = (base, stream_pts)
                pts = (segment[0] + (stream_pts - segment[1]) if segment and stream_pts is not None
                       else arrival - self._t0)
                if self._last is not None:
                    pts = max(pts, self._last[0] + 1e-6)   # never backwards, also across reconnects
                gap = self._recover(pts, arrival)
                if rgb is None:   # read before the consumer was ready: begin() forgets these anyway
                    self._last = (pts, arrival)
                    continue
                if isinstance(rgb, nvdec.HeldNv12):   # NVDEC's NV12, converted when taken (with the rest of its batch)
                    frame = HeldFrame(self.stream_id, self.frames_in, pts, rgb, arrival)
                else:   # (NVDEC's RGB of a realtime file: a contiguous device tensor already)
                    rgb = np.ascontiguousarray(rgb) if isinstance(rgb, np.ndarray) else rgb
                    frame = Frame(self.stream_id, self.frames_in, pts, rgb, arrival)
                self.buffer.put(frame, gap)
                self.frames_in += 1
                self._last = (pts, arrival)
                self._arrivals.append(arrival)
        except (Lost, Stalled) as e:
            return e
        return None

    def _lose(self, lost: Lost | Stalled | None) -> None:
        """The stream just went down: an outage starts. A reconnection that delivered no frame
        before it dropped again is one more failed attempt of the outage already open."""
        if lost is None:
            return
        if self._outage is not None:
            self._outage.fail(f"no frames within the {self.config.read_timeout_s:g} s read timeout"
                              if isinstance(lost, Stalled) else lost.cause)
            return
        start_pts, start_wall = self._last if self._last is not None else (0.0, self._t0)
        stalled = isinstance(lost, Stalled)
        cause = f"no frames for {lost.waited_s:.1f} s" if stalled else lost.cause
        self._outage = Outage(cause, stalled, self.config.read_timeout_s, start_pts, start_wall)
        self._outages += 1
        since = f"at {start_pts:.1f} s" if self._last is not None else "before its first frame"
        warnings.warn(f"{self.name}: stream lost {since} ({cause}"
                      f"{f', read timeout {self.config.read_timeout_s:g} s' if stalled else ''}); reconnecting",
                      StreamInterruptedWarning, stacklevel=2)

    def _recover(self, pts: float, arrival: float) -> Gap | None:
        """A frame arrived: the Gap of the outage it ends, if one was open."""
        with self._lock:
            outage, self._outage = self._outage, None
            if outage is None:
                return None
            self._outage_s += arrival - outage.start_wall
        warnings.warn(f"{self.name}: stream back after {arrival - outage.start_wall:.1f} s without frames",
                      StreamInterruptedWarning, stacklevel=2)
        return Gap(self.stream_id, outage.start_pts, pts, outage.start_wall, arrival, outage.reason(arrival))

    def _end_capture(self, now: float, ending: str | None) -> None:
        """Close the buffer; an outage still open becomes its last Gap, ending `now`."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            outage, self._outage = self._outage, None
            if outage is not None:
                self._outage_s += max(0.0, now - outage.start_wall)
        last_gap = None
        if outage is not None:
            # no frame ends it: it lasts as long on the session timeline as on the wall clock
            length = max(now - outage.start_wall, 1e-6)
            last_gap = Gap(self.stream_id, outage.start_pts, outage.start_pts + length, outage.start_wall,
                           outage.start_wall + length,
                           outage.reason(now, ending or "still down when the capture ended"))
        self.buffer.close(last_gap)

    def _connect(self, size: tuple[int, int] | None) -> Connection:
        conn = CONNECTIONS[self.spec.kind](self.spec, self.config, size)
        conn.wanted = lambda: self.began_at is not None   # no RGB for frames begin() would forget
        return conn

    def _reconnect(self) -> Connection | None:
        """The next connection of the open outage (sources/reconnect.py: its backoff grows with the
        outage's failures, whichever way each failed); None when stopped or giving up."""
        if self._outage is None:   # the stream ended without an outage: stopped
            return None
        size = (self.width, self.height)
        conn, self.error = self._policy.run(self._outage, lambda: self._connect(size), self._stop, self.name)
        if conn is not None:
            self.reconnects += 1
        return conn


def open_live(spec: str, *, config: LiveConfig | None = None, stream_id: str | None = None) -> LiveSource:
    """Parse SOURCE, open it and start its capture thread. SourceError (one line) if it can't be opened."""
    config = config or LiveConfig()
    parsed = parse_source(spec, realtime=config.realtime)
    if stream_id is not None:
        parsed = SourceSpec(parsed.kind, parsed.target, stream_id, parsed.name)
    return LiveSource(parsed, config).start()


OPEN_AT_ONCE = 16   # sources opened side by side: an open mostly waits on the network (a live stream's probe)


def open_many(entries: list[tuple[str, str]], config: LiveConfig) -> list[LiveSource]:
    """open_live for each (spec, stream id), up to OPEN_AT_ONCE at a time, in the order given. The first
    failure in that order is raised, after every source already opened is closed again."""
    if len(entries) == 1:
        return [open_live(entries[0][0], config=config, stream_id=entries[0][1])]
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=min(OPEN_AT_ONCE, len(entries)), thread_name_prefix="open-source")
    futures = [pool.submit(open_live, spec, config=config, stream_id=sid) for spec, sid in entries]
    try:
        opened = [f.result() for f in futures]
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        for f in futures:
            if not f.cancelled() and f.exception() is None:
                f.result().close()
        raise
    pool.shutdown()
    return opened


def window_rate(times: list[float], now: float, *, window_s: float = _RATE_WINDOW_S,
                since: float | None = None) -> float:
    """Events per second over the last `window_s` seconds: those whose time falls in the window,
    over its length (shorter just after `since`, the start, but at least _RATE_MIN_SPAN_S). A burst
    (frames buffered during an outage and delivered at once) counts for what it adds to the
    window, not at the rate it came in."""
    start = now - window_s if since is None else max(now - window_s, since)
    span = max(now - start, min(window_s, _RATE_MIN_SPAN_S))
    return sum(1 for t in times if start <= t <= now) / span


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100) of values, nan when empty (for status lines and benchmarks)."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))
