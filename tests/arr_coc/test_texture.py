"""Texture: channel contract, per-frame normalisation, colour science, motion / residual on clips."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.texture import CHANNELS, Texture, TextureConfig, TextureExtractor, rgb_to_lab
from sources.synthetic import Shot, render_clip

GRID = (9, 12)  # 144 x 192 clips: 16 px per cell
SIGNED = {"lab_a", "sobel_gx", "sobel_gy", "flow_dy", "flow_dx"}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def frames_of(clip) -> torch.Tensor:
    return torch.from_numpy(clip.frames).permute(0, 3, 1, 2).contiguous()  # (T, 3, H, W) uint8


@pytest.fixture(scope="module")
def extractor() -> TextureExtractor:
    return TextureExtractor()


@pytest.fixture(scope="module")
def pan() -> torch.Tensor:
    return frames_of(render_clip([Shot("pan", 4, speed=2.0)], seed=1))


@pytest.fixture(scope="module")
def cut() -> torch.Tensor:
    return frames_of(render_clip([Shot("static", 2), Shot("static", 2)], seed=2))


@pytest.fixture(scope="module")
def moving() -> tuple[torch.Tensor, list]:
    clip = render_clip([Shot("moving_object", 3, speed=3.0)], seed=3)
    return frames_of(clip), clip.boxes


class TestContract:
    @pytest.mark.parametrize("with_prev", [False, True])
    def test_shapes_dtypes_ranges(self, extractor, pan, with_prev):
        tex = extractor(pan[1:], pan[:-1] if with_prev else None, GRID)
        b = pan.shape[0] - 1
        assert len(CHANNELS) == 17 and tex.data.shape == (b, 17, *GRID)
        assert tex.flow.shape == (b, 2, *GRID) and tex.cell_rgb.shape == (b, 3, *GRID)
        assert tex.motion.shape == tex.residual.shape == (b, *GRID)
        assert tex.has_prev.dtype == torch.bool and tex.has_prev.tolist() == [with_prev] * b
        for field in (tex.data, tex.flow, tex.motion, tex.residual, tex.cell_rgb):
            assert field.dtype == torch.float32 and torch.isfinite(field).all()
        for name in CHANNELS:
            values = tex.channel(name)
            lo = -1.0 if name in SIGNED else 0.0
            assert values.min() >= lo - 1e-6 and values.max() <= 1.0 + 1e-6, name
        assert (tex.channel("relevance_cache") == 0).all()
        if not with_prev:
            for name in ("motion", "flow_dy", "flow_dx"):
                assert (tex.channel(name) == 0).all(), name

    def test_content_dependent_channels_use_their_range(self, extractor, pan):
        tex = extractor(pan[1:], pan[:-1], GRID)
        for name in ("sobel_gx", "sobel_gy", "sobel_mag", "saliency", "motion"):
            peak = tex.channel(name).abs().flatten(1).amax(1)
            torch.testing.assert_close(peak, torch.ones_like(peak), msg=name)
        assert (tex.channel("saliency").flatten(1).amin(1) == 0).all()

    def test_channel_by_name_and_with_channel(self, extractor, pan):
        tex = extractor(pan[1:], pan[:-1], GRID)
        for i, name in enumerate(CHANNELS):
            assert torch.equal(tex.channel(name), tex.data[:, i])
        with pytest.raises(KeyError, match="relevance_cache"):
            tex.channel("relevance")
        cache = torch.rand(pan.shape[0] - 1, *GRID)
        new = tex.with_channel("relevance_cache", cache)
        assert isinstance(new, Texture) and new is not tex
        assert torch.equal(new.channel("relevance_cache"), cache)
        assert (tex.channel("relevance_cache") == 0).all()  # the original is untouched
        assert torch.equal(new.channel("saliency"), tex.channel("saliency"))
        with pytest.raises(ValueError, match="shape"):
            tex.with_channel("relevance_cache", cache[:, :1])

    def test_per_frame_normalisation(self, extractor, pan, cut):
        """A frame's texture is the same whatever else is in the batch."""
        a = extractor(pan[1:2], pan[0:1], GRID)
        with_pan = extractor(pan[1:3], pan[0:2], GRID)
        dark_cut = torch.cat([pan[1:2], cut[2:3] // 4])
        with_cut = extractor(dark_cut, torch.cat([pan[0:1], cut[1:2]]), GRID)
        for other in (with_pan, with_cut):
            for field in ("data", "flow", "motion", "residual", "cell_rgb"):
                torch.testing.assert_close(getattr(other, field)[:1], getattr(a, field), atol=1e-4, rtol=0, msg=field)
        assert not torch.allclose(with_cut.data[1], with_pan.data[1], atol=1e-2)  # the partner did change

    def test_uint8_and_float_input_agree(self, extractor, pan):
        as_uint8 = extractor(pan[1:], pan[:-1], GRID)
        as_float = extractor(pan[1:].float() / 255, pan[:-1].float() / 255, GRID)
        torch.testing.assert_close(as_float.data, as_uint8.data, atol=1e-5, rtol=0)
        torch.testing.assert_close(as_float.residual, as_uint8.residual, atol=1e-6, rtol=0)

    @pytest.mark.parametrize("size, grid", [((37, 53), (3, 5)), ((20, 31), (4, 5)), ((143, 97), (7, 4))])
    def test_odd_sizes(self, extractor, size, grid):
        frames = torch.randint(0, 256, (2, 3, *size), dtype=torch.uint8)
        tex = extractor(frames, frames.roll(1, -1), grid)
        assert tex.data.shape == (2, 17, *grid) and torch.isfinite(tex.data).all()

    def test_output_dtype_follows_config(self, pan):
        tex = TextureExtractor(TextureConfig(dtype="float16"))(pan[1:], pan[:-1], GRID)
        assert tex.data.dtype == tex.flow.dtype == tex.residual.dtype == torch.float16

    def test_has_prev_mask_zeroes_motion_rows(self, extractor, pan):
        tex = extractor(pan[1:3], pan[0:2], GRID, has_prev=torch.tensor([True, False]))
        assert tex.has_prev.tolist() == [True, False]
        assert tex.motion[0].mean() > 0.005
        for field in (tex.flow[1], tex.motion[1], tex.residual[1], tex.channel("motion")[1]):
            assert (field == 0).all()

    @pytest.mark.parametrize("bad, match", [
        (lambda f: (f[:, :2], None, GRID), r"\(B, 3, H, W\)"),
        (lambda f: (f, f[:, :, :-1], GRID), "prev"),
        (lambda f: (f, None, (0, 4)), "grid"),
        (lambda f: (f.int(), None, GRID), "uint8"),
    ])
    def test_rejects_bad_input(self, extractor, pan, bad, match):
        with pytest.raises(ValueError, match=match):
            extractor(*bad(pan[:2]))


class TestConfig:
    @pytest.mark.parametrize("kwargs, match", [
        ({"cell_px": 1}, "cell_px=1"), ({"flow_window": 8}, "flow_window=8"),
        ({"flow_levels": 2.5}, "flow_levels"), ({"saliency_scales": ()}, "saliency_scales"),
        ({"saliency_scales": (1.0, -2.0)}, r"saliency_scales\[1\]"), ({"motion_floor": 0}, "motion_floor"),
        ({"dtype": "int8"}, "dtype='int8'"),
    ])
    def test_rejects_out_of_range(self, kwargs, match):
        with pytest.raises(ConfigError, match=match):
            TextureConfig(**kwargs)

    def test_frozen(self):
        with pytest.raises(AttributeError):
            TextureConfig().cell_px = 4


class TestColour:
    def test_lab_of_known_colours(self):
        # CIE L*a*b* (D65) of sRGB primaries and greys, as tabulated by colour-science references
        rgb = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1], [0, 0, 0], [0.5, 0.5, 0.5]],
                           dtype=torch.float64).T.reshape(1, 3, 1, 6)
        expected = torch.tensor([[53.24, 80.09, 67.20], [87.73, -86.18, 83.18], [32.30, 79.19, -107.86],
                                 [100.0, 0.0, 0.0], [0.0, 0.0, 0.0], [53.39, 0.0, 0.0]], dtype=torch.float64)
        lab, luminance = rgb_to_lab(rgb)
        torch.testing.assert_close(lab[0, :, 0].T, expected, atol=0.02, rtol=0)
        torch.testing.assert_close(luminance[0, 0, 0, :4], torch.tensor([0.2127, 0.7152, 0.0722, 1.0],
                                                                        dtype=torch.float64), atol=1e-3, rtol=0)

    def test_lab_matches_opencv(self):
        img = np.random.default_rng(0).random((16, 16, 3)).astype(np.float32)
        ref = cv2.cvtColor(img, cv2.COLOR_RGB2Lab)  # OpenCV's float path uses lookup tables: ~0.2 off
        lab, _ = rgb_to_lab(torch.from_numpy(img).permute(2, 0, 1)[None])
        np.testing.assert_allclose(lab[0].permute(1, 2, 0).numpy(), ref, atol=0.35)

    def test_colour_channels_of_a_red_frame(self, extractor):
        red = torch.zeros(1, 3, 64, 80, dtype=torch.uint8)
        red[:, 0] = 255
        tex = extractor(red, None, (4, 5))
        for name, value in (("r", 1.0), ("g", 0.0), ("b", 0.0), ("lab_l", 0.5324), ("lab_a", 80.09 / 128),
                            ("luminance", 0.2127)):
            torch.testing.assert_close(tex.channel(name), torch.full((1, 4, 5), value), atol=1e-3, rtol=0, msg=name)
        for name in ("sobel_gx", "sobel_gy", "sobel_mag", "saliency"):  # flat: ~zeros, not NaN or +-1
            assert tex.channel(name).abs().max() < 1e-4, name


