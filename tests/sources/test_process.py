"""Decoding in a worker process gives exactly what decoding in the caller's thread gives."""
from __future__ import annotations

import os
import signal
import time
import warnings

import av
import numpy as np
import pytest

from sources import SourceError, VideoTruncatedWarning, open_video
from sources.process import DEFAULT_SHARED_BYTES, DecodeWorker, ProcessSource, slot_layout
from sources.synthetic import Shot, render_clip, write_video

from process_helpers import collect

DECODERS = ("pyav", "decord")   # the host decoders; nvdec: tests/sources/test_nvdec.py


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    clip = render_clip([Shot("moving_object", 23, speed=2.0), Shot("pan", 20)], height=72, width=96, seed=5)
    return write_video(tmp_path_factory.mktemp("proc") / "clip.mkv", clip.frames, fps=25)


def test_same_frames_as_in_process_decoding(clip_path):
    with open_video(clip_path, fps=10) as src:
        ref = list(src)
    with ProcessSource(clip_path, batch_size=4, slots=2, fps=10) as src:
        assert (src.stream_id, src.width, src.height, src.fps) == ("clip", 96, 72, 10)
        indices, pts, rgb = collect(src)
        assert not src.truncated
    assert indices == [f.index for f in ref]
    assert pts == pytest.approx([f.pts_s for f in ref])
    assert np.array_equal(rgb, np.stack([f.rgb for f in ref]))
    assert len(indices) % 4 != 0  # the short last batch arrived too


