"""Video files as streams of Frames, decoded by PyAV (default, threaded), decord, or the GPU's NVDEC.

    with open_video("clip.mp4", fps=2.0, end_s=30.0) as video:
        for frame in video:            # sources.frame.Frame: stream_id, index, pts_s, rgb (H, W, 3)
            ...
        video.truncated                # True when damage stopped decoding early (a warning says so)

Every decoder gives the same frames: index is the frame's index in the decoded stream (before
sampling), pts_s its presentation time in seconds from the start of the stream, rgb an upright
(rotation metadata applied) uint8 C-contiguous array. Sampling to a target fps keeps the first
frame at or after each 1/fps tick (ticks start at start_s), so variable frame rates are
sampled on real timestamps and no frame is ever repeated. NVDEC's frames stay on the GPU
(Frame.rgb a CUDA tensor) and equal PyAV's within the colour conversion's rounding (sources/yuv.py).
"""
from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from sources.errors import NvdecFallbackWarning, SourceError, VideoTruncatedWarning
from sources.frame import Frame
from sources.nvdec import NvdecError, NvdecUnavailable
from sources.sampling import NONREF_CODECS, PTS_TOL_S as _PTS_TOL_S, NonrefSkip, Sampler as _Sampler
from sources.video_probe import (DECODERS, DEFAULT_MAX_PIXELS, NOT_VIDEO_CODECS, Decoder, VideoInfo, _check_args,
                                 _check_start, _decord_numpy, _duration_s, _ends_mid_packet, _first_frame,
                                 _open_container, _reason, _upright, _video_info, check_file)

__all__ = ["DECODERS", "DEFAULT_MAX_PIXELS", "NOT_VIDEO_CODECS", "Decoder", "NvdecUnavailable", "VideoInfo",
           "VideoSource", "check_file", "open_video", "probe"]


# Decoding that ends this much before the end the file declares means the file was cut short
# (the slack absorbs a video track that is a little shorter than the container's audio).
_MISSING_TAIL_S = 0.5
_MISSING_TAIL_FRAMES = 3
# Without decode timestamps, B-frames can present at most this long after a later packet.
_REORDER_SLACK_S = 1.0
# decord decodes each get_batch chunk into one array: bound it so 4K input stays at ~64 MB.
_DECORD_CHUNK_BYTES = 64 << 20
_DECORD_MAX_CHUNK = 32
_DECORD_NOPTS_S = 1e9


def probe(path: str | Path) -> VideoInfo:
    """Read a video file's size, frame rate, duration, frame count and codec (decodes one frame)."""
    path = Path(path)
    check_file(path)
    container, stream = _open_container(path)
    with container:
        first = _first_frame(path, container, stream)
        return _video_info(container, stream, first)


def open_video(path: str | Path, *, decoder: Decoder = "pyav", fps: float | None = None,
               start_s: float = 0.0, end_s: float | None = None, max_frames: int | None = None,
               stream_id: str | None = None, threads: int = 0,
               max_pixels: int | None = DEFAULT_MAX_PIXELS, fallback: bool = False) -> VideoSource:
    """Open a video file for reading as Frames; see the module docstring for the semantics.

    decoder:    "pyav" (threaded FFmpeg decode, default), "decord", or "nvdec" (the GPU's decoders
                through PyNvVideoCodec, frames as CUDA tensors: sources/nvdec.py).
    fps:        target frame rate (first frame at or after each 1/fps tick); None keeps every frame.
    start_s, end_s: keep frames with start_s <= pts_s < end_s.
    max_frames: stop after this many frames.
    stream_id:  Frame.stream_id; defaults to the file stem.
    threads:    decoding threads; 0 (default): the decoder's own choice (FFmpeg: up to 16 for
                frame + slice threading; decord: its default). Several decoders on one host (a
                batch's videos in flight, Ray actors) may want fewer each.
    max_pixels: refuse videos whose frames have more pixels (width x height) than this (default:
                DCI 8K, 8192x4320); None: no limit.
    fallback:   decoder="nvdec" only: where NVDEC cannot decode this video (no GPU, no PyNvVideoCodec,
                a codec or format it lacks), warn once naming why and decode with PyAV instead.
                Without it that is a NvdecUnavailable (a SourceError).
    Raises SourceError (one line naming the path) for bad arguments and unreadable files.
    """
    path = Path(path)
    _check_args(path, decoder, fps, start_s, end_s, max_frames, stream_id, threads, max_pixels)
    check_file(path)
    kwargs = dict(fps=None if fps is None else float(fps), start_s=float(start_s),
                  end_s=None if end_s is None else float(end_s), max_frames=max_frames,
                  stream_id=stream_id or path.stem, threads=int(threads), max_pixels=max_pixels)
    if decoder != "nvdec":
        return (_PyAVSource if decoder == "pyav" else _DecordSource)(path, **kwargs)
    try:
        return _NvdecSource(path, **kwargs)
    except NvdecUnavailable as e:
        if not fallback:
            raise
        warnings.warn(f"{path}: decoding with pyav: nvdec cannot be used ({e.reason})", NvdecFallbackWarning,
                      stacklevel=2)
        return _PyAVSource(path, **kwargs)


