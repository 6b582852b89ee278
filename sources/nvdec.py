"""NVDEC, the GPU's own video decoders, through NVIDIA's PyNvVideoCodec (`pip install
arr-coc-video[nvdec]`): the decode=nvdec path of sources/video.py and sources/live_connections.py.

Why: FFmpeg's software H.264 decode costs a CPU core ~7 ms per 720p frame and ~13 ms per 1080p one;
NVDEC ~1 ms of CPU, and its frames are already in GPU memory, where the texture stage wants them.

What this module owns is the small interface the sources use, `NvdecSession`: one decoder session
over one demuxed input, yielding (pts, NV12 frame on the device). Each source opens its own
session; the driver spreads concurrent sessions over the GPU's NVDEC engines (an H100/H200 has 7),
so several streams decode in parallel without any scheduling here. The frames come out as NV12
(PyNvVideoCodec's NATIVE colour type) and are converted to RGB by sources/yuv.py, with the colour
matrix and range the stream declares: NVDEC's own RGB conversion differs from FFmpeg's (mean 6 levels
on a BT.709 clip), and frames must not depend on the decoder chosen.

What NVDEC decodes here: 8-bit 4:2:0 streams (yuv420p / yuvj420p) of the codecs in NVDEC_CODECS,
with a BT.601 / BT.709 matrix and even frame sizes. The rest (10-bit, 4:2:2, 4:4:4, BT.2020, a codec
the GPU lacks such as AV1 on older chips) raises NvdecUnavailable, one line naming the reason, so
that a caller that allows it (decode.fallback) can say so and decode with PyAV.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from sources.errors import SourceError

if TYPE_CHECKING:
    import torch

    from sources.yuv import YuvLayout

# FFmpeg codec names NVDEC has decoders for (the GPU may still lack one: found at the first packet)
NVDEC_CODECS = frozenset({"h264", "hevc", "av1", "vp8", "vp9", "mpeg1video", "mpeg2video", "mpeg4", "vc1", "mjpeg"})
_NOPTS = -(1 << 62)   # PyNvVideoCodec passes FFmpeg's AV_NOPTS_VALUE (INT64_MIN) through


class NvdecUnavailable(SourceError):
    """decoder=nvdec cannot decode this input here: PyNvVideoCodec or a CUDA GPU missing, or a codec,
    bit depth, chroma format or colour matrix NVDEC (or the conversion here) does not handle.
    `reason` is the why without the input's name, for a fallback's warning."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: decoder=nvdec cannot be used: {reason}")
        self.reason = reason


class NvdecError(Exception):
    """PyNvVideoCodec failed while demuxing or decoding (an unsupported stream before the first
    frame, damage after it); the message is its one-line reason."""


class NvdecSession(Protocol):
    """One NVDEC decoder session over one input (a file or a stream URL). time_base: seconds per pts
    unit as its demuxer reports them (None: the caller's own, e.g. PyAV's for the same stream)."""

    time_base: float | None

    def frames(self) -> Iterator[tuple[int | None, torch.Tensor]]:
        """(pts in the stream's time base, or None; NV12 uint8 (H * 3 / 2, W) on the GPU) in
        presentation order, until the input ends. A frame's memory is the decoder's: it is valid
        until the next item is asked for (copy or convert it before). Raises NvdecError."""
        ...

    def close(self) -> None:
        ...


def check_available(name: str) -> None:
    """NvdecUnavailable unless PyNvVideoCodec imports and a CUDA GPU is visible."""
    import torch

    if not torch.cuda.is_available():
        raise NvdecUnavailable(name, "no CUDA GPU is available")
    # its import logs a failure over several lines (troubleshooting steps) before raising: the
    # first line of the exception is said instead, once
    log = logging.getLogger("PyNvVideoCodec")
    was_disabled, log.disabled = log.disabled, True
    try:
        import PyNvVideoCodec  # noqa: F401
    except ImportError as e:
        raise NvdecUnavailable(name, f"PyNvVideoCodec is not installed (pip install 'arr-coc-video[nvdec]'): {e}") \
            from e
    except Exception as e:  # its import checks the driver (libnvcuvid, NVENC version) and raises RuntimeError
        raise NvdecUnavailable(name, f"PyNvVideoCodec cannot load ({_first_line(e)})") from e
    finally:
        log.disabled = was_disabled


