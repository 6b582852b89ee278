"""decoder="nvdec": what NVDEC is fed (PacketFeed: PyAV's packets, Annex B where needed), the
adapter of PyNvVideoCodec's API, the NV12 conversion (batched and not), the file source's sampling /
timestamps / damage and the live connection's frames, reconnects and refusals. On CPU through
doubles (FFmpeg's decoder given only what NVDEC is given; a fake of PyNvVideoCodec's API); on a GPU
with PyNvVideoCodec, NVDEC's own frames against PyAV's, for files, a loopback HTTP MPEG-TS stream
and a live source that reconnects."""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from sources import (NvdecFallbackWarning, NvdecUnavailable, SourceError, StreamInterruptedWarning,
                     VideoTruncatedWarning, open_video)
from sources import nvdec
from sources.synthetic import Shot, render_clip, write_video
from sources.yuv import yuv_layout, yuv_to_rgb

sys.path.insert(0, str(Path(__file__).parents[1] / "live"))
from live_servers import http_ts_server  # noqa: E402

from benchmarks.loopback import TSServer, encode_clip, serve_ts  # noqa: E402  (live_servers put the root on the path)

HAS_NVDEC = torch.cuda.is_available() and importlib.util.find_spec("PyNvVideoCodec") is not None


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    frames = render_clip([Shot("moving_object", 24, speed=2.0), Shot("pan", 21)], height=72, width=96, seed=7).frames
    return write_video(tmp_path_factory.mktemp("nvdec") / "clip.mkv", frames, fps=25)


class PyAVNv12Decoder:
    """NvdecDecoder's double: FFmpeg's decoder for the codec, given only each packet's bytes and pts
    (what PyNvVideoCodec's PacketData carries: no stream header, so H.264 out of MP4 / Matroska
    decodes only once PacketFeed made it Annex B), each frame repacked as NV12 (H * 3 / 2, W) the
    way NVDEC hands them over. fail_after: raise NvdecError after this many frames (0: before the
    first). `packets` counts what it was fed, None for the end of the stream."""

    stream = None       # off the GPU: no CUDA stream
    ordered = False

    def __init__(self, name: str, codec: str, fail_after: int | None = None) -> None:
        self.context = av.CodecContext.create(codec, "r")
        self.fail_after, self.frames, self.closed = fail_after, 0, False
        self.packets: list[int | None] = []

    def decode(self, packet):
        if packet is None:
            self.packets.append(None)
            decoded = self.context.decode(None)
        else:
            data = av.Packet(bytes(packet))
            data.pts = packet.pts
            self.packets.append(packet.pts)
            decoded = self.context.decode(data)
        out = []
        for frame in decoded:
            if self.frames == self.fail_after:
                raise nvdec.NvdecError("CUDA_ERROR_INVALID_IMAGE")
            self.frames += 1
            out.append((frame.pts, torch.from_numpy(frame.reformat(format="nv12").to_ndarray())))
        return out

    def close(self) -> None:
        self.closed = True


class FakeNvdec:
    """What the fake_nvdec fixture opened; `fail_after` applies to the decoders opened from then on."""

    def __init__(self) -> None:
        self.decoders: list[PyAVNv12Decoder] = []
        self.fail_after: int | None = None

    def open_decoder(self, name: str, codec: str, gpu_id: int | None = None) -> PyAVNv12Decoder:
        self.decoders.append(PyAVNv12Decoder(name, codec, self.fail_after))
        return self.decoders[-1]


@pytest.fixture
def fake_nvdec(monkeypatch):
    """NVDEC without a GPU: the availability check passes and decoders are PyAVNv12Decoder."""
    fake = FakeNvdec()
    monkeypatch.setattr(nvdec, "check_available", lambda name: None)
    monkeypatch.setattr(nvdec, "open_decoder", fake.open_decoder)
    return fake


@pytest.fixture(scope="module")
def http_stream(tmp_path_factory):
    """A loopback HTTP MPEG-TS stream of 640x360 H.264 at 30 fps (benchmarks/loopback.py)."""
    with http_ts_server(tmp_path_factory.mktemp("http"), size=(640, 360), fps=30, seconds=3.0) as server:
        yield server


def read(path, **kwargs):
    with open_video(path, **kwargs) as video:
        return list(video), video


