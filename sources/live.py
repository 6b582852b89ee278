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
backoff and jitter, forever unless `max_reconnects` attempts in a row fail. Every such outage is a
`Gap` with a reason a person can read ("no frames for 8.0 s (read timeout 5 s)", "server closed the
connection; reconnect failed: connection refused (4 attempts)"); a StreamInterruptedWarning says
when it begins and ends. The first frames after a reconnect carry the Gap (last frame before,
first frame after), which is never dropped: it moves to the next surviving frame. An outage still
open when the capture ends (closed, or gave up) is a Gap that ends then: `take()` returns it with
no frames once the frames before it are taken. stats() counts the gaps and the seconds without
frames. Failing to open a source at start is a SourceError.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import random
import re
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal
from urllib.parse import urlsplit, urlunsplit

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from sources.errors import SourceError, StreamInterruptedWarning
from sources.frame import Frame

SourceKind = Literal["camera", "network", "file"]
NETWORK_SCHEMES = ("rtsp", "rtsps", "http", "https")
TRANSPORTS = ("tcp", "udp")
_FALLBACK_FPS = 30.0  # for streams that declare no frame rate (the store needs one)
_RECEIVED_MAX = 256   # packet arrival times kept until their frame comes out of the decoder
_RATE_WINDOW_S = 2.0  # rates (fps in, fps out) are measured over this many recent seconds
_RATE_MIN_SPAN_S = 0.5  # ... and over at least this long just after the start (no spike from 2 frames)


@dataclass(frozen=True)
class LiveConfig:
    """How live sources connect, buffer and recover.

    transport:         RTSP lower transport; TCP survives lossy networks and NAT (default).
    open_timeout_s:    give up connecting after this long.
    read_timeout_s:    a stream that delivers nothing for this long has stalled: reconnect.
    backoff_initial_s, backoff_max_s: reconnect delays double from the first to the cap.
    backoff_jitter:    each delay is scaled by a random factor in [1 - j, 1 + j], so that many
                       clients of one server do not reconnect in lockstep.
    max_reconnects:    give up after this many failed reconnect attempts in a row (None: never).
    probe_s:           how much of a network stream FFmpeg reads to learn its codec and rate (its
                       default, 5 s, would delay every reconnect by seconds).
    buffer_frames:     newest frames kept per source; older ones are dropped (and counted).
    realtime:          files are allowed and played at their frame rate (demos, tests).
    decode_threads:    FFmpeg decoding threads per network stream. Frame threads each hold a frame
                       back, counted in the latencies (they run from a frame's packet arrival).
                       2 (default): one frame held back (33 ms at 30 fps), two cores' decode rate,
                       plenty for 720p/1080p H.264; 1: none held back; 0: FFmpeg's choice, up to
                       one thread per core (16 threads: 15 frames, half a second at 30 fps: on an
                       H100 box, 16 streams of 720p30 had frame latency p95 580 ms against 109 ms
                       at 2 threads, bench_live_cuda_h100_16_kept_dt*.json).
    """

    transport: Literal["tcp", "udp"] = "tcp"
    open_timeout_s: float = 5.0
    read_timeout_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 1.0
    backoff_jitter: float = 0.2
    max_reconnects: int | None = None
    probe_s: float = 0.5
    buffer_frames: int = 16
    realtime: bool = False
    decode_threads: int = 2
    av_options: tuple[tuple[str, str], ...] = ()   # more FFmpeg options for network streams (a server's pinning)

    def __post_init__(self) -> None:
        from arr_coc._validate import check_choice, check_int, check_range

        check_choice("live.transport", self.transport, TRANSPORTS)
        check_range("live.open_timeout_s", self.open_timeout_s, 0.0, 3600.0, lo_open=True)
        check_range("live.read_timeout_s", self.read_timeout_s, 0.0, 3600.0, lo_open=True)
        check_range("live.backoff_initial_s", self.backoff_initial_s, 0.0, 3600.0)
        check_range("live.backoff_max_s", self.backoff_max_s, self.backoff_initial_s, 3600.0)
        check_range("live.backoff_jitter", self.backoff_jitter, 0.0, 1.0)
        if self.max_reconnects is not None:
            check_range("live.max_reconnects", self.max_reconnects, 0, None)
        check_range("live.probe_s", self.probe_s, 0.0, 60.0, lo_open=True)
        check_range("live.buffer_frames", self.buffer_frames, 1, 10_000)
        check_int("live.decode_threads", self.decode_threads)
        check_range("live.decode_threads", self.decode_threads, 0, 64)

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """Delay before reconnect attempt `attempt` (0-based)."""
        base = min(self.backoff_max_s, self.backoff_initial_s * 2.0 ** min(attempt, 30))
        return base * (1.0 + self.backoff_jitter * rng.uniform(-1.0, 1.0))


@dataclass(frozen=True)
class SourceSpec:
    kind: SourceKind
    target: int | str   # camera index, device path, URL or file path
    stream_id: str
    name: str           # what messages show: the spec with any password removed


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


class _OpenError(SourceError):
    """A source could not be (re)opened. `cause` is the why without the source's name, for a Gap's reason."""

    def __init__(self, name: str, message: str, cause: str) -> None:
        super().__init__(f"{name}: {message}")
        self.cause = cause


class _Stalled(Exception):
    """No frame for longer than the read timeout (FFmpeg's interrupt, or frames that stopped coming)."""

    def __init__(self, waited_s: float) -> None:
        self.waited_s = waited_s


class _Lost(Exception):
    """The connection ended; `cause` says how (for a Gap's reason)."""

    def __init__(self, cause: str) -> None:
        self.cause = cause


@dataclass
class _Outage:
    """A live stream without frames since (start_pts, start_wall): its Gap once it ends."""

    cause: str                  # how it began; a stall's reason states the whole outage's length
    stalled: bool
    read_timeout_s: float
    start_pts: float
    start_wall: float
    failures: int = 0           # reconnect attempts that failed
    last_failure: str = ""

    def reason(self, end_wall: float, ending: str | None = None) -> str:
        parts = [f"no frames for {end_wall - self.start_wall:.1f} s (read timeout {self.read_timeout_s:g} s)"
                 if self.stalled else self.cause]
        if self.failures:
            attempts = f" ({self.failures} attempts)" if self.failures > 1 else ""
            parts.append(f"reconnect failed: {self.last_failure}{attempts}")
        if ending:
            parts.append(ending)
        return "; ".join(parts)


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
    scheme = urlsplit(spec).scheme.lower()
    if scheme in NETWORK_SCHEMES:
        parts = urlsplit(spec)
        name = "_".join(str(v) for v in (parts.hostname, parts.port, parts.path) if v)
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


class _Connection:
    """One open connection to a source: `frames()` yields (stream pts or None, rgb, arrival or None)
    until it drops; arrival (time.time()) is when the frame's data came in, where the connection
    knows it (a network stream: its packet), else None (the frame's own time out of the source)."""

    width: int
    height: int
    fps: float
    truncated = False   # a file whose decoding damage stopped early (set once frames() ended)

    def frames(self) -> Iterator[tuple[float | None, np.ndarray, float | None]]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _NetworkConnection(_Connection):
    def __init__(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        options = {"analyzeduration": str(int(cfg.probe_s * 1e6))}
        if urlsplit(spec.target).scheme.lower().startswith("rtsp"):
            options["rtsp_transport"] = cfg.transport
        options.update(cfg.av_options)
        started = time.monotonic()
        try:
            # PyAV's (open, read) timeouts abort a blocked open / read through FFmpeg's interrupt callback
            self.container = av.open(spec.target, options=options, timeout=(cfg.open_timeout_s, cfg.read_timeout_s))
        except (av.FFmpegError, OSError) as e:
            waited = time.monotonic() - started
            if waited >= 0.9 * cfg.open_timeout_s:
                raise _OpenError(spec.name, f"no answer from the server within the {cfg.open_timeout_s:g} s open timeout",
                                 f"no answer within the {cfg.open_timeout_s:g} s open timeout") from e
            raise _OpenError(spec.name, f"cannot open the stream ({_reason(e)})", _lower(_reason(e))) from e
        if not self.container.streams.video:
            self.container.close()
            raise _OpenError(spec.name, "the stream has no video track", "the stream has no video track")
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"
        if cfg.decode_threads:
            self.stream.codec_context.thread_count = cfg.decode_threads
        rate = self.stream.average_rate or self.stream.guessed_rate
        self.fps = float(rate) if rate and 0 < float(rate) <= 1000 else _FALLBACK_FPS
        ctx = self.stream.codec_context
        if not ctx.width or not ctx.height:
            self.container.close()
            raise _OpenError(spec.name, f"no video size found in the first {cfg.probe_s:g} s of the stream "
                             f"(raise live.probe_s)", "no video size found in the stream")
        # a stream that comes back at another size is scaled to the size it started with (the
        # allocation grid of a stream is fixed)
        self.width, self.height = size or (ctx.width, ctx.height)
        self._reformatter = VideoReformatter()
        self._read_timeout_s = cfg.read_timeout_s

    def frames(self) -> Iterator[tuple[float | None, np.ndarray, float | None]]:
        """Frames until the server closes the connection (returns) or nothing comes for longer
        than the read timeout (_Stalled). PyAV's read timeout alone misses stalls up to twice the
        timeout: when it interrupts a read, FFmpeg flushes its parser and returns the held-back
        packet instead of the error, and the next read gets a fresh timeout. So the time is
        measured from the last frame, at every packet, too. Until a connection's first frame, the
        last packet counts: a camera with keyframes further apart than the timeout is waited for."""
        last, framed = time.monotonic(), False
        received: dict[int, float] = {}   # packet pts -> its arrival (time.time()), until its frame is out
        try:
            for packet in self.container.demux(self.stream):
                now = time.monotonic()
                if now - last > self._read_timeout_s:
                    raise _Stalled(now - last)
                if not framed:
                    last = now
                if packet.pts is not None:
                    received[packet.pts] = time.time()
                    if len(received) > _RECEIVED_MAX:   # frames that never came out (corrupt, dropped)
                        del received[next(iter(received))]
                for frame in packet.decode():
                    if frame.is_corrupt:  # concealed packet loss: skip the frame, keep the stream
                        continue
                    rgb = self._reformatter.reformat(frame, width=self.width, height=self.height,
                                                     format="rgb24").to_ndarray()     # (H, W, 3)
                    # FFmpeg's frame threads hold frames back (about one per thread): the frame's
                    # arrival is its packet's, so latencies count the decoder's delay too
                    came = received.pop(frame.pts, None) if frame.pts is not None else None
                    yield (None if frame.pts is None or frame.time is None else float(frame.time)), rgb, came
                    last, framed = time.monotonic(), True
        except av.ExitError:   # "Immediate exit requested": PyAV's read timeout interrupted FFmpeg
            raise _Stalled(time.monotonic() - last) from None
        except (ConnectionResetError, BrokenPipeError):
            raise _Lost("server closed the connection (connection reset)") from None
        except (av.FFmpegError, OSError) as e:
            raise _Lost(f"stream error: {_lower(_reason(e))}") from None
        raise _Lost("server closed the connection")

    def close(self) -> None:
        self.container.close()


def _quiet_opencv() -> None:
    """OpenCV logs every capture backend it tries and fails (V4L2, its FFmpeg, Orbbec: ~10 lines for
    a missing camera) before we can say one line ourselves. Its logger goes silent (process-wide,
    as PyAV's FFmpeg log is); its FFmpeg reads OPENCV_FFMPEG_LOGLEVEL when that backend first starts."""
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")   # AV_LOG_QUIET
    import cv2

    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)


class _CameraConnection(_Connection):
    def __init__(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        _quiet_opencv()
        import cv2

        params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(cfg.open_timeout_s * 1000),
                  cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(cfg.read_timeout_s * 1000)]
        self.cap = cv2.VideoCapture(spec.target, cv2.CAP_ANY, params)
        if not self.cap.isOpened():
            self.cap.release()
            raise _OpenError(spec.name, "cannot open the camera (no such device, busy, or no permission)",
                             "cannot open the camera")
        ok, bgr = self.cap.read()
        if not ok:
            self.cap.release()
            raise _OpenError(spec.name, "the camera opened but delivers no frames", "the camera delivers no frames")
        self._first = bgr
        fps = self.cap.get(cv2.CAP_PROP_FPS)
        self.fps = float(fps) if 0 < fps <= 1000 else _FALLBACK_FPS
        self.width, self.height = size or (bgr.shape[1], bgr.shape[0])
        self._read_timeout_s = cfg.read_timeout_s

    def frames(self) -> Iterator[tuple[float | None, np.ndarray]]:
        import cv2

        bgr, self._first = self._first, None
        while True:
            if bgr is None:
                started = time.monotonic()
                ok, bgr = self.cap.read()
                if not ok:   # stalled past the backend's read timeout, or unplugged
                    waited = time.monotonic() - started
                    if waited >= 0.9 * self._read_timeout_s:
                        raise _Stalled(waited)
                    raise _Lost("the camera stopped delivering frames (unplugged?)")
            if bgr.shape[:2] != (self.height, self.width):
                bgr = cv2.resize(bgr, (self.width, self.height), interpolation=cv2.INTER_AREA)
            msec = self.cap.get(cv2.CAP_PROP_POS_MSEC)
            yield (msec / 1000.0 if msec > 0 else None), cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), None
            bgr = None

    def close(self) -> None:
        self.cap.release()


