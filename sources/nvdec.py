"""NVDEC, the GPU's own video decoders, through NVIDIA's PyNvVideoCodec (`pip install
arr-coc-video[nvdec]`): the decode=nvdec path of sources/video.py and sources/live_connections.py.

Why: FFmpeg's software H.264 decode costs a CPU core ~7 ms per 720p frame and ~13 ms per 1080p one;
NVDEC ~1 ms of CPU, and its frames are already in GPU memory, where the texture stage wants them.

PyAV demuxes, NVDEC decodes. The sources read packets with PyAV exactly as for decoder pyav (one
container, its seeks, read timeouts, damage checks and reconnects), and `PacketFeed` hands each
packet's bytes and pts to one PyNvVideoCodec decoder session. NVDEC passes a packet's pts on to its
frame, so frames carry the stream's own pts in PyAV's time base, and timestamps, sampling, gaps and
drops are the PyAV path's code. PyNvVideoCodec's own demuxer is not used: it takes no timeout or
interrupt, and (2.2.4, H200) it never returned from opening a live HTTP MPEG-TS stream that PyAV
opened at once; files use the same feed, so that one decode path serves both.

Each source opens its own session; the driver spreads concurrent sessions over the GPU's NVDEC
engines (an H100/H200 has 7), so several streams decode in parallel without any scheduling here.
Frames come out as NV12 (PyNvVideoCodec's NATIVE colour type) and `Nv12ToRgb` converts them with
sources/yuv.py, with the colour matrix and range the stream declares (files: several frames per
conversion): NVDEC's own RGB conversion differs from FFmpeg's (mean 6 levels on a BT.709 clip),
and frames must not depend on the decoder chosen.

What NVDEC decodes here: 8-bit 4:2:0 streams (yuv420p / yuvj420p) of the codecs in NVDEC_CODECS,
with a BT.601 / BT.709 matrix and even frame sizes. The rest (10-bit, 4:2:2, 4:4:4, BT.2020, a codec
the GPU lacks such as AV1 on older chips) raises NvdecUnavailable, one line naming the reason, so
that a caller that allows it (decode.fallback) can say so and decode with PyAV.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Protocol

from sources.errors import SourceError

if TYPE_CHECKING:
    import av
    import torch

    from sources.yuv import YuvLayout

# FFmpeg codec name -> PyNvVideoCodec's cudaVideoCodec member (the GPU may still lack one: found at
# its first frame)
NVDEC_CODECS = {"h264": "H264", "hevc": "HEVC", "av1": "AV1", "vp8": "VP8", "vp9": "VP9", "mpeg1video": "MPEG1",
                "mpeg2video": "MPEG2", "mpeg4": "MPEG4", "vc1": "VC1", "mjpeg": "JPEG"}
# H.264 / HEVC in MP4, MOV, Matroska or FLV come as length-prefixed NAL units with the parameter sets
# in the stream header (avcC / hvcC, whose first byte is 1); NVDEC's parser reads Annex B (start
# codes, parameter sets in the stream). MPEG-TS and raw streams are Annex B already.
_ANNEXB_FILTERS = {"h264": "h264_mp4toannexb", "hevc": "hevc_mp4toannexb"}
_NOPTS = -(1 << 62)   # pts of a packet without one; FFmpeg's AV_NOPTS_VALUE (INT64_MIN) is below it too
class CaptureLock:
    """The one lock between CUDA-graph captures and the work that must not overlap one. A capture
    holds it alone (`with lock:`, re-entrant, as threading.RLock). Everything else that only must
    not run during a capture holds it shared (`with lock.shared():`) and overlaps the rest: NVDEC's
    decoders of many streams, page-locked allocations and device-wide syncs of the stages and the
    VLM. A waiting capture goes first: no new shared holder enters until it is done. The shared side
    is re-entrant per thread, and the capturing thread may enter it; a thread that holds it shared
    and asks to capture gets a RuntimeError (it would wait for itself)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = self._shared = self._waiting = 0
        self._local = threading.local()      # .depth: this thread's nesting of shared()

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if getattr(self._local, "depth", 0):
                raise RuntimeError("CaptureLock: a thread holding the shared side cannot take it alone")
            self._waiting += 1
            try:
                while self._owner is not None or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("CaptureLock released by a thread that does not hold it")
            self._depth -= 1
            if not self._depth:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> "CaptureLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        counted = False
        if not depth:
            with self._cond:
                if self._owner != threading.get_ident():   # (the capturing thread holds it already)
                    while self._owner is not None or self._waiting:
                        self._cond.wait()
                    self._shared += 1
                    counted = True
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if counted:
                with self._cond:
                    self._shared -= 1
                    if not self._shared:
                        self._cond.notify_all()