class TestNv12Conversion:
    def test_semi_planar_equals_planar(self, clip):
        """NV12 (U, V interleaved) converts to exactly what the planar layout gives."""
        with av.open(str(clip)) as c:
            frame = next(c.decode(c.streams.video[0]))
        h, w = frame.height, frame.width
        planar = yuv_layout("yuv420p", 1, 1, h, w)
        nv12 = yuv_layout("yuv420p", 1, 1, h, w, semi_planar=True)
        yuv = frame.to_ndarray()                                    # (H * 3 / 2, W): Y, then U, then V
        semi = frame.reformat(format="nv12").to_ndarray()           # (H * 3 / 2, W): Y, then UVUV...
        a = yuv_to_rgb(torch.from_numpy(yuv.reshape(1, -1)), planar)
        b = yuv_to_rgb(torch.from_numpy(semi.reshape(1, -1)), nv12)
        assert torch.equal(a, b) and a.shape == (1, h, w, 3)

    def test_synthetic_nv12_colours(self):
        """A flat NV12 frame: grey stays grey, full-strength V is red-ish, U blue-ish (BT.709, full range)."""
        h, w = 4, 6
        layout = yuv_layout("yuvj420p", 1, 2, h, w, semi_planar=True)
        frame = torch.full((h * 3 // 2, w), 128, dtype=torch.uint8)       # Y 128, U = V = 128: grey
        assert yuv_to_rgb(frame.reshape(1, -1), layout).unique().tolist() == [128]
        frame[h:, 1::2] = 255                                             # V high: red up, blue unchanged
        rgb = yuv_to_rgb(frame.reshape(1, -1), layout)[0, 0, 0].tolist()
        assert rgb[0] == 255 and rgb[2] == 128 and rgb[1] < 128

    def test_refusals_name_the_reason(self):
        with pytest.raises(NvdecUnavailable, match="codec 'prores'"):
            nvdec.nv12_layout("x.mov", "prores", "yuv420p", 1, 1, 72, 96)
        with pytest.raises(NvdecUnavailable, match="yuv420p10le"):
            nvdec.nv12_layout("x.mp4", "hevc", "yuv420p10le", 1, 1, 72, 96)
        with pytest.raises(NvdecUnavailable, match="yuv444p"):
            nvdec.nv12_layout("x.mp4", "h264", "yuv444p", 1, 1, 72, 96)
        with pytest.raises(NvdecUnavailable, match="colour matrix 9"):
            nvdec.nv12_layout("x.mp4", "h264", "yuv420p", 9, 1, 72, 96)
        assert nvdec.nv12_layout("x.mp4", "h264", "yuv420p", 1, 1, 72, 96).semi_planar


class TestSource:
    def test_same_frames_as_pyav(self, clip, fake_nvdec):
        ref, _ = read(clip)
        got, video = read(clip, decoder="nvdec")
        assert video.decoder == "nvdec" and video.frame_count == len(ref)
        assert [f.index for f in got] == [f.index for f in ref]
        assert np.allclose([f.pts_s for f in got], [f.pts_s for f in ref])
        assert all(isinstance(f.rgb, torch.Tensor) and f.on_device for f in got)
        diff = np.abs(np.stack([f.host_rgb() for f in got]).astype(int) - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.max() <= 2 and diff.mean() < 0.9, (diff.max(), diff.mean())
        assert not video.truncated and fake_nvdec.decoders[0].closed

    @pytest.mark.parametrize("kwargs", [dict(fps=7.0), dict(start_s=0.5, end_s=1.3), dict(start_s=0.3, max_frames=5),
                                        dict(fps=4.0, start_s=0.9)])
    def test_sampling_as_pyav(self, clip, fake_nvdec, kwargs):
        ref, ref_video = read(clip, **kwargs)
        got, video = read(clip, decoder="nvdec", **kwargs)
        assert [f.index for f in got] == [f.index for f in ref] and len(got) > 0
        assert np.allclose([f.pts_s for f in got], [f.pts_s for f in ref])
        assert video.frame_count == ref_video.frame_count

    def test_decoder_error_after_the_first_frame_is_damage(self, clip, fake_nvdec):
        fake_nvdec.fail_after = 10
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, video = read(clip, decoder="nvdec")
        assert [f.index for f in got] == list(range(10)) and video.truncated
        assert any(issubclass(w.category, VideoTruncatedWarning) and "CUDA_ERROR_INVALID_IMAGE" in str(w.message)
                   for w in caught)

    def test_decoder_error_before_the_first_frame_is_unavailable(self, clip, fake_nvdec):
        fake_nvdec.fail_after = 0
        with pytest.raises(NvdecUnavailable, match="NVDEC cannot decode this stream .CUDA_ERROR_INVALID_IMAGE"):
            open_video(clip, decoder="nvdec")
        with pytest.warns(NvdecFallbackWarning, match="decoding with pyav: nvdec cannot be used"):
            video = open_video(clip, decoder="nvdec", fallback=True)
        with video:
            assert video.decoder == "pyav" and isinstance(next(iter(video)).rgb, np.ndarray)

    def test_unsupported_format_is_refused_before_any_session(self, tmp_path, fake_nvdec):
        frames = render_clip([Shot("pan", 6)], height=48, width=64, seed=1).frames
        path = tmp_path / "c444.mp4"
        with av.open(str(path), "w") as c:
            s = c.add_stream("libx264", rate=25)
            s.width, s.height, s.pix_fmt = 64, 48, "yuv444p"
            for f in frames:
                c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
            c.mux(s.encode())
        with pytest.raises(NvdecUnavailable, match="pixel format yuv444p"):
            open_video(path, decoder="nvdec")
        assert fake_nvdec.decoders == []
        with pytest.warns(NvdecFallbackWarning, match="yuv444p"):
            with open_video(path, decoder="nvdec", fallback=True) as video:
                assert video.decoder == "pyav"

    def test_missing_file_is_a_source_error_not_a_fallback(self, tmp_path, fake_nvdec):
        with pytest.raises(SourceError, match="no such file") as e:
            open_video(tmp_path / "missing.mp4", decoder="nvdec", fallback=True)
        assert not isinstance(e.value, NvdecUnavailable)


class TestAvailability:
    def test_missing_package(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)    # import raises ImportError
        with pytest.raises(NvdecUnavailable, match=r"x.mp4: decoder=nvdec cannot be used: PyNvVideoCodec is not "
                                                   r"installed \(pip install 'arr-coc-video\[nvdec\]'\)"):
            nvdec.check_available("x.mp4")

    def test_a_driver_it_cannot_load_is_its_first_line(self, monkeypatch, tmp_path):
        package = tmp_path / "PyNvVideoCodec"
        package.mkdir()
        (package / "__init__.py").write_text(
            "raise RuntimeError('libnvidia-encode.so.1: cannot open shared object file\\n\\n=== STEPS ===')\n")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.delitem(sys.modules, "PyNvVideoCodec", raising=False)
        monkeypatch.syspath_prepend(str(tmp_path))
        with pytest.raises(NvdecUnavailable) as e:
            nvdec.check_available("x.mp4")
        assert str(e.value) == ("x.mp4: decoder=nvdec cannot be used: PyNvVideoCodec cannot load "
                                "(libnvidia-encode.so.1: cannot open shared object file)")


def write_ts(path, frames, fps=25, codec="libx264"):
    """frames as H.264 (or `codec`) 4:2:0 in MPEG-TS: Annex B packets, a keyframe every 10 frames."""
    with av.open(str(path), "w", format="mpegts") as c:
        s = c.add_stream(codec, rate=fps, options={"g": "10"})
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode())
    return path


def feed_all(path):
    """Every packet of the file through a PacketFeed to the double: (feed, [(pts, nv12)])."""
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        feed = nvdec.PacketFeed(str(path), stream)
        out = []
        for packet in c.demux(stream):
            out += [(pts, nv12.clone()) for pts, nv12 in feed.decode(packet)]
        return feed, out


def pyav_frames(path):
    with av.open(str(path)) as c:
        return [(f.pts, torch.from_numpy(f.reformat(format="nv12").to_ndarray())) for f in c.decode(video=0)]


class TestPacketFeed:
    """What NVDEC is given: each packet's bytes and pts, as its parser reads them."""

    def test_h264_out_of_matroska_is_made_annex_b(self, clip, fake_nvdec):
        feed, got = feed_all(clip)                     # Matroska: length-prefixed NAL units, avcC header
        ref = pyav_frames(clip)
        assert feed._filter is not None and len(got) == len(ref) == 45
        assert [p for p, _ in got] == [p for p, _ in ref]                 # the packets' pts, in display order
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, ref))
        assert fake_nvdec.decoders[0].packets[-1] is None                 # the end flushed the decoder

    def test_mpeg_ts_packets_go_as_they_are(self, tmp_path, fake_nvdec):
        frames = render_clip([Shot("pan", 30)], height=48, width=64, seed=3).frames
        path = write_ts(tmp_path / "c.ts", frames)
        feed, got = feed_all(path)
        with av.open(str(path)) as c:
            sent = [p.pts for p in c.demux(video=0) if p.size]
        assert feed._filter is None and fake_nvdec.decoders[0].packets == sent + [None]
        assert [p for p, _ in got] == [p for p, _ in pyav_frames(path)]

    def test_mpeg4_header_goes_before_the_first_packet(self, tmp_path, fake_nvdec):
        frames = render_clip([Shot("pan", 12)], height=48, width=64, seed=4).frames
        path = write_video(tmp_path / "m4.mp4", frames, fps=25, codec="mpeg4")
        feed, got = feed_all(path)
        assert len(got) == 12 and feed._header is None                    # sent, once

    def test_an_unsupported_codec_is_one_line(self, tmp_path, monkeypatch):
        fake = types.SimpleNamespace(cudaVideoCodec=types.SimpleNamespace(H264=4))
        monkeypatch.setitem(sys.modules, "PyNvVideoCodec", fake)
        with pytest.raises(NvdecUnavailable, match=r"^x.mkv: decoder=nvdec cannot be used: PyNvVideoCodec has "
                                                   r"no decoder for codec 'vp9'$"):
            nvdec.open_decoder("x.mkv", "vp9")


