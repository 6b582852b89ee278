"""Generated relevance benchmark: object scenes, queries naming one object, exact ground truth.

Every scene holds 3-4 objects that differ in colour, shape, size and position on a muted smooth
background; a query names one of them ("the small blue triangle", "where is the red car?").
Colours are unique within a scene, so a query always picks out exactly one object (ARR-COC's
per-cell coupling can read colour, not the outline of an object a few cells wide; shape and size
words are still in the query, as a user would say them). Hard cases from the seeds: a tiny
target in the periphery, and a target whose colour is pulled towards the background (low
contrast). Video clips cut, dissolve or fade between shots of the same target, moving, still or
under a camera pan. Everything is deterministic from a seed; boxes are exact pixel boxes
(y0, x0, y1, x1), end-exclusive.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from sources.synthetic import smooth_texture

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35), "green": (40, 175, 60), "blue": (35, 70, 230), "yellow": (240, 220, 40),
    "purple": (150, 55, 205), "orange": (250, 140, 25), "cyan": (40, 215, 225),
}
SHAPES = ("square", "circle", "triangle", "car")
SIZES: dict[str, tuple[float, float]] = {"small": (0.20, 0.25), "large": (0.29, 0.36)}  # side / min(H, W)
TINY = (0.09, 0.12)
TEMPLATES = ("the {size} {color} {shape}", "where is the {color} {shape}?", "find the {color} {shape}",
             "{color} {shape}", "is there a {size} {color} {shape} here?")
SceneKind = Literal["normal", "tiny_periphery", "low_contrast"]
Motion = Literal["static", "moving", "pan"]
TransitionKind = Literal["cut", "dissolve", "fade"]


@dataclass(frozen=True)
class SceneObject:
    color: str
    shape: str
    size: str            # "small" | "large" | "tiny"
    box: tuple[int, int, int, int]  # (y0, x0, y1, x1) pixels, end-exclusive

    def describe(self, rng: np.random.Generator) -> str:
        size = "small" if self.size == "tiny" else self.size
        template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
        return template.format(size=size, color=self.color, shape=self.shape)


@dataclass(frozen=True)
class Scene:
    image: np.ndarray                   # uint8 (H, W, 3)
    objects: tuple[SceneObject, ...]
    queries: tuple[str, ...]            # one query per object, same order
    target: int                         # the object the scene is "about" (hard cases: the hard one)
    kind: SceneKind


@dataclass(frozen=True)
class Transition:
    kind: TransitionKind
    start: int   # first frame of the transition (the first frame of the new shot for a cut)
    end: int     # last frame of the transition (== start for a cut)


@dataclass(frozen=True)
class SceneClip:
    frames: np.ndarray                  # uint8 (T, H, W, 3)
    query: str
    boxes: tuple[tuple[int, int, int, int] | None, ...]  # target box per frame; None inside a transition
    shot: tuple[int, ...]               # shot index per frame, -1 inside a dissolve / fade
    transitions: tuple[Transition, ...]
    motions: tuple[str, ...]            # motion kind per shot


def shape_mask(shape: str, side_y: int, side_x: int) -> np.ndarray:
    """Boolean (side_y, side_x) mask of a shape filling its box."""
    y = (np.arange(side_y) + 0.5)[:, None] / side_y
    x = (np.arange(side_x) + 0.5)[None, :] / side_x
    if shape == "square":
        return np.ones((side_y, side_x), bool)
    if shape == "circle":
        return (y - 0.5) ** 2 + (x - 0.5) ** 2 <= 0.25
    if shape == "triangle":  # apex up, base on the bottom edge
        return np.abs(x - 0.5) <= 0.5 * y
    if shape == "car":  # body, cabin and two dark wheels
        body = (y >= 0.35) & (y <= 0.8)
        cabin = (y >= 0.05) & (y < 0.35) & (x >= 0.25) & (x <= 0.75)
        return body | cabin
    raise ValueError(f"unknown shape {shape!r}; allowed: {', '.join(SHAPES)}")


def paint(image: np.ndarray, obj: SceneObject, rgb: tuple[int, int, int] | np.ndarray) -> None:
    """Draw obj into image (in place) in colour rgb."""
    y0, x0, y1, x1 = obj.box
    H, W = image.shape[:2]
    mask = shape_mask(obj.shape, y1 - y0, x1 - x0)
    cy0, cx0, cy1, cx1 = max(y0, 0), max(x0, 0), min(y1, H), min(x1, W)
    if cy1 <= cy0 or cx1 <= cx0:
        return
    m = mask[cy0 - y0:cy1 - y0, cx0 - x0:cx1 - x0]
    region = image[cy0:cy1, cx0:cx1]
    region[m] = np.asarray(rgb, dtype=np.uint8)
    if obj.shape == "car":  # wheels: dark discs under the body
        side_y, side_x = y1 - y0, x1 - x0
        yy = (np.arange(cy0, cy1) - y0 + 0.5)[:, None] / side_y
        xx = (np.arange(cx0, cx1) - x0 + 0.5)[None, :] / side_x
        for wx in (0.25, 0.75):
            wheel = ((yy - 0.82) / 0.16) ** 2 + ((xx - wx) / 0.13) ** 2 <= 1.0
            region[wheel] = 25


def background(rng: np.random.Generator, h: int, w: int, *, cells: int = 5,
               grey: tuple[float, float] = (80, 170), texture: float = 0.35) -> np.ndarray:
    """Muted smooth background: a random texture pulled towards a grey, so named colours stand out.

    cells: texture cells across the frame (more: busier); grey: range of the grey level drawn;
    texture: the texture's weight against the grey (more: stronger colour variation).
    """
    tex = smooth_texture(rng, h, w, cells=cells).astype(np.float32)
    level = rng.uniform(*grey)
    return np.clip(texture * tex + (1 - texture) * level, 0, 255).astype(np.uint8)


def _place(rng: np.random.Generator, side: int, H: int, W: int, taken: list[tuple[int, int, int, int]],
           periphery: bool = False, x_range: tuple[int, int] | None = None) -> tuple[int, int, int, int] | None:
    x_lo, x_hi = x_range if x_range is not None else (0, W)
    for _ in range(200):
        if periphery:  # hug one of the four borders, in the outer band of the frame
            edge = int(rng.integers(4))
            m = int(rng.integers(2, max(3, int(0.06 * min(H, W)))))
            along = int(rng.integers(0, (W if edge < 2 else H) - side))
            y0, x0 = {0: (m, along), 1: (H - side - m, along), 2: (along, m), 3: (along, W - side - m)}[edge]
        else:
            y0, x0 = int(rng.integers(0, H - side)), int(rng.integers(x_lo, max(x_lo + 1, x_hi - side)))
        box = (y0, x0, y0 + side, x0 + side)
        gap = max(2, side // 6)
        if all(box[2] + gap <= t[0] or t[2] + gap <= box[0] or box[3] + gap <= t[1] or t[3] + gap <= box[1]
               for t in taken):
            return box
    return None


def sample_objects(rng: np.random.Generator, H: int, W: int, n: int, kind: SceneKind = "normal",
                   first: tuple[str, str, str] | None = None,
                   first_x_range: tuple[int, int] | None = None) -> list[SceneObject]:
    """n objects with distinct colours at non-overlapping positions; object 0 is the target.

    first: (colour, shape, size) of the target, or None to draw it too.
    first_x_range: [lo, hi) pixel columns the target must lie in (a pan keeps it in view).
    """
    colors = [str(c) for c in rng.permutation(list(COLORS))]
    if first is not None:
        colors = [first[0]] + [c for c in colors if c != first[0]]
    colors = colors[:n]
    objects: list[SceneObject] = []
    taken: list[tuple[int, int, int, int]] = []
    for i, color in enumerate(colors):
        tiny = i == 0 and kind == "tiny_periphery"
        size = "tiny" if tiny else ("small", "large")[int(rng.integers(2))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        if i == 0 and first is not None:
            shape, size = first[1], first[2]
        lo, hi = TINY if tiny else SIZES[size]
        side = max(6, int(round(rng.uniform(lo, hi) * min(H, W))))
        x_range = first_x_range if i == 0 else None
        box = _place(rng, side, H, W, taken, periphery=tiny, x_range=x_range)
        if box is None:  # crowded: a smaller object always fits eventually
            side = max(6, side // 2)
            box = _place(rng, side, H, W, taken, periphery=tiny, x_range=x_range)
            if box is None:
                continue
        taken.append(box)
        objects.append(SceneObject(color, shape, size, box))
    return objects


def render_objects(canvas: np.ndarray, objects: list[SceneObject] | tuple[SceneObject, ...],
                   low_contrast: int | None = None) -> np.ndarray:
    """Paint objects on a copy of canvas; object low_contrast (an index) is blended 60% into its surround."""
    image = canvas.copy()
    for i, obj in enumerate(objects):
        rgb = np.array(COLORS[obj.color], np.float32)
        if i == low_contrast:
            y0, x0, y1, x1 = obj.box
            surround = canvas[max(0, y0):max(0, y1), max(0, x0):max(0, x1)].reshape(-1, 3).mean(0)
            rgb = 0.4 * rgb + 0.6 * surround
        paint(image, obj, rgb.round().astype(np.uint8))
    return image


def make_scene(seed: int, size: tuple[int, int] = (224, 224), kind: SceneKind = "normal") -> Scene:
    """One still scene; the target is object 0 (for hard kinds, the hard object)."""
    rng = np.random.default_rng(seed)
    H, W = size
    canvas = background(rng, H, W)
    objects = sample_objects(rng, H, W, int(rng.integers(3, 5)), kind)
    image = render_objects(canvas, objects, low_contrast=0 if kind == "low_contrast" else None)
    queries = tuple(o.describe(rng) for o in objects)
    return Scene(image=image, objects=tuple(objects), queries=queries, target=0, kind=kind)


def make_scenes(seed: int, count: int, size: tuple[int, int] = (224, 224),
                kinds: tuple[SceneKind, ...] = ("normal",)) -> list[Scene]:
    """count scenes cycling through kinds; scene i uses seed (seed, i) so sets never overlap by accident."""
    return [make_scene(int(np.random.SeedSequence([seed, i]).generate_state(1)[0]), size, kinds[i % len(kinds)])
            for i in range(count)]


def _shift(obj: SceneObject, dy: float, dx: float) -> SceneObject:
    y0, x0, y1, x1 = obj.box
    dy, dx = int(round(dy)), int(round(dx))
    return SceneObject(obj.color, obj.shape, obj.size, (y0 + dy, x0 + dx, y1 + dy, x1 + dx))


def _clip_box(box: tuple[int, int, int, int], H: int, W: int) -> tuple[int, int, int, int] | None:
    y0, x0, y1, x1 = max(box[0], 0), max(box[1], 0), min(box[2], H), min(box[3], W)
    return (y0, x0, y1, x1) if y1 > y0 and x1 > x0 else None


def _shot(rng: np.random.Generator, target: tuple[str, str, str], H: int, W: int, frames: int,
          motion: Motion) -> tuple[list[np.ndarray], list[tuple[int, int, int, int] | None]]:
    """One shot containing the target (colour, shape, size) and 2-3 distractors."""
    pan_speed = rng.uniform(1.5, 3.0) if motion == "pan" else 0.0
    canvas_w = W + int(np.ceil(pan_speed * frames)) + 1
    canvas = background(rng, H, canvas_w)
    # under a pan the target sits where the moving window sees it for the whole shot
    in_view = (canvas_w - W, W) if motion == "pan" else None
    objects = sample_objects(rng, H, canvas_w if motion == "pan" else W, int(rng.integers(3, 5)),
                             first=target, first_x_range=in_view)
    velocity = np.zeros((len(objects), 2))
    if motion == "moving":  # the target and maybe one distractor drift; they bounce off the borders
        for i in (0, 1) if rng.random() < 0.5 else (0,):
            angle = rng.uniform(0, 2 * np.pi)
            velocity[i] = rng.uniform(1.5, 3.0) * np.array([np.sin(angle), np.cos(angle)])
    frames_out, boxes = [], []
    pos = np.zeros((len(objects), 2))
    for f in range(frames):
        moved = []
        for i, obj in enumerate(objects):
            y0, x0, y1, x1 = obj.box
            for axis, (lo_edge, hi_edge, limit) in enumerate(((y0, y1, H), (x0, x1,
                                                                            canvas_w if motion == "pan" else W))):
                p = pos[i, axis] + velocity[i, axis]
                if lo_edge + p < 0 or hi_edge + p > limit:
                    velocity[i, axis] *= -1
                pos[i, axis] += velocity[i, axis]
            moved.append(_shift(obj, pos[i, 0], pos[i, 1]))
        image = render_objects(canvas, moved)
        x = int(round(pan_speed * f))
        frames_out.append(image[:, x:x + W].copy())
        boxes.append(_clip_box(_shift(moved[0], 0, -x).box, H, W))
    return frames_out, boxes


def make_clip(seed: int, size: tuple[int, int] = (224, 224), shots: int = 4, shot_frames: tuple[int, int] = (18, 26),
              transition_frames: int = 8) -> SceneClip:
    """A clip of `shots` shots of the same target object joined by cuts, dissolves or fades.

    Shots last at least 18 frames, longer than PySceneDetect's default minimum scene length (15),
    so both detectors are judged on the same events.
    """
    rng = np.random.default_rng(seed)
    H, W = size
    target = (str(rng.choice(list(COLORS))), str(rng.choice(SHAPES)), ("small", "large")[int(rng.integers(2))])
    query = SceneObject(target[0], target[1], target[2], (0, 0, 1, 1)).describe(rng)
    frames: list[np.ndarray] = []
    boxes: list[tuple[int, int, int, int] | None] = []
    shot_ids: list[int] = []
    transitions: list[Transition] = []
    motions: list[str] = []
    for s in range(shots):
        motion: Motion = ("static", "moving", "pan")[int(rng.integers(3))]
        motions.append(motion)
        shot_frames_s, shot_boxes = _shot(rng, target, H, W, int(rng.integers(*shot_frames)), motion)
        if s > 0:
            kind: TransitionKind = ("cut", "cut", "dissolve", "fade")[int(rng.integers(4))]
            if kind == "cut":
                transitions.append(Transition("cut", len(frames), len(frames)))
            else:
                a, b = frames[-1].astype(np.float32), shot_frames_s[0].astype(np.float32)
                start = len(frames)
                for k in range(transition_frames):
                    w = (k + 1) / (transition_frames + 1)
                    if kind == "dissolve":
                        mixed = (1 - w) * a + w * b
                    else:  # through black: out over the first half, in over the second
                        mixed = a * max(0.0, 1 - 2 * w) if w < 0.5 else b * min(1.0, 2 * w - 1)
                    frames.append(mixed.round().astype(np.uint8))
                    boxes.append(None)
                    shot_ids.append(-1)
                transitions.append(Transition(kind, start, len(frames)))  # ends on the new shot's first frame
        frames.extend(shot_frames_s)
        boxes.extend(shot_boxes)
        shot_ids.extend([s] * len(shot_frames_s))
    return SceneClip(frames=np.stack(frames), query=query, boxes=tuple(boxes), shot=tuple(shot_ids),
                     transitions=tuple(transitions), motions=tuple(motions))


def make_clips(seed: int, count: int, size: tuple[int, int] = (224, 224), **kwargs) -> list[SceneClip]:
    return [make_clip(int(np.random.SeedSequence([seed, i]).generate_state(1)[0]), size, **kwargs)
            for i in range(count)]
