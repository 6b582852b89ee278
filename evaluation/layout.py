"""Where the objects of a generated clip are, frame by frame, for the renderers of evaluation/renderers.py.

A shot is a world (a background larger than the frame) holding 2-8 objects, seen through a camera
that stays still, shakes, pans or zooms. Objects are planned in world pixels; the camera maps a
world box to frame pixels at every frame. Every object stays fully in view for its whole shot and
never overlaps another (an object may be partly hidden by an occluder the renderer draws, never by
another object, so counts stay exact). A moving object travels in a straight line against the
background; under a panning or zooming camera nothing moves against the background (every object
moves in the frame), so "moving" keeps one meaning. One object may appear late (staggered), so
"the object that appears last" has an answer. Colours may repeat (a colour group), so "how many red
objects" has one.

Everything is drawn from the generator given, so a clip is deterministic from its seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from .scenes import COLORS, SHAPES

Box = tuple[int, int, int, int]  # (y0, x0, y1, x1) pixels, end-exclusive
CAMERAS = ("still", "shake", "pan", "zoom")


@dataclass(frozen=True)
class Body:
    """One object in world pixels: its box at its shot's frame 0, moved by velocity every frame."""
    color: str
    shape: str
    size: str                            # "small" | "large"
    side: int                            # world pixels
    start: tuple[float, float]           # (y, x) top-left at frame 0
    velocity: tuple[float, float]        # world pixels per frame
    appear: int                          # the first frame of the shot it is drawn in

    def box(self, f: int) -> Box:
        y = int(round(self.start[0] + self.velocity[0] * f))
        x = int(round(self.start[1] + self.velocity[1] * f))
        return (y, x, y + self.side, x + self.side)


@dataclass(frozen=True)
class Camera:
    """Per frame the world window (top-left y, x) and its zoom z: the window is z times the frame's
    size, so z < 1 magnifies."""
    frame: tuple[int, int]               # (H, W)
    path: tuple[tuple[float, float, float], ...]

    def window(self, f: int) -> tuple[float, float, float, float]:
        y, x, z = self.path[f]
        return y, x, y + z * self.frame[0], x + z * self.frame[1]

    def to_frame(self, box: Box, f: int) -> Box:
        y, x, z = self.path[f]
        return (int(round((box[0] - y) / z)), int(round((box[1] - x) / z)),
                int(round((box[2] - y) / z)), int(round((box[3] - x) / z)))

    def view(self, world: np.ndarray, f: int, *, labels: bool = False) -> np.ndarray:
        """The frame (H, W, 3) the camera sees of world at frame f (bilinear); labels: world is an
        (Hw, Ww) uint8 label map, taken nearest, 255 outside."""
        y, x, z = self.path[f]
        H, W = self.frame
        m = np.array([[1 / z, 0, -x / z], [0, 1 / z, -y / z]], np.float32)
        if labels:
            return cv2.warpAffine(world, m, (W, H), flags=cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT,
                                  borderValue=255)
        return cv2.warpAffine(world, m, (W, H), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)

    @property
    def moves(self) -> bool:
        """The window pans or zooms (more than a shake)."""
        ys, xs, zs = np.array(self.path).T
        return bool(np.ptp(zs) > 0.02 or max(np.ptp(ys), np.ptp(xs)) > 0.05 * min(self.frame))


@dataclass(frozen=True)
class PlanStyle:
    """A renderer's knobs for its shots."""
    side: tuple[float, float] = (0.12, 0.24)     # object side / min(H, W) in the frame
    repeat_color: float = 0.5                    # share of shots with a colour group
    stagger: float = 0.3                         # share of one-shot clips with an object appearing late
    movers: tuple[float, float, float] = (0.4, 0.45, 0.15)   # chance of 0, 1, 2 moving objects
    cameras: tuple[float, float, float, float] = (0.3, 0.3, 0.2, 0.2)   # weights of CAMERAS
    shake_px: float = 3.0                        # shake amplitude (frame pixels)
    two_shots: float = 0.2                       # share of clips of two shots joined by a hard cut


@dataclass(frozen=True)
class ShotPlan:
    bodies: tuple[Body, ...]
    camera: Camera
    world: tuple[int, int]               # (Hw, Ww) world pixels
    frames: int

    def frame_box(self, i: int, f: int) -> Box | None:
        """Body i's box in frame pixels at frame f, None before it appears."""
        body = self.bodies[i]
        return None if f < body.appear else self.camera.to_frame(body.box(f), f)