class TestCaptureLock:
    """nvdec.CaptureLock: captures alone (re-entrant), decoders together, a waiting capture first."""

    @staticmethod
    def later(fn) -> tuple[threading.Thread, list]:
        done: list = []
        thread = threading.Thread(target=lambda: done.append(fn()))
        thread.start()
        return thread, done

    def test_shared_holders_overlap_and_wait_for_a_capture(self):
        lock = nvdec.CaptureLock()
        inside = threading.Barrier(2, timeout=5)

        def share():
            with lock.shared():
                inside.wait()                      # both inside at once, or the barrier breaks
            return True

        a, b = threading.Thread(target=share), threading.Thread(target=share)
        a.start(), b.start(), a.join(5), b.join(5)
        assert not inside.broken
        def decode_once() -> bool:
            with lock.shared():
                return True

        with lock, lock:                           # re-entrant for the capturing thread
            with lock.shared():                    # which may also enter the shared side
                pass
            thread, done = self.later(decode_once)
            thread.join(0.2)
            assert done == []                      # a decoder waits while a capture runs
        thread.join(5)
        assert done == [True]

    def test_a_capture_waits_for_decoders_and_goes_before_new_ones(self):
        lock = nvdec.CaptureLock()
        order: list[str] = []
        held = lock.shared()
        held.__enter__()
        capture, _ = self.later(lambda: (lock.acquire(), order.append("capture"), lock.release()))
        time.sleep(0.1)
        assert order == []                         # the capture waits for the decoder inside
        late, _ = self.later(lambda: (lock.shared().__enter__(), order.append("decoder")))
        time.sleep(0.1)
        held.__exit__(None, None, None)
        capture.join(5), late.join(5)
        assert order == ["capture", "decoder"]     # the waiting capture went first


    def test_shared_is_reentrant_even_while_a_capture_waits(self):
        """A thread inside the shared side may enter it again (a page-locked allocation inside a
        decoder's call) though a capture waits: the capture waits for it, not it for the capture."""
        lock = nvdec.CaptureLock()
        order: list[str] = []
        with lock.shared():
            capture, _ = self.later(lambda: (lock.acquire(), order.append("capture"), lock.release()))
            time.sleep(0.1)
            with lock.shared():                    # would wait for the capture, which waits for us
                order.append("nested")
            with pytest.raises(RuntimeError, match="holding the shared side cannot take it alone"):
                lock.acquire()                     # would wait for itself
        capture.join(5)
        assert order == ["nested", "capture"]

    def test_page_locked_allocations_overlap_decoders(self, monkeypatch):
        """Page-locked allocations overlap NVDEC's decoders (and one another); only captures exclude
        them (a shared decoder side behind allocations taken alone: a lock convoy, 5.3 frames/s a
        stream at 32 live NVDEC streams on an H200)."""
        from pipeline.runtime import cuda

        lock = nvdec.CaptureLock()
        monkeypatch.setattr(cuda, "CAPTURE_LOCK", lock)
        monkeypatch.setattr(cuda.torch, "empty", lambda shape, dtype, pin_memory: ("page-locked", pin_memory))
        with lock.shared():                        # a decoder inside
            thread, done = self.later(lambda: cuda.host_uint8((4,), pin=True))
            thread.join(5)
            assert done == [("page-locked", True)]
        with lock:                                 # a capture: the allocation waits for it
            thread, done = self.later(lambda: cuda.host_uint8((4,), pin=True))
            thread.join(0.2)
            assert done == []
        thread.join(5)
        assert done == [("page-locked", True)]


