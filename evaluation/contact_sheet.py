"""A contact sheet of the QA renderers: a few clips of each, three frames a clip, one row a renderer.

    python -m evaluation.contact_sheet --out docs/renderers.jpg [--clips 3]

Only this command writes the sheet (docs/renderers.jpg is committed from it); the held-out
renderer's test clips are drawn here for evaluation, as bench_accuracy draws them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

from .renderers import HELD_OUT, RENDERERS, scene
from .shapes_qa import SPLIT_SEEDS

TILE = 160          # tile height in pixels
LABEL = 22          # label band height


def _tile(frame: np.ndarray) -> np.ndarray:
    h, w = frame.shape[:2]
    return cv2.resize(frame, (int(round(w * TILE / h)), TILE), interpolation=cv2.INTER_AREA)


def sheet(clips: int = 3, frames_per_clip: int = 3) -> np.ndarray:
    """(H, W, 3) uint8: per renderer a row of test clips, each its first, middle and last frame."""
    split = "test"
    rows = []
    for name in RENDERERS:
        tiles = []
        for k in range(clips):
            sc = scene(name, SPLIT_SEEDS[split].start + k, split=split, evaluation=True)  # type: ignore[arg-type]
            video = sc.clip.frames
            for f in np.linspace(0, len(video) - 1, frames_per_clip).round().astype(int):
                tiles.append(_tile(video[f]))
            tiles.append(np.full((TILE, 8, 3), 255, np.uint8))
        row = np.concatenate(tiles[:-1], axis=1)
        band = np.full((LABEL, row.shape[1], 3), 255, np.uint8)
        label = f"{name} (held out)" if name == HELD_OUT else name
        cv2.putText(band, label, (4, LABEL - 6), cv2.FONT_HERSHEY_SIMPLEX, 0.55, (0, 0, 0), 1, cv2.LINE_AA)
        rows.append(np.concatenate([band, row], axis=0))
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 6), (0, width - r.shape[1]), (0, 0)), constant_values=255) for r in rows]
    return np.concatenate(rows, axis=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.contact_sheet", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="the image to write (.jpg or .png)")
    p.add_argument("--clips", type=int, default=3, help="clips per renderer (default: %(default)s)")
    args = p.parse_args(argv)
    if not 1 <= args.clips <= 10:
        print(f"error: --clips {args.clips}: must be in 1..10", file=sys.stderr)
        return 2
    try:
        image = sheet(args.clips)
    except (OSError, ModuleNotFoundError) as e:     # the photo renderer without scikit-image
        print(f"error: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(args.out), image[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 85]):
        print(f"error: could not write {args.out}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({image.shape[1]}x{image.shape[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
