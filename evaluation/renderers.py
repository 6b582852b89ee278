"""Independent renderers of the generated video QA, selectable by name, one held out from training.

    shapes   the original generator (evaluation/synth_qa.py): flat shapes on muted smooth
             backgrounds, 2-5 objects, cuts / dissolves / fades; its clips are unchanged (the
             shipped arrcoc-synth-qa learnt them), the region families are added to its questions
    photo    objects composited onto real photographs bundled with scikit-image (evaluation/draw.py:
             PHOTOS), solid or gradient fills under a soft drop shadow, the camera panning and
             zooming over the photo, a light codec
    busy     saturated stripes, checks and blobs in every answer colour (and others); solid fills
             ringed in black, or textured; 3-8 objects; a still or shaking camera
    styled   (held out) soft gradients under a fine weave; solid, gradient, textured or outlined
             objects, a partial occluder, lighting drift, blur, camera shake and zoom, a heavy codec

Every renderer uses the same colour, shape and count words (synth_qa.ANSWER_WORDS), so the shipped
model's answers apply, and records each clip's tracks (every object's box per frame) with each
question's named objects. Clips are deterministic from (renderer, seed, split); seeds come from
synth_qa.SPLIT_SEEDS, and a clip's video id is VIDEO_OFFSET[renderer] + seed, so one dataset root can
hold every renderer.

Leave-one-renderer-out: HELD_OUT is kept out of every training and tuning entry point from the
start: `scene(HELD_OUT, ...)` raises unless `evaluation=True` and split "test", and
`training_renderers()` never lists it (a leave-one-out run that holds out another renderer too
trains on the rest).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from . import draw
from .layout import PlanStyle, ShotPlan, plan_shot
from .questions import clip_questions, more_questions, region_questions
from .scenes import Transition, shape_mask
from .shapes_qa import (SPLIT_SEEDS, STYLES, QAClip, QAScene, Split, Track, check_seed, direction_answer,
                       make_qa_scene, track_boxes)

RENDERERS: tuple[str, ...] = ("shapes", "photo", "busy", "styled")
HELD_OUT = "styled"
VIDEO_OFFSET: dict[str, int] = {name: 10_000_000 * i for i, name in enumerate(RENDERERS)}


class HeldOutError(ValueError):
    """The held-out renderer was asked for outside an explicit evaluation of its test split."""


@dataclass(frozen=True)
class Recipe:
    """How a renderer other than shapes draws a clip."""
    plan: PlanStyle
    background: Callable[[np.random.Generator, int, int], np.ndarray]
    fills: tuple[str, ...] = ("solid",)
    shadow: float = 0.0              # share of objects with a soft drop shadow
    ring: bool = False               # a black ring around each object (separates it from a busy background)
    occlude: float = 0.0             # share of clips with one object partly hidden
    light: float = 0.0               # lighting drift: gain within 1 +- light over the clip, a tint
    blur: tuple[float, float] = (0.0, 0.0)     # Gaussian sigma range (pixels)
    codec: tuple[int, int] = (85, 95)          # JPEG quality range
    objects: tuple[int, int] = (2, 8)          # objects in a one-shot clip, inclusive


def _shapes_scene(seed: int, split: Split) -> QAScene:
    sc = make_qa_scene(seed, split=split)
    rng = np.random.default_rng([VIDEO_OFFSET["shapes"] + 37, seed])   # its own stream: the clip stays as it was
    size = sc.clip.frames.shape[1:3]
    moves = [m == "pan" for m in sc.motions]
    extra = region_questions(rng, sc.tracks, size, moves, min_gap=int(np.ceil(0.75 * sc.clip.fps)))
    clip = QAClip(sc.clip.frames, sc.clip.fps, sc.clip.qas + extra, sc.clip.seed, sc.clip.objects)
    return QAScene(clip, sc.tracks, sc.shot, sc.transitions, sc.motions, sc.kind)


def _draw_shot(rng: np.random.Generator, recipe: Recipe, plan: ShotPlan, world: np.ndarray,
               draw_objects: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The shot's frames (float32) before lighting, blur and codec, and their colour labels (uint8)."""
    fills = [recipe.fills[int(rng.integers(len(recipe.fills)))] for _ in plan.bodies]
    shadows = [rng.random() < recipe.shadow for _ in plan.bodies]
    looks = rng.random((len(plan.bodies), 3))
    hidden = int(rng.integers(len(plan.bodies))) if plan.bodies and rng.random() < recipe.occlude else -1
    bar = draw.occluder(rng, plan.bodies[hidden].box(0)) if hidden >= 0 else None
    frames, labels = [], []
    for f in range(plan.frames):
        image = world.astype(np.float32)
        label = np.full(world.shape[:2], 255, np.uint8)
        for i, body in enumerate(plan.bodies):
            if f < body.appear or not draw_objects:
                continue
            box = body.box(f)
            if recipe.ring:   # a black silhouette 2 px larger under the object: a ring around it
                _darken(image, (box[0] - 2, box[1] - 2, box[2] + 2, box[3] + 2), body.shape)
            draw.draw_object(image, box, body.shape, body.color, fill=fills[i], shadow=shadows[i],
                             rng_values=looks[i], labels=label)
            if i == hidden and bar is not None:
                (y0, x0, y1, x1), tone = bar
                dy, dx = box[0] - plan.bodies[i].box(0)[0], box[1] - plan.bodies[i].box(0)[1]
                y0, x0, y1, x1 = max(0, y0 + dy), max(0, x0 + dx), max(0, y1 + dy), max(0, x1 + dx)
                image[y0:y1, x0:x1] = tone
                label[y0:y1, x0:x1] = 255
        frames.append(plan.camera.view(image, f))
        labels.append(plan.camera.view(label, f, labels=True))
    return frames, labels