def _camera(rng: np.random.Generator, style: PlanStyle, size: tuple[int, int], frames: int
            ) -> tuple[str, tuple[int, int], Camera]:
    H, W = size
    kind = CAMERAS[int(rng.choice(len(CAMERAS), p=np.array(style.cameras) / sum(style.cameras)))]
    z0 = z1 = 1.0
    pan = np.zeros(2)
    if kind == "zoom":
        z0, z1 = (1.0, rng.uniform(0.7, 0.85)) if rng.random() < 0.5 else (rng.uniform(0.7, 0.85), 1.0)
    elif kind == "pan":
        axis = int(rng.integers(2))
        pan[axis] = rng.choice((-1, 1)) * rng.uniform(0.12, 0.25) * size[axis]
    shake = style.shake_px if kind == "shake" else 0.0
    margin = int(np.ceil(shake)) + 2
    Hw, Ww = int(H + abs(pan[0]) + 2 * margin), int(W + abs(pan[1]) + 2 * margin)
    y0, x0 = margin + max(0.0, -pan[0]), margin + max(0.0, -pan[1])
    path = []
    for f in range(frames):
        t = f / max(1, frames - 1)
        z = z0 + (z1 - z0) * t
        jitter = rng.uniform(-shake, shake, 2) if shake else np.zeros(2)
        # a zoom stays centred on the world's centre
        cy, cx = y0 + pan[0] * t + H * (1 - z) / 2, x0 + pan[1] * t + W * (1 - z) / 2
        path.append((float(cy + jitter[0]), float(cx + jitter[1]), float(z)))
    return kind, (Hw, Ww), Camera(size, tuple(path))


def _safe(camera: Camera, frames: int) -> tuple[float, float, float, float]:
    """The world rectangle every window of the shot sees."""
    wins = np.array([camera.window(f) for f in range(frames)])
    return wins[:, 0].max() + 1, wins[:, 1].max() + 1, wins[:, 2].min() - 1, wins[:, 3].min() - 1


def _colors(rng: np.random.Generator, style: PlanStyle, n: int) -> list[str]:
    """n colour names: distinct, or (repeat_color of the time, always past 7 objects) one colour
    repeated 2-5 times and the rest distinct."""
    names = [str(c) for c in rng.permutation(list(COLORS))]
    if n > len(names) or (n >= 2 and rng.random() < style.repeat_color):
        k = int(rng.integers(max(2, n - len(names) + 1), min(5, n) + 1))
        out = [names[0]] * k + names[1:1 + n - k]
        return [out[i] for i in rng.permutation(n)]
    return names[:n]


def _clear(box: tuple[float, ...], others: list[tuple[float, ...]], gap: float) -> bool:
    return all(box[2] + gap <= o[0] or o[2] + gap <= box[0] or box[3] + gap <= o[1] or o[3] + gap <= box[1]
               for o in others)


def plan_shot(rng: np.random.Generator, style: PlanStyle, size: tuple[int, int], frames: int, n: int,
              *, colors: list[str] | None = None, stagger: bool = False, movers: int | None = None) -> ShotPlan:
    """One shot of n objects (fewer where the frame is crowded: at least 2 where n >= 2, else 1)."""
    H, W = size
    kind, world, camera = _camera(rng, style, size, frames)
    sy0, sx0, sy1, sx1 = _safe(camera, frames)
    colors = colors or _colors(rng, style, n)
    if movers is None:
        movers = int(rng.choice(3, p=style.movers)) if not camera.moves else 0
    z = float(np.mean([p[2] for p in camera.path]))
    bodies: list[Body] = []
    swept: list[tuple[float, ...]] = []
    for i, color in enumerate(colors):
        size_word = ("small", "large")[int(rng.integers(2))]
        lo, hi = style.side
        frac = rng.uniform(lo, (lo + hi) / 2) if size_word == "small" else rng.uniform((lo + hi) / 2, hi)
        side = max(8, int(round(frac * min(H, W) * z * (1.0 if n <= 5 else 0.8))))
        moving = i < movers
        for _ in range(200):
            velocity = np.zeros(2)
            if moving:
                axis = int(rng.integers(2))
                velocity[axis] = rng.choice((-1, 1)) * rng.uniform(0.2, 0.4) * size[axis] * z
                velocity[1 - axis] = rng.uniform(-0.2, 0.2) * abs(velocity[axis])
                velocity /= max(1, frames - 1)
            travel = velocity * (frames - 1)
            ylo, yhi = sy0 - min(0.0, travel[0]), sy1 - side - max(0.0, travel[0])
            xlo, xhi = sx0 - min(0.0, travel[1]), sx1 - side - max(0.0, travel[1])
            if yhi <= ylo or xhi <= xlo:
                continue
            y, x = rng.uniform(ylo, yhi), rng.uniform(xlo, xhi)
            sweep = (min(y, y + travel[0]), min(x, x + travel[1]),
                     max(y, y + travel[0]) + side, max(x, x + travel[1]) + side)
            if _clear(sweep, swept, max(3, side / 5)):
                bodies.append(Body(color, str(SHAPES[int(rng.integers(len(SHAPES)))]), size_word, side,
                                   (float(y), float(x)), (float(velocity[0]), float(velocity[1])), 0))
                swept.append(sweep)
                break
    if stagger and len(bodies) >= 2:   # the last one appears 45-60% into the shot, the rest at once
        late = int(rng.integers(len(bodies)))
        b = bodies[late]
        bodies[late] = Body(b.color, b.shape, b.size, b.side, b.start, b.velocity,
                            int(round(rng.uniform(0.45, 0.6) * frames)))
    return ShotPlan(tuple(bodies), camera, world, frames)
