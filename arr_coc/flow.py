"""Dense optical flow in pure torch: pyramidal Lucas-Kanade with warping, batched over frames.

No pretrained weights are involved, so it runs anywhere torch runs. Every step is a whole-image
tensor op (grid_sample, 3x3 convolutions, avg_pool windowed sums); the only Python loops are over
pyramid levels and refinement iterations.

Convention (shared with arr_coc.texture): flow channel 0 is dy, channel 1 is dx, in pixels, and
content moved by flow from prev to cur, i.e. cur(y, x) ~ prev(y - dy, x - dx).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._consts import arange, constant

# Tikhonov term added to the diagonal of the 2x2 structure tensor (intensity^2 / pixel^2, images in
# [0, 1]). It keeps flat regions at zero update instead of NaN, and damps the aperture problem along
# straight edges; real texture has eigenvalues orders of magnitude above it.
_RIDGE = 1e-6
# Largest update one iteration may take (pixels at the current level). Lucas-Kanade's linearisation
# only holds for about a pixel; the pyramid, not one big step, handles large motion.
_MAX_STEP = 1.0
# Sobel d/dy and d/dx kernels, scaled by 1/8 to give intensity per pixel; 5-tap binomial blur
_SOBEL = tuple(v / 8.0 for v in (-1.0, -2.0, -1.0, 0.0, 0.0, 0.0, 1.0, 2.0, 1.0,
                                 -1.0, 0.0, 1.0, -2.0, 0.0, 2.0, -1.0, 0.0, 1.0))
_BINOMIAL = tuple(v / 16.0 for v in (1.0, 4.0, 6.0, 4.0, 1.0))


def sobel(gray: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sobel derivatives (d/dy, d/dx) of (B, 1, H, W) images, in intensity per pixel (kernel / 8).

    Borders are replicated, so a flat image has exactly zero gradient everywhere.
    """
    kernels = constant(_SOBEL, (2, 1, 3, 3), gray.device, gray.dtype)  # (2, 1, 3, 3): d/dy, d/dx
    padded = F.pad(gray, (1, 1, 1, 1), mode="replicate")      # (B, 1, H+2, W+2)
    grad = F.conv2d(padded, kernels)                          # (B, 2, H, W)
    return grad[:, 0:1], grad[:, 1:2]


