"""Generated video QA with exact answers (the original generator), written in the MSRVTT-QA release layout.

Clips are built from evaluation/scenes.py objects (distinct colours, four shapes, small / large /
tiny sizes, low-contrast targets) on muted smooth backgrounds. A clip is either one shot of 2-5
objects (all still, exactly one moving in a straight line, or all still under a camera pan;
sometimes fading in from or out to black) or two shots of one object each, joined by a hard cut,
a dissolve or a fade through black. Every answer follows from the scene description:

  color_moving     What color is the moving object?          colour word (one object moves, no pan)
  where            Where is the <color> <shape>?             "top left" ... "center" ... "bottom right"
  shape            What shape is the <color> object?         shape word (colours are unique in a clip)
  count            How many objects are there?               "two" ... "five" (one-shot clips)
  exists           Is there a <color> <shape>?               "yes" on even seeds, else "no"
  color_after_cut  What color is the object after the cut?   colour word (exactly one hard cut)
  direction        Which way does the <color> <shape> move?  left / right / up / down

A where question names only an object whose box centre stays in one 3x3 region, at least
WHERE_MARGIN of the frame away from the region borders, in every frame it is seen (a pan or a
move may carry an object across a border; such an object is not asked about). A moving object
stays in the frame and never overlaps another; under a pan every object stays in view.

Splits draw from disjoint seed ranges (SPLIT_SEEDS). Test clips differ from train / val ones
(STYLES): frame sizes 224x224, 192x256, 256x192 or 240x320 (train / val: 224x224), 2-4 s
(train / val: 2-3.5 s), and busier backgrounds: 8 texture cells instead of 5, texture weight
0.5 instead of 0.35, grey level drawn from 55-195 instead of 80-170.

On disk (write_split): ROOT/videos/video<seed>.mp4 and ROOT/{split}_qa.json, records
{answer, category_id, id, question, video_id} with video_id = seed, id = 10 * seed + k, and
category_id = the family name, which sources.msrvtt keeps as Question.type (so `eval` reports
accuracy per family).

This is the `shapes` renderer of evaluation/renderers.py (which adds the region question
families of evaluation/questions.py to its clips); `python -m evaluation.synth_qa` writes splits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
from tqdm import tqdm

from sources.synthetic import write_video

from .scenes import (COLORS, SHAPES, Motion, SceneKind, SceneObject, Transition, TransitionKind, background,
                     render_objects, sample_objects)

Box = tuple[int, int, int, int]  # (y0, x0, y1, x1) pixels, end-exclusive
Split = Literal["train", "val", "test"]
SPLITS: tuple[str, ...] = ("train", "val", "test")
SPLIT_SEEDS: dict[str, range] = {"train": range(0, 1_000_000), "val": range(1_000_000, 2_000_000),
                                 "test": range(2_000_000, 3_000_000)}
FAMILIES: tuple[str, ...] = ("color_moving", "where", "shape", "count", "exists", "color_after_cut", "direction")
# families whose answer lives in a small region or a moment (evaluation/questions.py asks them)
REGION_FAMILIES: tuple[str, ...] = ("color_at", "shape_at", "relation", "count_color", "color_last", "moves")
ALL_FAMILIES: tuple[str, ...] = FAMILIES + REGION_FAMILIES
_ROWS = ("top", "middle", "bottom")
_COLS = ("left", "center", "right")
WHERE_ANSWERS: tuple[str, ...] = tuple("center" if (r, c) == ("middle", "center") else f"{r} {c}"
                                       for r in _ROWS for c in _COLS)
COUNT_WORDS: tuple[str, ...] = ("two", "three", "four", "five")    # 2 .. 5 objects
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
ANSWER_WORDS: tuple[str, ...] = tuple(sorted({*COLORS, *SHAPES, *WHERE_ANSWERS, *COUNT_WORDS, "yes", "no",
                                              *DIRECTIONS}))
WHERE_MARGIN = 0.05      # fraction of the frame between an asked-about centre and a region border
TEMPLATES: dict[str, tuple[str, ...]] = {
    "color_moving": ("What color is the moving object?", "Which color is the object that moves?",
                     "What is the color of the moving object?"),
    "where": ("Where is the {color} {shape}?", "Where in the frame is the {color} {shape}?",
              "In which part of the frame is the {color} {shape}?"),
    "shape": ("What shape is the {color} object?", "What is the shape of the {color} object?",
              "Which shape is the {color} object?"),
    "count": ("How many objects are there?", "How many objects are in the video?", "How many objects can you see?"),
    "exists": ("Is there {a} {color} {shape}?", "Does the video show {a} {color} {shape}?",
               "Can you see {a} {color} {shape}?"),
    "color_after_cut": ("What color is the object after the cut?", "After the cut, what color is the object?",
                        "What color is the object in the second shot?"),
    "direction": ("Which way does the {color} {shape} move?", "In which direction does the {color} {shape} move?",
                  "Which direction is the {color} {shape} moving?"),
}
_TRANSITION_FRAMES = 4   # a dissolve or a fade through black between two shots
_FADE_FRAMES = 3         # a one-shot clip fading in from / out to black
_MIN_CUT_DIFF = 20.0     # mean |difference| across a hard cut, so the cut is plain to see


@dataclass(frozen=True)
class SplitStyle:
    sizes: tuple[tuple[int, int], ...]   # (H, W) to draw from; even, for yuv420p
    seconds: tuple[float, float]         # clip length range
    fps: tuple[float, ...]
    cells: int                           # background texture cells (scenes.background)
    grey: tuple[float, float]            # background grey level range
    texture: float                       # background texture weight


_TRAIN_STYLE = SplitStyle(((224, 224),), (2.0, 3.5), (8.0, 10.0), cells=5, grey=(80, 170), texture=0.35)
STYLES: dict[str, SplitStyle] = {
    "train": _TRAIN_STYLE, "val": _TRAIN_STYLE,
    "test": SplitStyle(((224, 224), (192, 256), (256, 192), (240, 320)), (2.0, 4.0), (8.0, 10.0),
                       cells=8, grey=(55, 195), texture=0.5),
}


@dataclass(frozen=True)
class QA:
    question: str
    answer: str
    family: str
    names: tuple[int, ...] = ()   # indices (QAScene.tracks) of the objects the question names

    def __post_init__(self) -> None:
        if self.family not in ALL_FAMILIES:
            raise ValueError(f"Invalid family ({self.family!r}). Supported values are {', '.join(ALL_FAMILIES)}.")
        if self.answer not in ANSWER_WORDS:
            raise ValueError(f"Invalid answer ({self.answer!r}) for {self.question!r}; "
                             f"allowed: {', '.join(ANSWER_WORDS)}")

    @property
    def one_object(self) -> bool:
        """The question names exactly one object (its answer lives in that object's region)."""
        return len(self.names) == 1


@dataclass(frozen=True)
class QAClip:
    frames: np.ndarray   # (T, H, W, 3) uint8
    fps: float
    qas: tuple[QA, ...]  # at most one question per family, each answer exact for this clip
    seed: int
    # (colour, shape, motion) of every object shown, motion a direction word or "still" (training targets)
    objects: tuple[tuple[str, str, str], ...] = ()
    # (T, H, W) uint8 per pixel the index (scenes.COLORS) of the object's colour shown there, 255
    # elsewhere (training targets where pixel colours mislead: backgrounds in the answer colours)
    labels: np.ndarray | None = None
    # (objects, T, 4) int32 each object's box (y0, x0, y1, x1) per frame in frame pixels, -1 where it
    # is not shown (training targets: which tokens hold an object, its centre; track_boxes)
    boxes: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.frames.dtype != np.uint8 or self.frames.ndim != 4 or self.frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 (T, H, W, 3), got {self.frames.dtype} {self.frames.shape}")
        if not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if not self.qas:
            raise ValueError(f"clip {self.seed} has no questions")


@dataclass(frozen=True)
class Track:
    """One object of a clip, where it is in every frame."""
    color: str
    shape: str
    size: str                          # "small" | "large" | "tiny"
    boxes: tuple[Box | None, ...]      # per clip frame, frame pixels; None where its shot is not shown
    shot: int
    travel: tuple[int, int]            # (dy, dx) pixels it moves over its shot against the background
    low_contrast: bool


@dataclass(frozen=True)
class QAScene:
    """The description a clip was rendered from (the tests check the answers against it)."""
    clip: QAClip
    tracks: tuple[Track, ...]
    shot: tuple[int, ...]               # shot index per frame; -1 inside a dissolve / fade / fade in or out
    transitions: tuple[Transition, ...]
    motions: tuple[Motion, ...]         # per shot
    kind: SceneKind


def track_boxes(tracks: Sequence[Track], frames: int) -> np.ndarray:
    """(len(tracks), frames, 4) int32: QAClip.boxes of these tracks, -1 where a track is not shown."""
    out = np.full((len(tracks), frames, 4), -1, np.int32)
    for i, t in enumerate(tracks):
        for f, box in enumerate(t.boxes):
            if box is not None:
                out[i, f] = box
    return out


def where_answer(box: tuple[int, int, int, int], size: tuple[int, int]) -> str:
    """Ground-truth answer to "where is X?": the 3x3 region of the box centre, e.g. "top left"."""
    cy, cx = (box[0] + box[2]) / 2 / size[0], (box[1] + box[3]) / 2 / size[1]
    row, col = _ROWS[min(2, int(cy * 3))], _COLS[min(2, int(cx * 3))]
    return "center" if (row, col) == ("middle", "center") else f"{row} {col}"


def direction_answer(travel: tuple[float, float]) -> str:
    """left / right / up / down: the larger of the two components of a (dy, dx) displacement."""
    dy, dx = travel
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def _shift(box: Box, dy: int, dx: int) -> Box:
    return (box[0] + dy, box[1] + dx, box[2] + dy, box[3] + dx)


def _clear(box: Box, others: Sequence[Box], gap: int) -> bool:
    return all(box[2] + gap <= o[0] or o[2] + gap <= box[0] or box[3] + gap <= o[1] or o[3] + gap <= box[1]
               for o in others)


def _plan_move(rng: np.random.Generator, objects: list[SceneObject], size: tuple[int, int],
               frames: int) -> tuple[SceneObject, np.ndarray] | None:
    """A straight move of objects[0] (start, per-frame velocity) that keeps it in the frame and
    clear of the others, passing through its sampled place; None if none was found."""
    H, W = size
    obj = objects[0]
    side = obj.box[2] - obj.box[0]
    others = [o.box for o in objects[1:]]
    for d in rng.permutation(len(DIRECTIONS)):
        axis, sign = (1, -1 + 2 * (d == 1)) if d < 2 else (0, -1 + 2 * (d == 3))
        travel = np.zeros(2)
        travel[axis] = sign * rng.uniform(0.2, 0.4) * size[axis]
        travel[1 - axis] = rng.uniform(-0.2, 0.2) * abs(travel[axis])   # a slight drift off the axis
        for _ in range(15):
            start = np.round(np.array(obj.box[:2]) - rng.uniform() * travel).astype(int)
            first = (int(start[0]), int(start[1]), int(start[0]) + side, int(start[1]) + side)
            last = _shift(first, *np.round(travel).astype(int).tolist())
            swept = (min(first[0], last[0]), min(first[1], last[1]), max(first[2], last[2]), max(first[3], last[3]))
            if swept[0] >= 0 and swept[1] >= 0 and swept[2] <= H and swept[3] <= W and \
                    _clear(swept, others, max(2, side // 6)):
                return SceneObject(obj.color, obj.shape, obj.size, first), travel / (frames - 1)
    return None


def _render_shot(rng: np.random.Generator, style: SplitStyle, size: tuple[int, int], frames: int, n: int,
                 motion: Motion, kind: SceneKind, first: tuple[str, str, str] | None = None
                 ) -> tuple[list[np.ndarray], list[SceneObject], list[list[Box]], tuple[int, int]]:
    """One shot of n objects (object 0 moves when motion is "moving").

    Returns its frames, its objects, each object's box per frame and object 0's travel (dy, dx)."""
    H, W = size
    pan = np.zeros(2)
    if motion == "pan":  # the window travels 15-30% of the frame along one axis
        axis = int(rng.integers(2))
        pan[axis] = rng.choice((-1, 1)) * round(rng.uniform(0.15, 0.3) * size[axis])
    my, mx = np.abs(pan).astype(int).tolist()
    # objects sit where every window of the pan sees them: beyond the first my rows and mx columns
    for _ in range(100):
        objects = sample_objects(rng, H - my, W - mx, n, kind, first=first)
        velocity = np.zeros(2)
        if motion == "moving":
            move = _plan_move(rng, objects, size, frames)
            if move is None:
                continue
            objects[0], velocity = move
        break
    else:
        raise RuntimeError(f"no room for a moving object in a {H}x{W} frame")
    canvas = background(rng, H + my, W + mx, cells=style.cells, grey=style.grey, texture=style.texture)
    objects = [SceneObject(o.color, o.shape, o.size, _shift(o.box, my, mx)) for o in objects]
    low = 0 if kind == "low_contrast" else None
    start = np.where(pan > 0, 0, np.abs(pan))
    images, boxes = [], [[] for _ in objects]
    for f in range(frames):
        dy, dx = np.round(velocity * f).astype(int).tolist()
        moved = [SceneObject(o.color, o.shape, o.size, _shift(o.box, dy, dx) if i == 0 else o.box)
                 for i, o in enumerate(objects)]
        oy, ox = np.round(start + pan * f / max(1, frames - 1)).astype(int).tolist()
        images.append(render_objects(canvas, moved, low_contrast=low)[oy:oy + H, ox:ox + W])
        for i, o in enumerate(moved):
            boxes[i].append(_shift(o.box, -oy, -ox))
    travel = tuple(np.round(velocity * (frames - 1)).astype(int).tolist())
    return images, [SceneObject(o.color, o.shape, o.size, b[0]) for o, b in zip(objects, boxes)], boxes, travel


def steady_where(track: Track, size: tuple[int, int]) -> bool:
    """The track's centre stays in one 3x3 region, WHERE_MARGIN clear of its borders."""
    answers = set()
    for box in track.boxes:
        if box is None:
            continue
        for c, extent in (((box[0] + box[2]) / 2, size[0]), ((box[1] + box[3]) / 2, size[1])):
            if min(abs(c / extent - 1 / 3), abs(c / extent - 2 / 3)) < WHERE_MARGIN:
                return False
        answers.add(where_answer(box, size))
    return len(answers) == 1


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _questions(rng: np.random.Generator, tracks: Sequence[Track], motions: Sequence[str], cut: bool,
               size: tuple[int, int], exists: bool) -> tuple[QA, ...]:
    qas: list[QA] = []

    def ask(family: str, answer: str, color: str = "", shape: str = "", names: Sequence[Track] = ()) -> None:
        template = TEMPLATES[family][int(rng.integers(len(TEMPLATES[family])))]
        qas.append(QA(template.format(color=color, shape=shape, a=article(color or "x")), answer, family,
                      tuple(next(i for i, x in enumerate(tracks) if x is t) for t in names)))

    def pick(candidates: Sequence[Track]) -> Track:  # the scene's target (the hard one) half the time
        if tracks[0] in candidates and (len(candidates) == 1 or rng.random() < 0.5):
            return tracks[0]
        others = [t for t in candidates if t is not tracks[0]]
        return others[int(rng.integers(len(others)))]

    movers = [t for t in tracks if t.travel != (0, 0)]
    if len(movers) == 1 and "pan" not in motions:
        ask("color_moving", movers[0].color, names=movers[:1])
    steady = [t for t in tracks if steady_where(t, size)]
    if steady:
        t = pick(steady)
        ask("where", where_answer(next(b for b in t.boxes if b is not None), size), t.color, t.shape, [t])
    t = pick(tracks)
    ask("shape", t.shape, t.color, names=[t])
    if len(motions) == 1 and 2 <= len(tracks) <= 5:
        ask("count", COUNT_WORDS[len(tracks) - 2], names=tracks)
    t = pick(tracks)
    if exists:
        ask("exists", "yes", t.color, t.shape, [t])
    elif rng.random() < 0.5:  # the colour is there, in another shape
        ask("exists", "no", t.color, str(rng.choice([s for s in SHAPES if s != t.shape])))  # names none
    else:  # a colour the clip does not have
        absent = [c for c in COLORS if c not in {t.color for t in tracks}]
        ask("exists", "no", str(rng.choice(absent)), str(rng.choice(SHAPES)))
    if cut:
        after = next(t for t in tracks if t.shot == 1)
        ask("color_after_cut", after.color, names=[after])
    if movers:
        t = pick(movers)
        ask("direction", direction_answer(t.travel), t.color, t.shape, [t])
    return tuple(qas)


def check_seed(seed: int, split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"Invalid split ({split!r}). Supported values are {', '.join(SPLITS)}.")
    seeds = SPLIT_SEEDS[split]
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed not in seeds:
        raise ValueError(f"seed {seed!r} is outside the {split} split's seeds [{seeds.start}, {seeds.stop})")


def make_qa_scene(seed: int, *, split: Split = "train") -> QAScene:
    """The clip of `seed` and the description it was rendered from."""
    check_seed(seed, split)
    style = STYLES[split]
    rng = np.random.default_rng(int(seed))
    size = style.sizes[int(rng.integers(len(style.sizes)))]
    fps = style.fps[int(rng.integers(len(style.fps)))]
    total = int(round(rng.uniform(*style.seconds) * fps))
    kind: SceneKind = ("normal", "normal", "normal", "tiny_periphery", "low_contrast")[int(rng.integers(5))]
    if rng.random() < 0.6:
        frames, tracks, shot, transitions, motions = _one_shot(rng, style, size, total, kind)
    else:
        frames, tracks, shot, transitions, motions = _two_shots(rng, style, size, total, kind)
    cut = any(t.kind == "cut" for t in transitions)
    # "yes" on even seeds: any run of consecutive seeds is balanced, so always-yes scores 50%
    qas = _questions(rng, tracks, motions, cut, size, exists=seed % 2 == 0)
    objects = tuple((t.color, t.shape, direction_answer(t.travel) if t.travel != (0, 0) else "still") for t in tracks)
    clip = QAClip(np.stack(frames), fps, qas, int(seed), objects)
    return QAScene(clip, tuple(tracks), tuple(shot), tuple(transitions), tuple(motions), kind)


def make_qa_clip(seed: int, *, split: Split = "train") -> QAClip:
    """The clip of `seed` (deterministic) with its questions; seed must lie in SPLIT_SEEDS[split]."""
    return make_qa_scene(seed, split=split).clip


def _tracks(objects: list[SceneObject], boxes: list[list[Box]], travel: tuple[int, int], shot: int,
            before: int, after: int, kind: SceneKind) -> list[Track]:
    return [Track(o.color, o.shape, o.size, (None,) * before + tuple(b) + (None,) * after, shot,
                  travel if i == 0 else (0, 0), i == 0 and kind == "low_contrast")
            for i, (o, b) in enumerate(zip(objects, boxes))]


# frames, tracks, shot index per frame, transitions, motion per shot
_Layout = tuple[list[np.ndarray], list[Track], list[int], list[Transition], Sequence[Motion]]


def _one_shot(rng: np.random.Generator, style: SplitStyle, size: tuple[int, int], total: int,
              kind: SceneKind) -> _Layout:
    motion: Motion = ("moving", "moving", "static", "pan")[int(rng.integers(4))]
    frames, objects, boxes, travel = _render_shot(rng, style, size, total, int(rng.integers(2, 6)), motion, kind)
    shot, transitions = [0] * total, []
    fade_in, fade_out = rng.random() < 0.2, rng.random() < 0.2
    for on, span in ((fade_in, range(_FADE_FRAMES)), (fade_out, range(total - 1, total - 1 - _FADE_FRAMES, -1))):
        if not on:
            continue
        for k, f in enumerate(span):  # k = 0 is the darkest frame
            frames[f] = (frames[f].astype(np.float32) * (k + 1) / (_FADE_FRAMES + 1)).round().astype(np.uint8)
            shot[f] = -1
        transitions.append(Transition("fade", min(span), max(span)))
    return frames, _tracks(objects, boxes, travel, 0, 0, 0, kind), shot, transitions, (motion,)


def _two_shots(rng: np.random.Generator, style: SplitStyle, size: tuple[int, int], total: int,
               kind: SceneKind) -> _Layout:
    join: TransitionKind = ("cut", "dissolve", "fade")[int(rng.choice(3, p=(0.7, 0.15, 0.15)))]
    between = 0 if join == "cut" else _TRANSITION_FRAMES
    lengths = total - between
    first_len = int(rng.integers(round(0.35 * lengths), round(0.65 * lengths) + 1))
    colors = [str(c) for c in rng.permutation(list(COLORS))[:2]]
    motions: list[Motion] = []
    shots = []
    for s, (color, frames) in enumerate(zip(colors, (first_len, lengths - first_len))):
        target = (color, str(rng.choice(SHAPES)),
                  "tiny" if kind == "tiny_periphery" else ("small", "large")[int(rng.integers(2))])
        motion: Motion = ("static", "moving", "pan")[int(rng.integers(3))]
        for _ in range(20):  # a new background until the cut is plain to see
            shot = _render_shot(rng, style, size, frames, 1, motion, kind, first=target)
            if s == 0 or join != "cut" or \
                    np.abs(shots[0][0][-1].astype(np.int16) - shot[0][0].astype(np.int16)).mean() >= _MIN_CUT_DIFF:
                break
        motions.append(motion)
        shots.append(shot)
    (frames_a, objects_a, boxes_a, travel_a), (frames_b, objects_b, boxes_b, travel_b) = shots
    a, b = frames_a[-1].astype(np.float32), frames_b[0].astype(np.float32)
    mixed = []
    for k in range(between):
        w = (k + 1) / (between + 1)
        blend = (1 - w) * a + w * b if join == "dissolve" else \
            (a * max(0.0, 1 - 2 * w) if w < 0.5 else b * min(1.0, 2 * w - 1))   # through black
        mixed.append(blend.round().astype(np.uint8))
    frames = frames_a + mixed + frames_b
    start = len(frames_a)
    transition = Transition(join, start, start if join == "cut" else start + between)  # ends on shot 2's first frame
    shot_ids = [0] * len(frames_a) + [-1] * between + [1] * len(frames_b)
    tracks = _tracks(objects_a, boxes_a, travel_a, 0, 0, between + len(frames_b), kind) + \
        _tracks(objects_b, boxes_b, travel_b, 1, len(frames_a) + between, 0, kind)
    return frames, tracks, shot_ids, [transition], motions


def write_split(root: str | Path, split: str, count: int, *, first_seed: int | None = None,
                progress: bool = False) -> Path:
    """Render `count` clips of `split` (seeds first_seed, first_seed + 1, ...; default: the split's
    first seed) into ROOT/videos/video<seed>.mp4 and ROOT/{split}_qa.json; returns the json's path."""
    if split not in SPLITS:
        raise ValueError(f"Invalid split ({split!r}). Supported values are {', '.join(SPLITS)}.")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    seeds = SPLIT_SEEDS[split]
    first = seeds.start if first_seed is None else first_seed
    check_seed(first, split)
    check_seed(first + count - 1, split)
    root = Path(root)
    records = []
    for seed in tqdm(range(first, first + count), desc=split, unit="clip", disable=not progress):
        clip = make_qa_clip(seed, split=split)  # type: ignore[arg-type]
        write_video(root / "videos" / f"video{seed}.mp4", clip.frames, fps=int(clip.fps))
        records += [{"answer": qa.answer, "category_id": qa.family, "id": 10 * seed + k, "question": qa.question,
                     "video_id": seed} for k, qa in enumerate(clip.qas)]
    path = root / f"{split}_qa.json"
    path.write_text(json.dumps(records))
    return path