def _darken(image: np.ndarray, box: tuple[int, int, int, int], shape: str) -> None:
    """A black silhouette of the shape in box (under the object: a ring around it)."""
    y0, x0, y1, x1 = box
    mask = shape_mask(shape, y1 - y0, x1 - x0)
    H, W = image.shape[:2]
    cy0, cx0, cy1, cx1 = max(y0, 0), max(x0, 0), min(y1, H), min(x1, W)
    image[cy0:cy1, cx0:cx1][mask[cy0 - y0:cy1 - y0, cx0 - x0:cx1 - x0]] = 15.0


def _finish(rng: np.random.Generator, recipe: Recipe, frames: list[np.ndarray]) -> np.ndarray:
    """Lighting drift, blur and codec over the clip's float frames -> (T, H, W, 3) uint8."""
    T = len(frames)
    g0, g1 = 1 + rng.uniform(-recipe.light, recipe.light, 2)
    tint = 1 + rng.uniform(-recipe.light / 2, recipe.light / 2, 3).astype(np.float32)
    sigma = rng.uniform(*recipe.blur)
    quality = int(rng.integers(recipe.codec[0], recipe.codec[1] + 1))
    out = []
    for f, image in enumerate(frames):
        gain = g0 + (g1 - g0) * f / max(1, T - 1)
        image = draw.blur(draw.light(image, gain, tint) if recipe.light else image, sigma)
        out.append(draw.codec(np.clip(image, 0, 255).round().astype(np.uint8), quality))
    return np.stack(out)


