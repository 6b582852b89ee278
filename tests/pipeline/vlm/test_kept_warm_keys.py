"""Warm-up's kept-tower shapes (kept_graph.warm_keys): every call a run can make fits one of them,
as KeptGraphs._fitting picks once warm-up has set free_captures to 0."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.vlm.kept_graph import MAX_PAD, TowerCall, blank_call, cell_bucket, pow2_at_least, warm_keys


def call_key(cells_per_block: list[int], units: int, windows: int | None) -> tuple[int, int, int, int]:
    """TowerCall.key of a call packing these blocks (frame pairs' encoded cells), without tensors."""
    cells = sum(cells_per_block)
    w = 0 if windows is None else pow2_at_least(windows, 8)
    return (cell_bucket(cells), pow2_at_least(len(cells_per_block), 2),
            pow2_at_least(max(cells_per_block) * units, 64), w)


def fits(warm: list[tuple], key: tuple) -> bool:
    return any(all(a >= b for a, b in zip(k, key)) and k[0] <= MAX_PAD * key[0] for k in warm)


@pytest.mark.parametrize("frame_cells, max_blocks, frame_windows", [(24, 6, None), (252, 48, None), (920, 8, 60),
                                                                    (256, 128, None)])
def test_every_call_fits_a_warm_shape(frame_cells, max_blocks, frame_windows):
    rng = np.random.default_rng(0)
    warm = warm_keys(max_blocks * frame_cells, max_blocks, frame_cells, 4, frame_windows)
    assert len(warm) <= 24 and len(set(warm)) == len(warm)
    for _ in range(2000):
        blocks = int(rng.integers(1, max_blocks + 1))
        per_block = [int(c) for c in rng.integers(1, frame_cells + 1, size=blocks) * rng.random(blocks) ** 3 + 1]
        per_block = [min(c, frame_cells) for c in per_block]
        windows = None if frame_windows is None else int(min(sum(per_block), blocks * frame_windows))
        assert fits(warm, call_key(per_block, 4, windows)), (per_block, warm)


def test_without_the_largest_shape_a_full_batch_fits_none():
    warm = warm_keys(48 * 252, 48, 252, 4, None)
    assert not fits(warm[:-1], call_key([252] * 48, 4, None))


def test_a_blank_call_has_its_keys_shape():
    import torch
    for key in warm_keys(8 * 920, 8, 920, 4, 60):
        call: TowerCall = blank_call(key, 12, torch.float32, torch.device("cpu"), 4, (46, 80), 64, True)
        assert call.key(4) == key
        assert int(call.cu.diff().max()) <= key[2] and int(call.cu_window.diff().max()) <= 64
        assert call.sizes.shape == (key[0] * 4, 2)