def warp(image: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Backward warp: out(p) = image(p - flow(p)), bilinear, borders replicated.

    image: (B, C, h, w); flow: (B, 2, h, w) as (dy, dx) in pixels. Returns (B, C, h, w).
    With flow from prev to cur, warp(prev, flow) predicts cur.
    """
    if image.dim() != 4 or flow.dim() != 4 or flow.shape[1] != 2:
        raise ValueError(f"warp expects image (B, C, h, w) and flow (B, 2, h, w), "
                         f"got {tuple(image.shape)} and {tuple(flow.shape)}")
    if image.shape[0] != flow.shape[0] or image.shape[-2:] != flow.shape[-2:]:
        raise ValueError(f"warp: image {tuple(image.shape)} and flow {tuple(flow.shape)} "
                         f"must share batch and spatial size")
    return sample(image, sampling_grid(flow))


def sampling_grid(flow: torch.Tensor) -> torch.Tensor:
    """(B, 2, h, w) flow (dy, dx) in pixels -> (B, h, w, 2) grid_sample grid of the points p - flow(p).

    Split from `warp` so a caller warping many maps with one flow builds the grid once."""
    _, _, h, w = flow.shape
    ys = arange(h, flow.device, flow.dtype).view(1, h, 1)
    xs = arange(w, flow.device, flow.dtype).view(1, 1, w)
    src_y = ys - flow[:, 0]                                   # (B, h, w) source row of each output pixel
    src_x = xs - flow[:, 1]                                   # (B, h, w)
    # align_corners=True maps pixel centres 0 and n-1 to -1 and +1; max() keeps 1-pixel axes finite
    return torch.stack([src_x * (2.0 / max(w - 1, 1)) - 1.0,
                        src_y * (2.0 / max(h - 1, 1)) - 1.0], dim=-1)  # (B, h, w, 2) as (x, y)


def sample(image: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Bilinear grid_sample of (B, C, h, w) at a `sampling_grid`, borders replicated."""
    return F.grid_sample(image, grid.to(image.dtype), mode="bilinear", padding_mode="border", align_corners=True)


def _blur(gray: torch.Tensor) -> torch.Tensor:
    """Separable 5-tap binomial blur (sigma ~ 1 px) of (B, 1, H, W), borders replicated."""
    k = constant(_BINOMIAL, (5,), gray.device, gray.dtype)
    out = F.conv2d(F.pad(gray, (2, 2, 0, 0), mode="replicate"), k.view(1, 1, 1, 5))
    return F.conv2d(F.pad(out, (0, 0, 2, 2), mode="replicate"), k.view(1, 1, 5, 1))


def _pyramid(gray: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """Fine-to-coarse list of blurred, 2x-downsampled images (ceil sizes: odd sides lose nothing).

    Every level is blurred because pixel noise and grain sit near the Nyquist frequency, where a
    3x3 derivative underestimates the true gradient while the temporal difference does not; on
    such images unblurred Lucas-Kanade overshoots each step by ~2x and oscillates.
    """
    pyramid = [_blur(gray)]
    for _ in range(levels - 1):
        pyramid.append(_blur(F.avg_pool2d(pyramid[-1], 2, ceil_mode=True)))
    return pyramid


def _box_mean(x: torch.Tensor, window: int) -> torch.Tensor:
    """Mean over the window x window box around each pixel of (B, C, h, w), counting only pixels
    inside the image. One 2-D pass, not two separable ones: at the working sizes the front end is
    bound by kernel launches, not by the k^2 reads."""
    r = window // 2
    return F.avg_pool2d(x, window, stride=1, padding=r, count_include_pad=False)


def _lk_step(prev: torch.Tensor, cur: torch.Tensor, cur_grad: tuple[torch.Tensor, torch.Tensor],
             flow: torch.Tensor, window: int) -> torch.Tensor:
    """One Gauss-Newton update of flow (B, 2, h, w) at one pyramid level."""
    warped = warp(prev, flow)                                 # (B, 1, h, w): prev moved onto cur
    wy, wx = sobel(warped)
    # averaging both images' gradients (symmetric LK) roughly halves the linearisation error
    iy = 0.5 * (wy + cur_grad[0])                             # (B, 1, h, w)
    ix = 0.5 * (wx + cur_grad[1])
    it = cur - warped
    products = torch.cat([ix * ix, ix * iy, iy * iy, ix * it, iy * it], dim=1)  # (B, 5, h, w)
    sums = _box_mean(products, window)                        # (B, 5, h, w) windowed means
    sxx, sxy, syy, sxt, syt = sums.unbind(1)                  # each (B, h, w)
    sxx = sxx + _RIDGE
    syy = syy + _RIDGE
    det = sxx * syy - sxy * sxy                               # > 0: PSD matrix plus ridge
    # cur(p) ~ warped(p) - grad . step  =>  (sum g g^T) step = -(sum g it)
    step_x = (sxy * syt - syy * sxt) / det
    step_y = (sxy * sxt - sxx * syt) / det
    step = torch.stack([step_y, step_x], dim=1).clamp(-_MAX_STEP, _MAX_STEP)  # (B, 2, h, w)
    flow = flow + step
    # Each pixel's window assumes one displacement, yet warping with a per-pixel field lets
    # neighbouring estimates disagree; fed back, that disagreement grows every iteration. Averaging
    # the field over the same window keeps it consistent with the windows (the cost: motion
    # boundaries blur by half a window, under one texture grid cell at the default settings).
    return _box_mean(flow, window)


def optical_flow(prev_gray: torch.Tensor, cur_gray: torch.Tensor, *, levels: int = 3,
                 iters: int = 3, window: int = 7) -> torch.Tensor:
    """Dense flow from prev to cur: (B, 1, H, W) each -> (B, 2, H, W) as (dy, dx) in pixels.

    cur(y, x) ~ prev(y - dy, x - dx). Intensities are expected in [0, 1] (the regulariser is
    scaled for that). levels: pyramid levels (each halves the size; capped so the coarsest level
    still holds a few windows). iters: warp-and-solve iterations per level. window: odd side of
    the square Lucas-Kanade window in pixels.
    """
    if prev_gray.dim() != 4 or prev_gray.shape[1] != 1 or prev_gray.shape != cur_gray.shape:
        raise ValueError(f"optical_flow expects two (B, 1, H, W) images of one shape, "
                         f"got {tuple(prev_gray.shape)} and {tuple(cur_gray.shape)}")
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels={levels!r} is invalid; allowed: an int >= 1")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters={iters!r} is invalid; allowed: an int >= 1")
    if isinstance(window, bool) or not isinstance(window, int) or window < 3 or window % 2 == 0:
        raise ValueError(f"window={window!r} is invalid; allowed: an odd int >= 3")
    out_dtype = prev_gray.dtype
    # half precision cannot resolve the small products in the structure tensor
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    prev, cur = prev_gray.to(work), cur_gray.to(work)
    h, w = prev.shape[-2:]
    usable = 1 + int(math.floor(math.log2(max(min(h, w) / (2 * window), 1.0))))
    prev_pyr = _pyramid(prev, min(levels, usable))
    cur_pyr = _pyramid(cur, min(levels, usable))
    flow = prev.new_zeros(prev.shape[0], 2, *prev_pyr[-1].shape[-2:])  # (B, 2, h_top, w_top)
    for prev_l, cur_l in zip(reversed(prev_pyr), reversed(cur_pyr)):
        if flow.shape[-2:] != prev_l.shape[-2:]:
            # the ceil-mode pyramid halves coordinates exactly, so displacements double
            flow = 2.0 * F.interpolate(flow, size=prev_l.shape[-2:], mode="bilinear",
                                       align_corners=False)  # (B, 2, h_l, w_l)
        cur_grad = sobel(cur_l)
        for _ in range(iters):
            flow = _lk_step(prev_l, cur_l, cur_grad, flow, window)
    return flow.to(out_dtype)