class VideoSource:
    """A video file as a one-pass iterable of Frames and a context manager (build with open_video).

    stream_id, fps (of the produced frames), source_fps, width, height (upright), info (VideoInfo),
    frame_count (estimate of the frames this source will produce, None if unknown),
    truncated (set, with a VideoTruncatedWarning, when damage stopped decoding early).
    """

    decoder: str
    _nonref: NonrefSkip | None = None   # PyAV, a target fps: frames left undecoded (sources/sampling.py)

    def __init__(self, path: Path, *, fps: float | None, start_s: float, end_s: float | None,
                 max_frames: int | None, stream_id: str, threads: int = 0,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS) -> None:
        self.path, self.stream_id, self.threads, self.max_pixels = path, stream_id, threads, max_pixels
        self.start_s, self.end_s, self.max_frames = start_s, end_s, max_frames
        self.truncated = False
        self._target_fps = fps
        self._damage: str | None = None
        self._iterated = self._closed = False
        try:
            self.info = self._open()
        except BaseException:
            self.close()
            raise
        self.source_fps = self.info.fps
        self.fps = self.source_fps if fps is None else min(fps, self.source_fps)
        self.width, self.height = self.info.width, self.info.height
        self.frame_count = self._estimate_frame_count()

    def _open(self) -> VideoInfo:
        raise NotImplementedError

    def _check_size(self, width: int, height: int) -> None:
        """Refuse frames above max_pixels before decoding any (sizes from the stream header)."""
        if self.max_pixels is not None and width * height > self.max_pixels:
            raise SourceError(f"{self.path}: frames of {width}x{height} ({width * height / 1e6:.1f} megapixels) "
                              f"are above the limit of {self.max_pixels / 1e6:.1f} megapixels "
                              f"(max_pixels={self.max_pixels})")

    def _frames(self) -> Iterator[Frame]:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True

    def __iter__(self) -> Iterator[Frame]:
        if self._closed:
            raise RuntimeError(f"{self.path}: the video source is closed")
        if self._iterated:
            raise RuntimeError(f"{self.path}: a VideoSource is read once; open the video again to re-read it")
        self._iterated = True
        return self._frames()

    def __enter__(self) -> VideoSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"VideoSource({str(self.path)!r}, decoder={self.decoder!r}, {self.width}x{self.height}, "
                f"fps={self.fps:g}, frame_count={self.frame_count})")

    def _sampler(self) -> _Sampler:
        return _Sampler(self._target_fps, self.start_s, self.end_s, self.max_frames)

    def _estimate_frame_count(self) -> int | None:
        info = self.info
        if info.duration_s is None:
            return self.max_frames
        if self._target_fps is None and self.start_s == 0 and self.end_s is None and info.frame_count:
            count = info.frame_count
        else:
            span = max(0.0, min(info.duration_s, self.end_s or math.inf) - self.start_s)
            count = math.ceil(span * self.fps - 1e-6)
        return count if self.max_frames is None else min(count, self.max_frames)

    def _sample(self, sampler: _Sampler, timed: Iterator[tuple[int, float, Any]]) -> Iterator[tuple[int, float, Any]]:
        """The (index, pts_s, frame) of `timed` (every decoded frame at or after start_s) that
        sampler keeps; at the stream's end (not at end_s or max_frames), _finish's damage check."""
        last_pts = None
        for index, pts_s, frame in timed:
            last_pts = pts_s
            keep = sampler.keep(pts_s)
            if keep is None:
                return
            if keep:
                yield index, pts_s, frame
                if sampler.full:
                    return
        self._finish(last_pts)

    def _finish(self, last_pts_s: float | None) -> None:
        """At the end of the stream: flag and warn if decoding stopped short of the declared end."""
        skipped_s = None if self._nonref is None else self._nonref.last_s   # undecoded frames reached it too
        last_pts_s = max((t for t in (last_pts_s, skipped_s) if t is not None), default=None)
        reason = self._damage or self._missing_tail(last_pts_s)
        if reason is None:
            return
        self.truncated = True
        where = "before its first frame" if last_pts_s is None else f"after {last_pts_s:.3f} s"
        warnings.warn(f"{self.path}: video is truncated or damaged ({reason}); stopped {where}",
                      VideoTruncatedWarning, stacklevel=3)

    def _missing_tail(self, last_pts_s: float | None) -> str | None:
        declared = self.info.duration_s
        if declared is None:
            return None
        expected = declared if self.end_s is None else min(declared, self.end_s)
        reached = self.start_s if last_pts_s is None else last_pts_s + 1.0 / self.source_fps
        if expected - reached > max(_MISSING_TAIL_S, _MISSING_TAIL_FRAMES / self.source_fps):
            return f"frames end at {reached:.2f} s but the file declares {declared:.2f} s"
        return None


