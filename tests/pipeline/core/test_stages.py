"""GPU runs: frames decoded in the worker go from its page-locked slots straight to the device
(YUV planes converted there) and give the same store as the host path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from pipeline.runners.run import run_video
from pipeline.core.stages import DecodeStage, FrameRef
from sinks import read_stream
from sources.synthetic import Shot, render_clip, write_video

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    clip = render_clip([Shot("moving_object", 30, speed=3.0), Shot("pan", 30)], height=144, width=256, seed=2)
    return write_video(tmp_path_factory.mktemp("dev") / "clip.mp4", clip.frames, fps=25), clip


def run(path, out, process: bool, decoder: str = "pyav"):
    cfg = load_config(PipelineConfig, None, ["runtime.device=cuda", "runtime.vlm=none", "runtime.batch_size=8",
                                             f"decode.process={str(process).lower()}", f"decode.decoder={decoder}"])
    query = torch.nn.functional.normalize(torch.randn(384, generator=torch.Generator().manual_seed(0)), dim=0)
    graphs = []
    result = run_video(path, "where is the square?", out, cfg, progress=False, query_embedding=query,
                       on_graph=graphs.append)
    return result, graphs[0].stages[0], read_stream(out, result.stream_id)


@pytest.mark.parametrize("decoder", ["pyav", "decord"])
def test_device_path_matches_the_host_path(clip, tmp_path, decoder):
    path, _ = clip
    host, _, ref = run(path, tmp_path / "host.zarr", process=False, decoder=decoder)
    dev, dev_stage, got = run(path, tmp_path / "dev.zarr", process=True, decoder=decoder)
    assert isinstance(dev_stage, DecodeStage) and dev_stage.device is not None
    assert (dev_stage.source.yuv is not None) == (decoder == "pyav")  # decord hands over RGB
    assert dev_stage._registered is None                                # unregistered at close
    assert host.frames == dev.frames == 60 and dev.complete
    assert np.array_equal(got["frame_index"], ref["frame_index"]) and np.allclose(got["pts"], ref["pts"])
    assert np.array_equal(got["scene_change"], ref["scene_change"])
    assert np.flatnonzero(got["scene_change"])[1:].tolist() == [30]
    # YUV converted on the GPU differs from swscale by <= 2 levels: relevance barely moves
    assert np.abs(got["relevance"].astype(float) - ref["relevance"].astype(float)).mean() < 0.02
    assert (got["tokens"] == ref["tokens"]).mean() > 0.95


def test_device_batches_carry_frame_refs(clip):
    from pipeline.core.stages import RunStatus
    from sources.process import ProcessSource

    path, _ = clip
    with ProcessSource(path, batch_size=16, slots=3, device_color=True) as source:
        stage = DecodeStage(source, 16, pin=True, status=RunStatus(), device=torch.device("cuda"))
        batches = list(stage.produce())
        stage.close()
    assert [b.frames_count for b in batches] == [16, 16, 16, 12]
    assert all(isinstance(f, FrameRef) for b in batches for f in b.frames)
    assert all(b.pixels.is_cuda and b.pixels.shape[1:] == (144, 256, 3) for b in batches)
