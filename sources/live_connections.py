"""How live sources connect: their configuration, a parsed SOURCE (SourceSpec), and one open
connection per kind (network stream through PyAV or NVDEC, camera through OpenCV, file paced at its
frame rate). sources/live.py runs the capture thread over them; sources/reconnect.py decides when to
try again after an outage.
"""
from __future__ import annotations

import collections
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal
from urllib.parse import urlsplit

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from sources.errors import NvdecFallbackWarning, SourceError
from sources.nvdec import NvdecError, NvdecUnavailable
from sources.reconnect import backoff_s
from sources.video_probe import NOT_VIDEO_CODECS

SourceKind = Literal["camera", "network", "file"]
NETWORK_SCHEMES = ("rtsp", "rtsps", "http", "https")
TRANSPORTS = ("tcp", "udp")
FALLBACK_FPS = 30.0   # for streams that declare no frame rate (the store needs one)
# live.capture_processes left unset: from this many sources on, capture in this many worker processes.
# One H200 of a 32-CPU host, 720p30 (docs/performance.md): 48 streams in threads 15.5% of frames dropped,
# p95 1.78 s, 11.4 CPU cores in the pipeline's process; in 4 processes 4.0%, 0.83 s, 2.7 cores.
AUTO_CAPTURE_MIN_SOURCES = 16
AUTO_CAPTURE_PROCESSES = 4
_RECEIVED_MAX = 256   # packet arrival times kept until their frame comes out of the decoder


def _one_thread_scaling() -> dict[str, int]:
    """reformat()'s keyword for one swscale thread, where PyAV has it ({} on older PyAV). Its
    default (0, one thread per CPU) gives every stream's converter a pool as large as the machine:
    48 live streams on 16 CPUs ran 720 scaling threads beside their decoders, and the pipeline
    processed under one frame a second per stream. Each stream has its capture thread already."""
    frame = av.VideoFrame(16, 16, "yuv420p")
    try:
        VideoReformatter().reformat(frame, format="rgb24", threads=1)
    except TypeError:
        return {}
    return {"threads": 1}


SCALING = _one_thread_scaling()


