"""pipeline.core.cuda's host <-> device helpers (CPU here; the CUDA run takes the same code)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.core.cuda import read_back, upload

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_upload_gives_each_array_as_int64_in_one_buffer(device):
    arrays = [np.array([3, 1, 2]), np.zeros(0, np.int32), np.arange(4, dtype=np.int32).reshape(2, 2), [7]]
    got = upload(arrays, torch.device(device))
    assert [g.dtype for g in got] == [torch.int64] * 4
    assert [g.tolist() for g in got] == [[3, 1, 2], [], [0, 1, 2, 3], [7]]
    assert len({g.untyped_storage().data_ptr() for g in got}) == 1          # views of one copy
    assert upload([], torch.device(device)) == []


@pytest.mark.parametrize("device", DEVICES)
def test_read_back_returns_every_tensor_in_its_shape(device):
    masks = [torch.rand(3, 4, generator=torch.Generator().manual_seed(i)) < 0.5 for i in range(3)]
    masks.append(torch.zeros(0, dtype=torch.bool))
    got = read_back([m.to(device) for m in masks])
    assert len(got) == 4
    for g, m in zip(got, masks):
        assert isinstance(g, np.ndarray) and g.shape == tuple(m.shape) and np.array_equal(g, m.numpy())
    assert read_back([]) == []