class FakePyNv:
    """PyNvVideoCodec's decoder API as _PyNvDecoder uses it, recording the calls. Decode returns one
    frame per packet (a CPU tensor standing for the device one), its pts the packet's."""

    class PacketData:
        def __init__(self) -> None:
            self.bsl_data, self.bsl, self.pts = 0, 0, 0

    class Frame:
        def __init__(self, pts: int, data: torch.Tensor) -> None:
            self.pts, self.data = pts, data

        def getPTS(self) -> int:   # noqa: N802 (its name)
            return self.pts

        def __dlpack__(self, stream=None):
            return self.data.__dlpack__()

        def __dlpack_device__(self):
            return self.data.__dlpack_device__()

    cudaVideoCodec = types.SimpleNamespace(H264=4, HEVC=8)
    OutputColorType = types.SimpleNamespace(NATIVE=0)

    def __init__(self, refuse_stream: bool = False, fail: str | None = None) -> None:
        self.created: list[dict] = []
        self.fed: list[tuple[bytes, int]] = []
        self.refuse_stream, self.fail = refuse_stream, fail

    def CreateDecoder(self, **kwargs):   # noqa: N802
        if self.fail is not None:
            raise RuntimeError(self.fail)
        if self.refuse_stream and kwargs["cudastream"]:
            raise RuntimeError("cudastream input argument does not correspond to cudacontext argument")
        self.created.append(kwargs)
        return self

    def Decode(self, data):   # noqa: N802
        payload = ctypes.string_at(data.bsl_data, data.bsl) if data.bsl else b""
        self.fed.append((payload, data.pts))
        if payload == b"bad":
            raise RuntimeError("CUDA_ERROR_INVALID_SOURCE\nsecond line")
        return [self.Frame(data.pts, torch.full((6, 4), len(payload), dtype=torch.uint8))] if data.bsl else []


class TestPyNvDecoder:
    """sources.nvdec's adapter of PyNvVideoCodec's decoder, against a fake of its API (the real one
    runs in TestOnTheGPU)."""

    @pytest.fixture
    def fake(self, monkeypatch):
        def use(**kwargs) -> FakePyNv:
            api = FakePyNv(**kwargs)
            monkeypatch.setitem(sys.modules, "PyNvVideoCodec", api)
            return api

        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: types.SimpleNamespace(cuda_stream=0xABC))
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        return use

    def test_packets_bytes_and_pts_go_in_and_come_back(self, fake):
        api = fake()
        decoder = nvdec.open_decoder("x.ts", "hevc")
        assert api.created == [dict(gpuid=0, codec=8, cudacontext=0, cudastream=0xABC, usedevicememory=True,
                                    outputColorType=0)]
        assert decoder.ordered and decoder.stream.cuda_stream == 0xABC
        packet = av.Packet(b"\x00\x00\x01frame")
        packet.pts = 3003
        [(pts, nv12)] = decoder.decode(packet)
        assert api.fed == [(b"\x00\x00\x01frame", 3003)] and pts == 3003 and nv12.unique().tolist() == [8]
        bare = av.Packet(b"x")                                 # no pts: a pts that comes back as None
        assert decoder.decode(bare)[0][0] is None and api.fed[-1][1] < -(1 << 61)
        assert decoder.decode(None) == [] and api.fed[-1] == (b"", 0)   # an empty PacketData: the end

    def test_decoder_calls_wait_while_a_graph_is_captured(self, fake):
        """Creating a decoder and decoding take the CUDA-graph capture lock (pipeline/runtime/cuda.py
        holds the same one while it captures): NVDEC's own device allocations during a capture in
        another thread broke the VLM's warm-up captures in a live run on an H200."""
        from pipeline.runtime.cuda import CAPTURE_LOCK

        assert CAPTURE_LOCK is nvdec.CAPTURE_LOCK
        fake()
        done: list[str] = []
        packet = av.Packet(b"frame")

        def work() -> None:
            decoder = nvdec.open_decoder("x.ts", "h264")
            done.append("created")
            decoder.decode(packet)
            done.append("decoded")

        with CAPTURE_LOCK:                                     # a capture in progress
            worker = threading.Thread(target=work)
            worker.start()
            worker.join(0.3)
            assert done == []                                  # creation waits for it
        worker.join(5)
        assert done == ["created", "decoded"]

    def test_a_stream_it_does_not_take_means_its_own_and_a_sync(self, fake):
        api = fake(refuse_stream=True)
        decoder = nvdec.open_decoder("x.ts", "h264")
        assert not decoder.ordered and api.created[0]["cudastream"] == 0

    def test_errors_are_one_line(self, fake):
        fake(fail="cuvidCreateDecoder failed\nCUDA_ERROR_NOT_SUPPORTED")
        with pytest.raises(NvdecUnavailable, match=r"^x.ts: decoder=nvdec cannot be used: PyNvVideoCodec cannot "
                                                   r"create a h264 decoder \(cuvidCreateDecoder failed\)$"):
            nvdec.open_decoder("x.ts", "h264")
        fake()
        decoder = nvdec.open_decoder("x.ts", "h264")
        with pytest.raises(nvdec.NvdecError, match=r"^CUDA_ERROR_INVALID_SOURCE$"):
            decoder.decode(av.Packet(b"bad"))


def alone(converter, nv12, index):
    """One frame converted by itself: a batch of one through add and take."""
    converter.add(nv12, index)
    return converter.take()[0]


class TestBatchedConversion:
    def test_batches_equal_frame_by_frame(self, clip):
        planes = [nv12 for _, nv12 in pyav_frames(clip)][:11]
        layout = nvdec.nv12_layout("c", "h264", "yuv420p", 1, 1, 72, 96)
        single = nvdec.Nv12ToRgb(layout, "c", PyAVNv12Decoder("c", "h264"))
        one = [alone(single, p, k) for k, p in enumerate(planes)]
        batched = nvdec.Nv12ToRgb(layout, "c", PyAVNv12Decoder("c", "h264"), batch=4)
        out = []
        for k, p in enumerate(planes):
            batched.add(p, k)
            if batched.full:
                out += list(batched.take())
        out += list(batched.take())                                    # the last 3
        assert len(out) == 11 and all(torch.equal(a, b) for a, b in zip(one, out))
        with pytest.raises(RuntimeError, match="no frames to convert"):
            batched.take()
        with pytest.raises(SourceError, match="frame size or format changed mid-stream at frame 12"):
            batched.add(torch.zeros((10, 8), dtype=torch.uint8), 12)

    @pytest.mark.parametrize("batch", [1, 3, 8, 64])
    def test_the_source_gives_the_same_frames_at_any_batch(self, clip, fake_nvdec, monkeypatch, batch):
        monkeypatch.setattr(nvdec, "CONVERT_BATCH", batch)
        got, _ = read(clip, decoder="nvdec", fps=11.0)
        monkeypatch.setattr(nvdec, "CONVERT_BATCH", 1)
        ref, _ = read(clip, decoder="nvdec", fps=11.0)
        assert [f.index for f in got] == [f.index for f in ref] and len(got) == 20
        assert all(torch.equal(a.rgb, b.rgb) for a, b in zip(got, ref))


