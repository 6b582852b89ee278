"""Training data for the video-QA VLM: generated clips, seen as the pipeline shows them to its VLM.

Frames: the pipeline decodes every frame and hands the VLM those its realize stage samples at
vlm.fps on their presentation times (`RealizeStage.vlm_frames`), one window per video in batch
mode, at most 256 frames of it (`VLMStage`, which drops every other frame when full).
`vlm_frame_indices` is that rule over the frames of a clip at its fps. The pipeline's frames went
through a video codec; a share of the training clips is JPEG-compressed (4:2:0 chroma, as H.264's
yuv420p) so the model does not learn from pixel detail a decoded video does not have. Another
share is resized to another aspect ratio and size (every answer of the generator is invariant to
that: regions are relative, shapes stay recognisable), so the model meets token grids other than
the training clips' one, as videos of other sizes give.

Token dropping: every training question gets its own keep map, an ARR-COC-style per-frame LOD map
(T, gh, gw) on the VLM's grid (0 dropped, 1 full, 2 pooled into its 2x2 block), which the
trainer passes through the pipeline's own selection (pair_lod, select_tokens), so the model
learns to answer from whatever a selection policy keeps. The policies cover the shapes the
benchmark's selectors produce: random cells, whole frames (uniform subsampling), blocks,
temporal difference (what changed since the previous frame), salience (what stands out from the
background) and mixed full / pooled cells, at keep ratios drawn log-uniformly from
[keep_min, keep_max], plus a share of questions with every token. The first `curriculum_steps`
steps keep only the cells that stand out (salience at a small ratio): with the background gone
the few object tokens dominate what the question attends to, which is what lets a model learnt
from scratch start grounding its answers (with every token it sat at the answer priors).

Token colours and shapes: auxiliary targets per visual token, the named colour
(evaluation.scenes.COLORS) covering at least a quarter of its cell over its frame pair, else
background, and the shape and motion (travel against the background) of the object of that
colour (colours name one object in a clip; a colour two objects share, or one no object has, is
left out). A linear head on the vision tower's tokens learns them alongside the answers (only
during training): dense, per-token supervision that gives the tower colour, shape and motion
features from the first steps (a token's frame pair shows its motion). Without the shape target
a model learnt colours but sat at chance on every question about shapes. Token regions: the 3x3
region of each visual token's cell, a target for a linear probe on the LM's hidden state of that
token after a few layers (qa_forward): with relative positions alone (M-RoPE) nothing in a
token's value says where it is, and "where" questions sat at chance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import cv2
import numpy as np

from pipeline.vlm.geometry import VLMGeometry
from evaluation.scenes import COLORS, SHAPES

WINDOW_MAX_FRAMES = 256          # VLMStage's window: past this, every other frame is dropped
PALETTE = np.array(list(COLORS.values()), np.float32)    # (C, 3): token colour classes; C = background
COLOR_DISTANCE = 60.0            # a pixel within this RGB distance of a named colour has that colour
COLOR_SHARE = 0.25               # a token has a colour when this much of its cell has it
POLICIES = ("random", "frames", "blocks", "temporal", "salient", "pooled")


def vlm_frame_indices(n_frames: int, fps: float, vlm_fps: float, max_frames: int = WINDOW_MAX_FRAMES) -> list[int]:
    """Indices of the frames of a clip (frame i at pts i / fps) that the pipeline's VLM sees in one
    window: RealizeStage.vlm_frames's sampling at vlm_fps, then VLMStage's cap of max_frames."""
    nxt, taken = None, []
    for i in range(n_frames):
        pts = i / fps
        if nxt is None or pts >= nxt - 1e-6:
            taken.append(i)
            nxt = (pts if nxt is None else nxt) + 1.0 / vlm_fps
            while nxt <= pts:
                nxt += 1.0 / vlm_fps
    window: list[int] = []
    for i in taken:
        if len(window) == max_frames:
            del window[::2]
        window.append(i)
    return window


def jpeg(frames: np.ndarray, quality: int) -> np.ndarray:
    """(T, H, W, 3) uint8 RGB through a JPEG round trip at this quality (4:2:0 chroma)."""
    out = np.empty_like(frames)
    for t, rgb in enumerate(frames):
        ok, buf = cv2.imencode(".jpg", rgb[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
        if not ok:
            raise RuntimeError("JPEG encoding failed")
        out[t] = cv2.imdecode(buf, cv2.IMREAD_COLOR)[..., ::-1]
    return out


def resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (T, height, width, 3), area-averaged when shrinking."""
    shrink = height * width < frames.shape[1] * frames.shape[2]
    mode = cv2.INTER_AREA if shrink else cv2.INTER_LINEAR
    return np.stack([cv2.resize(f, (width, height), interpolation=mode) for f in frames])


