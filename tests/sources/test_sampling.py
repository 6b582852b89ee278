"""sources/sampling.py's NonrefSkip: with a target fps, PyAV leaves the non-reference frames the
sampler will not keep undecoded. Every read must give what a full decode gives: the same frames,
bit for bit, at the same indices and times, and the same truncation verdicts."""
from __future__ import annotations

import warnings

import av
import numpy as np
import pytest

from sources import open_video
from sources import video as video_module
from sources.synthetic import Shot, render_clip, write_video


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling")
    frames = render_clip([Shot("moving_object", 40, speed=2.0), Shot("pan", 35, speed=1.5)], height=72, width=96,
                         seed=11).frames
    return {"mp4": write_video(d / "clip.mp4", frames, fps=25), "mkv": write_video(d / "clip.mkv", frames, fps=25)}


def read(path, monkeypatch=None, full: bool = False, **kwargs):
    """(frames, the source, warnings) of one read; full: with NonrefSkip off (every frame decoded)."""
    if full:
        monkeypatch.setattr(video_module, "NONREF_CODECS", ())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_video(path, decoder="pyav", **kwargs) as video:
            frames = list(video)
    if full:
        monkeypatch.undo()
    return frames, video, caught


def test_the_clip_has_non_reference_frames(clips):
    with av.open(str(clips["mp4"])) as c:
        kinds = [f.pict_type for f in c.decode(video=0)]
    assert kinds.count(av.video.frame.PictureType.B) > 20


@pytest.mark.parametrize("kwargs", [dict(fps=2), dict(fps=5, threads=1), dict(fps=5, threads=4), dict(fps=3.3),
                                    dict(fps=25), dict(fps=2, start_s=0.9), dict(fps=4, start_s=1.3, end_s=2.5),
                                    dict(fps=6, max_frames=5)])
@pytest.mark.parametrize("container", ["mp4", "mkv"])
def test_the_same_frames_as_a_full_decode(clips, monkeypatch, kwargs, container):
    got, video, got_warnings = read(clips[container], **kwargs)
    ref, _, ref_warnings = read(clips[container], monkeypatch, full=True, **kwargs)
    assert [(f.index, round(f.pts_s, 6)) for f in got] == [(f.index, round(f.pts_s, 6)) for f in ref]
    assert all(np.array_equal(a.rgb, b.rgb) for a, b in zip(got, ref))
    assert [str(w.message) for w in got_warnings] == [str(w.message) for w in ref_warnings] == []
    assert not video.truncated
    if kwargs["fps"] < 10:
        assert video._nonref is not None and video._nonref.skipped > 0   # frames really were left undecoded


def test_without_a_target_fps_every_frame_is_decoded(clips):
    frames, video, _ = read(clips["mp4"])
    assert video._nonref is None and len(frames) == 75


def test_decode_workers_get_the_same_indices(clips, monkeypatch):
    """decoded_frames() (the decode worker's read: YUV frames, no RGB) keeps the same frames."""
    def indices(full: bool):
        if full:
            monkeypatch.setattr(video_module, "NONREF_CODECS", ())
        with open_video(clips["mp4"], decoder="pyav", fps=2) as video:
            out = [(i, round(t, 6), frame.to_ndarray().tobytes()) for i, t, frame in video.decoded_frames()]
        monkeypatch.undo()
        return out

    assert indices(False) == indices(True)


def test_a_cut_file_is_still_truncated(clips, tmp_path, monkeypatch):
    """A file cut short warns as it does with every frame decoded, and keeps the same frames."""
    data = clips["mkv"].read_bytes()
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    got, video, got_warnings = read(cut, fps=3)
    ref, ref_video, ref_warnings = read(cut, monkeypatch, full=True, fps=3)
    assert [(f.index, f.pts_s) for f in got] == [(f.index, f.pts_s) for f in ref]
    assert video.truncated and ref_video.truncated and len(got) < 20
    assert [str(w.message) for w in got_warnings] == [str(w.message) for w in ref_warnings] != []