# Held alone by every CUDA-graph capture (pipeline/runtime/cuda.py takes this one lock as its
# CAPTURE_LOCK) and shared around each call into NVDEC (decoder creation, Decode, the conversion,
# close): a decoding thread invalidates a capture running in another (H200, 32 live NVDEC streams
# decoding through the VLM's warm-up: "cudaErrorStreamCaptureInvalidated", then "beginAllocateToPool:
# already recording to mempool_id"). History (docs/performance.md): held alone by decoders too, it
# cut 32 live streams to 6.6 frames/s each; shared by decoders but still taken alone by the stages'
# page-locked allocations, those 32 streams' warm-up took ~4 s a graph (every stream converting)
# and their steady state 5.3 frames/s each (a lock convoy behind every allocation).
CAPTURE_LOCK = CaptureLock()
# Files convert this many frames per call of yuv_to_rgb (its ~12 kernels launched once per batch);
# live streams one at a time, as each comes in.
CONVERT_BATCH = 8


class NvdecUnavailable(SourceError):
    """decoder=nvdec cannot decode this input here: PyNvVideoCodec or a CUDA GPU missing, or a codec,
    bit depth, chroma format or colour matrix NVDEC (or the conversion here) does not handle.
    `reason` is the why without the input's name, for a fallback's warning."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: decoder=nvdec cannot be used: {reason}")
        self.reason = reason


class NvdecError(Exception):
    """PyNvVideoCodec failed while decoding (a stream it does not take before the first frame,
    damage after it); the message is its one-line reason."""


class NvdecDecoder(Protocol):
    """One NVDEC decoder session, fed packet by packet (open_decoder). stream: the CUDA stream its
    frames are ready on (None off the GPU); ordered: whether the decoder also writes its next
    frames on that stream, so work queued there on a frame runs before the frame is overwritten
    (else that work must be finished before the next decode call)."""

    stream: Any
    ordered: bool

    def decode(self, packet: av.Packet | None) -> list[tuple[int | None, torch.Tensor]]:
        """The frames this packet completes, in presentation order: (pts as its packet's, or None;
        NV12 uint8 (H * 3 / 2, W)). None: the stream ended, the frames still held come out. A
        frame's memory is the decoder's: valid until the next call. Raises NvdecError."""
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


def open_decoder(name: str, codec: str, gpu_id: int | None = None) -> NvdecDecoder:
    """A PyNvVideoCodec decoder session for `codec` (FFmpeg's name) on GPU `gpu_id` (None: torch's
    current device, which under CUDA_VISIBLE_DEVICES is the process's own GPU); NvdecUnavailable
    where it cannot be created. Tests replace this function with a double of NvdecDecoder."""
    return _PyNvDecoder(name, codec, gpu_id)


class _PyNvDecoder:
    """PyNvVideoCodec's decoder, output NATIVE (NV12) in device memory, written on a CUDA stream of
    our own: the frames' copies then never wait for work on the default stream (a VLM's), and what
    we queue on a frame runs before the decoder reuses its memory, with no host sync per frame."""

    def __init__(self, name: str, codec: str, gpu_id: int | None) -> None:
        import PyNvVideoCodec as nvc
        import torch

        member = getattr(nvc.cudaVideoCodec, NVDEC_CODECS.get(codec, ""), None)
        if member is None:
            raise NvdecUnavailable(name, f"PyNvVideoCodec has no decoder for codec {codec!r}")
        self._nvc = nvc
        gpu = torch.cuda.current_device() if gpu_id is None else gpu_id
        self.stream = torch.cuda.Stream(gpu)

        def create(stream: int) -> Any:
            return nvc.CreateDecoder(gpuid=gpu, codec=member, cudacontext=0, cudastream=stream, usedevicememory=True,
                                     outputColorType=nvc.OutputColorType.NATIVE)

        try:
            with CAPTURE_LOCK.shared():
                try:
                    self._decoder, self.ordered = create(self.stream.cuda_stream), True
                except Exception:  # a stream it does not validate: its own, synchronized at each frame
                    self._decoder, self.ordered = create(0), False
        except Exception as e:
            raise NvdecUnavailable(name, f"PyNvVideoCodec cannot create a {codec} decoder ({_first_line(e)})") from e

    def decode(self, packet: av.Packet | None) -> list[tuple[int | None, torch.Tensor]]:
        import torch

        data = self._nvc.PacketData()   # empty: the end of the stream, which flushes the decoder
        if packet is not None:          # the packet (its memory) outlives the call: the caller holds it
            data.bsl_data, data.bsl = packet.buffer_ptr, packet.buffer_size
            data.pts = _NOPTS if packet.pts is None else packet.pts
        try:
            with CAPTURE_LOCK.shared(), torch.cuda.stream(self.stream):   # DLPack makes each frame ready on this stream
                return [(_pts(f.getPTS()), torch.from_dlpack(f)) for f in self._decoder.Decode(data)]
        except Exception as e:  # PyNvVCExceptionDecode / Cuda / Unsupported, RuntimeError
            raise NvdecError(_first_line(e)) from e

    def close(self) -> None:
        with CAPTURE_LOCK.shared():
            self._decoder = None


class PacketFeed:
    """One PyAV video stream's packets into an NVDEC decoder: the bitstream as NVDEC's parser reads
    it (Annex B for H.264 / HEVC out of MP4 or Matroska; MPEG-4 Part 2's header, which those
    containers keep out of the stream, before its first packet), pts as they are."""

    def __init__(self, name: str, stream: av.video.stream.VideoStream, gpu_id: int | None = None) -> None:
        from av.bitstream import BitStreamFilterContext

        codec, header = stream.codec_context.name, stream.codec_context.extradata
        self._filter = None
        if codec in _ANNEXB_FILTERS and header and header[0] == 1:
            self._filter = BitStreamFilterContext(_ANNEXB_FILTERS[codec], stream)
        self._header = header if codec == "mpeg4" and header else None
        self.decoder = open_decoder(name, codec, gpu_id)

    @property
    def consumes(self) -> bool:
        """Whether decode() empties the packets it is given (a bitstream filter takes their data)."""
        return self._filter is not None

    def decode(self, packet: av.Packet | None) -> list[tuple[int | None, torch.Tensor]]:
        """NvdecDecoder.decode for one demuxed packet; None or an empty one (PyAV's last): the end."""
        import av

        if packet is None or packet.size == 0:   # the Annex B filters hold no packet back to drain
            return self.decoder.decode(None)
        if self._filter is not None:
            packet = _one(self._filter.filter(packet))
            if packet is None:
                return []
        if self._header is not None:
            joined = av.Packet(bytes(self._header) + bytes(packet))
            joined.pts, packet, self._header = packet.pts, joined, None
        return self.decoder.decode(packet)

    def close(self) -> None:
        self.decoder.close()


def _one(packets: list[av.Packet]) -> av.Packet | None:
    """A bitstream filter's output for one packet as one packet (the Annex B filters give one per
    packet; several are joined: NVDEC parses access units out of the byte stream)."""
    import av

    if len(packets) <= 1:
        return packets[0] if packets else None
    joined = av.Packet(b"".join(bytes(p) for p in packets))
    joined.pts = packets[0].pts
    return joined


def _pts(value: Any) -> int | None:
    if value is None:
        return None
    value = int(value)
    return None if value <= _NOPTS or value >= -_NOPTS else value


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:200]