class TestDamage:
    def test_a_cut_mpeg_ts_file_stops_where_pyav_does(self, tmp_path, fake_nvdec):
        frames = render_clip([Shot("pan", 40)], height=48, width=64, seed=5).frames
        full = write_ts(tmp_path / "full.ts", frames).read_bytes()
        cut = len(full) * 6 // 10
        cut += 1 if cut % 188 == 0 else 0
        path = tmp_path / "cut.ts"
        path.write_bytes(full[:cut])
        with pytest.warns(VideoTruncatedWarning, match="ends inside a packet"):
            ref, ref_video = read(path)
        with pytest.warns(VideoTruncatedWarning, match="ends inside a packet"):
            got, video = read(path, decoder="nvdec")
        assert video.truncated and ref_video.truncated and 0 < len(got) < 40
        assert [f.index for f in got] == [f.index for f in ref]
        assert np.allclose([f.pts_s for f in got], [f.pts_s for f in ref])


def as_rgb(pixels):
    """A live connection's pixels as a host array: NVDEC's held NV12 converted as a consumer's take
    converts it (nvdec.convert_held), tensors copied to the host."""
    if isinstance(pixels, nvdec.HeldNv12):
        pixels = nvdec.convert_held([pixels])[0]
    return pixels.cpu().numpy() if isinstance(pixels, torch.Tensor) else pixels


class TestHeldFrames:
    """Live NVDEC frames are held as NV12 copies and converted when a consumer takes them: each run
    of one connection's frames in one conversion, frames dropped before being taken never."""

    @staticmethod
    def held(clip, size=None):
        """(HeldNv12 of every frame of the clip through one converter, PyAV's RGB frames)."""
        with av.open(str(clip)) as c:
            frames = list(c.decode(c.streams.video[0]))
        h, w = frames[0].height, frames[0].width
        converter = nvdec.Nv12ToRgb(yuv_layout("yuv420p", 1, 1, h, w, semi_planar=True), "c",
                                    PyAVNv12Decoder("c", "h264"))
        held = [converter.hold(torch.from_numpy(f.reformat(format="nv12").to_ndarray()), k, size or (h, w))
                for k, f in enumerate(frames)]
        return held, [f.to_ndarray(format="rgb24") for f in frames]

    def test_a_batch_equals_frame_by_frame(self, clip):
        held, _ = self.held(clip)
        batch = nvdec.convert_held(held[:7])
        one = torch.stack([nvdec.convert_held([h])[0] for h in held[:7]])
        assert torch.equal(batch, one) and batch.shape == (7, 72, 96, 3)

    def test_runs_of_one_connection_convert_together(self, clip, monkeypatch):
        from sources.frame import Frame
        from sources.live import HeldFrame, frames_of

        a, _ = self.held(clip)
        b, _ = self.held(clip)                                      # another connection (a reconnect)
        calls: list[int] = []
        real = nvdec.convert_held
        monkeypatch.setattr(nvdec, "convert_held", lambda frames: (calls.append(len(frames)), real(frames))[1])
        plain = Frame("s", 2, 0.08, np.zeros((72, 96, 3), np.uint8))
        items = [HeldFrame("s", 0, 0.0, a[0]), HeldFrame("s", 1, 0.04, a[1]), plain,
                 HeldFrame("s", 3, 0.12, a[3]), HeldFrame("s", 4, 0.16, b[4]), HeldFrame("s", 5, 0.2, b[5])]
        out = frames_of(items)
        assert calls == [2, 1, 2]
        assert [f.index for f in out] == [0, 1, 2, 3, 4, 5] and out[2] is plain
        assert all(isinstance(f.rgb, torch.Tensor) and f.rgb.shape == (72, 96, 3) for f in out if f is not plain)
        assert torch.equal(out[4].rgb, real([b[4]])[0])

    def test_frames_dropped_before_a_take_are_never_converted(self, clip, monkeypatch):
        from sources.live import HeldFrame, LatestFrames, frames_of

        held, _ = self.held(clip)
        converted: list[int] = []
        real = nvdec.convert_held
        monkeypatch.setattr(nvdec, "convert_held", lambda frames: (converted.extend(id(f) for f in frames),
                                                                  real(frames))[1])
        buffer = LatestFrames(capacity=3)
        for k in range(10):                                         # the consumer fell behind
            buffer.put(HeldFrame("s", k, k / 25, held[k]))
        frames, _ = buffer.take(8, timeout_s=0.0)
        out = frames_of(frames)
        assert [f.index for f in out] == [7, 8, 9] and buffer.dropped == 7
        assert converted == [id(h) for h in held[7:10]]

    def test_a_stream_back_at_another_size_is_scaled_as_before(self, clip):
        """The connection's frames are wanted at the size the source started with: resized in the
        batch, each frame as it would be alone."""
        import torch.nn.functional as F

        held, _ = self.held(clip, size=(36, 48))
        batch = nvdec.convert_held(held[:4])
        assert batch.shape == (4, 36, 48, 3) and batch.dtype == torch.uint8
        full = nvdec.convert_held(self.held(clip)[0][:4])
        for k in range(4):
            chw = full[k].permute(2, 0, 1)[None].float()
            alone = F.interpolate(chw, size=(36, 48), mode="bilinear", antialias=True, align_corners=False)
            alone = alone[0].permute(1, 2, 0).round_().clamp_(0, 255).to(torch.uint8)
            assert (batch[k].int() - alone.int()).abs().max() <= 1

    def test_mixed_converters_in_one_call_are_refused(self, clip):
        a, _ = self.held(clip)
        b, _ = self.held(clip)
        with pytest.raises(ValueError, match="more than one converter"):
            nvdec.convert_held([a[0], b[1]])


