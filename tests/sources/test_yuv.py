"""The device-side YUV -> RGB conversion reproduces what the RGB decode path gives."""
from __future__ import annotations

import av
import numpy as np
import pytest
import torch
from av.video.reformatter import VideoReformatter

from sources.synthetic import Shot, render_clip, write_video
from sources.yuv import YuvLayout, matches, write_planes, yuv_layout, yuv_to_rgb

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def decoded(path, n=6):
    with av.open(str(path)) as c:
        return [f for _, f in zip(range(n), c.decode(c.streams.video[0]))]


@pytest.fixture(scope="module")
def clip_frames(tmp_path_factory):
    clip = render_clip([Shot("moving_object", 6, speed=3.0)], height=72, width=96, seed=3)
    return decoded(write_video(tmp_path_factory.mktemp("yuv") / "c.mkv", clip.frames, fps=25))


def convert(frames, layout, device):
    flat = np.zeros((len(frames), layout.frame_bytes), np.uint8)
    for k, f in enumerate(frames):
        write_planes(f, flat[k], layout)
    return yuv_to_rgb(torch.from_numpy(flat).to(device), layout).cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("colorspace,color_range", [(2, 0), (1, 1), (5, 2)], ids=["unspecified", "bt709", "bt601-full"])
def test_matches_swscale(clip_frames, device, colorspace, color_range):
    for f in clip_frames:  # the tags are what FFmpeg would read from the stream
        f.colorspace, f.color_range = colorspace, color_range
    f0 = clip_frames[0]
    layout = yuv_layout(f0.format.name, colorspace, color_range, f0.height, f0.width)
    assert layout is not None and all(matches(layout, f) for f in clip_frames)
    got = convert(clip_frames, layout, device).astype(int)
    ref = np.stack([VideoReformatter().reformat(f, format="rgb24").to_ndarray() for f in clip_frames]).astype(int)
    diff = np.abs(got - ref)
    assert got.shape == ref.shape
    assert diff.max() <= 2 and diff.mean() < 0.9, (diff.max(), diff.mean())
    # the tags matter: converting with the wrong matrix or range is visibly off
    wrong = YuvLayout(layout.height, layout.width, 0.2126 if layout.kr != 0.2126 else 0.299,
                      0.0722 if layout.kb != 0.0722 else 0.114, not layout.full_range)
    assert np.abs(convert(clip_frames, wrong, device).astype(int) - ref).mean() > 3


@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_rotation_matches_numpy(clip_frames, rotation):
    f0 = clip_frames[0]
    plain = yuv_layout(f0.format.name, 2, 0, f0.height, f0.width)
    turned = yuv_layout(f0.format.name, 2, 0, f0.height, f0.width, rotation)
    got, ref = convert(clip_frames, turned, "cpu"), convert(clip_frames, plain, "cpu")
    assert got.shape[1:3] == turned.upright
    assert np.array_equal(got, np.stack([np.rot90(r, rotation // 90) for r in ref]))


def test_unsupported_formats_keep_the_rgb_path():
    assert yuv_layout("yuv420p10le", 2, 0, 72, 96) is None
    assert yuv_layout("yuv444p", 2, 0, 72, 96) is None
    assert yuv_layout("yuv420p", 9, 0, 72, 96) is None   # BT.2020
    assert yuv_layout("yuv420p", 2, 0, 45, 67) is None    # odd sizes: swscale interpolates chroma there
    assert yuv_layout("yuvj420p", 2, 0, 72, 96).full_range
    assert yuv_layout("yuv420p", 1, 1, 46, 68).frame_bytes == 46 * 68 + 2 * 23 * 34
