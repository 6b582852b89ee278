"""decoder="nvdec": the NV12 conversion, the source's sampling / timestamps / damage semantics and
its refusals, on CPU through a double of sources.nvdec's NvdecSession (frames PyAV decodes,
repacked as NV12 tensors the way NVDEC hands them over); on a GPU with PyNvVideoCodec, NVDEC's
own frames against PyAV's, for a file and a live source."""
from __future__ import annotations

import importlib.util
import sys
import threading
import time
import warnings

import av
import numpy as np
import pytest
import torch

from sources import NvdecFallbackWarning, NvdecUnavailable, SourceError, VideoTruncatedWarning, open_video
from sources import nvdec
from sources.synthetic import Shot, render_clip, write_video
from sources.yuv import yuv_layout, yuv_to_rgb

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


class TestLive:
    """Network streams (here: a file opened as one) and realtime files with live.decoder nvdec."""

    def spec(self, clip):
        from sources.live import SourceSpec
        return SourceSpec("network", str(clip), "clip", "clip")

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
        diff = np.abs(np.stack([g[1].numpy() for g in got]).astype(int) - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.max() <= 2 and all(g[2] is not None for g in got)

    def test_network_decoder_error_is_a_lost_stream(self, clip, fake_nvdec):
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, Lost

        fake_nvdec.fail_after = 3
        conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec"), None)
        with pytest.raises(Lost, match="stream error: cuda_error_invalid_image|stream error: CUDA_ERROR"):
            list(conn.frames())
        conn.close()

    def test_network_stall(self, clip, fake_nvdec, monkeypatch):
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, Stalled

        stop = threading.Event()

        def stalled(self):   # a stream whose demuxer blocks: no frame, no error
            stop.wait(5.0)
            yield from ()

        monkeypatch.setattr(PyAVNv12Session, "frames", stalled)
        conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec", read_timeout_s=0.2), None)
        with pytest.raises(Stalled):
            next(conn.frames())
        stop.set()
        conn.close()

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

    def test_a_demuxer_that_never_opens_is_refused_within_the_open_timeout(self, clip, fake_nvdec, monkeypatch):
        """Seen on an H200: PyNvVideoCodec's demuxer never returned from opening a live HTTP stream.
        The connection gives up after live.open_timeout_s (NVDEC unavailable: PyAV with fallback)."""
        from sources.live import LiveConfig
        from sources.live_connections import CONNECTIONS, NetworkConnection

        release = threading.Event()

        def hangs(target, gpu_id=None):
            release.wait(10.0)
            return PyAVNv12Session(target)

        monkeypatch.setattr(nvdec, "open_session", hangs)
        started = time.monotonic()
        with pytest.raises(NvdecUnavailable, match="did not open the stream within 0.3 s"):
            CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec", open_timeout_s=0.3), None)
        assert time.monotonic() - started < 5.0
        with pytest.warns(NvdecFallbackWarning, match=r"decoding with pyav: nvdec cannot be used \(its demuxer"):
            conn = CONNECTIONS["network"](self.spec(clip), LiveConfig(decoder="nvdec", open_timeout_s=0.3,
                                                                      fallback=True), None)
        assert isinstance(conn, NetworkConnection)
        conn.close()
        release.set()

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
        """The network path (PyAV's probe, the session in a reader thread), on a file for a stream."""
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
        rgb = np.stack([g[1].cpu().numpy() for g in got]).astype(int)
        diff = np.abs(rgb - np.stack([f.rgb for f in ref]).astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 4, (diff.mean(), diff.max())