class Nv12ToRgb:
    """NVDEC's NV12 frames of one stream -> upright RGB uint8 tensors on the same device
    (sources/yuv.py), each finished before it is handed on, so that a consumer on any CUDA stream
    can read it (and calls record_stream before the tensor can be freed under it).

    Files: `add` each frame as it comes out of the decoder (a copy into a batch of slots; the
    decoder's memory is then free for its next frame), `take` converts the frames added in one call
    of yuv_to_rgb: its kernels launched once per batch, not per frame. The work runs on the
    decoder's stream (NvdecDecoder.stream), off the default stream. Live streams: `hold` copies a
    frame out and converts nothing; the consumer converts what it takes, all at once
    (convert_held), in its own thread."""

    def __init__(self, layout: YuvLayout, name: str, decoder: NvdecDecoder, batch: int = 1) -> None:
        self.layout, self.name, self.batch = layout, name, batch
        self._stream, self._ordered = getattr(decoder, "stream", None), getattr(decoder, "ordered", False)
        self._slots: torch.Tensor | None = None   # (batch, frame_bytes) uint8, reused
        self.count = 0

    @property
    def full(self) -> bool:
        return self.count == self.batch

    def hold(self, nv12: torch.Tensor, index: int, size: tuple[int, int]) -> HeldNv12:
        """One frame copied out of the decoder's memory (on its stream, before its next call), not
        converted: the conversion's dozen kernels and the size change to `size` (H, W) wait for
        convert_held, which runs them once for every frame a consumer takes together. Frames the
        consumer never takes (dropped while it was behind) are never converted."""
        import torch

        self._check(nv12, index)
        ready = None
        with self._on_stream():
            planes = nv12.reshape(-1).clone()                             # (frame_bytes,)
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(self._stream)
        if not self._ordered:   # the decoder's next frame may overwrite this one's memory at once
            self._finish()
        return HeldNv12(planes, self, ready, size)

    def add(self, nv12: torch.Tensor, index: int) -> None:
        import torch

        self._check(nv12, index)
        if self.full:
            raise RuntimeError(f"{self.name}: Nv12ToRgb holds {self.batch} frames already; take() them first")
        h, w = self.layout.height, self.layout.width
        if self._slots is None:
            self._slots = torch.empty((self.batch, self.layout.frame_bytes), dtype=torch.uint8, device=nv12.device)
        with self._on_stream():
            self._slots[self.count].view(h * 3 // 2, w).copy_(nv12)
        self.count += 1
        if not self._ordered:   # the decoder's next frame may overwrite this one's memory at once
            self._finish()

    def take(self) -> torch.Tensor:
        """The frames added since the last take -> (n, H', W', 3), finished."""
        from sources.yuv import yuv_to_rgb

        if self._slots is None or not self.count:
            raise RuntimeError(f"{self.name}: no frames to convert")
        with self._on_stream():
            rgb = yuv_to_rgb(self._slots[:self.count], self.layout)     # (n, H', W', 3)
        self.count = 0
        self._finish()
        return rgb

    def _check(self, nv12: torch.Tensor, index: int) -> None:
        import torch

        h, w = self.layout.height, self.layout.width
        if tuple(nv12.shape) != (h * 3 // 2, w) or nv12.dtype != torch.uint8:
            raise SourceError(f"{self.name}: frame size or format changed mid-stream at frame {index}: NV12 "
                              f"{w}x{h} -> {tuple(nv12.shape)} {nv12.dtype}")

    def _on_stream(self) -> Any:
        """On the decoder's stream, and holding CAPTURE_LOCK shared (no conversion while a graph is captured)."""
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(CAPTURE_LOCK.shared())
        if self._stream is not None:
            stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def _finish(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class HeldNv12(NamedTuple):
    """A live NVDEC frame between its decoder and its consumer (Nv12ToRgb.hold): its own copy of the
    NV12 planes, the converter of its stream (layout, decoder stream), the event the copy is done at
    on that stream (None off the GPU), and the (H, W) its RGB is wanted at."""
    planes: Any
    converter: Nv12ToRgb
    ready: Any
    size: tuple[int, int]


def convert_held(frames: list[HeldNv12]) -> torch.Tensor:
    """Held frames of one stream's converter -> (n, H, W, 3) uint8 RGB at their size, converted on
    the calling thread's current CUDA stream in one call of yuv_to_rgb (and one resize where the
    stream's frames are not at the size the source started with)."""
    import torch

    from sources.yuv import yuv_to_rgb

    converter, size = frames[0].converter, frames[0].size
    if any(f.converter is not converter or f.size != size for f in frames):
        raise ValueError("convert_held: the frames come from more than one converter or size")
    planes = frames[0].planes
    with CAPTURE_LOCK.shared():
        if planes.is_cuda:
            current = torch.cuda.current_stream(planes.device)
            if frames[-1].ready is not None:   # the copies ran in order on the decoder's stream
                current.wait_event(frames[-1].ready)
            for f in frames:                   # allocated there, read here: not reused before this runs
                f.planes.record_stream(current)
        rgb = yuv_to_rgb(torch.stack([f.planes for f in frames]), converter.layout)   # (n, h, w, 3)
        return resize_rgb(rgb, size)


def resize_rgb(rgb: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(n, h, w, 3) uint8 -> (n, H, W, 3) uint8 (bilinear, antialiased: a stream that came back at
    another size is scaled to the size it started with); itself when already that size."""
    import torch.nn.functional as F

    if tuple(rgb.shape[1:3]) == tuple(size):
        return rgb
    nchw = rgb.permute(0, 3, 1, 2).float()
    out = F.interpolate(nchw, size=tuple(size), mode="bilinear", antialias=True, align_corners=False)
    return out.permute(0, 2, 3, 1).round_().clamp_(0, 255).to(rgb.dtype).contiguous()
