"""bench_accuracy's per-question breakdown on splits written by evaluation/renderers.py.

Those splits record, per question, the objects it names (`objects`: track indices, `one_object`),
and per video every track's box per frame ({split}_tracks.json). Two measures follow:

  breakdown    accuracy over the questions that name exactly one object and over the rest
  named share  for the questions that name one object: the share of the tokens the store records
               per frame (ARR-COC's allocation, `tokens` [T, gh, gw]) that fall on that object's
               cells, over the frames where it is shown; `area_share` is the share of cells it
               covers, what a selection blind to it keeps on it on average

A cell is the object's where the object's box covers at least CELL_COVER of it. The store's
tokens are ARR-COC's allocation for the whole clip (batch attends to all of a clip's questions at
once; pass 2's per-question picks are not stored), so the named share is measured on ARR-COC's
rows only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

CELL_COVER = 0.25


def load_annotations(root: Path, split: str) -> tuple[dict[str, dict], dict[str, dict]] | None:
    """(records by question id, videos by video id) of a renderer split, None for another layout."""
    tracks = root / f"{split}_tracks.json"
    if not tracks.is_file():
        return None
    records = {str(r["id"]): r for r in json.loads((root / f"{split}_qa.json").read_text())}
    return records, json.loads(tracks.read_text())


def object_cells(box: tuple[int, int, int, int], size: tuple[int, int], grid: tuple[int, int]) -> np.ndarray:
    """(gh, gw) bool: the cells of a (gh, gw) grid over a frame of `size` that box covers >= CELL_COVER of."""
    (H, W), (gh, gw) = size, grid
    ys, xs = np.linspace(0, H, gh + 1), np.linspace(0, W, gw + 1)
    oy = np.clip(np.minimum(ys[1:], box[2]) - np.maximum(ys[:-1], box[0]), 0, None) / np.diff(ys)   # (gh,)
    ox = np.clip(np.minimum(xs[1:], box[3]) - np.maximum(xs[:-1], box[1]), 0, None) / np.diff(xs)   # (gw,)
    cells = oy[:, None] * ox[None, :] >= CELL_COVER
    if not cells.any():      # a small object: the cell of its centre
        cy, cx = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        cells[min(gh - 1, int(cy / H * gh)), min(gw - 1, int(cx / W * gw))] = True
    return cells


def named_share(store_path: Path, records: dict[str, dict], videos: dict[str, dict]) -> dict[str, Any]:
    """Mean over the one-object questions of the named object's share of the stored tokens and of the cells."""
    from sinks import ZarrStore

    store = ZarrStore.open(store_path, mode="r")
    present = set(store.stream_ids())
    token_shares, area_shares = [], []
    for r in records.values():
        sid = f"video{r['video_id']}"
        if not r.get("one_object") or sid not in present:
            continue
        video = videos[str(r["video_id"])]
        boxes = video["tracks"][r["objects"][0]]["boxes"]
        data = store.read(sid)
        tokens, pts = np.asarray(data["tokens"], np.float64), np.asarray(data["pts"])   # (T, gh, gw), (T,)
        on, total, cells, frames = 0.0, 0.0, 0, 0
        for t in range(len(pts)):
            box = boxes[min(len(boxes) - 1, int(round(pts[t] * video["fps"])))]
            if box is None:
                continue
            mask = object_cells(tuple(box), tuple(video["size"]), tokens.shape[1:])
            on, total = on + tokens[t][mask].sum(), total + tokens[t].sum()
            cells, frames = cells + int(mask.sum()), frames + 1
        if frames and total > 0:
            token_shares.append(on / total)
            area_shares.append(cells / (frames * tokens.shape[1] * tokens.shape[2]))
    return {"questions": len(token_shares),
            "token_share": round(float(np.mean(token_shares)), 6) if token_shares else None,
            "area_share": round(float(np.mean(area_shares)), 6) if area_shares else None}


def breakdown(report, records: dict[str, dict]) -> dict[str, Any]:
    """Accuracy over the questions naming exactly one object and over the others (eval's predictions)."""
    groups: dict[str, list[bool]] = {"one_object": [], "other": []}
    for p in report.predictions:
        r = records.get(str(p.question.question_id))
        if r is not None:
            groups["one_object" if r.get("one_object") else "other"].append(bool(p.correct))
    return {k: {"accuracy": round(sum(v) / len(v), 6) if v else None, "questions": len(v)}
            for k, v in groups.items()}