def nv12_layout(name: str, codec: str, pixel_format: str | None, colorspace: int, color_range: int,
                height: int, width: int, rotation: int = 0) -> YuvLayout:
    """The NV12 layout NVDEC's frames of this stream will have (sizes before rotation), or
    NvdecUnavailable naming what NVDEC or the conversion here does not handle."""
    from sources.yuv import yuv_layout

    if codec not in NVDEC_CODECS:
        raise NvdecUnavailable(name, f"NVDEC has no decoder for codec {codec!r} "
                                     f"(it decodes {', '.join(sorted(NVDEC_CODECS))})")
    if pixel_format not in ("yuv420p", "yuvj420p"):
        raise NvdecUnavailable(name, f"pixel format {pixel_format} (only 8-bit 4:2:0 is decoded on the GPU here; "
                                     f"10-bit, 4:2:2 and 4:4:4 streams decode with pyav)")
    layout = yuv_layout(pixel_format, colorspace, color_range, height, width, rotation, semi_planar=True)
    if layout is None:
        raise NvdecUnavailable(name, f"colour matrix {colorspace} or frame size {width}x{height} (the GPU-side "
                                     f"conversion reproduces BT.601 / BT.709 at even sizes only)")
    return layout


def open_session(target: str, gpu_id: int | None = None) -> NvdecSession:
    """A PyNvVideoCodec session over a file path or stream URL, on GPU `gpu_id` (None: torch's
    current device, which under CUDA_VISIBLE_DEVICES is the process's own GPU). Tests replace
    this function with a double of NvdecSession."""
    return _PyNvSession(target, gpu_id)


class _PyNvSession:
    """PyNvVideoCodec's demuxer (its own FFmpeg, with the bitstream filters NVDEC needs) feeding one
    decoder created for the demuxer's codec, output NATIVE (NV12) in device memory."""

    def __init__(self, target: str, gpu_id: int | None) -> None:
        import PyNvVideoCodec as nvc
        import torch

        self._nvc = nvc
        self._gpu = torch.cuda.current_device() if gpu_id is None else gpu_id
        try:
            self._demuxer = nvc.CreateDemuxer(target)
            self._decoder = nvc.CreateDecoder(gpuid=self._gpu, codec=self._demuxer.GetNvCodecId(),
                                              usedevicememory=True, outputColorType=nvc.OutputColorType.NATIVE)
        except Exception as e:
            raise NvdecError(_first_line(e)) from e
        num, den = (getattr(self._demuxer, name, lambda: 0)() for name in ("GetTimebaseNum", "GetTimebaseDen"))
        self.time_base = num / den if num and den else None

    def frames(self) -> Iterator[tuple[int | None, torch.Tensor]]:
        import torch

        try:
            for packet in self._demuxer:
                for frame in self._decoder.Decode(packet):
                    yield _pts(frame.getPTS()), torch.from_dlpack(frame)
            for frame in self._flush():
                yield _pts(frame.getPTS()), torch.from_dlpack(frame)
        except NvdecError:
            raise
        except Exception as e:  # PyNvVCExceptionDecode / Cuda / Unsupported, RuntimeError from the demuxer
            raise NvdecError(_first_line(e)) from e

    def _flush(self) -> list[Any]:
        """The frames the decoder still holds once the demuxer ended (B-frame reordering keeps a few):
        an empty packet is the end of stream. Where the demuxer already sent one, none come back."""
        try:
            return list(self._decoder.Decode(self._nvc.PacketData()))
        except Exception:  # no constructible PacketData, or a decoder already ended: the demuxer's end flushed
            return []

    def close(self) -> None:
        self._decoder = self._demuxer = None


def _pts(value: Any) -> int | None:
    if value is None:
        return None
    value = int(value)
    return None if value <= _NOPTS or value >= -_NOPTS else value


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:200]


class Nv12ToRgb:
    """NVDEC's NV12 frames of one stream -> upright RGB (H', W', 3) uint8 tensors on the same device
    (sources/yuv.py), each finished before it is handed on: the decoder overwrites a frame's memory
    at its next frame, and the RGB tensor is then ready for a consumer on any CUDA stream (which
    calls record_stream before the tensor can be freed under it)."""

    def __init__(self, layout: YuvLayout, name: str) -> None:
        self.layout, self.name = layout, name
        self._stream: Any = None   # a side stream: the conversion does not queue behind the consumers' work

    def __call__(self, nv12: torch.Tensor, index: int) -> torch.Tensor:
        import torch

        from sources.yuv import yuv_to_rgb

        h, w = self.layout.height, self.layout.width
        if tuple(nv12.shape) != (h * 3 // 2, w) or nv12.dtype != torch.uint8:
            raise SourceError(f"{self.name}: frame size or format changed mid-stream at frame {index}: NV12 "
                              f"{w}x{h} -> {tuple(nv12.shape)} {nv12.dtype}")
        if not nv12.is_cuda:
            return yuv_to_rgb(nv12.reshape(1, -1), self.layout)[0]
        if self._stream is None:
            self._stream = torch.cuda.Stream(nv12.device)
        self._stream.wait_stream(torch.cuda.current_stream(nv12.device))   # where DLPack put the frame
        with torch.cuda.stream(self._stream):
            rgb = yuv_to_rgb(nv12.reshape(1, -1), self.layout)[0]           # (H', W', 3)
        self._stream.synchronize()
        return rgb