class _FileConnection(_Connection):
    """A video file paced to its own timestamps, like a camera that ends when the file does."""

    def __init__(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        from sources.video import open_video

        self.video = open_video(spec.target, stream_id=spec.stream_id)
        self.fps, self.width, self.height = float(self.video.fps), self.video.width, self.video.height

    def frames(self) -> Iterator[tuple[float | None, np.ndarray]]:
        start = first_pts = None
        for frame in self.video:
            if start is None:
                start, first_pts = time.monotonic(), frame.pts_s
            delay = start + (frame.pts_s - first_pts) - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            yield frame.pts_s, frame.rgb, None
        raise _Lost("end of file")

    @property
    def truncated(self) -> bool:
        return self.video.truncated

    def close(self) -> None:
        self.video.close()


_CONNECTIONS = {"network": _NetworkConnection, "camera": _CameraConnection, "file": _FileConnection}


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


class LiveSource:
    """A live source with its capture thread (build and start with `open_live`)."""

    def __init__(self, spec: SourceSpec, config: LiveConfig) -> None:
        self.spec, self.config = spec, config
        self.stream_id, self.name = spec.stream_id, spec.name
        self.buffer = LatestFrames(config.buffer_frames)
        self.frames_in = 0
        self.reconnects = 0
        self.error: SourceError | None = None   # why the source gave up, if it did
        self.truncated = False                   # a file whose decoding damage stopped early (warned)
        self._stop = threading.Event()
        self._rng = random.Random()
        self._arrivals: collections.deque[float] = collections.deque(maxlen=512)
        self._thread: threading.Thread | None = None
        self._conn: _Connection | None = None
        self._t0 = 0.0
        self._begin_lock = threading.Lock()
        self.began_at: float | None = None       # time.time() when the consumer became ready
        self._last: tuple[float, float] | None = None   # (pts, arrival) of the last frame
        self._outage: _Outage | None = None             # the stream is down since then
        self._outages = 0
        self._outage_s = 0.0                            # seconds of the outages that ended
        self._lock = threading.Lock()                   # ends an open outage once (thread or close())
        self._ended = False
        self._closed_at: float | None = None

    def start(self) -> "LiveSource":
        """Open the source (SourceError if it cannot be opened). A stream is read from now on (that
        keeps its connection alive); a file starts playing at `begin()`."""
        self._conn = _CONNECTIONS[self.spec.kind](self.spec, self.config, None)
        self.width, self.height, self.fps = self._conn.width, self._conn.height, self._conn.fps
        self._t0 = time.time()
        if self.spec.kind != "file":
            self._start_capture()
        return self

    def begin(self) -> None:
        """The consumer is ready for frames (the first `take()` calls this too). A file starts
        playing now, at pts 0 of the session; a stream forgets the frames that arrived before,
        uncounted, so that the consumer's first frames are the newest."""
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

    def _start_capture(self) -> None:
        self._thread = threading.Thread(target=self._capture, name=f"capture-{self.stream_id}", daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        """The capture ended (file at its end, gave up, or closed) and every frame and gap was taken."""
        return self.buffer.drained

    def take(self, max_frames: int, timeout_s: float = 0.05) -> tuple[list[Frame], Gap | None]:
        if self.began_at is None:
            self.begin()
        return self.buffer.take(max_frames, timeout_s)

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

    def __enter__(self) -> "LiveSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LiveSource({self.name!r}, kind={self.spec.kind!r}, stream_id={self.stream_id!r})"

    def _capture(self) -> None:
        conn: _Connection | None = self._conn
        try:
            while conn is not None and not self._stop.is_set():
                lost = self._pump(conn)
                conn.close()
                self.truncated = self.truncated or conn.truncated
                if self._stop.is_set() or self.spec.kind == "file":
                    break
                self._lose(lost)
                conn = self._reconnect()
        except BaseException as e:  # a bug here must not hang the consumer: it surfaces as error
            self.error = SourceError(f"{self.name}: capture failed ({type(e).__name__}: {e})")
        finally:
            if self._closed_at is not None:
                self._end_capture(self._closed_at, "still down when the source closed")
            else:
                self._end_capture(time.time(), "gave up" if self.error is not None else None)

    def _pump(self, conn: _Connection) -> _Lost | _Stalled | None:
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
                pts = segment[0] + (stream_pts - segment[1]) if segment and stream_pts is not None else arrival - self._t0
                if self._last is not None:
                    pts = max(pts, self._last[0] + 1e-6)   # never backwards, also across reconnects
                gap = self._recover(pts, arrival)
                self.buffer.put(Frame(self.stream_id, self.frames_in, pts, np.ascontiguousarray(rgb), arrival), gap)
                self.frames_in += 1
                self._last = (pts, arrival)
                self._arrivals.append(arrival)
        except (_Lost, _Stalled) as e:
            return e
        return None

    def _lose(self, lost: _Lost | _Stalled | None) -> None:
        """The stream just went down: an outage starts. A reconnection that delivered no frame
        before it dropped again is one more failed attempt of the outage already open."""
        if lost is None:
            return
        if self._outage is not None:
            self._outage.failures += 1
            self._outage.last_failure = (f"no frames within the {self.config.read_timeout_s:g} s read timeout"
                                         if isinstance(lost, _Stalled) else lost.cause)
            return
        start_pts, start_wall = self._last if self._last is not None else (0.0, self._t0)
        stalled = isinstance(lost, _Stalled)
        cause = f"no frames for {lost.waited_s:.1f} s" if stalled else lost.cause
        self._outage = _Outage(cause, stalled, self.config.read_timeout_s, start_pts, start_wall)
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
                           outage.start_wall + length, outage.reason(now, ending or "still down when the capture ended"))
        self.buffer.close(last_gap)

    def _reconnect(self) -> _Connection | None:
        """Reconnect with capped exponential backoff and jitter; None when stopped or giving up."""
        attempt = 0
        size = (self.width, self.height)
        outage = self._outage
        while not self._stop.is_set():
            if self.config.max_reconnects is not None and attempt >= self.config.max_reconnects:
                last = outage.reason(time.time()) if outage is not None else "the stream was lost"
                self.error = SourceError(f"{self.name}: gave up after {attempt} failed reconnect attempts "
                                         f"(--max-reconnects {self.config.max_reconnects}); last: {last}")
                return None
            if self._stop.wait(self.config.backoff_s(attempt, self._rng)):
                return None
            attempt += 1
            try:
                conn = _CONNECTIONS[self.spec.kind](self.spec, self.config, size)
            except SourceError as e:
                if outage is not None:
                    outage.failures += 1
                    outage.last_failure = e.cause if isinstance(e, _OpenError) else _lower(str(e))
                continue
            self.reconnects += 1
            return conn
        return None


def open_live(spec: str, *, config: LiveConfig | None = None, stream_id: str | None = None) -> LiveSource:
    """Parse SOURCE, open it and start its capture thread. SourceError (one line) if it can't be opened."""
    config = config or LiveConfig()
    parsed = parse_source(spec, realtime=config.realtime)
    if stream_id is not None:
        parsed = SourceSpec(parsed.kind, parsed.target, stream_id, parsed.name)
    return LiveSource(parsed, config).start()


def _reason(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def _lower(text: str) -> str:
    """FFmpeg's "Connection refused" inside a sentence: "connection refused" (acronyms stay)."""
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


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
