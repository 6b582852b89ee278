"""decord's frames without asnumpy(): chunks are views of decord's own memory, bit-identical to
asnumpy(), and the decode worker hands over exactly what in-process decoding gives."""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

decord = pytest.importorskip("decord")

from sources import VideoTruncatedWarning, open_video  # noqa: E402
from sources.process import ProcessSource  # noqa: E402
from sources.synthetic import Shot, render_clip, write_video  # noqa: E402

from process_helpers import collect  # noqa: E402

N_FRAMES = 43  # one full decord chunk (32 frames at this size) and a partial one


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    clip = render_clip([Shot("moving_object", 23, speed=2.0), Shot("pan", 20)], height=72, width=96, seed=5)
    return write_video(tmp_path_factory.mktemp("decord") / "clip.mkv", clip.frames, fps=25)


def reference(path, **kwargs):
    """(indices, pts, rgb) of in-process decoding, each frame copied out of its chunk."""
    with open_video(path, decoder="decord", **kwargs) as src:
        frames = list(src)
        truncated = src.truncated
    return [f.index for f in frames], [f.pts_s for f in frames], np.stack([f.rgb for f in frames]), truncated


def test_chunks_are_bit_identical_to_asnumpy_and_outlive_the_source(clip_path):
    expected = decord.VideoReader(str(clip_path), ctx=decord.cpu(0)).get_batch(list(range(N_FRAMES))).asnumpy()
    with open_video(clip_path, decoder="decord") as src:
        chunks = list(src.decoded_chunks())
        assert not src.truncated
    assert [len(idx) for idx, _, _ in chunks] == [32, 11]
    gc.collect()
    for _ in range(3):  # new allocations would reuse the chunks' memory if the views did not hold it
        decord.VideoReader(str(clip_path), ctx=decord.cpu(0)).get_batch(list(range(N_FRAMES)))
    rgb = np.concatenate([c for _, _, c in chunks])
    assert np.array_equal(rgb, expected)
    assert [i for idx, _, _ in chunks for i in idx] == list(range(N_FRAMES))
    assert [t for _, pts, _ in chunks for t in pts] == pytest.approx(np.arange(N_FRAMES) / 25, abs=1e-3)
    first = chunks[0][2]
    assert first.flags.c_contiguous and first.flags.writeable and not first.flags.owndata  # no copy made


def test_decoded_chunks_reads_once(clip_path):
    with open_video(clip_path, decoder="decord") as src:
        list(src)
        with pytest.raises(RuntimeError, match="read once"):
            src.decoded_chunks()


@pytest.mark.parametrize("batch_size, kwargs", [(5, {}), (16, {"fps": 10.0}), (4, {"start_s": 0.5, "max_frames": 30})])
def test_worker_gives_the_in_process_frames(clip_path, batch_size, kwargs):
    # batch sizes that do not divide decord's chunks: slots are filled across chunk boundaries
    indices, pts, rgb, _ = reference(clip_path, **kwargs)
    with ProcessSource(clip_path, batch_size=batch_size, slots=2, decoder="decord", **kwargs) as src:
        assert src.yuv is None
        got_indices, got_pts, got_rgb = collect(src)
        assert not src.truncated
    assert got_indices == indices and len(indices) > batch_size
    assert got_pts == pytest.approx(pts)
    assert np.array_equal(got_rgb, rgb)


def test_worker_keeps_decord_truncation(clip_path, tmp_path):
    data = clip_path.read_bytes()
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(data[: len(data) * 6 // 10])
    with pytest.warns(VideoTruncatedWarning):
        indices, _, rgb, truncated = reference(cut)
    assert truncated and 0 < len(indices) < N_FRAMES
    with ProcessSource(cut, batch_size=8, slots=2, decoder="decord") as src, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_indices, _, got_rgb = collect(src)
        assert src.truncated
    assert any(issubclass(w.category, VideoTruncatedWarning) for w in caught)
    assert got_indices == indices and np.array_equal(got_rgb, rgb)
