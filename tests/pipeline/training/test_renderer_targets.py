"""Per-token colour targets on the multi-renderer clips come from the renderer's own labels: on a
background painted in the answer colours, pixel colours would mark background patches as objects."""
from __future__ import annotations

import numpy as np

from evaluation.renderers import scene
from evaluation.scenes import COLORS
from evaluation.synth_qa import SPLIT_SEEDS
from pipeline.training.qa_data import label_colors, token_colors


def _in_boxes(sc, grid, pairs):
    """(T', gh, gw) bool: token cells overlapping some object's box on either frame of the pair."""
    T, H, W = sc.clip.frames.shape[:3]
    gh, gw = grid
    inside = np.zeros((T, gh, gw), bool)
    for t in sc.tracks:
        for f, box in enumerate(t.boxes):
            if box is not None:
                y0, x0 = max(0, box[0]) * gh // H, max(0, box[1]) * gw // W
                y1, x1 = -(-min(H, box[2]) * gh // H), -(-min(W, box[3]) * gw // W)
                inside[f, y0:y1, x0:x1] = True
    if T % 2:
        inside = np.concatenate([inside, inside[-1:]])
    return inside.reshape(pairs, 2, gh, gw).any(1)


def test_labels_mark_objects_only_where_pixels_also_mark_the_background():
    grid = (8, 8)
    outside_pixels = outside_labels = 0
    for seed in range(SPLIT_SEEDS["train"].start, SPLIT_SEEDS["train"].start + 4):
        sc = scene("busy", seed, split="train")
        by_label = label_colors(sc.clip.labels, grid)
        by_pixel = token_colors(sc.clip.frames, grid)
        inside = _in_boxes(sc, grid, len(by_label))
        outside_labels += int(((by_label < len(COLORS)) & ~inside).sum())
        outside_pixels += int(((by_pixel < len(COLORS)) & ~inside).sum())
        named = {list(COLORS).index(t.color) for t in sc.tracks}
        assert set(np.unique(by_label)) <= named | {len(COLORS)}
        assert (by_label < len(COLORS)).any()
    assert outside_labels == 0 and outside_pixels > 10


def test_step_data_uses_the_labels_after_resizing(monkeypatch):
    from pipeline.configio import load_config
    from pipeline.training import qa_data
    from pipeline.training.qa_vlm import QAVLMConfig, clip_source, step_data

    cfg = load_config(QAVLMConfig, None, ["data.renderers=[busy]", "train.clips_per_step=2", "train.resize_prob=1.0",
                                          "train.workers=0"])
    used = []
    real = qa_data.label_colors
    monkeypatch.setattr(qa_data, "label_colors", lambda labels, *a: used.append(labels.shape) or real(labels, *a))
    samples = step_data(cfg, clip_source(cfg))[0]
    assert len(used) == 2
    for s, shape in zip(samples, used):
        assert shape == s.frames.shape[:3]          # resized with its frames


def test_a_colour_labels_a_token_by_its_area_share_of_the_cell():
    """28 x 28 cells: a 2-pixel strip along a cell's top edge covers 7% of it (no colour there), a
    block of 8 x 28 pixels 29% (its colour), wherever in the cell they lie."""
    labels = np.full((2, 56, 56), 255, np.uint8)
    labels[:, 28:30, 0:28] = 1                     # cell (1, 0): a strip at its top edge
    labels[:, 48:56, 28:56] = 2                    # cell (1, 1): a block at its bottom edge
    labels[:, 0:10, 0:28] = 3                      # cell (0, 0): 36% ...
    labels[1, 0:10, 0:28] = 255                    # ... on one frame of the pair only: 18%, none
    out = label_colors(labels, (2, 2))
    assert out.shape == (1, 2, 2) and out.dtype == np.int8
    assert out[0].tolist() == [[len(COLORS), len(COLORS)], [len(COLORS), 2]]