class _PyAVSource(VideoSource):
    decoder = "pyav"

    def _open(self) -> VideoInfo:
        self._open_stream()
        self._check_size(self._first.width, self._first.height)
        return _video_info(self._container, self._stream, self._first)

    def _open_stream(self) -> None:
        """Open the container, seek to start_s, start the decoder and decode the first frame (_first)."""
        self._container, stream = _open_container(self.path)
        self._stream = stream
        self._check_size(stream.codec_context.width, stream.codec_context.height)
        self._start_decoder(stream)
        self._ends_mid_packet = _ends_mid_packet(self.path, self._container)
        self._held_back_pts: int | None = None
        self._t0 = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        _check_start(self.path, self.start_s, _duration_s(self._container, stream))
        self._index_base = 0
        if self.start_s > 0:
            self._index_base = self._count_frames_before(self.start_s - _PTS_TOL_S)
            try:
                self._container.seek(int((self.start_s + self._t0) / stream.time_base), stream=stream)
            except av.FFmpegError as e:
                raise SourceError(f"{self.path}: cannot seek to start_s={self.start_s} ({_reason(e)})") from e
        self._decoded = self._decode()
        self._first = next(self._decoded, None)
        if self._first is None:
            raise SourceError(f"{self.path}: not a readable video ({self._damage or 'no frame could be decoded'})")

    def _start_decoder(self, stream: av.video.stream.VideoStream) -> None:
        stream.thread_type = "AUTO"  # frame + slice threads: several times faster on multi-core CPUs
        if self.threads:
            stream.thread_count = self.threads
        if self._target_fps is not None and stream.codec_context.name in NONREF_CODECS:
            self._nonref = NonrefSkip(stream, self.start_s - _PTS_TOL_S)   # frames no one keeps or needs

    def _decode_packet(self, packet: av.Packet) -> list[Any]:
        """The frames one packet completes (the final empty packet flushes the decoder); raises
        one of _DECODE_ERRORS."""
        if self._nonref is not None:
            self._nonref.before(packet)
        return packet.decode()

    def _flush_decoder(self) -> list[Any]:
        return self._stream.codec_context.decode(None)

    _DECODE_ERRORS: tuple[type[BaseException], ...] = (av.FFmpegError,)

    def close(self) -> None:
        super().close()
        if getattr(self, "_container", None) is not None:
            self._container.close()
            self._container = None

    def _count_frames_before(self, limit_s: float) -> int:
        """Frames presented before limit_s, counted on packet timestamps, so that indices after a
        seek match a decode from the start (demuxing is cheap next to decoding)."""
        stream = self._stream
        tb, t0 = float(stream.time_base), stream.start_time or 0
        count = 0
        try:
            for packet in self._container.demux(stream):
                if packet.pts is None:
                    continue
                order = packet.dts if packet.dts is not None else packet.pts
                slack = 0.0 if packet.dts is not None else _REORDER_SLACK_S
                if (order - t0) * tb >= limit_s + slack:  # pts >= dts: no later packet comes earlier
                    break
                count += (packet.pts - t0) * tb < limit_s
        except av.FFmpegError:
            pass  # damage before start_s: the seek and decode that follow report it
        return count

    def _packets(self) -> Iterator[av.Packet]:
        """Demuxed packets. A cut MPEG-TS file's last packet is incomplete (the demuxer does not
        flag it): hold it back and note the damage."""
        packets = self._container.demux(self._stream)
        if not self._ends_mid_packet:
            yield from packets  # ends with an empty packet that flushes the decoder
            return
        held = None
        for packet in packets:
            if packet.size == 0:
                break
            if held is not None:
                yield held
            held = packet
        if held is not None:
            self._damage, self._held_back_pts = "the MPEG-TS file ends inside a packet", held.pts

    def _decode(self) -> Iterator[av.VideoFrame]:
        """Decoded frames in presentation order. On damage (a decoder error, a packet the demuxer or a
        frame the decoder flags corrupt) note why, hand out what the decoder holds from before it, stop."""
        cut = None  # pts of the damaged packet: frames presented from there on are not trusted
        try:
            for packet in self._packets():
                if packet.is_corrupt:
                    self._damage, cut = "corrupt or incomplete packet", packet.pts
                    break
                pts = packet.pts   # before decoding: nvdec's bitstream filter empties the packet
                try:
                    frames = self._decode_packet(packet)
                except self._DECODE_ERRORS as e:
                    self._damage, cut = _reason(e), pts
                    break
                intact = [f for f in frames if not f.is_corrupt]  # concealed decode errors
                yield from intact
                if len(intact) < len(frames):
                    self._damage = "the decoder reported a corrupt frame"
                    cut = min(f.pts for f in frames if f.is_corrupt)
                    break
        except av.FFmpegError as e:  # the demuxer's own errors
            self._damage = _reason(e)
        cut = self._held_back_pts if cut is None else cut
        if self._damage is None:
            return
        try:
            for frame in self._flush_decoder():
                if cut is None or frame.pts is None or frame.pts < cut:
                    yield frame
        except self._DECODE_ERRORS:
            pass

    def decoded_frames(self) -> Iterator[tuple[int, float, av.VideoFrame]]:
        """(index, pts_s, frame) of the kept frames as FFmpeg decoded them, before any conversion to
        RGB or rotation: for callers that convert elsewhere (the decode worker hands YUV planes to
        the GPU). Read once, like iterating the source."""
        if self._closed or self._iterated:
            iter(self)  # raises the same errors
        self._iterated = True
        return self._kept()

    def _kept(self) -> Iterator[tuple[int, float, av.VideoFrame]]:
        start = self.start_s - _PTS_TOL_S
        # frame.time is not used: frames flushed after damage carry no time_base
        time_base, start_pts = float(self._stream.time_base), self._stream.start_time or 0
        sampler, skip = self._sampler(), self._nonref
        frames, self._first = itertools.chain((self._first,), self._decoded), None

        def timed() -> Iterator[tuple[int, float, av.VideoFrame]]:
            index = self._index_base - 1
            for frame in frames:
                if skip is not None:
                    skip.came_out(frame.pts)
                t = None if frame.pts is None else (frame.pts - start_pts) * time_base
                if t is not None and t < start:
                    continue  # decoded from the keyframe before start_s
                index += 1   # (+ the frames skipped before it: their places in the full stream)
                at = index + (skip.skipped if skip is not None else 0)
                yield at, at / self.source_fps if t is None else t, frame

        if skip is not None:
            skip.arm(start)
        for kept in self._sample(sampler, timed()):
            if skip is not None and sampler.period is not None:
                skip.arm(sampler.next_tick - _PTS_TOL_S)   # nothing before the next tick will be kept
            yield kept

    def _frames(self) -> Iterator[Frame]:
        rotation = self.info.rotation
        # one swscale context for the whole stream: frame.to_ndarray builds one per frame (~2x slower)
        reformatter = VideoReformatter()
        for index, pts_s, frame in self._kept():
            try:
                rgb = reformatter.reformat(frame, format="rgb24").to_ndarray()  # (H, W, 3)
            except av.FFmpegError as e:
                raise SourceError(f"{self.path}: cannot convert frame {index} ({frame.format.name}) "
                                  f"to RGB ({_reason(e)})") from e
            yield Frame(self.stream_id, index, pts_s, _upright(rgb, rotation))


