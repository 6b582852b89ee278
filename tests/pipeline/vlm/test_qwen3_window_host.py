"""Qwen3-VL's window laid out from the kept cells read on the host (VLM.prepare's path: no host read
after the vision tower is queued) equals the one laid out from a device index (a nonzero), in both
empty-frame-group modes and with a frame group left without any kept token."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_frames, request, rewrap

from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm_config import VLMConfig


@pytest.fixture(scope="module")
def vlm():
    return build_tiny_vlm("qwen3_vl", device="cpu", dtype=torch.float32, config=VLMConfig(max_new_tokens=2))


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_host_index_layout_equals_the_device_one(vlm, mode):
    v = rewrap(vlm, empty_frame_groups=mode)
    frames = make_frames(6, 112, 112, seed=3)                       # 3 frame groups
    gh, gw = v.geometry.grid(112, 112)
    rng = np.random.default_rng(0)
    keep = (rng.random((6, gh, gw)) < 0.3).astype(np.int8)
    keep[2:4] = 0                                                   # the middle group keeps nothing
    keep[0, 0, 0] = keep[5, 1, 1] = 1
    req = request(frames, keep)
    [window] = v._window_prefixes([req])                             # the host-index path
    merged = v.encoder.window_tokens([req], [torch.as_tensor(keep)])[0]
    want = v.prefixes.window_prefix(frames, torch.as_tensor(keep), merged)   # nonzero on the device
    assert window.tokens_kept == want.tokens_kept > 0
    for name in ("embeds", "positions", "deepstack", "visual", "groups"):
        torch.testing.assert_close(getattr(window, name), getattr(want, name), rtol=0, atol=0, msg=name)
    empty_slots = int((want.groups == 1).sum())
    assert (empty_slots == 0) == (mode == "drop")                   # the empty group's stamp: kept or not
