"""Training targets from where a clip's objects are (QAClip.boxes): per token and per question.

The weak question families of arrcoc-synth-qa (count, count_color, exists, relation) failed in the
LM, not the vision tower: a linear probe on the shipped tower's tokens reads their colour (0.97) and
their object's shape (0.80), and the model answers "what shape is the red object" at 0.91, yet
"is there a red circle" at chance when a red object of another shape is there, "is A left of B" at
chance and "how many red objects" mostly "three". Three targets name what those answers are made of:

- object centres: per visual token whether an object's box centre lies in its cell (either frame
  of its pair). Objects touch cells they barely cover (in a third of the count questions two objects
  touch one cell), their centres never share one (boxes keep a gap), so the count is the number of
  centre tokens: a dense target for the vision tower's head.
- evidence tokens: per question the cells the objects its answer depends on cover (its named
  objects; for "is there a <colour> <shape>?" naming none, the objects of that colour). The
  grounding loss asks the question's attention to fall there (the colour-only target misses the
  second object of a relation and the other objects of a count), and a keep map may keep them so
  that a dropped view stays answerable (a count asked of a view with half the objects dropped
  teaches the prior, not counting).
- question facts: per question, read off the LM's state where it answers: the centre (y, x) of
  each of the one or two objects it names, and which shapes the objects of its colour have. A
  relation's answer is a comparison of the two centres, an exists answer a lookup of its shape in
  the second; the probe makes the LM gather them there.
"""
from __future__ import annotations

import numpy as np

from evaluation.scenes import COLORS, SHAPES

FACTS = 4 + len(SHAPES)      # (y, x) of the first and second named object, the colour's shapes (multi-hot)
EVIDENCE_SHARE = 0.25        # a cell is an object's when its box covers this much of it


def _pairs(boxes: np.ndarray, temporal_patch: int) -> np.ndarray:
    """(n, T, 4) -> (n, T', tp, 4): frames grouped as the VLM pairs them (an odd last frame with itself)."""
    if pad := -boxes.shape[1] % temporal_patch:
        boxes = np.concatenate([boxes, boxes[:, -1:].repeat(pad, 1)], 1)
    return boxes.reshape(boxes.shape[0], -1, temporal_patch, 4)


def _cover(boxes: np.ndarray, size: tuple[int, int], grid: tuple[int, int]) -> np.ndarray:
    """(..., 4) boxes in frame pixels of a frame `size` -> (..., gh, gw) share of each cell they cover
    (0 where a box is absent, -1)."""
    H, W = size
    gh, gw = grid
    out = []
    for lo, hi, extent, n in ((0, 2, H, gh), (1, 3, W, gw)):
        a = boxes[..., lo, None] / extent * n                       # (..., 1) in cells
        b = boxes[..., hi, None] / extent * n
        cell = np.arange(n, dtype=np.float64)
        out.append(np.clip(np.minimum(b, cell + 1) - np.maximum(a, cell), 0, 1))   # (..., n)
    share = out[0][..., :, None] * out[1][..., None, :]            # (..., gh, gw)
    return np.where((boxes[..., 0] >= 0)[..., None, None], share, 0.0)


def _centre_cells(boxes: np.ndarray, size: tuple[int, int], grid: tuple[int, int]) -> np.ndarray:
    """(..., 4) -> (..., gh, gw) bool: the cell holding each present box's centre."""
    H, W = size
    gh, gw = grid
    cy = np.clip(((boxes[..., 0] + boxes[..., 2]) / 2 / H * gh).astype(int), 0, gh - 1)
    cx = np.clip(((boxes[..., 1] + boxes[..., 3]) / 2 / W * gw).astype(int), 0, gw - 1)
    hit = (np.arange(gh)[:, None] == cy[..., None, None]) & (np.arange(gw)[None, :] == cx[..., None, None])
    return hit & (boxes[..., 0] >= 0)[..., None, None]


def centre_tokens(boxes: np.ndarray, size: tuple[int, int], grid: tuple[int, int],
                  temporal_patch: int = 2) -> np.ndarray:
    """boxes (n, T, 4) of the VLM's frames (frame pixels of `size`, -1 absent) -> (T', gh, gw) int8:
    1 where some object's centre lies in the cell on either frame of the pair, else 0."""
    if not len(boxes):
        T = -(-boxes.shape[1] // temporal_patch)
        return np.zeros((T, *grid), np.int8)
    return _centre_cells(_pairs(boxes, temporal_patch), size, grid).any((0, 2)).astype(np.int8)


def question_color(question: str) -> str | None:
    """The first colour word of a question, else None."""
    return next((w for w in question.lower().replace("?", " ").split() if w in COLORS), None)


def evidence(names: tuple[int, ...], question: str, objects: tuple[tuple[str, ...], ...]) -> tuple[int, ...]:
    """The objects a question's answer depends on: those it names, else (an absent object: "is there
    a red circle?" answered no) those of its colour."""
    if names:
        return tuple(names)
    color = question_color(question)
    return tuple(i for i, o in enumerate(objects) if o[0] == color) if color else ()


def evidence_tokens(boxes: np.ndarray, which: tuple[int, ...], size: tuple[int, int], grid: tuple[int, int],
                    temporal_patch: int = 2) -> np.ndarray:
    """(T', gh, gw) bool: cells that the objects `which` cover by EVIDENCE_SHARE, or hold the centre
    of, on either frame of the pair."""
    T = -(-boxes.shape[1] // temporal_patch)
    if not which:
        return np.zeros((T, *grid), bool)
    pairs = _pairs(boxes[list(which)], temporal_patch)                         # (k, T', tp, 4)
    hit = (_cover(pairs, size, grid) >= EVIDENCE_SHARE) | _centre_cells(pairs, size, grid)
    return hit.any((0, 2))


def question_facts(names: tuple[int, ...], question: str, boxes: np.ndarray, size: tuple[int, int],
                   objects: tuple[tuple[str, ...], ...]) -> np.ndarray:
    """(FACTS,) float32, NaN where undefined: the mean centre (y, x) in [0, 1] over the frames shown
    of the first and second object a question naming one or two objects names, and the shapes
    (multi-hot over SHAPES) of the shown objects of the question's colour."""
    facts = np.full(FACTS, np.nan, np.float32)
    H, W = size
    shown = boxes[..., 0] >= 0                                                 # (n, T)
    if 1 <= len(names) <= 2:
        for k, i in enumerate(names):
            if shown[i].any():
                b = boxes[i][shown[i]].astype(np.float64)
                facts[2 * k:2 * k + 2] = ((b[:, 0] + b[:, 2]) / 2 / H).mean(), ((b[:, 1] + b[:, 3]) / 2 / W).mean()
    color = question_color(question)
    if color is not None:
        facts[4:] = 0.0
        for i, o in enumerate(objects):
            if o[0] == color and shown[i].any():
                facts[4 + SHAPES.index(o[1])] = 1.0
    return facts


def force_keep(keep: np.ndarray, tokens: np.ndarray, temporal_patch: int = 2) -> np.ndarray:
    """A keep map (T, gh, gw) LOD (0 dropped, 1 full, 2 pooled) with every cell of `tokens` (T', gh, gw)
    kept in full on both frames of its pair."""
    frames = tokens.repeat(temporal_patch, 0)[:keep.shape[0]]
    return np.where(frames, 1, keep).astype(keep.dtype)
