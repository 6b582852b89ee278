"""Shared by the ProcessSource tests (imported as a module: pytest puts this folder on sys.path)."""
from __future__ import annotations

import numpy as np

from sources.process import ProcessSource


def collect(source: ProcessSource) -> tuple[list[int], list[float], np.ndarray]:
    """Every batch of the source, released as read -> (indices, pts, rgb (N, H, W, 3))."""
    indices, pts, rgb = [], [], []
    for batch in source.batches():
        indices += batch.indices
        pts += batch.pts
        rgb.append(batch.rgb.copy())
        source.release(batch)
    return indices, pts, np.concatenate(rgb)
