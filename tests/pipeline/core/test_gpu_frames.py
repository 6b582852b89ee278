"""Frames whose pixels are tensors (the GPU decoder's): the decode stage stacks them where they are,
the texture stage and the VLM's window take them without a host round trip, the overlay gets
numpy."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.core.items import RunStatus
from pipeline.core.stages import DecodeStage, stack_frames
from pipeline.runtime.cuda import window_frames
from sources.frame import Frame

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tensor_frames(n: int, device: str) -> list[Frame]:
    """Frames whose pixels hold their index."""
    return [Frame("s", i, i / 25, torch.full((6, 8, 3), i, dtype=torch.uint8, device=device)) for i in range(n)]


class TensorSource:
    stream_id = "s"

    def __init__(self, frames: list[Frame]) -> None:
        self.frames = frames

    def __iter__(self):
        return iter(self.frames)


def test_frame_takes_tensors_and_checks_them():
    frame = tensor_frames(1, "cpu")[0]
    assert frame.on_device and (frame.height, frame.width) == (6, 8)
    assert isinstance(frame.host_rgb(), np.ndarray) and frame.host_rgb().shape == (6, 8, 3)
    assert not Frame("s", 0, 0.0, np.zeros((6, 8, 3), np.uint8)).on_device
    with pytest.raises(ValueError, match="uint8 tensor"):
        Frame("s", 0, 0.0, torch.zeros(6, 8, 3))
    with pytest.raises(ValueError, match=r"shape \(H, W, 3\)"):
        Frame("s", 0, 0.0, torch.zeros(6, 8, dtype=torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_stage_stacks_tensor_frames_in_place(device):
    stage = DecodeStage(TensorSource(tensor_frames(10, device)), 4, pin=False, status=RunStatus())
    batches = list(stage.produce())
    assert [b.frames_count for b in batches] == [4, 4, 2]
    for b in batches:
        assert b.pixels.device.type == device and b.pixels.shape[1:] == (6, 8, 3)
        assert (b.ready is not None) == (device == "cuda")
        if b.ready is not None:
            b.ready.synchronize()
        # the frames are views of the batch, in order
        assert [int(f.rgb[0, 0, 0]) for f in b.frames] == [f.index for f in b.frames]
        assert [int(p[0, 0, 0]) for p in b.pixels] == [f.index for f in b.frames]


@pytest.mark.parametrize("device", DEVICES)
def test_live_stacking_and_windows_stay_on_the_device(device):
    frames = tensor_frames(3, device)
    stacked = stack_frames(frames, pin=False)
    if device == "cuda":
        torch.cuda.synchronize()
    assert stacked.device.type == device and stacked[:, 0, 0, 0].tolist() == [0, 1, 2]
    window = window_frames([f.rgb for f in frames], pin=device == "cuda")      # an in-process GPU VLM
    assert isinstance(window, torch.Tensor if device == "cuda" else np.ndarray)
    host = window_frames([f.rgb for f in frames], pin=False)                   # a VLM in its own process
    assert isinstance(host, np.ndarray) and host[:, 0, 0, 0].tolist() == [0, 1, 2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_texture_stage_takes_device_batches_without_a_copy():
    from pipeline.core.stages import TextureStage

    seen = []
    model = SimpleNamespace(extract=lambda frames, last, grid: seen.append(frames) or SimpleNamespace())
    stage = TextureStage(model, torch.device("cuda"), (2, 2))
    batch = next(DecodeStage(TensorSource(tensor_frames(4, "cuda")), 4, pin=False, status=RunStatus()).produce())
    stage.process(batch)
    assert seen[0].data_ptr() == batch.pixels.data_ptr()   # the decode stage's tensor itself, permuted
