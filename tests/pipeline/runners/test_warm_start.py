"""No cold start: warm-up (pipeline/core/warmup.py) covers every graph shape a live run asks for.

On the CPU nothing is captured, but the graph caches record each shape they are asked for without a
graph (runtime.cuda.LEDGER, kind "shape"): after the run's first frame there must be none. With
warm-up off the same run asks for shapes late, so the check can fail. On CUDA (marked cuda) a
20-second run must capture no graph after its first frame.
"""
from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from pipeline.config import PipelineConfig, RuntimeConfig
from pipeline.core.live_stages import LiveOptions
from pipeline.runners.live import run_live
from pipeline.runtime.cuda import FIRST_FRAME, LEDGER
from sources.live import LiveConfig
from sources.synthetic import Shot, render_clip, write_video

UNTRAINED = {"model_weights": "none"} if "model_weights" in {f.name for f in dataclasses.fields(RuntimeConfig)} else {}
SHOTS = [Shot("moving_object", 25, speed=2.0), Shot("pan", 25, speed=1.0), Shot("fast_object", 25, speed=3.0)]


def cfg(device: str = "cpu", **runtime) -> PipelineConfig:
    return PipelineConfig(runtime=RuntimeConfig(device=device, vlm="tiny-random",
                                                **{"batch_size": 4, **UNTRAINED, **runtime}))


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    pytest.importorskip("av")
    d = tmp_path_factory.mktemp("warm_clip")
    return write_video(d / "cuts.mp4", render_clip(SHOTS, height=120, width=160, seed=3).frames, fps=25)


def late(since: float, kind: str) -> list[str]:
    """Labels of `kind` ledger entries after the first frame taken at or after `since`."""
    first = LEDGER.first_mark(FIRST_FRAME, since)
    assert first is not None, "the run took no frame"
    return [e.label for e in LEDGER.entries(first, kind)]


def live(clip, tmp_path, options: LiveOptions, sources: int = 3, device: str = "cpu"):
    return run_live([str(clip)] * sources, "what moves?", tmp_path / "o.zarr", cfg(device),
                    live=LiveConfig(realtime=True, buffer_frames=32), options=options,
                    answers_out=io.StringIO(), status_out=io.StringIO(),
                    # a fixed unit query: the GPU machines lack MiniLM's weights, and what the
                    # question says does not change the shapes its answers ask for
                    query_embedding=torch.nn.functional.normalize(torch.ones(384), dim=0))


class TestCoverageOnCPU:
    @pytest.mark.parametrize("family, settings", [("qwen2_vl", []), ("qwen2_5_vl", []), ("qwen3_vl", []),
                                                  ("qwen2_vl", ["vlm.tempering.ladder=[0.1,0.3]"])])
    def test_warm_up_plans_every_shape_answers_ask_for(self, tmp_path, clip, family, settings):
        from pipeline.configio import load_config
        from pipeline.vlm.loading import build_tiny_vlm

        runtime = {"device": "cpu", "vlm": "tiny-random", "batch_size": 4, **UNTRAINED}
        config = load_config(PipelineConfig, None, [f"runtime.{k}={v}" for k, v in runtime.items()] + settings)
        since = LEDGER.mark("test")
        result = run_live([str(clip)] * 3, "what moves?", tmp_path / "o.zarr", config,
                          live=LiveConfig(realtime=True, buffer_frames=32),
                          options=LiveOptions(every_s=1.0, warm_up=True), answers_out=io.StringIO(),
                          status_out=io.StringIO(), vlm=build_tiny_vlm(family, config=config.vlm))
        assert len(result.answers) >= 6                            # 3 streams, answers batched and not
        assert result.warm_up is not None and result.warm_up.shapes > 0 and result.warm_up.graphs == 0
        assert late(since, "shape") == []

    def test_without_warm_up_shapes_come_late(self, tmp_path, clip):
        since = LEDGER.mark("test")
        result = live(clip, tmp_path, LiveOptions(every_s=1.0, warm_up=False))
        assert result.warm_up is None and result.answers
        shapes = late(since, "shape")
        assert any(s.startswith("prefill") for s in shapes) and any(s.startswith("kept") for s in shapes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_20_second_live_run_captures_no_graph_after_its_first_frame(tmp_path):
    """Three 20 s streams on CUDA with the tiny VLM: warm-up captures the front end's, the vision
    tower's, the prefills' and the decoders' graphs; from the first frame on, none."""
    pytest.importorskip("av")
    clip = write_video(tmp_path / "long.mp4", render_clip([Shot("moving_object", 250, speed=2.0),
                                                           Shot("fast_object", 250, speed=3.0)],
                                                          height=240, width=320, seed=5).frames, fps=25)
    since = LEDGER.mark("test")
    result = live(clip, tmp_path, LiveOptions(every_s=1.0), device="cuda")
    assert result.warm_up is not None and result.warm_up.graphs > 0
    assert len(result.answers) >= 30                               # 3 streams x ~20 windows
    assert late(since, "capture") == []
    assert late(since, "shape") == []