class TestLive:
    """Network streams with live.decoder nvdec: PyAV's connection (a file opened as a stream, and a
    loopback HTTP MPEG-TS stream), its packets through the NVDEC double."""

    def spec(self, target):
        from sources.live import SourceSpec
        return SourceSpec("network", str(target), "clip", "clip")

    def test_network_frames_as_pyav_then_lost(self, clip, fake_nvdec):
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, Lost, NvdecNetworkConnection

        ref, _ = read(clip)
        conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec"), None)
        assert isinstance(conn, NvdecNetworkConnection) and (conn.width, conn.height) == (96, 72)
        got = []
        with pytest.raises(Lost, match="server closed the connection"):
            for item in conn.frames():
                got.append(item)
        conn.close()
        assert len(got) == len(ref) and np.allclose([g[0] for g in got], [f.pts_s for f in ref])
        diff = np.abs(np.stack([as_rgb(g[1]) for g in got]).astype(int) - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.max() <= 2 and all(g[2] is not None for g in got)
        assert fake_nvdec.decoders[0].closed

    def test_no_conversion_until_the_frames_are_wanted(self, clip, fake_nvdec, monkeypatch):
        """Before a live source's consumer is ready, NVDEC still decodes every frame (the references
        of the next ones) but nothing converts them: 32 streams converting during the VLM's warm-up
        starved its captures of the interpreter on an H200 (about 4 s a graph)."""
        from sources import nvdec as module
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, Lost

        ref, _ = read(clip)
        conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec"), None)
        converted: list[int] = []
        real = module.Nv12ToRgb.hold

        def hold(self, nv12, index, size):
            converted.append(index)
            return real(self, nv12, index, size)

        monkeypatch.setattr(module.Nv12ToRgb, "hold", hold)
        wanted = [False]
        conn.wanted = lambda: wanted[0]
        got = []
        with pytest.raises(Lost):
            for _, rgb, _ in conn.frames():
                got.append(rgb)
                if len(got) == 3:
                    wanted[0] = True
        conn.close()
        assert len(got) == len(ref) and got[:3] == [None] * 3 and all(g is not None for g in got[3:])
        assert converted == list(range(3, len(ref)))     # indices count the decoded frames, skipped ones too
        assert np.abs(as_rgb(got[3]).astype(int) - ref[3].rgb.astype(int)).max() <= 2

    @pytest.mark.filterwarnings("ignore:no VLM is loaded")
    def test_a_live_run_takes_held_frames_through_the_pipeline(self, tmp_path, fake_nvdec):
        """`live` with decoder nvdec end to end (CPU, the NVDEC double): the held NV12 frames are
        converted as the capture stage takes them and reach the store like PyAV's."""
        import io

        from pipeline.config import PipelineConfig, RuntimeConfig
        from pipeline.core.live_stages import LiveOptions
        from pipeline.runners.live import run_live
        from sinks import read_stream, validate_store
        from sources.live import LiveConfig

        live = LiveConfig(decoder="nvdec", open_timeout_s=2.0, read_timeout_s=1.0, backoff_initial_s=0.05,
                          backoff_max_s=0.4)
        cfg = PipelineConfig(runtime=RuntimeConfig(device="cpu", batch_size=4, model_weights="none"))
        with http_ts_server(tmp_path, size=(160, 120), fps=30, seconds=2.0) as server:
            result = run_live([server.url()], "where is the ball?", tmp_path / "o.zarr", cfg, live=live,
                              options=LiveOptions(duration_s=2.5), status_out=io.StringIO())
        assert validate_store(tmp_path / "o.zarr") == [] and result.errors == []
        data = read_stream(tmp_path / "o.zarr", result.stream_ids[0])
        assert len(data["pts"]) >= 10 and np.all(np.diff(data["pts"]) > 0)
        assert data["attrs"]["width"] == 160 and data["tokens"].sum() > 0
        assert fake_nvdec.decoders and fake_nvdec.decoders[0].frames >= len(data["pts"])

    def test_loopback_http_stream_as_pyav(self, tmp_path, fake_nvdec):
        """The same live stream, read from its start by both decoders: the same pts, and arrival times
        that are the packets'."""
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, NetworkConnection, NvdecNetworkConnection

        def first(conn, n):
            out = []
            for item in conn.frames():
                out.append(item)
                if len(out) == n:
                    break
            conn.close()
            return out

        with http_ts_server(tmp_path, fps=30) as server:
            spec = self.spec(server.url())
            nv = first(CONNECTIONS["network"](spec, LiveConfig(decoder="nvdec", read_timeout_s=3.0), None), 40)
            ref_conn = CONNECTIONS["network"](spec, LiveConfig(read_timeout_s=3.0), None)
            assert isinstance(ref_conn, NetworkConnection) and not isinstance(ref_conn, NvdecNetworkConnection)
            ref = first(ref_conn, 40)
        assert [round(t, 6) for t, _, _ in nv] == [round(t, 6) for t, _, _ in ref]
        diff = np.abs(np.stack([as_rgb(rgb) for _, rgb, _ in nv]).astype(int) - np.stack([r for _, r, _ in ref]))
        assert diff.max() <= 2
        # past what the probe buffered (~15 frames), the packets come paced at 30 fps, and so do the
        # arrival stamps: the last 20 frames span about 19 frame times. A loaded machine reads some in
        # bursts (CI on 2 busy cores: 14 frame times stamped within 0.10 s), never all at one instant
        span = nv[-1][2] - nv[-20][2]
        assert 19 * 0.004 < span < 19 * 0.06

    def test_reconnect_is_counted_as_pyavs(self, tmp_path, fake_nvdec):
        """The server drops the first connection: one gap, one reconnect, pts never back, with either
        decoder."""
        from sources.live import LiveConfig, open_live

        results = {}
        for decoder in ("pyav", "nvdec"):
            with DroppingServer(tmp_path / decoder, drop_after_s=0.6) as server, warnings.catch_warnings():
                warnings.simplefilter("ignore", StreamInterruptedWarning)
                cfg = LiveConfig(decoder=decoder, read_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.2,
                                 buffer_frames=1000)
                with open_live(server.url(), config=cfg) as src:
                    frames, gaps = [], []
                    deadline = time.monotonic() + 8.0
                    while time.monotonic() < deadline and (not gaps or len(frames) < 40):
                        got, gap = src.take(100, timeout_s=0.05)
                        frames += got
                        gaps += [gap] if gap is not None else []
                    results[decoder] = frames, gaps, src.stats()
        for decoder, (frames, gaps, stats) in results.items():
            pts = np.array([f.pts_s for f in frames])
            assert len(gaps) == 1 and stats.reconnects == 1 and stats.dropped == 0, decoder
            # how FFmpeg sees the close depends on where in a read it comes, for either decoder
            assert gaps[0].reason in ("server closed the connection", "stream error: input/output error"), \
                (decoder, gaps[0].reason)
            assert np.all(np.diff(pts) > 0) and [f.index for f in frames] == list(range(len(frames))), decoder
        assert all(isinstance(f.rgb, torch.Tensor) for f in results["nvdec"][0])

    def test_network_decoder_error_mid_stream_is_a_lost_stream(self, clip, fake_nvdec):
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, Lost

        fake_nvdec.fail_after = 3
        conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec"), None)
        with pytest.raises(Lost, match="stream error: CUDA_ERROR_INVALID_IMAGE"):
            list(conn.frames())
        conn.close()

    def test_a_stream_nvdec_refuses_is_one_line_or_pyav(self, clip, fake_nvdec):
        """Refused before the connection's first frame: NvdecUnavailable, or with live.fallback one
        warning and PyAV's frames from there on (numpy arrays)."""
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, Lost

        fake_nvdec.fail_after = 0
        conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec"), None)
        with pytest.raises(NvdecUnavailable, match=r"^clip: decoder=nvdec cannot be used: NVDEC cannot decode this "
                                                   r"stream \(CUDA_ERROR_INVALID_IMAGE\)$"):
            list(conn.frames())
        conn.close()
        conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec", fallback=True), None)
        got = []
        with pytest.warns(NvdecFallbackWarning, match=r"clip: decoding with pyav: nvdec cannot be used \(NVDEC cannot"):
            with pytest.raises(Lost):
                for item in conn.frames():
                    got.append(item)
        conn.close()
        assert len(got) == 45 and all(isinstance(rgb, np.ndarray) for _, rgb, _ in got)
        assert fake_nvdec.decoders[-1].closed

    def test_a_refused_live_source_ends_with_that_line(self, clip, fake_nvdec):
        from sources.live import LiveConfig, LiveSource, SourceSpec

        fake_nvdec.fail_after = 0
        src = LiveSource(SourceSpec("network", str(clip), "clip", "clip"), LiveConfig(decoder="nvdec")).start()
        deadline = time.monotonic() + 5.0
        while not src.finished and time.monotonic() < deadline:
            src.take(10, timeout_s=0.05)
        src.close()
        assert str(src.error) == "clip: decoder=nvdec cannot be used: NVDEC cannot decode this stream " \
                                 "(CUDA_ERROR_INVALID_IMAGE)"

    def test_network_refusal_and_fallback(self, clip, monkeypatch):
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, NetworkConnection

        def missing(name):
            raise NvdecUnavailable(name, "PyNvVideoCodec is not installed")

        monkeypatch.setattr(nvdec, "check_available", missing)
        with pytest.raises(NvdecUnavailable, match="clip: decoder=nvdec cannot be used: PyNvVideoCodec"):
            CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec"), None)
        with pytest.warns(NvdecFallbackWarning, match="clip: decoding with pyav: nvdec cannot be used"):
            conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec", fallback=True), None)
        assert isinstance(conn, NetworkConnection)
        conn.close()

    def test_realtime_file_frames_are_tensors(self, clip, fake_nvdec):
        from sources.live import LiveConfig, open_live

        with open_live(str(clip), config=LiveConfig(realtime=True, decoder="nvdec", buffer_frames=100)) as live:
            frames = []
            while not live.finished:
                frames += live.take(100, timeout_s=0.2)[0]
        assert len(frames) == 45 and all(isinstance(f.rgb, torch.Tensor) for f in frames)

    def test_bad_decoder_name(self):
        from arr_coc._validate import ConfigError
        from sources.live import LiveConfig

        with pytest.raises(ConfigError, match="live.decoder"):
            LiveConfig(decoder="decord")


class DroppingServer(TSServer):
    """A loopback HTTP MPEG-TS stream whose first connection is closed after `drop_after_s`; later
    ones play on."""

    def __init__(self, tmp, drop_after_s: float) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.drop_after_s, self.connections = drop_after_s, 0
        super().__init__(encode_clip(tmp / "clip.ts", 160, 120, 30, 2.0))

    def send(self, wfile) -> None:
        self.connections += 1
        if self.connections > 1:
            serve_ts(self.clip, wfile, self.stop)
            return
        stop = threading.Event()
        timer = threading.Timer(self.drop_after_s, stop.set)
        timer.start()
        try:
            serve_ts(self.clip, wfile, stop)
        finally:
            timer.cancel()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_without_a_gpu_nvdec_is_one_clear_error(clip):
    with pytest.raises(NvdecUnavailable, match="decoder=nvdec cannot be used: no CUDA GPU is available"):
        open_video(clip, decoder="nvdec")
    with pytest.warns(NvdecFallbackWarning, match="no CUDA GPU"):
        with open_video(clip, decoder="nvdec", fallback=True) as video:
            assert video.decoder == "pyav"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_NVDEC, reason="needs a CUDA GPU and PyNvVideoCodec")
