"""CUDA-graph replay of the front end gives what eager execution gives (GPU only)."""
from __future__ import annotations

import pytest
import torch

from arr_coc.model import ARRCOC
from pipeline.core.frontend_graphs import CAPTURE_ON_SIGHTING, FrontendGraphs, graphable
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


@torch.inference_mode()
def test_first_and_short_batches_replay_like_eager():
    """The stages' use: a stream's first batch replays the full-batch graphs (frames[0] standing in
    for the last frame, the initial state as tensors); after prepare(), a short last batch runs
    eagerly the first time its shape comes and is captured when it comes again (batch mode: the
    next video). Every batch equals eager execution."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = ARRCOC(query_dim=16).to(device).eval()
    query = torch.randn(16, device=device)
    clip = render_clip([Shot("moving_object", 21, speed=3.0)], seed=2)
    frames = torch.from_numpy(clip.frames).to(device).permute(0, 3, 1, 2)    # (21, 3, H, W): 8, 8, 5
    grid, T = (6, 8), 8
    graphs = FrontendGraphs(model, grid, query)
    graphs.prepare(T, frames.shape[2], frames.shape[3])
    assert len(graphs.texture_graphs) == 1 and len(graphs.realize_graphs) == 1
    stream = torch.cuda.Stream()
    for video in range(3):
        eager_state = graph_state = last = None
        for i in range(0, 21, T):
            batch = frames[i:i + T]
            tex = model.extract(batch, last, grid)
            eager, eager_state, _ = model.realize(tex, query, eager_state)
            with torch.cuda.stream(stream):
                gtex = graphs.extract(batch, batch[0] if last is None else last, stream, last_real=last is not None)
                state = graph_state if graph_state is not None else model.realizer.initial_state(tex)
                vlm = torch.ones(len(batch), dtype=torch.bool, device=device)
                replayed = graphs.realize(gtex if gtex is not None else tex, state, vlm, stream)
            stream.synchronize()
            short = len(batch) < T
            assert (gtex is None) == (replayed is None) == (short and video + 1 < CAPTURE_ON_SIGHTING), (video, i)
            if replayed is None:
                graphed, graph_state, _ = model.realize(tex, query, state)
                gtex = tex
            else:
                graphed, graph_state = replayed
            last = batch[-1].clone()
            torch.testing.assert_close(gtex.data, tex.data)
            assert torch.equal(gtex.has_prev, tex.has_prev)
            for name in ("tokens", "lod", "scene_change", "selected"):
                assert torch.equal(getattr(graphed, name), getattr(eager, name)), (video, i, name)
            torch.testing.assert_close(graphed.relevance, eager.relevance)
    assert len(graphs.texture_graphs) == 2 and len(graphs.realize_graphs) == 2   # full and short batches


@torch.inference_mode()
def test_realize_stage_waits_for_the_query_made_on_the_callers_stream():
    """The stages' streams are non-blocking pool streams: the realize stage must wait for the
    query its caller just wrote on the default stream (else a first batch, replayed at once, could
    read a query mask still being filled: NaN relevance)."""
    from pipeline.core.stages import RealizeStage
    device = torch.device("cuda")
    model = ARRCOC(query_dim=16).to(device).eval()
    query = torch.zeros(16, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)                 # the caller's stream is busy (tens of ms)
    query.fill_(1.0)                               # queued behind it
    stage = RealizeStage(model, device, query)
    with torch.cuda.stream(stage.stream):
        seen = stage.query.clone()
    torch.cuda.synchronize()
    assert bool((seen == 1).all())
