"""A tiny stand-in for evaluation/synth_qa.make_qa_clip (same types, two easy families), so the
trainer's tests run without the generator: a coloured square drifting left or right on grey."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLORS = {"red": (225, 35, 35), "green": (40, 175, 60), "blue": (35, 70, 230), "yellow": (240, 220, 40)}


@dataclass(frozen=True)
class QA:
    question: str
    answer: str
    family: str


@dataclass(frozen=True)
class QAClip:
    frames: np.ndarray
    fps: float
    qas: tuple[QA, ...]
    seed: int


def make_clip(seed: int, *, split: str = "train") -> QAClip:
    rng = np.random.default_rng([seed, {"train": 0, "val": 1, "test": 2}[split]])
    H, W, T, fps = 56, 84, 6, 4.0
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    step = 6 if rng.random() < 0.5 else -6
    x0 = 10 if step > 0 else W - 30
    frames = np.full((T, H, W, 3), 128, np.uint8)
    for t in range(T):
        x = x0 + step * t
        frames[t, 18:38, x:x + 20] = COLORS[color]
    qas = (QA("What color is the moving object?", color, "color_moving"),
           QA(f"Which way does the {color} square move?", "right" if step > 0 else "left", "direction"))
    return QAClip(frames, fps, qas, seed)