def cell_colors(frames: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (T, gh, gw, 3) float32 mean colour of each VLM token's cell."""
    gh, gw = grid
    return np.stack([cv2.resize(f, (gw, gh), interpolation=cv2.INTER_AREA) for f in frames]).astype(np.float32)


def token_colors(frames: np.ndarray, grid: tuple[int, int], temporal_patch: int = 2, sub: int = 4) -> np.ndarray:
    """(T, H, W, 3) uint8 -> (ceil(T / tp), gh, gw) int8: per visual token the index of the named
    colour covering COLOR_SHARE of its cell (on a sub x sub sampling of the cell) over its frame
    pair, len(COLORS) for background. An odd last frame pairs with itself, as the VLM's does."""
    gh, gw = grid
    small = np.stack([cv2.resize(f, (gw * sub, gh * sub), interpolation=cv2.INTER_AREA) for f in frames])
    dist = np.linalg.norm(small[..., None, :].astype(np.float32) - PALETTE, axis=-1)   # (T, gh*sub, gw*sub, C)
    label = np.where(dist.min(-1) < COLOR_DISTANCE, dist.argmin(-1), len(PALETTE))
    return _token_shares(label, grid, temporal_patch, sub)


def label_colors(labels: np.ndarray, grid: tuple[int, int], temporal_patch: int = 2) -> np.ndarray:
    """token_colors from a renderer's own labels (QAClip.labels: (T, H, W) uint8, a COLORS index where
    an object shows its colour, 255 elsewhere) instead of pixel colours, which on backgrounds painted
    in the answer colours would label background patches. Each colour's share of a cell is its area
    share (a nearest pick of sub x sub samples, each at its sub-cell's corner, put an object's 2-pixel
    edge at a quarter of a cell: a quarter of the object tokens of rendered clips took the wrong side
    of COLOR_SHARE)."""
    gh, gw = grid
    share = np.stack([np.stack([cv2.resize((m == c).astype(np.float32), (gw, gh), interpolation=cv2.INTER_AREA)
                                for c in range(len(PALETTE))], -1) for m in labels])      # (T, gh, gw, C)
    if pad := -len(share) % temporal_patch:
        share = np.concatenate([share, share[-1:].repeat(pad, 0)])
    share = share.reshape(-1, temporal_patch, gh, gw, len(PALETTE)).mean(1)              # (T', gh, gw, C)
    colored = share.max(-1) >= COLOR_SHARE
    return np.where(colored, share.argmax(-1), len(PALETTE)).astype(np.int8)


def _token_shares(label: np.ndarray, grid: tuple[int, int], temporal_patch: int, sub: int) -> np.ndarray:
    """(T, gh*sub, gw*sub) class per sample (len(PALETTE): background) -> (ceil(T / tp), gh, gw) int8:
    the colour covering COLOR_SHARE of each token's samples over its frame pair, else background."""
    gh, gw = grid
    if pad := -len(label) % temporal_patch:
        label = np.concatenate([label, label[-1:].repeat(pad, 0)])
    onehot = np.eye(len(PALETTE) + 1, dtype=np.float32)[label]                           # (T, .., .., C + 1)
    share = onehot.reshape(-1, temporal_patch, gh, sub, gw, sub, len(PALETTE) + 1).mean((1, 3, 5))
    colored = share[..., :-1].max(-1) >= COLOR_SHARE
    return np.where(colored, share[..., :-1].argmax(-1), len(PALETTE)).astype(np.int8)


MOTIONS = ("left", "right", "up", "down", "still")     # an object's travel against the background


def token_objects(colors: np.ndarray, objects: tuple[tuple[str, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """token_colors' labels and a clip's (colour, shape, motion) objects -> per token the index of
    its object's shape (SHAPES; len(SHAPES) for background) and of its motion (MOTIONS; background
    is "still"); -1 (no target) where its colour belongs to no object, or to objects that differ."""
    names = list(COLORS)
    out = []
    for k, words in ((1, SHAPES), (2, MOTIONS)):
        table = np.full(len(names) + 1, -1, np.int8)
        table[len(names)] = len(SHAPES) if k == 1 else MOTIONS.index("still")
        found: dict[str, set[str]] = {}
        for obj in objects:
            if len(obj) > k:
                found.setdefault(obj[0], set()).add(obj[k])
        for color, values in found.items():
            if color in names and len(values) == 1:
                table[names.index(color)] = words.index(next(iter(values)))
        out.append(table[colors.astype(np.int64)])
    return out[0], out[1]


def token_regions(grid: tuple[int, int]) -> np.ndarray:
    """(gh, gw) int8: the 3x3 region (row-major, as evaluation.synth_qa.where_answer's words) of each
    cell's centre."""
    gh, gw = grid
    rows = np.minimum(2, ((np.arange(gh) + 0.5) * 3 / gh).astype(int))
    cols = np.minimum(2, ((np.arange(gw) + 0.5) * 3 / gw).astype(int))
    return (rows[:, None] * 3 + cols[None, :]).astype(np.int8)


def _top(score: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """True at the round(ratio * size) highest scores (ties broken at random), at least one."""
    k = max(1, int(round(ratio * score.size)))
    order = np.lexsort((rng.random(score.size), -score.ravel()))
    keep = np.zeros(score.size, bool)
    keep[order[:k]] = True
    return keep.reshape(score.shape)


def _blocks(shape: tuple[int, int, int], ratio: float, rng: np.random.Generator) -> np.ndarray:
    """1-3 rectangles covering about `ratio` of each frame, the same on every frame."""
    T, gh, gw = shape
    keep = np.zeros((gh, gw), bool)
    n = int(rng.integers(1, 4))
    for _ in range(n):
        area = max(1.0, ratio * gh * gw / n)
        aspect = float(np.exp(rng.uniform(-0.7, 0.7)))
        h = int(np.clip(round(np.sqrt(area / aspect)), 1, gh))
        w = int(np.clip(round(area / h), 1, gw))
        y, x = int(rng.integers(0, gh - h + 1)), int(rng.integers(0, gw - w + 1))
        keep[y:y + h, x:x + w] = True
    return np.broadcast_to(keep, shape)


def _frames(shape: tuple[int, int, int], ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Whole frames: an even spread of round(ratio * T) of them (at least one), or as many at random."""
    T = shape[0]
    n = max(1, int(round(ratio * T)))
    if rng.random() < 0.5:
        chosen = np.unique(np.linspace(0, T - 1, n).round().astype(int))
    else:
        chosen = rng.choice(T, size=n, replace=False)
    keep = np.zeros(shape, bool)
    keep[chosen] = True
    return keep


def _temporal(cells: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """The cells that changed most since the previous frame; the first frame counts as all new."""
    change = np.abs(np.diff(cells, axis=0)).sum(-1)                        # (T - 1, gh, gw)
    first = np.full((1, *cells.shape[1:3]), np.inf, np.float32)
    return _top(np.concatenate([first, change]), ratio, rng)


def _salient(cells: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Per frame, the cells whose colour lies farthest from the frame's median (objects on a muted
    background), with a little noise so near-ties vary."""
    median = np.median(cells.reshape(cells.shape[0], -1, 3), axis=1)[:, None, None]  # (T, 1, 1, 3)
    score = np.linalg.norm(cells - median, axis=-1)                           # (T, gh, gw)
    score = score + rng.normal(0, 4.0, score.shape)
    return np.stack([_top(s, ratio, rng) for s in score])


def keep_map(policy: str, cells: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """cells (T, gh, gw, 3) cell colours of the VLM's frames -> (T, gh, gw) int8 LOD map keeping
    about `ratio` of the cells per `policy` (POLICIES); at least one cell is kept."""
    shape = cells.shape[:3]
    if policy == "random":
        keep = rng.random(shape) < ratio
    elif policy == "frames":
        keep = _frames(shape, ratio, rng)
    elif policy == "blocks":
        keep = _blocks(shape, ratio, rng)
    elif policy == "temporal":
        keep = _temporal(cells, ratio, rng)
    elif policy == "salient":
        keep = _salient(cells, ratio, rng)
    elif policy == "pooled":
        return _pooled(shape, ratio, rng)
    else:
        raise ValueError(f"Invalid keep policy ({policy!r}). Supported values are {', '.join(POLICIES)}.")
    lod = keep.astype(np.int8)
    if not lod.any():
        lod[tuple(int(rng.integers(n)) for n in shape)] = 1
    return lod


def _pooled(shape: tuple[int, int, int], ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Full cells at random (about ratio / 2), and about ratio / 2 of the 2x2 blocks pooled into one
    token where no cell of theirs is full (as ARR-COC's LOD 2 for middling relevance)."""
    T, gh, gw = shape
    lod = (rng.random(shape) < ratio / 2).astype(np.int8)
    blocks = rng.random((T, (gh + 1) // 2, (gw + 1) // 2)) < ratio / 2
    pooled = blocks.repeat(2, 1).repeat(2, 2)[:, :gh, :gw]
    lod[pooled & (lod == 0)] = 2
    if not lod.any():
        lod[tuple(int(rng.integers(n)) for n in shape)] = 1
    return lod


@dataclass(frozen=True)
class DropSpec:
    keep_min: float
    keep_max: float
    p_all: float
    policies: tuple[str, ...]


def draw_keep(spec: DropSpec, cells: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One question's keep map: every token with probability p_all, else a policy drawn uniformly
    at a ratio drawn log-uniformly from [keep_min, keep_max]."""
    if rng.random() < spec.p_all:
        return np.ones(cells.shape[:3], np.int8)
    policy = spec.policies[int(rng.integers(len(spec.policies)))]
    ratio = float(np.exp(rng.uniform(np.log(spec.keep_min), np.log(spec.keep_max))))
    return keep_map(policy, cells, ratio, rng)


@dataclass
class ClipSample:
    """One clip as the trainer needs it: the VLM's frames and, per view (a question with its own
    keep map), the question, its answer and family, and the keep map."""
    frames: np.ndarray                   # (T, H, W, 3) uint8, the frames the VLM sees
    questions: list[str]
    answers: list[str]
    families: list[str]
    keeps: list[np.ndarray]              # (T, gh, gw) int8 per view
    colors: np.ndarray                   # (T', gh, gw) int8 token colours (token_colors)
    shapes: np.ndarray | None = None     # (T', gh, gw) int8 token shapes (token_objects), -1: none
    motions: np.ndarray | None = None    # (T', gh, gw) int8 token motions (token_objects), -1: none
    # from the clip's boxes (qa_targets), where it has them:
    centres: np.ndarray | None = None    # (T', gh, gw) int8 1 where an object's centre is
    evidence: list[np.ndarray] | None = None   # per view (T', gh, gw) bool its answer's objects' cells
    facts: np.ndarray | None = None      # (views, qa_targets.FACTS) float32 question facts, NaN: none


class StepData:
    """Map-style dataset over training steps: item s is the list of ClipSamples of step s, all drawn
    deterministically from (seed, s): clip seeds first_seed + s * clips_per_step + i; with world
    ranks, rank r's item holds every world-th of them from i = r (the ranks together: the same clips)."""

    def __init__(self, make_clip: Callable, geometry: VLMGeometry, *, clips_per_step: int, views_per_question: int,
                 vlm_fps: float, drop: DropSpec, jpeg_prob: float, jpeg_quality: tuple[int, int],
                 resize_prob: float, aspect: tuple[float, float], area: tuple[float, float], seed: int,
                 first_seed: int, steps: int, curriculum_steps: int = 0,
                 curriculum: DropSpec | None = None, rank: int = 0, world: int = 1,
                 family_views: dict[str, int] | None = None, keep_evidence: float = 0.0) -> None:
        self.make_clip, self.geometry = make_clip, geometry
        self.clips_per_step, self.views = clips_per_step, views_per_question
        self.vlm_fps, self.drop, self.jpeg_prob, self.jpeg_quality = vlm_fps, drop, jpeg_prob, jpeg_quality
        self.resize_prob, self.aspect, self.area = resize_prob, aspect, area
        self.seed, self.first_seed, self.steps = seed, first_seed, steps
        self.curriculum_steps, self.curriculum = curriculum_steps, curriculum
        self.rank, self.world = rank, world   # under data parallelism: this rank's share of each step
        # views per question of these families instead of views_per_question; the share of dropped
        # views that keep every cell of their answer's objects (qa_targets: answerable views)
        self.family_views, self.keep_evidence = dict(family_views or {}), keep_evidence

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> list[ClipSample]:
        drop = self.curriculum if step < self.curriculum_steps else self.drop
        return [self.sample(self.first_seed + step * self.clips_per_step + i, drop)
                for i in range(self.clips_per_step)[self.rank::self.world]]

    def sample(self, clip_seed: int, drop: DropSpec | None = None) -> ClipSample:
        clip = self.make_clip(clip_seed, split="train")
        rng = np.random.default_rng([self.seed, clip_seed])
        shown = vlm_frame_indices(len(clip.frames), clip.fps, self.vlm_fps)
        frames = clip.frames[shown]
        labels = None if getattr(clip, "labels", None) is None else clip.labels[shown]
        if rng.random() < self.resize_prob:
            H, W = frames.shape[1:3]
            aspect = float(np.exp(rng.uniform(np.log(self.aspect[0]), np.log(self.aspect[1]))))   # W / H
            area = rng.uniform(*self.area) * H * W
            height = 2 * max(8, int(round(np.sqrt(area / aspect) / 2)))      # even sides, as a video has
            frames = resize(frames, height, 2 * max(8, int(round(height * aspect / 2))))
            if labels is not None:
                labels = np.stack([cv2.resize(m, frames.shape[2:0:-1], interpolation=cv2.INTER_NEAREST)
                                   for m in labels])
        if rng.random() < self.jpeg_prob:
            frames = jpeg(frames, int(rng.integers(self.jpeg_quality[0], self.jpeg_quality[1] + 1)))
        grid = self.geometry.grid(*frames.shape[1:3])
        cells = cell_colors(frames, grid)
        qas = [qa for qa in clip.qas for _ in range(self.family_views.get(qa.family, self.views))]
        tp = self.geometry.temporal_patch_size
        colors = token_colors(frames, grid, tp) if labels is None else label_colors(labels, grid, tp)
        objects = getattr(clip, "objects", ())
        shapes, motions = token_objects(colors, objects)
        keeps = [draw_keep(drop or self.drop, cells, rng) for _ in qas]
        boxes = getattr(clip, "boxes", None)
        if boxes is None:
            return ClipSample(frames=np.ascontiguousarray(frames), questions=[qa.question for qa in qas],
                              answers=[qa.answer for qa in qas], families=[qa.family for qa in qas],
                              keeps=keeps, colors=colors, shapes=shapes, motions=motions)
        from pipeline.training import qa_targets as qt
        size, boxes = clip.frames.shape[1:3], boxes[:, shown]                   # boxes of the frames shown
        evidence = [qt.evidence_tokens(boxes, qt.evidence(qa.names, qa.question, objects), size, grid, tp)
                    for qa in qas]
        if self.keep_evidence > 0:
            keeps = [qt.force_keep(k, e, tp) if rng.random() < self.keep_evidence else k
                     for k, e in zip(keeps, evidence)]
        return ClipSample(frames=np.ascontiguousarray(frames), questions=[qa.question for qa in qas],
                          answers=[qa.answer for qa in qas], families=[qa.family for qa in qas],
                          keeps=keeps, colors=colors, shapes=shapes, motions=motions,
                          centres=qt.centre_tokens(boxes, size, grid, tp), evidence=evidence,
                          facts=np.stack([qt.question_facts(qa.names, qa.question, boxes, size, objects)
                                          for qa in qas]))