class TestOnTheGPU:
    @pytest.fixture(scope="class")
    def h264(self, tmp_path_factory):
        frames = render_clip([Shot("moving_object", 40, speed=2.0), Shot("pan", 35)], height=360, width=640,
                             seed=2).frames
        return write_video(tmp_path_factory.mktemp("gpu") / "clip.mp4", frames, fps=30)

    def test_file_frames_equal_pyav(self, h264):
        ref, _ = read(h264)
        got, video = read(h264, decoder="nvdec")
        assert [f.index for f in got] == [f.index for f in ref]
        assert np.allclose([f.pts_s for f in got], [f.pts_s for f in ref])
        assert all(f.rgb.is_cuda for f in got)
        diff = np.abs(np.stack([f.host_rgb() for f in got]).astype(int) - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 4, (diff.mean(), diff.max())
        assert not video.truncated

    def test_live_file_frames_equal_pyav(self, h264):
        from sources.live import LiveConfig, open_live

        ref, _ = read(h264)
        with open_live(str(h264), config=LiveConfig(realtime=True, decoder="nvdec", buffer_frames=200)) as live:
            frames = []
            while not live.finished:
                frames += live.take(200, timeout_s=0.2)[0]
        assert len(frames) == len(ref) and all(f.rgb.is_cuda for f in frames)
        diff = np.abs(np.stack([f.host_rgb() for f in frames]).astype(int) - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 4, (diff.mean(), diff.max())

    def test_network_connection_frames_equal_pyav(self, h264):
        """The network path (PyAV's connection, its packets to NVDEC), on a file for a stream."""
        from sources.live import LiveConfig, SourceSpec
        from sources.live_connections import CONNECTIONS, Lost, NvdecNetworkConnection

        ref, _ = read(h264)
        conn = CONNECTIONS["network"](SourceSpec("network", str(h264), "clip", "clip"), LiveConfig(decoder="nvdec"),
                                      None)
        assert isinstance(conn, NvdecNetworkConnection)
        got = []
        with pytest.raises(Lost):
            for item in conn.frames():
                got.append(item)
        conn.close()
        times, ref_times = np.array([g[0] for g in got]), np.array([f.pts_s for f in ref])
        assert len(got) == len(ref) and np.allclose(times - times[0], ref_times - ref_times[0], atol=1e-3)
        rgb = np.stack([as_rgb(g[1]) for g in got]).astype(int)
        diff = np.abs(rgb - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 4, (diff.mean(), diff.max())

    @pytest.mark.parametrize("kwargs", [dict(fps=7.0), dict(start_s=1.1, end_s=2.0), dict(start_s=0.5, max_frames=9)])
    def test_sampling_and_seeking_as_pyav(self, h264, kwargs):
        ref, _ = read(h264, **kwargs)
        got, _ = read(h264, decoder="nvdec", **kwargs)
        assert [f.index for f in got] == [f.index for f in ref] and len(got) > 0
        assert np.allclose([f.pts_s for f in got], [f.pts_s for f in ref])
        diff = np.abs(np.stack([f.host_rgb() for f in got]).astype(int) - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 4, (diff.mean(), diff.max())

    def test_mpeg_ts_file_equals_pyav(self, tmp_path):
        frames = render_clip([Shot("moving_object", 30, speed=2.0)], height=240, width=320, seed=6).frames
        path = write_ts(tmp_path / "c.ts", frames)
        ref, _ = read(path)
        got, _ = read(path, decoder="nvdec")
        assert [f.index for f in got] == [f.index for f in ref] and len(got) == 30
        assert np.allclose([f.pts_s for f in got], [f.pts_s for f in ref])
        diff = np.abs(np.stack([f.host_rgb() for f in got]).astype(int) - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 4, (diff.mean(), diff.max())

    def test_the_decoder_writes_on_our_stream(self):
        """PyNvVideoCodec took our CUDA stream: no host sync per frame (else it still decodes, slower)."""
        decoder = nvdec.open_decoder("probe", "h264")
        try:
            assert decoder.ordered and decoder.stream is not None
        finally:
            decoder.close()

    def test_conversion_on_the_gpu_equals_the_cpu(self):
        g = torch.Generator().manual_seed(0)
        for fmt, colorspace, rotation in (("yuv420p", 1, 0), ("yuvj420p", 5, 90), ("yuv420p", 2, 180)):
            layout = nvdec.nv12_layout("c", "h264", fmt, colorspace, 1, 90, 160, rotation)
            planes = torch.randint(0, 256, (5, layout.frame_bytes), generator=g, dtype=torch.uint8)
            cpu, gpu = yuv_to_rgb(planes, layout), yuv_to_rgb(planes.cuda(), layout).cpu()
            assert (cpu.int() - gpu.int()).abs().max() <= 1 and (cpu != gpu).float().mean() < 1e-3
            decoder = types.SimpleNamespace(stream=torch.cuda.Stream(), ordered=True)
            batched = nvdec.Nv12ToRgb(layout, "c", decoder, batch=5)
            for k, p in enumerate(planes.cuda()):
                batched.add(p.view(135, 160), k)
            single = nvdec.Nv12ToRgb(layout, "c", decoder)
            one = [alone(single, p.view(135, 160), k) for k, p in enumerate(planes.cuda())]
            assert torch.equal(batched.take(), torch.stack(one))

    def test_live_http_mpeg_ts_stream_equals_pyav(self, http_stream):
        """The live path end to end: a loopback HTTP MPEG-TS stream (what PyNvVideoCodec's own
        demuxer never opened), demuxed by PyAV, decoded by NVDEC, against PyAV's decode of the same
        stream from its start: the same pts, pixels within the conversion's rounding."""
        from sources.live import LiveConfig, SourceSpec
        from sources.live_connections import CONNECTIONS, NvdecNetworkConnection

        spec = SourceSpec("network", http_stream.url(), "cam", "cam")

        def first(conn, n):
            out = []
            try:
                for t, rgb, came in conn.frames():
                    out.append((t, as_rgb(rgb), came))
                    if len(out) == n:
                        return out
            finally:
                conn.close()

        started = time.monotonic()
        conn = CONNECTIONS["network"](spec, LiveConfig(decoder="nvdec", open_timeout_s=5.0), None)
        assert isinstance(conn, NvdecNetworkConnection) and time.monotonic() - started < 5.0
        got = first(conn, 60)
        ref = first(CONNECTIONS["network"](spec, LiveConfig(open_timeout_s=5.0), None), 60)
        assert [round(t, 6) for t, _, _ in got] == [round(t, 6) for t, _, _ in ref]
        diff = np.abs(np.stack([r for _, r, _ in got]).astype(int) - np.stack([r for _, r, _ in ref]).astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 4, (diff.mean(), diff.max())
        assert all(came is not None for _, _, came in got)

    def test_live_source_reconnects_with_nvdec(self, tmp_path):
        from sources.live import LiveConfig, open_live

        with DroppingServer(tmp_path, drop_after_s=1.0) as server, warnings.catch_warnings():
            warnings.simplefilter("ignore", StreamInterruptedWarning)
            cfg = LiveConfig(decoder="nvdec", read_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.2,
                             buffer_frames=1000)
            with open_live(server.url(), config=cfg) as src:
                frames, gaps = [], []
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and (not gaps or len(frames) < 60):
                    got, gap = src.take(100, timeout_s=0.05)
                    frames += got
                    gaps += [gap] if gap is not None else []
                stats = src.stats()
        assert src.error is None and len(gaps) == 1 and stats.reconnects == 1 and stats.dropped == 0
        assert all(f.rgb.is_cuda for f in frames) and np.all(np.diff([f.pts_s for f in frames]) > 0)
