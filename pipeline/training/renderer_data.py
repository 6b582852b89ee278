"""ARR-COC's training data from the QA renderers (evaluation/renderers.py): the training renderers only.

Every question of a rendered clip records the objects it names (QA.names) and every object's box in
every frame (QAScene.tracks), so each question is an example of where the tokens should go: on the
objects it names. That holds on every background the renderers draw (muted textures, real
photographs, busy patterns in the answer colours), which the still scenes of evaluation/scenes.py
never show. Three views of the same clips:

  still  one frame of a clip, a question naming objects visible in it, the cells those objects cover
         (the grounding / static / hard stages)
  clip   every frame of a clip with a question naming one object and its box per frame (temporal)
  qa     the frames the VLM sees (its fps) with every (question, answer) of the clip (vlm_qa, outcome)

RendererScenes is the gate: it accepts only training renderers (evaluation.renderers.MultiRendererClips
refuses the held-out one) and draws the train or val split. Clips are drawn in `workers` processes.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch


class RendererScenes:
    """(seed, split) -> the QAScene of training renderer renderers[seed % n]; the held-out renderer
    (and any unknown name) is refused when the source is built."""

    def __init__(self, renderers: tuple[str, ...]) -> None:
        from evaluation.renderers import MultiRendererClips
        self.renderers = MultiRendererClips(tuple(renderers)).renderers

    def __call__(self, seed: int, split: str = "train"):
        from evaluation.renderers import scene
        return scene(self.renderers[int(seed) % len(self.renderers)], int(seed), split=split)  # type: ignore[arg-type]


def _draw(job: tuple[tuple[str, ...], int, str]):
    renderers, seed, split = job
    return RendererScenes(renderers)(seed, split)


def render_scenes(source: RendererScenes, seeds, split: str = "train", workers: int = 0) -> list:
    """The QAScenes of `seeds`, in order, drawn here (workers 0) or in that many processes."""
    jobs = [(source.renderers, int(s), split) for s in seeds]
    if workers <= 0 or len(jobs) < 2:
        return [_draw(j) for j in jobs]
    # fork: the children need nothing but numpy and OpenCV, and nothing has touched CUDA yet
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        return list(pool.map(_draw, jobs, chunksize=max(1, len(jobs) // (4 * workers))))


@dataclass(frozen=True)
class StillItem:
    """One frame of a rendered clip and a question about objects visible in it."""
    frame: int                              # row of the frames array
    question: str
    boxes: tuple[tuple[int, int, int, int], ...]   # pixel boxes of the named objects in that frame


def still_items(scenes: list, frames_per_clip: int, seed: int) -> tuple[np.ndarray, list[StillItem]]:
    """-> frames (S, H, W, 3) uint8 (frames_per_clip of each clip, at random) and one item per
    (frame, question naming objects all visible in it). All clips must share one frame size (the
    train split's is 224 x 224)."""
    rng = np.random.default_rng(seed)
    frames, items = [], []
    for sc in scenes:
        T = len(sc.clip.frames)
        for t in sorted(rng.choice(T, size=min(frames_per_clip, T), replace=False).tolist()):
            row = len(frames)
            frames.append(sc.clip.frames[t])
            for qa in sc.clip.qas:
                boxes = [sc.tracks[i].boxes[t] for i in qa.names]
                if boxes and all(b is not None for b in boxes):
                    items.append(StillItem(row, qa.question, tuple(tuple(b) for b in boxes)))
    sizes = {f.shape for f in frames}
    if len(sizes) > 1:
        raise ValueError(f"rendered frames differ in size ({sorted(sizes)}): still examples need one size")
    return np.stack(frames), items


def union_coverage(items: list[StillItem], size: tuple[int, int], grid: tuple[int, int], device) -> torch.Tensor:
    """(E, gh, gw) share of each cell covered by any object the item's question names."""
    from evaluation.metrics import box_coverage

    M = max(len(it.boxes) for it in items)
    boxes = torch.tensor([list(it.boxes) + [(0, 0, 0, 0)] * (M - len(it.boxes)) for it in items],
                         device=device)                                          # (E, M, 4), empty boxes pad
    cover = box_coverage(boxes.view(-1, 4), size, grid)                          # (E * M, gh, gw)
    return cover.view(len(items), M, *grid).amax(1)                              # (E, gh, gw)


@dataclass(frozen=True)
class TrackClip:
    """A clip with a question naming one object, as evaluation.scenes.make_clips' VideoClip reads:
    frames, query, the object's box per frame (None where not shown) and the shot per frame."""
    frames: np.ndarray
    query: str
    boxes: tuple
    shot: tuple[int, ...]


def track_clips(scenes: list, seed: int) -> list[TrackClip]:
    """One TrackClip per clip that has a question naming exactly one object (one at random)."""
    rng = np.random.default_rng(seed)
    out = []
    for sc in scenes:
        single = [qa for qa in sc.clip.qas if len(qa.names) == 1]
        if single:
            qa = single[int(rng.integers(len(single)))]
            out.append(TrackClip(sc.clip.frames, qa.question, sc.tracks[qa.names[0]].boxes, sc.shot))
    return out


def qa_views(scenes: list, vlm_fps: float) -> list[tuple[np.ndarray, list[tuple[str, str]]]]:
    """(frames the VLM sees at vlm_fps, [(question, answer)]) per clip, as train_vlm.qa_clips."""
    from .qa_data import vlm_frame_indices

    out = []
    for sc in scenes:
        clip = sc.clip
        shown = vlm_frame_indices(len(clip.frames), clip.fps, vlm_fps)
        out.append((np.ascontiguousarray(clip.frames[shown]), [(qa.question, qa.answer) for qa in clip.qas]))
    return out