class TestSpatialChannels:
    def test_position_and_eccentricity(self, extractor):
        tex = extractor(torch.zeros(1, 3, 90, 90), None, (3, 3))
        torch.testing.assert_close(tex.channel("pos_y")[0, :, 0], torch.tensor([1 / 6, 0.5, 5 / 6]))
        torch.testing.assert_close(tex.channel("pos_x")[0, 0], torch.tensor([1 / 6, 0.5, 5 / 6]))
        ecc = tex.channel("eccentricity")[0]
        assert ecc[1, 1] == 0 and torch.allclose(ecc[0, 0], torch.tensor(2 / 3))
        assert ecc[0, 1] < ecc[0, 0]

    def test_sobel_follows_a_horizontal_ramp(self, extractor):
        ramp = torch.linspace(0.1, 0.9, 96).view(1, 1, 1, 96).expand(1, 3, 64, 96)
        tex = extractor(ramp, None, (4, 6))
        assert (tex.channel("sobel_gx") > 0.9).all()
        assert tex.channel("sobel_gy").abs().max() < 1e-4

    def test_saliency_peaks_on_an_odd_patch(self, extractor):
        frame = torch.full((1, 3, 96, 128), 0.4)
        frame[:, :, 40:56, 80:96] = torch.tensor([0.9, 0.1, 0.1]).view(3, 1, 1)  # cell (2, 5) of a (6, 8) grid
        sal = extractor(frame, None, (6, 8)).channel("saliency")[0]
        assert divmod(int(sal.argmax()), 8) == (2, 5)
        assert sal[0, 0] < 0.1


