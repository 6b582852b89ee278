"""Checking and probing video files: argument and file checks, opening a container and picking
its video stream, what the container says (VideoInfo), rotation, FFmpeg / decord error lines, and
decord's arrays as numpy without a copy. sources/video.py's decoders build on these."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import av
import numpy as np

from sources.errors import SourceError

Decoder = Literal["pyav", "decord", "nvdec"]
DECODERS: tuple[str, ...] = ("pyav", "decord", "nvdec")

_TS_PACKET_SIZES = (188, 192, 204)  # plain, M2TS (timecode prefix), with Reed-Solomon bytes
# Larger frames are refused: DCI 8K (8192x4320). One RGB frame of that is 106 MB; a frame of
# 8000x8000 (192 MB) made every buffer of the pipeline, sized in frames, run to gigabytes.
DEFAULT_MAX_PIXELS = 8192 * 4320


@dataclass(frozen=True)
class VideoInfo:
    """What the container says about a video file (sizes are after rotation)."""

    width: int
    height: int
    fps: float                 # average frame rate
    duration_s: float | None   # length of the video stream, None if the container does not say
    frame_count: int | None    # from the container, else estimated as duration_s * fps
    codec: str
    rotation: int = 0          # counter-clockwise degrees applied to make frames upright
    pixel_format: str | None = None  # of the decoded frames (PyAV's name, e.g. "yuv420p")
    colorspace: int = 2        # FFmpeg AVColorSpace of the first frame (2: unspecified)
    color_range: int = 0       # FFmpeg AVColorRange of the first frame (1: limited, 2: full, 0: unspecified)


def _check_args(path: Path, decoder: object, fps: object, start_s: object, end_s: object,
                max_frames: object, stream_id: object, threads: object = 0,
                max_pixels: object = DEFAULT_MAX_PIXELS) -> None:
    def bad(problem: str) -> SourceError:
        return SourceError(f"{path}: {problem}")

    if decoder not in DECODERS:
        raise bad(f"decoder={decoder!r} is not supported; allowed: {', '.join(DECODERS)}")
    if fps is not None and not (_is_number(fps) and 0 < fps < math.inf):
        raise bad(f"fps={fps!r} is out of range; allowed: (0, inf), or None for every frame")
    if not (_is_number(start_s) and 0 <= start_s < math.inf):
        raise bad(f"start_s={start_s!r} is out of range; allowed: [0, inf)")
    if end_s is not None and not (_is_number(end_s) and end_s > start_s):
        raise bad(f"end_s={end_s!r} must be greater than start_s={start_s!r} (or None for the end)")
    if max_frames is not None and not (isinstance(max_frames, (int, np.integer))
                                       and not isinstance(max_frames, bool) and max_frames >= 1):
        raise bad(f"max_frames={max_frames!r} is out of range; allowed: integers >= 1, or None")
    if stream_id is not None and not (isinstance(stream_id, str) and stream_id):
        raise bad(f"stream_id={stream_id!r} must be a non-empty string, or None for the file stem")
    if not (isinstance(threads, (int, np.integer)) and not isinstance(threads, bool) and 0 <= threads <= 256):
        raise bad(f"threads={threads!r} is out of range; allowed: integers in [0, 256], 0 for the decoder's choice")
    if max_pixels is not None and not (isinstance(max_pixels, (int, np.integer)) and not isinstance(max_pixels, bool)
                                       and max_pixels >= 1):
        raise bad(f"max_pixels={max_pixels!r} is out of range; allowed: integers >= 1, or None for no limit")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_file(path: Path) -> None:
    """A SourceError unless `path` is a non-empty file (what every file source checks first)."""
    if not path.exists():
        raise SourceError(f"{path}: no such file")
    if path.is_dir():
        raise SourceError(f"{path}: is a directory, not a video file")
    if path.stat().st_size == 0:
        raise SourceError(f"{path}: file is empty (0 bytes)")


def _check_start(path: Path, start_s: float, duration_s: float | None) -> None:
    if duration_s is not None and start_s >= duration_s:
        raise SourceError(f"{path}: start_s={start_s} is past the end of the video ({duration_s:.3f} s)")


# FFmpeg decoders that render text or karaoke graphics as "video": a text file named .nfo/.ans/.cdg
# opens as one, and would be answered as footage
NOT_VIDEO_CODECS = frozenset({"ansi", "bintext", "xbin", "idf", "cdgraphics"})


def _open_container(path: Path) -> tuple[av.container.InputContainer, av.video.stream.VideoStream]:
    """Open with PyAV and pick the video stream (cover art in audio files does not count)."""
    try:
        container = av.open(str(path))
    except OSError as e:  # PyAV's OS errors (permissions, ...) are also FFmpegErrors: catch them first
        raise SourceError(f"{path}: cannot open ({e.strerror or e})") from e
    except av.FFmpegError as e:
        raise SourceError(f"{path}: not a readable video ({_reason(e)})") from e
    videos = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
    if not videos:
        kinds = ", ".join(sorted({s.type for s in container.streams})) or "none"
        container.close()
        raise SourceError(f"{path}: no video stream (streams found: {kinds})")
    codec = videos[0].codec_context.codec
    if codec.name in NOT_VIDEO_CODECS:
        container.close()
        raise SourceError(f"{path}: not a video, FFmpeg would draw it as {codec.long_name} ({codec.name!r}): "
                          f"text or karaoke graphics, not camera or film footage")
    return container, videos[0]


def _first_frame(path: Path, container: av.container.InputContainer,
                 stream: av.video.stream.VideoStream) -> av.VideoFrame:
    try:
        for frame in container.decode(stream):
            return frame
    except av.FFmpegError as e:
        raise SourceError(f"{path}: not a readable video ({_reason(e)})") from e
    raise SourceError(f"{path}: not a readable video (no frame could be decoded)")


def _video_info(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                first: av.VideoFrame) -> VideoInfo:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate:
        raise SourceError(f"{container.name}: the container gives no frame rate for the video stream")
    fps, duration = float(rate), _duration_s(container, stream)
    rotation = _rotation(first, stream)
    width, height = (first.height, first.width) if rotation % 180 else (first.width, first.height)
    if stream.frames:
        frame_count = int(stream.frames)
    else:
        frame_count = None if duration is None else round(duration * fps)
    return VideoInfo(width, height, fps, duration, frame_count, stream.codec_context.name, rotation,
                     first.format.name, int(first.colorspace), int(first.color_range))


def _duration_s(container: av.container.InputContainer, stream: av.video.stream.VideoStream) -> float | None:
    """The video stream's own duration where the container has one (so a longer audio track does
    not count), else Matroska's per-track DURATION tag, else the container's duration."""
    if stream.duration is not None:
        return float(stream.duration * stream.time_base)
    tag = re.fullmatch(r"(\d+):(\d+):(\d+(?:\.\d*)?)", stream.metadata.get("DURATION", ""))
    if tag:
        return int(tag[1]) * 3600 + int(tag[2]) * 60 + float(tag[3])
    return None if container.duration is None else container.duration / av.time_base


def _ends_mid_packet(path: Path, container: av.container.InputContainer) -> bool:
    """MPEG-TS packets have a fixed size and TS declares no duration: a cut file ends mid-packet."""
    size = path.stat().st_size
    return container.format.name == "mpegts" and all(size % n for n in _TS_PACKET_SIZES)


def _rotation(frame: av.VideoFrame, stream: av.video.stream.VideoStream) -> int:
    """Counter-clockwise degrees (0, 90, 180, 270) that make the frame upright."""
    degrees = float(frame.rotation)  # display matrix, which FFmpeg attaches to every frame
    if not degrees and "rotate" in stream.metadata:  # legacy tag, clockwise
        try:
            degrees = -float(stream.metadata["rotate"])
        except ValueError:
            degrees = 0.0
    return round(degrees / 90) % 4 * 90


def _upright(rgb: np.ndarray, rotation: int) -> np.ndarray:
    """(H, W, 3) -> upright (H', W', 3), C-contiguous (copies only when rotating or row-padded)."""
    if rotation:
        rgb = np.rot90(rgb, rotation // 90)
    return np.ascontiguousarray(rgb)


def _reason(error: BaseException) -> str:
    """One line from an FFmpeg / decord error (decord's carry a C++ backtrace)."""
    text = getattr(error, "strerror", None) or str(error) or type(error).__name__
    line = text.strip().splitlines()[0]
    line = re.sub(r"^(\[[\d:]+\] \S+:\d+: )+", "", line)  # decord's "[time] file.cc:line: " prefix
    # decord's failed FFmpeg call, "Check failed: avcodec_send_packet(...) >= 0 (-1094995529 vs. 0) ...":
    # FFmpeg's own words for the code
    failed = re.match(r"Check failed: (\w+)\(.*\) >= 0 \((-\d+) vs\. 0\)", line)
    if failed:
        try:
            av.error.err_check(int(failed[2]))
        except av.FFmpegError as e:
            line = f"{e.strerror} ({failed[1]})"
    return line[:200]


class _DecordMemory:
    """Keeps a decord NDArray alive under numpy views of its memory (numpy holds this as `base`)."""

    def __init__(self, batch: object, data: int) -> None:
        self._batch = batch
        self.__array_interface__ = {"shape": tuple(batch.shape), "typestr": "|u1", "data": (data, False),
                                    "version": 3}


def _decord_numpy(batch: object) -> np.ndarray:
    """A decord uint8 NDArray as a writable numpy array over the same memory. asnumpy() copies it
    into fresh memory (page faults included: a large share of get_batch's own time), and every
    reader copies the frames on anyway (into a batch, a shared slot). Not np.from_dlpack: numpy
    marks DLPack imports read-only, and frames from asnumpy() were writable."""
    tensor = batch.handle.contents  # DLTensor: data, ctx, ndim, dtype, shape, strides, byte_offset
    compact = not tensor.strides  # NULL strides: row-major and dense
    if not (compact and tensor.data and batch.dtype == "uint8" and tensor.ctx.device_type == 1):  # kDLCPU
        return batch.asnumpy()
    return np.asarray(_DecordMemory(batch, tensor.data + tensor.byte_offset))
