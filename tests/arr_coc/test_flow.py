"""Optical flow: known translations against ground truth and OpenCV's DIS flow on the same pair."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from arr_coc.flow import optical_flow, sobel, warp
from sources.synthetic import smooth_texture

H, W = 96, 128
MARGIN = 12  # interior: LK windows and the border replicate in warp are off near the edges

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def canvas() -> np.ndarray:
    """Grey textured canvas, larger than the frames so shifted crops have real content."""
    rgb = smooth_texture(np.random.default_rng(7), H + 40, W + 40, cells=8)
    return cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY).astype(np.float32)


def shifted(canvas: np.ndarray, dy: float, dx: float) -> np.ndarray:
    """uint8 (H, W) crop of canvas with its content moved by (dy, dx): out(y, x) = canvas(y - dy, x - dx)."""
    m = np.float32([[1, 0, dx], [0, 1, dy]])
    out = cv2.warpAffine(canvas, m, canvas.shape[::-1], flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REFLECT)
    return np.clip(np.round(out[20:20 + H, 20:20 + W]), 0, 255).astype(np.uint8)


def as_tensor(gray: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gray).float().div(255.0)[None, None]  # (1, 1, H, W)


def interior_epe(flow_dy: np.ndarray, flow_dx: np.ndarray, dy: float, dx: float) -> float:
    inner = (slice(MARGIN, -MARGIN), slice(MARGIN, -MARGIN))
    return float(np.sqrt((flow_dy[inner] - dy) ** 2 + (flow_dx[inner] - dx) ** 2).mean())


class TestTranslations:
    @pytest.mark.parametrize("dy, dx", [(1.0, -2.0), (3.0, 4.0), (0.0, 6.0),      # integer
                                        (0.5, 0.25), (-1.3, 0.7), (2.6, -5.4)])  # sub-pixel
    def test_recovers_shift_like_dis(self, canvas, dy, dx):
        prev, cur = shifted(canvas, 0.0, 0.0), shifted(canvas, dy, dx)
        ours = optical_flow(as_tensor(prev), as_tensor(cur), levels=3, iters=3, window=7)[0].numpy()
        dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM).calc(prev, cur, None)  # (H, W, [dx, dy])
        ours_epe = interior_epe(ours[0], ours[1], dy, dx)
        dis_epe = interior_epe(dis[..., 1], dis[..., 0], dy, dx)
        assert ours_epe < 0.25, f"end-point error {ours_epe:.3f} px (DIS: {dis_epe:.3f})"
        assert ours_epe < dis_epe + 0.05, f"ours {ours_epe:.3f} px vs DIS {dis_epe:.3f} px"

    def test_batched_pairs_are_independent(self, canvas):
        pairs = [(0.5, 0.25), (-2.0, 3.0)]
        prev = torch.cat([as_tensor(shifted(canvas, 0, 0))] * 2)                 # (2, 1, H, W)
        cur = torch.cat([as_tensor(shifted(canvas, dy, dx)) for dy, dx in pairs])
        batched = optical_flow(prev, cur)
        for i in range(2):
            alone = optical_flow(prev[i:i + 1], cur[i:i + 1])
            torch.testing.assert_close(batched[i:i + 1], alone, atol=1e-4, rtol=0)
        means = batched[:, :, MARGIN:-MARGIN, MARGIN:-MARGIN].mean((2, 3))
        torch.testing.assert_close(means, torch.tensor(pairs), atol=0.1, rtol=0)


class TestDegenerateInputs:
    def test_identical_frames_give_zero_flow(self, canvas):
        img = as_tensor(shifted(canvas, 0, 0))
        flow = optical_flow(img, img.clone())
        assert flow.abs().max().item() < 1e-4  # grid_sample coordinate round-off only

    def test_flat_image_has_no_nan(self):
        flat = torch.full((2, 1, 40, 50), 0.5)
        flow = optical_flow(flat, flat + 0.1)  # a brightness change with no texture to track
        assert torch.isfinite(flow).all()
        assert flow.abs().max().item() < 1e-6

    def test_half_flat_image_is_finite_and_still_tracks_texture(self, canvas):
        prev = as_tensor(shifted(canvas, 0, 0))
        cur = as_tensor(shifted(canvas, 0.0, 1.5))
        prev[..., :, : W // 2] = 0.3
        cur[..., :, : W // 2] = 0.3
        flow = optical_flow(prev, cur)
        assert torch.isfinite(flow).all()
        textured = flow[0, 1, MARGIN:-MARGIN, W // 2 + MARGIN:-MARGIN]
        assert abs(textured.mean().item() - 1.5) < 0.15

    @pytest.mark.parametrize("size", [(1, 1), (5, 3), (37, 53)])
    def test_odd_and_tiny_sizes(self, size):
        prev = torch.rand(2, 1, *size)
        flow = optical_flow(prev, prev.roll(1, -1))
        assert flow.shape == (2, 2, *size)
        assert torch.isfinite(flow).all()

    def test_keeps_float64(self, canvas):
        img = as_tensor(shifted(canvas, 0, 0)).double()
        assert optical_flow(img, img).dtype == torch.float64

    @pytest.mark.parametrize("kwargs, bad", [({"window": 8}, "window=8"), ({"levels": 0}, "levels=0"),
                                             ({"iters": 0}, "iters=0")])
    def test_rejects_bad_arguments(self, kwargs, bad):
        img = torch.rand(1, 1, 32, 32)
        with pytest.raises(ValueError, match=bad):
            optical_flow(img, img, **kwargs)

    def test_rejects_mismatched_shapes(self):
        with pytest.raises(ValueError, match=r"\(B, 1, H, W\)"):
            optical_flow(torch.rand(1, 1, 32, 32), torch.rand(1, 1, 32, 31))


class TestWarp:
    def test_integer_shift_is_exact(self):
        img = torch.rand(1, 3, 20, 30)
        flow = torch.tensor([2.0, -3.0]).view(1, 2, 1, 1).expand(1, 2, 20, 30)
        out = warp(img, flow)  # out(y, x) = img(y - 2, x + 3)
        torch.testing.assert_close(out[..., 2:, :-3], img[..., :-2, 3:], atol=1e-5, rtol=0)

    def test_estimated_flow_moves_prev_onto_cur(self, canvas):
        prev = as_tensor(shifted(canvas, 0, 0))
        cur = as_tensor(shifted(canvas, -1.3, 2.7))
        flow = optical_flow(prev, cur)
        truth = torch.tensor([-1.3, 2.7]).view(1, 2, 1, 1).expand(1, 2, H, W)
        inner = (..., slice(MARGIN, -MARGIN), slice(MARGIN, -MARGIN))
        before = (cur - prev)[inner].abs().mean().item()
        after = (cur - warp(prev, flow))[inner].abs().mean().item()
        # bilinear resampling of the pixel grain leaves a floor that even the true flow hits
        floor = (cur - warp(prev, truth))[inner].abs().mean().item()
        assert after < 0.3 * before, f"|cur - warp(prev)| {after:.4f} vs |cur - prev| {before:.4f}"
        assert after < 1.25 * floor, f"|cur - warp(prev)| {after:.4f} vs {floor:.4f} with the true flow"

    def test_zero_flow_is_identity(self):
        img = torch.rand(2, 3, 11, 17)
        torch.testing.assert_close(warp(img, torch.zeros(2, 2, 11, 17)), img, atol=1e-6, rtol=0)


def test_sobel_of_a_ramp():
    ramp = torch.arange(10.0).view(1, 1, 1, 10).expand(1, 1, 8, 10) * 0.01  # +0.01 per column
    gy, gx = sobel(ramp)
    torch.testing.assert_close(gx[..., 1:-1], torch.full_like(gx[..., 1:-1], 0.01))
    assert gy.abs().max().item() < 1e-7


@pytest.mark.cuda
@cuda
def test_cpu_and_cuda_agree(canvas):
    prev = as_tensor(shifted(canvas, 0, 0))
    cur = as_tensor(shifted(canvas, 1.7, -2.2))
    cpu = optical_flow(prev, cur)
    gpu = optical_flow(prev.cuda(), cur.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-3, rtol=0)