class TestMotion:
    def test_identical_frames_have_no_motion(self, extractor, pan):
        tex = extractor(pan[:2], pan[:2].clone(), GRID)
        assert tex.motion.abs().max() == 0 and tex.channel("motion").abs().max() == 0
        assert tex.flow.abs().max() < 1e-4 and tex.residual.max() < 1e-4

    def test_pan_is_explained_by_flow(self, extractor, pan):
        tex = extractor(pan[1:], pan[:-1], GRID)
        # the camera moves right 2 px a frame, so content moves left by 2 / 16 of a cell
        interior = tex.flow[:, :, 1:-1, 1:-1]
        torch.testing.assert_close(interior[:, 1].mean((1, 2)), torch.full((3,), -0.125), atol=0.02, rtol=0)
        assert interior[:, 0].abs().max() < 0.03
        assert (tex.residual.mean((1, 2)) < 0.1 * tex.motion.mean((1, 2))).all()
        assert (tex.channel("flow_dx")[:, 1:-1, 1:-1] < -0.5).all()

    def test_cut_leaves_a_large_residual_everywhere(self, extractor, cut, pan):
        tex = extractor(cut[1:], cut[:-1], GRID)  # frames 1 -> 2 is the cut
        pan_residual = extractor(pan[1:], pan[:-1], GRID).residual.mean()
        at_cut = tex.residual[1]
        assert at_cut.mean() > 20 * pan_residual
        assert (at_cut > 0.02).float().mean() > 0.9
        assert tex.residual[0].max() < 1e-4 and tex.residual[2].max() < 1e-4  # static within each shot

    def test_moving_object_flow_points_along_its_motion(self, extractor, moving):
        frames, boxes = moving
        tex = extractor(frames[1:], frames[:-1], GRID)
        y0, x0, y1, x1 = boxes[1]
        cy, cx = (y0 + y1) // 32, (x0 + x1) // 32  # centre cell of the object (16 px cells)
        assert tex.flow[0, 1, cy, cx] > 0.1       # moves right, 3 / 16 of a cell a frame
        assert tex.channel("motion")[0, cy, :].max() == 1.0  # the brightest motion is on its row
        # a flat square only shows motion at its edges, so flow explains part of the change
        assert tex.residual[0].sum() < 0.6 * tex.motion[0].sum()
        still = tex.motion[0] == 0  # the background around it stays still: no invented flow or change
        assert still.float().mean() > 0.8
        assert (tex.flow[0][:, still] == 0).all() and (tex.residual[0][still] == 0).all()