def _recipe_scene(name: str, seed: int, split: Split, draw_objects: bool = True) -> QAScene:
    recipe = RECIPES[name]
    style = STYLES[split]
    rng = np.random.default_rng([VIDEO_OFFSET[name], seed])
    size = style.sizes[int(rng.integers(len(style.sizes)))]
    fps = float(style.fps[int(rng.integers(len(style.fps)))])
    total = int(round(rng.uniform(*style.seconds) * fps))
    lo, hi = recipe.objects
    plans: list[ShotPlan] = []
    if rng.random() < recipe.plan.two_shots:
        first = int(rng.integers(round(0.4 * total), round(0.6 * total) + 1))
        plans.append(plan_shot(rng, recipe.plan, size, first, int(rng.integers(lo, min(hi, 5) + 1))))
        colors = [c for c in draw.COLORS if c not in {b.color for b in plans[0].bodies}] or list(draw.COLORS)
        plans.append(plan_shot(rng, recipe.plan, size, total - first, 1, colors=[str(rng.choice(colors))]))
    else:
        plans.append(plan_shot(rng, recipe.plan, size, total, int(rng.integers(lo, hi + 1)),
                               stagger=rng.random() < recipe.plan.stagger))
    frames: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    tracks: list[Track] = []
    shot_ids: list[int] = []
    for s, plan in enumerate(plans):
        world = recipe.background(rng, *plan.world)
        before, after = len(frames), total - len(frames) - plan.frames
        shot_frames, shot_labels = _draw_shot(rng, recipe, plan, world, draw_objects)
        frames += shot_frames
        labels += shot_labels
        shot_ids += [s] * plan.frames
        z = float(np.mean([p[2] for p in plan.camera.path]))
        for i, body in enumerate(plan.bodies):
            travel = tuple(int(round(v * (plan.frames - 1) / z)) for v in body.velocity)
            boxes = tuple(plan.frame_box(i, f) for f in range(plan.frames))
            tracks.append(Track(body.color, body.shape, body.size, (None,) * before + boxes + (None,) * after, s,
                                travel, False))   # type: ignore[arg-type]
    video = _finish(rng, recipe, frames)
    moves = [p.camera.moves for p in plans]
    motions = tuple("pan" if m else ("moving" if any(b.velocity != (0.0, 0.0) for b in p.bodies) else "static")
                    for p, m in zip(plans, moves))
    transitions = (Transition("cut", plans[0].frames, plans[0].frames),) if len(plans) == 2 else ()
    qas = clip_questions(rng, tracks, size, moves, exists=seed % 2 == 0, min_gap=int(np.ceil(0.75 * fps)))
    objects = tuple((t.color, t.shape, direction_answer(t.travel) if t.travel != (0, 0) else "still") for t in tracks)
    clip = QAClip(video, fps, qas, int(seed), objects, np.stack(labels))
    return QAScene(clip, tuple(tracks), tuple(shot_ids), transitions, motions, "normal")  # type: ignore[arg-type]


RECIPES: dict[str, Recipe] = {
    "photo": Recipe(PlanStyle(side=(0.13, 0.26), cameras=(0.2, 0.2, 0.35, 0.25), shake_px=2.0),
                    draw.photo_background, fills=("solid", "gradient"), shadow=0.7, codec=(70, 95)),
    "busy": Recipe(PlanStyle(side=(0.14, 0.26), cameras=(0.6, 0.4, 0.0, 0.0), shake_px=3.0, two_shots=0.15),
                   draw.busy_background, fills=("solid", "texture"), ring=True, codec=(75, 95), objects=(3, 8)),
    "styled": Recipe(PlanStyle(side=(0.13, 0.25), cameras=(0.2, 0.4, 0.1, 0.3), shake_px=4.0),
                     draw.gradient_background, fills=draw.FILLS, shadow=0.4, occlude=0.5, light=0.15,
                     blur=(0.0, 1.2), codec=(35, 80)),
}


def check_renderer(name: str) -> None:
    if name not in RENDERERS:
        raise ValueError(f"Invalid renderer ({name!r}). Supported values are {', '.join(RENDERERS)}.")


def scene(renderer: str, seed: int, *, split: Split = "train", evaluation: bool = False,
          draw_objects: bool = True) -> QAScene:
    """The clip of (renderer, seed, split) with the description it was drawn from.

    The held-out renderer draws only its test split, and only with evaluation=True. draw_objects
    False draws the same clip without its objects (the tests compare the two)."""
    check_renderer(renderer)
    check_seed(seed, split)
    if renderer == HELD_OUT and not (evaluation and split == "test"):
        raise HeldOutError(f"renderer {renderer!r} is held out of training and tuning: only its test split is "
                           f"drawn, and only for evaluation (evaluation=True)")
    if renderer == "shapes":
        if not draw_objects:
            raise ValueError("draw_objects=False is for the recipe renderers; shapes draws its objects")
        return _shapes_scene(seed, split)
    return _recipe_scene(renderer, seed, split, draw_objects)


def training_renderers(leave_out: str | None = None) -> tuple[str, ...]:
    """The renderers training and tuning may draw: all but HELD_OUT and leave_out."""
    if leave_out is not None:
        check_renderer(leave_out)
    return tuple(r for r in RENDERERS if r not in (HELD_OUT, leave_out))


def video_id(renderer: str, seed: int) -> int:
    check_renderer(renderer)
    return VIDEO_OFFSET[renderer] + int(seed)


