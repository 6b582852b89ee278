"""Questions of the multi-renderer QA generator, from a clip's tracks (evaluation/synth_qa.Track).

The region families, whose answer lives in a small region or a moment, so that where the visual
tokens go decides the answer:

  color_at     What color is the <shape> at the <where>?          colour (the only <shape> ever centred there)
  shape_at     What shape is the object at the <where>?           shape (the only object ever centred there)
  relation     Is the <c> <s> left of / right of / above / below the <c2> <s2>?   yes / no (clearly apart)
  count_color  How many <color> objects are there?                "two" ... "five" (one shot)
  color_last   What color is the object that appears last?        colour (it appears >= min_gap frames after the rest)
  moves        Does the <color> <shape> move?                     yes / no (no camera pan or zoom)

`clip_questions` also asks synth_qa's seven families where colours may repeat (a question names
an object by colour and shape only where that pair is unique in the clip, by colour alone only
where the colour is). Every QA records the tracks it names (QA.names); QA.one_object says whether
that is exactly one.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .scenes import COLORS, SHAPES
from .shapes_qa import (COUNT_WORDS, QA, TEMPLATES, WHERE_ANSWERS, Track, article, direction_answer, steady_where,
                       where_answer)

REGION_TEMPLATES: dict[str, tuple[str, ...]] = {
    "color_at": ("What color is the {shape} at the {where}?", "What is the color of the {shape} at the {where}?",
                 "Which color is the {shape} at the {where}?"),
    "shape_at": ("What shape is the object at the {where}?", "What is the shape of the object at the {where}?",
                 "Which shape is the object at the {where}?"),
    "relation": ("Is the {color} {shape} {rel} the {color2} {shape2}?",
                 "In the video, is the {color} {shape} {rel} the {color2} {shape2}?"),
    "count_color": ("How many {color} objects are there?", "How many {color} objects are in the video?",
                    "How many {color} objects can you see?"),
    "color_last": ("What color is the object that appears last?", "Which color is the last object to appear?",
                   "What color is the object that shows up last?"),
    "moves": ("Does the {color} {shape} move?", "Is the {color} {shape} moving?",
              "Does the {color} {shape} move in the video?"),
}
RELATIONS = {"left of": (1, -1), "right of": (1, 1), "above": (0, -1), "below": (0, 1)}   # axis, sign of b - a
_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
RELATION_GAP = 0.03          # fraction of the frame between two objects a relation is asked about


class _Asker:
    def __init__(self, rng: np.random.Generator, tracks: Sequence[Track]) -> None:
        self.rng, self.tracks, self.qas = rng, tracks, []

    def __call__(self, family: str, answer: str, names: Sequence[Track] = (), **fields: str) -> None:
        templates = REGION_TEMPLATES.get(family) or TEMPLATES[family]
        template = templates[int(self.rng.integers(len(templates)))]
        fields.setdefault("a", article(fields.get("color") or "x"))
        self.qas.append(QA(template.format(**fields), answer, family,
                           tuple(next(i for i, x in enumerate(self.tracks) if x is t) for t in names)))

    def pick(self, candidates: Sequence[Track]) -> Track:
        return candidates[int(self.rng.integers(len(candidates)))]


def _centres(track: Track, size: tuple[int, int]) -> set[str]:
    return {where_answer(b, size) for b in track.boxes if b is not None}


def _apart(a: Track, b: Track, axis: int, size: tuple[int, int]) -> int:
    """+1 if b lies wholly past a along axis (0: down, 1: right) in every frame both are seen, -1 if
    wholly before, 0 otherwise or if they are never seen together; RELATION_GAP of the frame between."""
    gap = RELATION_GAP * size[axis]
    signs = set()
    for ba, bb in zip(a.boxes, b.boxes):
        if ba is None or bb is None:
            continue
        if bb[axis] >= ba[axis + 2] + gap:
            signs.add(1)
        elif ba[axis] >= bb[axis + 2] + gap:
            signs.add(-1)
        else:
            return 0
    return signs.pop() if len(signs) == 1 else 0


def region_questions(rng: np.random.Generator, tracks: Sequence[Track], size: tuple[int, int],
                     camera_moves: Sequence[bool], min_gap: int) -> tuple[QA, ...]:
    """At most one question per region family. camera_moves: per shot, whether the camera pans or
    zooms; min_gap: frames between the last appearance and the one before for color_last."""
    ask = _Asker(rng, tracks)
    combos = [(t.color, t.shape) for t in tracks]
    unique = [t for t, c in zip(tracks, combos) if combos.count(c) == 1]
    steady = [t for t in tracks if steady_where(t, size)]
    at = [t for t in steady if not any(o is not t and o.shape == t.shape and _centres(t, size) & _centres(o, size)
                                       for o in tracks)]
    if at:
        t = ask.pick(at)
        ask("color_at", t.color, [t], shape=t.shape, where=next(iter(_centres(t, size))))
    alone = [t for t in steady if not any(o is not t and _centres(t, size) & _centres(o, size) for o in tracks)]
    if alone:
        t = ask.pick(alone)
        ask("shape_at", t.shape, [t], where=next(iter(_centres(t, size))))
    pairs = [(a, b, rel) for a in unique for b in unique if a is not b and a.shot == b.shot
             for rel, (axis, sign) in RELATIONS.items() if _apart(a, b, axis, size) == -sign]
    if pairs:   # a's relation to b holds in every frame: "yes" half the time, else its opposite, "no"
        a, b, rel = pairs[int(rng.integers(len(pairs)))]
        yes = rng.random() < 0.5
        ask("relation", "yes" if yes else "no", [a, b], color=a.color, shape=a.shape,
            rel=rel if yes else _OPPOSITE[rel], color2=b.color, shape2=b.shape)
    if len(camera_moves) == 1:
        groups = {c: [t for t in tracks if t.color == c] for c in {t.color for t in tracks}}
        counted = [c for c, g in groups.items() if 2 <= len(g) <= 1 + len(COUNT_WORDS)]
        if counted:
            c = counted[int(rng.integers(len(counted)))]
            ask("count_color", COUNT_WORDS[len(groups[c]) - 2], groups[c], color=c)
        appear = [next(f for f, b in enumerate(t.boxes) if b is not None) for t in tracks]
        order = np.argsort(appear)
        if len(tracks) >= 2 and appear[order[-1]] - appear[order[-2]] >= min_gap:
            last = tracks[int(order[-1])]
            ask("color_last", last.color, [last])
    still_camera = [t for t in unique if not camera_moves[t.shot]]
    if still_camera:
        movers = [t for t in still_camera if t.travel != (0, 0)]
        t = ask.pick(movers) if movers and rng.random() < 0.5 else ask.pick(still_camera)
        ask("moves", "yes" if t.travel != (0, 0) else "no", [t], color=t.color, shape=t.shape)
    return tuple(ask.qas)


def clip_questions(rng: np.random.Generator, tracks: Sequence[Track], size: tuple[int, int],
                   camera_moves: Sequence[bool], *, exists: bool, min_gap: int) -> tuple[QA, ...]:
    """synth_qa's seven families where colours may repeat, then the region families."""
    ask = _Asker(rng, tracks)
    combos = [(t.color, t.shape) for t in tracks]
    colors = [t.color for t in tracks]
    unique = [t for t, c in zip(tracks, combos) if combos.count(c) == 1]
    movers = [t for t in tracks if t.travel != (0, 0)]
    if len(movers) == 1 and not any(camera_moves):
        ask("color_moving", movers[0].color, movers)
    steady = [t for t in unique if steady_where(t, size)]
    if steady:
        t = ask.pick(steady)
        ask("where", where_answer(next(b for b in t.boxes if b is not None), size), [t], color=t.color, shape=t.shape)
    lone = [t for t in tracks if colors.count(t.color) == 1]
    if lone:
        t = ask.pick(lone)
        ask("shape", t.shape, [t], color=t.color)
    if len(camera_moves) == 1 and 2 <= len(tracks) <= 1 + len(COUNT_WORDS):
        ask("count", COUNT_WORDS[len(tracks) - 2], tracks)
    if exists and unique:
        t = ask.pick(unique)
        ask("exists", "yes", [t], color=t.color, shape=t.shape)
    elif not exists:
        absent = [c for c in COLORS if c not in colors]
        if rng.random() < 0.5 or not absent:   # a colour the clip has, in a shape it does not have in it
            c = str(rng.choice(sorted(set(colors))))
            shapes = [s for s in SHAPES if (c, s) not in combos]
            if shapes:
                ask("exists", "no", color=c, shape=str(rng.choice(shapes)))
        else:
            ask("exists", "no", color=str(rng.choice(absent)), shape=str(rng.choice(SHAPES)))
    second = [t for t in tracks if t.shot == 1]
    if len(camera_moves) == 2 and len(second) == 1:
        ask("color_after_cut", second[0].color, second)
    movers = [t for t in movers if any(t is u for u in unique)]
    if movers:
        t = ask.pick(movers)
        ask("direction", direction_answer(t.travel), [t], color=t.color, shape=t.shape)
    return tuple(ask.qas) + region_questions(rng, tracks, size, camera_moves, min_gap)