@pytest.mark.cuda
@cuda
def test_cpu_and_cuda_agree(extractor, pan, cut):
    frames = torch.cat([pan[1:], cut[2:3]])
    prev = torch.cat([pan[:-1], cut[1:2]])
    cpu = extractor(frames, prev, GRID)
    gpu = extractor(frames.cuda(), prev.cuda(), GRID)
    for field in ("data", "flow", "motion", "residual", "cell_rgb"):
        torch.testing.assert_close(getattr(gpu, field).cpu(), getattr(cpu, field), atol=2e-3, rtol=0, msg=field)


class TestSequence:
    """sequence(frames, last) resizes each frame once; it must equal forward() with explicit prev."""

    @pytest.mark.parametrize("with_last", [True, False])
    def test_equals_forward_with_shifted_prev(self, with_last):
        from sources.synthetic import Shot, render_clip
        clip = render_clip([Shot("moving_object", 6, speed=3.0)], height=100, width=130, seed=2)
        x = torch.from_numpy(clip.frames).permute(0, 3, 1, 2)              # (6, 3, 100, 130)
        extractor = TextureExtractor()
        last = x[0] if with_last else None
        frames = x[1:] if with_last else x
        got = extractor.sequence(frames, last, (4, 5))
        first = x[0:1] if with_last else frames[:1]
        prev = torch.cat([first, frames[:-1]])
        has_prev = torch.ones(len(frames), dtype=torch.bool)
        has_prev[0] = with_last
        want = extractor(frames, prev, (4, 5), has_prev=has_prev)
        for name in ("data", "flow", "motion", "residual", "cell_rgb", "has_prev"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=name)

    @pytest.mark.parametrize("b", [1, 4])
    @pytest.mark.parametrize("blank", [False, True])
    def test_first_frame_standing_in_for_last_equals_none(self, b, blank):
        """A stream's start as a CUDA graph runs it: last = frames[0] marked not real (last_real
        False) gives the texture of last=None, blank frames included (flow of a flat image), and
        B = 1, where last=None computes no motion at all. The floats agree within rounding, not
        bit for bit: last is resized alone, frames[0] within the batch, and the CPU kernels may
        sum in another order for another batch size (AVX-512 Xeons differ by ~1e-6)."""
        from sources.synthetic import Shot, render_clip
        clip = render_clip([Shot("moving_object", b, speed=3.0)], height=100, width=130, seed=4)
        frames = torch.from_numpy(clip.frames).permute(0, 3, 1, 2)
        if blank:
            frames = torch.zeros_like(frames)
        extractor = TextureExtractor()
        want = extractor.sequence(frames, None, (4, 5))
        got = extractor.sequence(frames, frames[0], (4, 5), torch.tensor(False))
        for name in ("data", "flow", "motion", "residual", "cell_rgb"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=0, msg=name)
        assert torch.equal(got.has_prev, want.has_prev)
        real = extractor.sequence(frames, frames[0], (4, 5), torch.tensor(True))
        assert bool(real.has_prev.all())                                   # True: a real last frame

    def test_large_downscale_matches_plain_area_resize_closely(self):
        # the integer pre-pooling before the area resize drops under k edge pixels, nothing more
        import numpy as np
        from sources.synthetic import smooth_texture
        image = smooth_texture(np.random.default_rng(0), 1024, 1024, cells=24)
        frames = torch.from_numpy(image).permute(2, 0, 1)[None]            # (1, 3, 1024, 1024)
        extractor = TextureExtractor()
        fast = extractor._prepare(frames, (288, 288), torch.float32)
        exact = torch.nn.functional.interpolate(frames.float() / 255, size=(288, 288), mode="area")
        assert fast.shape == exact.shape
        assert (fast - exact).abs().mean() < 0.01  # grain (sd 6/255) included
