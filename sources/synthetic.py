"""Generated videos with exact ground truth: shots, hard cuts, a moving object, a camera pan.

Used by the demo (`make demo`), the tests and the benchmarks, so nothing needs a download.
Each shot has its own random smooth background (so a cut changes the whole picture) and
optionally a coloured object moving across it or a camera panning over a larger canvas.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

ShotKind = Literal["static", "moving_object", "fast_object", "pan", "fade_in"]


@dataclass(frozen=True)
class Shot:
    kind: ShotKind
    frames: int
    color: tuple[int, int, int] = (230, 40, 40)
    object_size: float = 0.18  # side of the object as a fraction of min(H, W)
    speed: float = 2.0         # pixels per frame (object) or canvas pixels per frame (pan)


@dataclass
class Clip:
    frames: np.ndarray                  # uint8 (T, H, W, 3)
    cuts: list[int]                     # first frame index of every shot after the first
    boxes: list[tuple[int, int, int, int] | None] = field(default_factory=list)  # (y0, x0, y1, x1) of the object


def smooth_texture(rng: np.random.Generator, h: int, w: int, cells: int = 6) -> np.ndarray:
    """A smooth random RGB texture (bilinear upsampling of a coarse random grid), uint8 (h, w, 3)."""
    coarse = rng.uniform(30, 220, size=(cells + 1, cells + 1, 3))
    ys = np.linspace(0, cells, h)
    xs = np.linspace(0, cells, w)
    y0 = np.clip(ys.astype(int), 0, cells - 1)
    x0 = np.clip(xs.astype(int), 0, cells - 1)
    fy = (ys - y0)[:, None, None]
    fx = (xs - x0)[None, :, None]
    c00 = coarse[y0][:, x0]
    c01 = coarse[y0][:, x0 + 1]
    c10 = coarse[y0 + 1][:, x0]
    c11 = coarse[y0 + 1][:, x0 + 1]
    img = (1 - fy) * ((1 - fx) * c00 + fx * c01) + fy * ((1 - fx) * c10 + fx * c11)
    fine = rng.normal(0, 6, size=(h, w, 1))  # mild grain so flow has something to lock onto
    return np.clip(img + fine, 0, 255).astype(np.uint8)


def render_clip(shots: list[Shot], height: int = 144, width: int = 192, seed: int = 0) -> Clip:
    """Render shots back to back; a new shot always starts with a hard cut (or a fade from black)."""
    rng = np.random.default_rng(seed)
    frames: list[np.ndarray] = []
    boxes: list[tuple[int, int, int, int] | None] = []
    cuts: list[int] = []
    for shot_index, shot in enumerate(shots):
        if shot_index > 0:
            cuts.append(len(frames))
        pan = shot.kind == "pan"
        canvas_w = width + int(np.ceil(shot.speed * shot.frames)) + 1 if pan else width
        background = smooth_texture(rng, height, canvas_w, cells=8 if pan else 6)
        side = max(4, int(shot.object_size * min(height, width)))
        speed = shot.speed * (4 if shot.kind == "fast_object" else 1)
        for t in range(shot.frames):
            if pan:
                x = int(round(shot.speed * t))
                frame = background[:, x:x + width].copy()
            else:
                frame = background.copy()
            box = None
            if shot.kind in ("moving_object", "fast_object"):
                span_x = max(1, width - side)
                x0 = int(round(width * 0.1 + speed * t)) % span_x
                y0 = (height - side) // 2
                frame[y0:y0 + side, x0:x0 + side] = shot.color
                box = (y0, x0, y0 + side, x0 + side)
            if shot.kind == "fade_in":
                frame = (frame.astype(np.float32) * min(1.0, (t + 1) / shot.frames)).astype(np.uint8)
            frames.append(frame)
            boxes.append(box)
    return Clip(frames=np.stack(frames), cuts=cuts, boxes=boxes)


def default_demo_clip(height: int = 240, width: int = 320, seed: int = 0) -> Clip:
    """Four shots: a moving red square, a slow pan, a fast-moving blue square, a static scene."""
    return render_clip(
        [
            Shot("moving_object", 40, color=(230, 40, 40), speed=2.0),
            Shot("pan", 40, speed=1.5),
            Shot("fast_object", 40, color=(40, 60, 230), speed=3.0),
            Shot("static", 30),
        ],
        height=height, width=width, seed=seed,
    )


def write_video(path: str | Path, frames: np.ndarray, fps: int = 25, codec: str = "libx264",
                pix_fmt: str = "yuv420p", crf: int = 18) -> Path:
    """Encode uint8 (T, H, W, 3) frames with PyAV. H and W must be even for yuv420p."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t, h, w, _ = frames.shape
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        if codec == "libx264":
            # keyframes only where x264 wants them; scenecut off so GOPs don't leak the cut positions
            stream.options = {"crf": str(crf), "preset": "veryfast", "x264-params": "scenecut=0"}
        for i in range(t):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[i]), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