def _key(qa: QA) -> tuple:
    """What a question asks, whatever its template: family, named tracks, answer and content words."""
    words = {w for w in qa.question.lower().replace("?", " ").split() if w in COLORS or w in SHAPES}
    rel = next((r for r in RELATIONS if f" {r} " in qa.question), "")
    where = next((w for w in sorted(WHERE_ANSWERS, key=len, reverse=True) if f" {w}?" in qa.question), "")
    return qa.family, qa.names, qa.answer, frozenset(words), rel, where


def more_questions(rng: np.random.Generator, tracks: Sequence[Track], size: tuple[int, int],
                   camera_moves: Sequence[bool], asked: Sequence[QA], wanted: dict[str, int], *, min_gap: int,
                   tries: int = 8) -> tuple[QA, ...]:
    """Training only: up to wanted[family] more questions of each family about the same clip, each
    asking something none of `asked` (nor another of them) asks (clip_questions drawn again, its
    exists answer alternating). A clip has at most one question per family; the weak families need
    more of them than that gives."""
    seen = {_key(qa) for qa in asked}
    got: dict[str, int] = {}
    out: list[QA] = []
    for k in range(tries):
        for qa in clip_questions(rng, tracks, size, camera_moves, exists=k % 2 == 0, min_gap=min_gap):
            if got.get(qa.family, 0) < wanted.get(qa.family, 0) and _key(qa) not in seen:
                seen.add(_key(qa))
                got[qa.family] = got.get(qa.family, 0) + 1
                out.append(qa)
        if all(got.get(f, 0) >= n for f, n in wanted.items()):
            break
    return tuple(out)