class MultiRendererClips:
    """make_clip for training (pipeline/training/qa_data.StepData, qa_eval.ValData): clip `seed` of
    `split` comes from renderers[seed % len(renderers)]; the held-out renderer is refused. Clips carry
    their objects' boxes (QAClip.boxes). `extra` {family: n}: train-split clips also ask up to n more
    questions of that family (questions.more_questions, from their own random stream: the clip and
    its own questions stay as they are); other splits never."""

    def __init__(self, renderers: tuple[str, ...], extra: dict[str, int] | None = None) -> None:
        if not renderers:
            raise ValueError("no renderers to train on")
        for r in renderers:
            check_renderer(r)
        if HELD_OUT in renderers:
            raise HeldOutError(f"renderer {HELD_OUT!r} is held out: it may not be trained or tuned on "
                               f"(training renderers: {', '.join(training_renderers())})")
        from .shapes_qa import ALL_FAMILIES
        for family, n in (extra or {}).items():
            if family not in ALL_FAMILIES or not isinstance(n, int) or n < 0:
                raise ValueError(f"Invalid extra questions ({family!r}: {n!r}): a family of "
                                 f"{', '.join(ALL_FAMILIES)} and a count >= 0")
        self.renderers = tuple(renderers)
        self.extra = {f: n for f, n in (extra or {}).items() if n}

    def __call__(self, seed: int, *, split: Split = "train") -> QAClip:
        name = self.renderers[int(seed) % len(self.renderers)]
        sc = scene(name, seed, split=split)
        qas = sc.clip.qas
        if self.extra and split == "train":
            rng = np.random.default_rng([VIDEO_OFFSET[name] + 91, int(seed)])
            moves = _camera_moves(sc)
            qas = qas + more_questions(rng, sc.tracks, sc.clip.frames.shape[1:3], moves, qas, self.extra,
                                       min_gap=int(np.ceil(0.75 * sc.clip.fps)))
        return replace(sc.clip, qas=qas, boxes=track_boxes(sc.tracks, len(sc.clip.frames)))


def _camera_moves(sc: QAScene) -> list[bool]:
    """Per shot whether the camera pans or zooms: the shapes generator's pans; the recipe renderers'
    motions say "pan" for either."""
    return [m == "pan" for m in sc.motions]


def write_renderer_split(root: str | Path, split: Split, count: int, renderers: tuple[str, ...], *,
                         evaluation: bool = False, progress: bool = False) -> Path:
    """Render `count` clips of `split` into ROOT in the MSRVTT-QA layout (as synth_qa.write_split),
    clip k (seed = the split's first seed + k) from renderers[seed % len(renderers)], video id
    VIDEO_OFFSET[renderer] + seed. Records add `renderer`, `objects` (the named tracks' indices)
    and `one_object`; ROOT/{split}_tracks.json holds per video its renderer, fps, size and every
    track's colour, shape and box per frame (null where not shown). Returns the QA json's path."""
    from tqdm import tqdm
    from sources.synthetic import write_video

    if not renderers:
        raise ValueError("no renderers to write")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    first = SPLIT_SEEDS[split].start
    check_seed(first + count - 1, split)
    root = Path(root)
    records, tracks = [], {}
    for seed in tqdm(range(first, first + count), desc=split, unit="clip", disable=not progress):
        name = renderers[seed % len(renderers)]
        sc = scene(name, seed, split=split, evaluation=evaluation)
        vid = video_id(name, seed)
        write_video(root / "videos" / f"video{vid}.mp4", sc.clip.frames, fps=int(sc.clip.fps))
        records += [{"answer": qa.answer, "category_id": qa.family, "id": 100 * vid + k, "question": qa.question,
                     "video_id": vid, "renderer": name, "objects": list(qa.names), "one_object": qa.one_object}
                    for k, qa in enumerate(sc.clip.qas)]
        tracks[str(vid)] = {"renderer": name, "seed": seed, "fps": sc.clip.fps,
                            "size": list(sc.clip.frames.shape[1:3]),
                            "tracks": [{"color": t.color, "shape": t.shape,
                                        "boxes": [list(b) if b is not None else None for b in t.boxes]}
                                       for t in sc.tracks]}
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{split}_tracks.json").write_text(json.dumps(tracks))
    path = root / f"{split}_qa.json"
    path.write_text(json.dumps(records))
    return path
