"""Live runs and file runs share the front end's CUDA graphs through one FrontendGraphsPool (the
server's, issue 40), on real graphs (GPU only; the CPU tests of the pool's accounting through the
server are tests/pipeline/serve/test_live_graphs.py): the second live run of a shape and a file run
of it capture nothing, and a set that live runs replayed gives a file run what eager execution gives."""
from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np
import pytest
import torch

from pipeline.config import PipelineConfig, RuntimeConfig
from pipeline.core.compose import frontend_graphs
from pipeline.core.frontend_graphs import FrontendGraphsPool
from pipeline.core.live_stages import LiveOptions
from pipeline.core.setup import build_model
from pipeline.runners.live import run_live
from pipeline.runners.run import run_video
from pipeline.runtime.cuda import LEDGER
from sinks import ZarrStore
from sources.live import LiveConfig
from sources.synthetic import Shot, render_clip, write_video

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# a fixed unit query: the GPU machines lack MiniLM's weights
QUERY = torch.nn.functional.normalize(torch.ones(384), dim=0)


def front_end_captures(since: float) -> list[str]:
    return [e.label for e in LEDGER.entries(since, "capture") if e.label.startswith(("texture", "realize"))]


def test_live_runs_and_a_file_run_share_one_set(tmp_path):
    pytest.importorskip("av")
    clip = write_video(tmp_path / "clip.mp4", render_clip([Shot("moving_object", 25, speed=2.0), Shot("pan", 25)],
                                                         height=120, width=160, seed=4).frames, fps=25)
    cfg = PipelineConfig(runtime=RuntimeConfig(device="cuda", vlm="none", batch_size=4, model_weights="none"))
    model = build_model(cfg, torch.device("cuda"), answering=False)     # untrained: one for every run
    pool = FrontendGraphsPool(2, frontend_graphs)
    captures = []
    for k in range(2):
        since = LEDGER.mark("test")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")        # --vlm none: allocation only
            run_live([str(clip)], "what moves?", tmp_path / f"live{k}.zarr", cfg,
                     live=LiveConfig(realtime=True, buffer_frames=32), options=LiveOptions(every_s=1.0),
                     answers_out=io.StringIO(), status_out=io.StringIO(), query_embedding=QUERY, model=model,
                     frontends=pool)
        captures.append(front_end_captures(since))
        assert len(pool) == 1
    assert captures[0] and captures[1] == [], captures         # the second live run replays the first's

    since = LEDGER.mark("test")
    shared = run_video(clip, "what moves?", tmp_path / "shared.zarr", cfg, progress=False,
                       query_embedding=QUERY, model=model, frontends=pool)
    assert front_end_captures(since) == [] and len(pool) == 1  # 50 frames: 12 full batches and one of 2
    eager_cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cuda_graphs=False))
    eager = run_video(clip, "what moves?", tmp_path / "eager.zarr", eager_cfg, progress=False,
                      query_embedding=QUERY, model=model)
    got = ZarrStore.open(shared.out, mode="r").read(shared.stream_id)
    want = ZarrStore.open(eager.out, mode="r").read(eager.stream_id)
    assert got["tokens"].shape[0] == want["tokens"].shape[0] == 50
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["scene_change"], want["scene_change"])
    np.testing.assert_allclose(got["relevance"].astype(np.float32), want["relevance"].astype(np.float32), atol=2e-3)