def test_bad_input_fails_in_the_caller(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        ProcessSource(tmp_path / "missing.mp4", batch_size=4)
    with pytest.raises(ValueError, match="slots >= 2"):
        ProcessSource(tmp_path / "x.mp4", batch_size=4, slots=1)


def test_truncated_file_warns_and_flags(clip_path, tmp_path):
    data = clip_path.read_bytes()
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(data[: len(data) * 6 // 10])
    with ProcessSource(cut, batch_size=8) as src, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        indices, _, _ = collect(src)
        assert src.truncated
    assert 0 < len(indices) < 43
    assert any(issubclass(w.category, VideoTruncatedWarning) for w in caught)


def test_dead_worker_is_a_clear_error(clip_path):
    with ProcessSource(clip_path, batch_size=2, slots=2) as src:
        batches = src.batches()
        next(batches)                        # the worker now waits for a free slot
        os.kill(src._worker.proc.pid, signal.SIGKILL)
        with pytest.raises(SourceError, match=r"decoder process died \(killed by SIGKILL, out of memory\?\)"):
            for _ in range(100):
                next(batches)


def test_worker_exits_when_the_parent_stops_it_early(clip_path):
    src = ProcessSource(clip_path, batch_size=2, slots=2)
    next(src.batches())
    src.close()
    deadline = time.time() + 5
    while src._worker.proc.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert not src._worker.proc.is_alive()


def test_device_color_hands_over_yuv_planes_that_convert_to_the_rgb_frames(clip_path):
    import torch

    from sources.yuv import yuv_to_rgb

    with open_video(clip_path) as src:
        ref = np.stack([f.rgb for f in src])
    with ProcessSource(clip_path, batch_size=8, slots=2, device_color=True) as src:
        assert src.yuv is not None and src.yuv.frame_bytes == 72 * 96 * 3 // 2
        planes, indices = [], []
        for batch in src.batches():
            with pytest.raises(ValueError, match="YUV planes"):
                _ = batch.rgb
            planes.append(yuv_to_rgb(torch.from_numpy(batch.pixels.copy()), batch.yuv).numpy())
            indices += batch.indices
            src.release(batch)
    got = np.concatenate(planes).astype(int)
    assert indices == list(range(len(ref)))
    diff = np.abs(got - ref)
    assert diff.max() <= 2 and diff.mean() < 0.9


def test_device_color_keeps_rgb_where_the_stream_needs_it(clip_path, tmp_path):
    with ProcessSource(clip_path, batch_size=8, slots=2, device_color=True, decoder="decord") as src:
        assert src.yuv is None                         # decord only gives RGB
    odd = render_clip([Shot("moving_object", 6)], height=41, width=57, seed=1)
    path = write_video(tmp_path / "odd.mkv", odd.frames, fps=25, codec="mpeg4")
    with ProcessSource(path, batch_size=8, slots=2, device_color=True) as src:
        assert src.yuv is None                         # odd size
        indices, _, rgb = collect(src)
    assert rgb.shape == (6, 41, 57, 3) and indices == list(range(6))


class TestSharedWorker:
    """One DecodeWorker serving video after video: the same frames as a fresh process each time."""

    @pytest.fixture(scope="class")
    @classmethod
    def clips(cls, tmp_path_factory):
        d = tmp_path_factory.mktemp("shared")
        sizes = [(72, 96), (48, 64), (72, 96)]
        return [write_video(d / f"c{i}.mp4", render_clip([Shot("pan", 12 + 5 * i)], height=h, width=w, seed=i).frames,
                            fps=25) for i, (h, w) in enumerate(sizes)]

    def test_videos_of_different_sizes_in_one_process(self, clips):
        worker = DecodeWorker()
        try:
            pid = worker.proc.pid
            for path in clips:
                with open_video(path) as src:
                    ref = np.stack([f.rgb for f in src])
                with ProcessSource(path, batch_size=4, slots=2, worker=worker) as src:
                    indices, _, rgb = collect(src)
                assert indices == list(range(len(ref)))
                np.testing.assert_array_equal(rgb, ref)
                assert worker.alive and worker.proc.pid == pid        # not a new process per video
        finally:
            worker.close()
        assert not worker.proc.is_alive()

    def test_a_video_stopped_early_leaves_nothing_for_the_next(self, clips):
        worker = DecodeWorker()
        try:
            src = ProcessSource(clips[0], batch_size=2, slots=2, worker=worker)
            batches = src.batches()
            next(batches)                     # slots of this video are out; the worker waits for more
            src.close()                       # stopped early: its slot numbers and messages are stale now
            with open_video(clips[2]) as ref_src:
                ref = np.stack([f.rgb for f in ref_src])
            with ProcessSource(clips[2], batch_size=2, slots=2, worker=worker) as src:
                indices, _, rgb = collect(src)
            assert indices == list(range(len(ref)))
            np.testing.assert_array_equal(rgb, ref)
        finally:
            worker.close()

    def test_a_damaged_video_then_a_good_one(self, clip_path, clips, tmp_path):
        cut = tmp_path / "cut.mkv"
        data = clip_path.read_bytes()
        cut.write_bytes(data[: len(data) * 6 // 10])
        worker = DecodeWorker()
        try:
            with ProcessSource(cut, batch_size=4, slots=2, worker=worker) as src, warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                collect(src)
                assert src.truncated
            with open_video(clips[0]) as ref_src:
                n = sum(1 for _ in ref_src)
            with ProcessSource(clips[0], batch_size=4, slots=2, worker=worker) as src:
                assert collect(src)[0] == list(range(n))
        finally:
            worker.close()

    def test_a_video_closed_before_the_worker_reached_it_is_skipped(self, clips, capfd):
        worker = DecodeWorker()
        try:
            shape = (2, 4, 72, 96, 3)
            worker.submit(str(clips[0]), {}, "arrcoc-gone-before-start", shape, None)  # slots already unlinked
            with open_video(clips[2]) as ref_src:
                ref = np.stack([f.rgb for f in ref_src])
            with ProcessSource(clips[2], batch_size=4, slots=2, worker=worker) as src:
                indices, _, rgb = collect(src)
            np.testing.assert_array_equal(rgb, ref)
            assert worker.alive and "Traceback" not in capfd.readouterr().err
        finally:
            worker.close()

    def test_a_closed_worker_is_refused(self, clips):
        worker = DecodeWorker()
        worker.close()
        with pytest.raises(ValueError, match="closed or has died"):
            ProcessSource(clips[0], batch_size=4, worker=worker)


class TestFrameMemory:
    """The shared slots are sized from the frame size and a byte budget, not from the batch alone;
    frames above max_pixels are refused before any is decoded."""

    @pytest.mark.parametrize("slots, batch, frame_bytes, budget, want", [
        (6, 16, 100, 6 * 16 * 100, (6, 16)),      # fits: as asked
        (6, 16, 100, 3 * 16 * 100 + 99, (3, 16)),  # fewer slots, each a whole batch
        (6, 16, 100, 2 * 16 * 100 - 1, (2, 15)),   # two slots of as many frames as fit
        (6, 16, 10**6, 1, (2, 1)),                  # never less than two frames
    ])
    def test_slot_layout(self, slots, batch, frame_bytes, budget, want):
        assert slot_layout(slots, batch, frame_bytes, budget) == want

    def test_slots_fit_the_budget_and_every_frame_still_arrives(self, clip_path):
        frame_bytes = 72 * 96 * 3
        budget = 5 * frame_bytes   # 6 slots x 16 frames would take 96 frames
        with ProcessSource(clip_path, batch_size=16, slots=6, shared_bytes=budget) as src:
            assert (src.slots, src.batch_size) == (2, 2) and src.buffer.nbytes <= budget
            indices, pts, rgb = collect(src)
        with open_video(clip_path) as video:
            ref = list(video)
        assert indices == [f.index for f in ref] and pts == pytest.approx([f.pts_s for f in ref])
        assert np.array_equal(rgb, np.stack([f.rgb for f in ref]))

    def test_default_budget_is_a_gibibyte(self, clip_path):
        assert DEFAULT_SHARED_BYTES == 1 << 30
        with ProcessSource(clip_path, batch_size=16, slots=6) as src:   # 96 small frames fit: as asked
            assert (src.slots, src.batch_size) == (6, 16)

    @pytest.mark.parametrize("decoder", DECODERS)
    def test_frames_above_max_pixels_are_one_line(self, clip_path, decoder):
        for opener in (lambda: open_video(clip_path, decoder=decoder, max_pixels=96 * 72 - 1),
                       lambda: ProcessSource(clip_path, batch_size=4, decoder=decoder, max_pixels=96 * 72 - 1)):
            with pytest.raises(SourceError) as err:
                opener()
            assert str(err.value) == (f"{clip_path}: frames of 96x72 (0.0 megapixels) are above the limit of "
                                      f"0.0 megapixels (max_pixels={96 * 72 - 1})")
        with open_video(clip_path, decoder=decoder, max_pixels=96 * 72) as video:   # at the limit: fine
            assert video.width * video.height == 96 * 72

    def test_an_8000x8000_frame_is_refused_by_default(self, tmp_path):
        """The fault-injection case (18.4 GB of slots for one frame): refused from the header, in
        the caller, before a slot is allocated. PNG in MOV: a 64-megapixel frame encodes in ~0.3 s."""
        path = tmp_path / "huge.mov"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("png", rate=1)
            stream.width, stream.height, stream.pix_fmt = 8000, 8000, "gray"
            frame = av.VideoFrame(8000, 8000, "gray")
            frame.planes[0].update(bytes(frame.planes[0].buffer_size))
            for packet in [*stream.encode(frame), *stream.encode()]:
                container.mux(packet)
        for decoder in DECODERS:
            with pytest.raises(SourceError, match=r"frames of 8000x8000 \(64\.0 megapixels\) are above the limit "
                                                  r"of 35\.4 megapixels \(max_pixels=35389440\)"):
                ProcessSource(path, batch_size=16, slots=6, decoder=decoder)