@dataclass(frozen=True)
class LiveConfig:
    """How live sources connect, buffer and recover.

    transport:         RTSP lower transport; TCP survives lossy networks and NAT (default).
    open_timeout_s:    give up connecting after this long.
    read_timeout_s:    a stream that delivers nothing for this long has stalled: reconnect.
    backoff_initial_s, backoff_max_s: reconnect delays double from the first to the cap.
    backoff_jitter:    each delay is scaled by a random factor in [1 - j, 1 + j], so that many
                       clients of one server do not reconnect in lockstep.
    max_reconnects:    give up after this many failed reconnect attempts in a row (None: never): an
                       attempt fails when the source cannot be opened, or opens and then ends or
                       stalls before its first frame.
    probe_s:           how much of a network stream FFmpeg reads to learn its codec and rate (its
                       default, 5 s, would delay every reconnect by seconds).
    buffer_frames:     newest frames kept per source; older ones are dropped (and counted).
    realtime:          files are allowed and played at their frame rate (demos, tests).
    connect:           how network streams are reached (None: as their URL says): URL -> a Route,
                       per connection; a server's fetch policy (pipeline/serve/fetch_policy.py).
    decoder:           "pyav" (default) or "nvdec": network streams and realtime files decoded by the
                       GPU's NVDEC, one decoder session per source, frames kept on the GPU
                       (sources/nvdec.py). Cameras are read through OpenCV either way.
    fallback:          with decoder nvdec: a source NVDEC cannot decode (no GPU or PyNvVideoCodec,
                       a codec or format it lacks) decodes with PyAV after one warning, instead of
                       failing to open.
    decode_threads:    FFmpeg decoding threads per network stream. Frame threads each hold a frame
                       back, counted in the latencies (they run from a frame's packet arrival).
                       2 (default): one frame held back, two cores' decode rate, plenty for
                       720p/1080p H.264; 1: none held back; 0: FFmpeg's choice, up to one thread
                       per core, each holding a frame back (many frames of latency on a big host).
    capture_processes: None (default): AUTO_CAPTURE_PROCESSES worker processes from
                       AUTO_CAPTURE_MIN_SOURCES sources up (PyAV, no connection policy), threads below;
                       0: each source's capture thread runs in this process; N: N worker processes
                       share the sources and hand frames over through shared memory
                       (sources/capture_process.py), so that many streams' decoding does not
                       compete with the pipeline's threads for the interpreter lock. PyAV only.
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
    av_options: tuple[tuple[str, str], ...] = ()   # more FFmpeg options for network streams
    connect: Callable[[str], "Route"] | None = field(default=None, compare=False, repr=False)
    decoder: Literal["pyav", "nvdec"] = "pyav"
    fallback: bool = False
    capture_processes: int | None = None

    def __post_init__(self) -> None:
        from arr_coc._validate import ConfigError, check_choice, check_int, check_range

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
        check_choice("live.decoder", self.decoder, ("pyav", "nvdec"))
        if self.capture_processes is not None:
            check_int("live.capture_processes", self.capture_processes)
            check_range("live.capture_processes", self.capture_processes, 0, 256)
        if self.capture_processes and self.decoder != "pyav":
            raise ConfigError("live.capture_processes needs live.decoder pyav: NVDEC's frames stay on the GPU "
                              "of the process that decoded them")

    def capture_workers(self, n_sources: int) -> int:
        """Worker processes that capture `n_sources` sources (0: threads in this process)."""
        if self.capture_processes is not None:
            return self.capture_processes
        if self.decoder != "pyav" or self.connect is not None or n_sources < AUTO_CAPTURE_MIN_SOURCES:
            return 0
        return AUTO_CAPTURE_PROCESSES

    def backoff_s(self, failures: int, rng: random.Random) -> float:
        """Delay before the reconnect attempt that follows `failures` failed ones in this outage."""
        return backoff_s(failures, self.backoff_initial_s, self.backoff_max_s, self.backoff_jitter, rng)


@dataclass(frozen=True)
class SourceSpec:
    kind: SourceKind
    target: int | str   # camera index, device path, URL or file path
    stream_id: str
    name: str           # what messages show: the spec with any password removed


class OpenError(SourceError):
    """A source could not be (re)opened. `cause` is the why without the source's name, for a Gap's reason."""

    def __init__(self, name: str, message: str, cause: str) -> None:
        super().__init__(f"{name}: {message}")
        self.cause = cause


class RefusedByPolicy(OpenError):
    """A Route refused where a stream leads (its host, a redirect): a server tells its client that
    much and no more."""


@dataclass
class Route:
    """How one connection reaches a network stream (LiveConfig.connect): FFmpeg opens `url` with
    `options` added; after a failed open, `refusal()` says whether the route refused where the
    stream led (one line), else None; `close()` once the connection ends."""

    url: str
    options: dict[str, str] = field(default_factory=dict)
    refusal: Callable[[], str | None] = lambda: None
    close: Callable[[], None] = lambda: None


class Stalled(Exception):
    """No frame for longer than the read timeout (FFmpeg's interrupt, or frames that stopped coming)."""

    def __init__(self, waited_s: float) -> None:
        self.waited_s = waited_s


class Lost(Exception):
    """The connection ended; `cause` says how (for a Gap's reason)."""

    def __init__(self, cause: str) -> None:
        self.cause = cause


class Connection:
    """One open connection to a source: `frames()` yields (stream pts or None, rgb, arrival or None)
    until it drops; arrival (time.time()) is when the frame's data came in, where the connection
    knows it (a network stream: its packet), else None (the frame's own time out of the source)."""

    width: int
    height: int
    fps: float
    truncated = False   # a file whose decoding damage stopped early (set once frames() ended)
    # whether anyone will look at the frames now (LiveSource: not before its consumer is ready); a
    # network stream read before then is decoded (its decoder needs every packet) but not converted
    # to RGB, and yields None for those frames
    wanted: Callable[[], bool] = staticmethod(lambda: True)

    def frames(self) -> Iterator[tuple[float | None, np.ndarray, float | None]]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class NetworkConnection(Connection):
    def __init__(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        self._route = cfg.connect(spec.target) if cfg.connect is not None else Route(spec.target)
        try:
            self._open(spec, cfg, size)
        except BaseException:
            self._route.close()
            raise

    def _open(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        options = {"analyzeduration": str(int(cfg.probe_s * 1e6))}
        if urlsplit(spec.target).scheme.lower().startswith("rtsp"):
            options["rtsp_transport"] = cfg.transport
        options.update(cfg.av_options)
        options.update(self._route.options)
        started = time.monotonic()
        try:
            # PyAV's (open, read) timeouts abort a blocked open / read through FFmpeg's interrupt callback
            self.container = av.open(self._route.url, options=options,
                                     timeout=(cfg.open_timeout_s, cfg.read_timeout_s))
        except (av.FFmpegError, OSError) as e:
            waited = time.monotonic() - started
            refusal = self._route.refusal()
            if refusal is not None:
                raise RefusedByPolicy(spec.name, refusal, refusal) from e
            if waited >= 0.9 * cfg.open_timeout_s:
                raise OpenError(spec.name,
                                f"no answer from the server within the {cfg.open_timeout_s:g} s open timeout",
                                f"no answer within the {cfg.open_timeout_s:g} s open timeout") from e
            raise OpenError(spec.name, f"cannot open the stream ({reason_of(e)})", lowercase_first(reason_of(e))) from e
        if not self.container.streams.video:
            self.container.close()
            raise OpenError(spec.name, "the stream has no video track", "the stream has no video track")
        self.stream = self.container.streams.video[0]
        codec = self.stream.codec_context.codec
        if codec.name in NOT_VIDEO_CODECS:    # a text file FFmpeg draws (by its name: .cdg, .nfo, ...)
            self.container.close()
            raise OpenError(spec.name, f"not a video, FFmpeg would draw it as {codec.long_name} ({codec.name!r}): "
                                       f"text or karaoke graphics, not camera or film footage", "not a video")
        self.stream.thread_type = "AUTO"
        if cfg.decode_threads:
            self.stream.codec_context.thread_count = cfg.decode_threads
        rate = self.stream.average_rate or self.stream.guessed_rate
        self.fps = float(rate) if rate and 0 < float(rate) <= 1000 else FALLBACK_FPS
        ctx = self.stream.codec_context
        if not ctx.width or not ctx.height:
            self.container.close()
            raise OpenError(spec.name, f"no video size found in the first {cfg.probe_s:g} s of the stream "
                             f"(raise live.probe_s)", "no video size found in the stream")
        # a stream that comes back at another size is scaled to the size it started with (the
        # allocation grid of a stream is fixed)
        self.width, self.height = size or (ctx.width, ctx.height)
        self._reformatter = VideoReformatter()
        self._read_timeout_s = cfg.read_timeout_s
        self._time_base = self.stream.time_base

    def frames(self) -> Iterator[tuple[float | None, np.ndarray, float | None]]:
        """Frames until the server closes the connection (returns) or nothing comes for longer
        than the read timeout (Stalled). PyAV's read timeout alone misses stalls up to twice the
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
                    raise Stalled(now - last)
                if not framed:
                    last = now
                if packet.pts is not None:
                    received[packet.pts] = time.time()
                    if len(received) > _RECEIVED_MAX:   # frames that never came out (corrupt, dropped)
                        del received[next(iter(received))]
                for pts, rgb in self._decode(packet):
                    # a decoder holds frames back (FFmpeg's frame threads about one per thread, NVDEC
                    # its reorder depth): the frame's arrival is its packet's, so latencies count the
                    # decoder's delay too
                    came = received.pop(pts, None) if pts is not None else None
                    yield self._seconds(pts), rgb, came
                    last, framed = time.monotonic(), True
        except av.ExitError:   # "Immediate exit requested": PyAV's read timeout interrupted FFmpeg
            raise Stalled(time.monotonic() - last) from None
        except (ConnectionResetError, BrokenPipeError):
            raise Lost("server closed the connection (connection reset)") from None
        except (av.FFmpegError, OSError, NvdecError) as e:
            raise Lost(f"stream error: {lowercase_first(reason_of(e))}") from None
        raise Lost("server closed the connection")

    def _decode(self, packet: av.Packet) -> Iterator[tuple[int | None, np.ndarray]]:
        """(pts in the stream's time base, or None; RGB (H, W, 3) at the connection's size, or None
        while the frames are not `wanted`) of the frames this packet completes (the demuxer's final
        empty packet flushes the decoder)."""
        for frame in packet.decode():
            if frame.is_corrupt:  # concealed packet loss: skip the frame, keep the stream
                continue
            if not self.wanted():
                yield frame.pts, None
                continue
            rgb = self._reformatter.reformat(frame, width=self.width, height=self.height, format="rgb24",
                                             **SCALING).to_ndarray()          # (H, W, 3)
            yield frame.pts, rgb

    def _seconds(self, pts: int | None) -> float | None:
        """pts in seconds, computed as PyAV's frame.time is (the stream's time base is the frames')."""
        tb = self._time_base
        return None if pts is None else float(pts) * tb.numerator / tb.denominator

    def close(self) -> None:
        self.container.close()
        self._route.close()


def _quiet_opencv() -> None:
    """OpenCV logs every capture backend it tries and fails (V4L2, its FFmpeg, Orbbec: ~10 lines for
    a missing camera) before we can say one line ourselves. Its logger goes silent (process-wide,
    as PyAV's FFmpeg log is); its FFmpeg reads OPENCV_FFMPEG_LOGLEVEL when that backend first starts."""
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")   # AV_LOG_QUIET
    import cv2

    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)


class CameraConnection(Connection):
    def __init__(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        _quiet_opencv()
        import cv2

        params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(cfg.open_timeout_s * 1000),
                  cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(cfg.read_timeout_s * 1000)]
        self.cap = cv2.VideoCapture(spec.target, cv2.CAP_ANY, params)
        if not self.cap.isOpened():
            self.cap.release()
            raise OpenError(spec.name, "cannot open the camera (no such device, busy, or no permission)",
                             "cannot open the camera")
        ok, bgr = self.cap.read()
        if not ok:
            self.cap.release()
            raise OpenError(spec.name, "the camera opened but delivers no frames", "the camera delivers no frames")
        self._first = bgr
        fps = self.cap.get(cv2.CAP_PROP_FPS)
        self.fps = float(fps) if 0 < fps <= 1000 else FALLBACK_FPS
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
                        raise Stalled(waited)
                    raise Lost("the camera stopped delivering frames (unplugged?)")
            if bgr.shape[:2] != (self.height, self.width):
                bgr = cv2.resize(bgr, (self.width, self.height), interpolation=cv2.INTER_AREA)
            msec = self.cap.get(cv2.CAP_PROP_POS_MSEC)
            yield (msec / 1000.0 if msec > 0 else None), cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), None
            bgr = None

    def close(self) -> None:
        self.cap.release()


class NvdecNetworkConnection(NetworkConnection):
    """A network stream decoded by NVDEC (sources/nvdec.py), frames as CUDA tensors: each frame is
    handed on as its own copy of the NV12 planes (nvdec.HeldNv12) and converted to RGB when the
    consumer takes it, together with the rest of its batch (LiveSource.take), not here: 32 streams
    converting frame by frame in their threads held the interpreter the VLM needs (H200, 32 live
    streams: 6.2 frames/s each, docs/performance.md).

    PyAV opens and demuxes the stream exactly as for NetworkConnection (its options, open and read
    timeouts, stall and drop detection, packet arrival times); the packets go to an NVDEC session
    instead of FFmpeg's decoder, so timestamps, latencies and every outage are counted as on the
    PyAV path. A stream NVDEC refuses before this connection's first frame (a codec or size the GPU
    lacks) is NvdecUnavailable, raised from frames(): the source ends with that line; with
    live.fallback, a warning instead, and PyAV decodes the connection from its first packet on (the
    packets until a first frame are kept for that). A stream back at another size is scaled on the
    GPU to the size it started with."""

    def __init__(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        from sources import nvdec

        nvdec.check_available(spec.name)
        super().__init__(spec, cfg, size)
        self._name, self._fallback, self._decoded = spec.name, cfg.fallback, 0
        # the packets before the first frame, for PyAV to decode if NVDEC refuses the stream then
        self._unframed: collections.deque[av.Packet] = collections.deque(maxlen=_RECEIVED_MAX)
        try:
            ctx = self.stream.codec_context
            layout = nvdec.nv12_layout(spec.name, ctx.name, ctx.pix_fmt, int(ctx.colorspace or 2),
                                       int(ctx.color_range or 0), ctx.height, ctx.width)
            self._feed: nvdec.PacketFeed | None = nvdec.PacketFeed(spec.name, self.stream)
        except BaseException:
            super().close()
            raise
        self._convert = nvdec.Nv12ToRgb(layout, spec.name, self._feed.decoder)

    def _decode(self, packet: av.Packet) -> Iterator[tuple[int | None, Any]]:
        if self._feed is None:   # NVDEC refused the stream: PyAV decodes (live.fallback)
            yield from super()._decode(packet)
            return
        if not self._decoded:
            self._unframed.append(_copy(packet, self.stream) if self._feed.consumes else packet)
        try:
            frames = self._feed.decode(packet)
        except NvdecError as e:
            if self._decoded:
                raise   # damage mid-stream: a lost stream, reconnected
            self._refused(str(e))
            for held in self._unframed:   # PyAV decodes from the connection's start, no frame lost
                yield from super()._decode(held)
            self._unframed.clear()
            return
        for pts, nv12 in frames:
            self._decoded += 1
            self._unframed.clear()
            if not self.wanted():   # no conversion nobody waits for: a live run's setup (its graph
                yield pts, None     # captures) would compete with every stream's for the interpreter
                continue
            try:   # copied out before the decoder's next call reuses nv12; converted when taken
                held = self._convert.hold(nv12, self._decoded - 1, (self.height, self.width))
            except SourceError as e:   # the stream changed size or format: reconnect, as at a new size
                raise Lost(f"stream error: {lowercase_first(str(e))}") from None
            yield pts, held

    def _refused(self, reason: str) -> None:
        """NVDEC cannot decode this stream: NvdecUnavailable, or with live.fallback a warning and PyAV."""

        refusal = NvdecUnavailable(self._name, f"NVDEC cannot decode this stream ({reason})")
        if not self._fallback:
            raise refusal
        warnings.warn(f"{self._name}: decoding with pyav: nvdec cannot be used ({refusal.reason})",
                      NvdecFallbackWarning, stacklevel=2)
        self._feed, feed = None, self._feed
        feed.close()

    def close(self) -> None:
        super().close()
        feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()


def _copy(packet: av.Packet, stream: av.video.stream.VideoStream) -> av.Packet:
    """A packet of the same data and timing, for PyAV's decoder (a bitstream filter empties the original)."""
    copy = av.Packet(bytes(packet))
    copy.pts, copy.dts, copy.time_base, copy.is_keyframe = packet.pts, packet.dts, packet.time_base, packet.is_keyframe
    copy.stream = stream
    return copy


def _network(spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> Connection:
    """A network stream's connection: NVDEC's where live.decoder asks for it (with live.fallback,
    PyAV's where NVDEC cannot be used, after a warning), else PyAV's."""
    if cfg.decoder != "nvdec":
        return NetworkConnection(spec, cfg, size)
    try:
        return NvdecNetworkConnection(spec, cfg, size)
    except NvdecUnavailable as e:
        if not cfg.fallback:
            raise
        warnings.warn(f"{spec.name}: decoding with pyav: nvdec cannot be used ({e.reason})", NvdecFallbackWarning,
                      stacklevel=2)
        return NetworkConnection(spec, cfg, size)


class FileConnection(Connection):
    """A video file paced to its own timestamps, like a camera that ends when the file does (decoded
    as live.decoder says: NVDEC's frames stay on the GPU)."""

    def __init__(self, spec: SourceSpec, cfg: LiveConfig, size: tuple[int, int] | None) -> None:
        from sources.video import open_video

        self.video = open_video(spec.target, stream_id=spec.stream_id, decoder=cfg.decoder, fallback=cfg.fallback)
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
        raise Lost("end of file")

    @property
    def truncated(self) -> bool:
        return self.video.truncated

    def close(self) -> None:
        self.video.close()


CONNECTIONS = {"network": _network, "camera": CameraConnection, "file": FileConnection}


def reason_of(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def lowercase_first(text: str) -> str:
    """FFmpeg's "Connection refused" inside a sentence: "connection refused" (acronyms stay)."""
    return text[:1].lower() + text[1:] if text[1:2].islower() else text