class _DecordSource(VideoSource):
    decoder = "decord"

    def _open(self) -> VideoInfo:
        try:
            import decord
        except ImportError as e:
            raise SourceError(f"{self.path}: decoder='decord' needs the decord package "
                              f"(pip install decord); or use decoder='pyav'") from e
        self._error_types = (decord.DECORDError, RuntimeError)
        # decord's own FFmpeg logs straight to fd 2 (43 "[h264 @ 0x...]" lines on one damaged file);
        # damage is reported once, as a VideoTruncatedWarning, like PyAV's (whose log is off)
        decord.logging.set_level(decord.logging.QUIET)
        # decord exposes neither rotation nor the declared duration: PyAV reads the header
        container, stream = _open_container(self.path)
        with container:
            self._check_size(stream.codec_context.width, stream.codec_context.height)
            first = _first_frame(self.path, container, stream)
            self._check_size(first.width, first.height)
            info = _video_info(container, stream, first)
            container_format = container.format.name
        _check_start(self.path, self.start_s, info.duration_s)
        # decord 0.6 returns frames shifted against their timestamps in MPEG-TS (or fails on them)
        if container_format == "mpegts":
            raise SourceError(f"{self.path}: decord misreads MPEG-TS files; use decoder='pyav'")
        # decord 0.6 applies the display matrix itself: 180 degrees correctly, while 90 / 270 crash
        # (it keeps the unrotated frame size for the rotated image)
        if info.rotation in (90, 270):
            raise SourceError(f"{self.path}: decord cannot decode videos rotated by {info.rotation} degrees; "
                              f"use decoder='pyav'")
        try:
            self._reader = decord.VideoReader(str(self.path), ctx=decord.cpu(0), num_threads=self.threads)
            count = len(self._reader)
            pts = self._reader.get_frame_timestamp(np.arange(count))[:, 0].astype(np.float64)  # (N,)
        except self._error_types as e:
            raise SourceError(f"{self.path}: decord cannot read this video ({_reason(e)}); "
                              f"try decoder='pyav'") from e
        # decord turns a missing pts into ~9.2e15 s (AV_NOPTS_VALUE): fall back to index / fps there
        missing = ~np.isfinite(pts) | (np.abs(pts) > _DECORD_NOPTS_S)
        self._pts = np.where(missing, np.arange(count) / info.fps, pts)  # (N,)
        self._indices, self._cut_short = self._select(self._pts)
        self._chunk = int(np.clip(_DECORD_CHUNK_BYTES // (3 * info.width * info.height), 1, _DECORD_MAX_CHUNK))
        self._no_frames = np.empty((0, info.height, info.width, 3), np.uint8)
        self._pending = self._read(self._indices[:self._chunk])
        if self._indices and len(self._pending[0]) == 0:
            raise SourceError(f"{self.path}: decord cannot decode this video ({self._pending[1]}); "
                              f"try decoder='pyav'")
        return info

    def _estimate_frame_count(self) -> int:
        return len(self._indices)  # exact: decord indexes every frame when it opens the file

    def close(self) -> None:
        super().close()
        self._reader = None
        self._pending = (None, None)

    def _select(self, pts: np.ndarray) -> tuple[list[int], bool]:
        """Indices the sampler keeps and whether it stopped before the last frame."""
        sampler, kept = self._sampler(), []
        for i, t in enumerate(pts.tolist()):
            keep = sampler.keep(t)
            if keep is None:
                return kept, True
            if keep:
                kept.append(i)
                if sampler.full:
                    return kept, i < len(pts) - 1
        return kept, False

    def _read(self, indices: list[int]) -> tuple[np.ndarray, str | None]:
        """Decode a chunk, (n, H, W, 3); on an error keep the frames before the first one that fails."""
        if not indices:
            return self._no_frames, None
        try:
            return _decord_numpy(self._reader.get_batch(indices)), None
        except self._error_types as e:
            intact = []
            for i in indices:
                try:
                    intact.append(_decord_numpy(self._reader.get_batch([i]))[0])
                except self._error_types:
                    break
            return (np.stack(intact) if intact else self._no_frames), _reason(e)

    def decoded_chunks(self) -> Iterator[tuple[list[int], list[float], np.ndarray]]:
        """(indices, pts_s, rgb (n, H, W, 3)) per chunk that decord decoded at once, the same frames
        as iterating the source: for callers that copy whole chunks elsewhere (the decode worker
        fills its shared slots with them). Read once, like iterating the source."""
        if self._closed or self._iterated:
            iter(self)  # raises the same errors
        self._iterated = True
        return self._chunks()

    def _chunks(self) -> Iterator[tuple[list[int], list[float], np.ndarray]]:
        last_pts = None
        for start in range(0, len(self._indices), self._chunk):
            chunk = self._indices[start:start + self._chunk]
            batch, damage = self._pending if start == 0 else self._read(chunk)
            self._pending = (self._no_frames, None)
            if len(batch):
                chunk = chunk[:len(batch)]
                pts = self._pts[chunk].tolist()
                last_pts = pts[-1]
                yield chunk, pts, batch
            if damage is not None:
                self._damage = damage
                self._finish(last_pts)
                return
        if not self._cut_short:
            self._finish(float(self._pts[-1]) if len(self._pts) else None)

    def _frames(self) -> Iterator[Frame]:
        for indices, pts, batch in self._chunks():
            for i, pts_s, rgb in zip(indices, pts, batch):
                yield Frame(self.stream_id, i, pts_s, rgb)  # a row of a (n, H, W, 3) C-order batch


class _Nv12Frame(NamedTuple):
    """A frame NVDEC decoded: its pts (the packet's, in the stream's time base) and NV12 planes on the
    GPU, valid until the decoder's next call (sources/nvdec.py)."""

    pts: int | None
    nv12: Any
    is_corrupt = False   # NVDEC conceals damage in a frame; a failed decode is an NvdecError


class _NvdecSource(_PyAVSource):
    """Decoded by NVDEC (sources/nvdec.py: a decoder session of its own), frames as CUDA tensors.

    PyAV demuxes as for decoder pyav (seek to start_s, indices, a cut MPEG-TS file's held-back last
    packet, corrupt packets) and nvdec.PacketFeed hands the packets to NVDEC, whose frames carry the
    packets' pts: timestamps and sampling are the PyAV path's. The header (rotation, declared
    duration, colour description) comes from a first frame PyAV decodes, before NVDEC starts. Damage:
    a decoder error after the first frame stops decoding (VideoTruncatedWarning), as a missing tail
    does; before it, the stream is one NVDEC does not take (NvdecUnavailable). The kept frames are
    converted to RGB nvdec.CONVERT_BATCH at a time: a frame is handed on once its batch is done."""

    decoder = "nvdec"
    _DECODE_ERRORS = (NvdecError,)

    def _open(self) -> VideoInfo:
        from sources import nvdec

        nvdec.check_available(str(self.path))
        container, stream = _open_container(self.path)
        with container:
            self._check_size(stream.codec_context.width, stream.codec_context.height)
            first = _first_frame(self.path, container, stream)
            self._check_size(first.width, first.height)
            info = _video_info(container, stream, first)
        self._layout = nvdec.nv12_layout(str(self.path), info.codec, info.pixel_format, info.colorspace,
                                         info.color_range, first.height, first.width, info.rotation)
        try:
            self._open_stream()
        except SourceError as e:
            if self._damage is None or isinstance(e, NvdecUnavailable):
                raise
            # the decoder refused the stream before its first frame: not damage, a stream NVDEC lacks
            raise NvdecUnavailable(str(self.path), f"NVDEC cannot decode this stream ({self._damage})") from e
        return info

    def _start_decoder(self, stream: av.video.stream.VideoStream) -> None:
        from sources import nvdec

        self._feed = nvdec.PacketFeed(str(self.path), stream)
        self._convert = nvdec.Nv12ToRgb(self._layout, str(self.path), self._feed.decoder, nvdec.CONVERT_BATCH)

    def _decode_packet(self, packet: av.Packet) -> list[_Nv12Frame]:
        return [_Nv12Frame(pts, nv12) for pts, nv12 in self._feed.decode(packet)]

    def _flush_decoder(self) -> list[_Nv12Frame]:
        return [_Nv12Frame(pts, nv12) for pts, nv12 in self._feed.decode(None)]

    def close(self) -> None:
        super().close()
        feed, self._feed = getattr(self, "_feed", None), None
        if feed is not None:
            feed.close()

    def _frames(self) -> Iterator[Frame]:
        pending: list[tuple[int, float]] = []   # (index, pts_s) of the frames in the batch being filled

        def batch() -> Iterator[Frame]:
            rgb = self._convert.take()                                   # (n, H', W', 3)
            for k, (index, pts_s) in enumerate(pending):
                yield Frame(self.stream_id, index, pts_s, rgb[k])
            pending.clear()

        for index, pts_s, frame in self._kept():
            self._convert.add(frame.nv12, index)   # copied out before the decoder's next call
            pending.append((index, pts_s))
            if self._convert.full:
                yield from batch()
        if pending:
            yield from batch()
