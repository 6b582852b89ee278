"""CUDA-graph replay of the front end gives what eager execution gives (GPU only)."""
from __future__ import annotations

import pytest
import torch

from arr_coc.model import ARRCOC
from pipeline.cudagraph import FrontendGraphs, graphable
from sources.synthetic import Shot, render_clip

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@torch.inference_mode()
def test_graph_replay_matches_eager():
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = ARRCOC(query_dim=16).to(device).eval()
    query = torch.randn(16, device=device)
    clip = render_clip([Shot("moving_object", 24, speed=3.0), Shot("pan", 24, speed=2.0)], seed=1)
    frames = torch.from_numpy(clip.frames).to(device).permute(0, 3, 1, 2)    # (48, 3, H, W)
    grid, T = (6, 8), 8
    graphs = FrontendGraphs(model, grid, query)
    stream = torch.cuda.Stream()
    eager_state = graph_state = None
    eager_last = graph_last = None
    for i in range(0, 48, T):
        batch = frames[i:i + T]
        tex = model.extract(batch, eager_last, grid)
        eager, eager_state, _ = model.realize(tex, query, eager_state)
        if graphable(graph_state):
            with torch.cuda.stream(stream):
                gtex = graphs.extract(batch, graph_last, stream)
                vlm = torch.ones(T, dtype=torch.bool, device=device)
                graphed, graph_state = graphs.realize(gtex, graph_state, vlm, stream)
            stream.synchronize()
        else:
            gtex = model.extract(batch, graph_last, grid)
            graphed, graph_state, _ = model.realize(gtex, query, graph_state)
        eager_last = graph_last = batch[-1].clone()
        torch.testing.assert_close(gtex.data, tex.data)
        for name in ("tokens", "lod", "scene_change", "selected"):
            assert torch.equal(getattr(graphed, name), getattr(eager, name)), (i, name)
        torch.testing.assert_close(graphed.relevance, eager.relevance)
    assert len(graphs.texture_graphs) == 1 and len(graphs.realize_graphs) == 1
    flags = torch.cat([eager.scene_change])  # last batch: inside the pan, no cut
    assert not flags.any()
