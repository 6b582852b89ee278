"""Batch pads each video's query vectors (one MiniLM vector per question) to a bucket (masked), so
videos share the front end's CUDA graphs: padding changes nothing ARR-COC computes, and the graphs
serve one query after another."""
from __future__ import annotations

import pytest
import torch

from arr_coc.model import ARRCOC
from pipeline.runners.batch import QUERY_BUCKET, pad_query
from pipeline.core.frontend_graphs import FrontendGraphs, graphable
from sources.synthetic import Shot, render_clip

GRID, T = (6, 8), 8


def clip_frames(device: torch.device) -> torch.Tensor:
    clip = render_clip([Shot("moving_object", 16, speed=3.0), Shot("pan", 16, speed=2.0)], seed=1)
    return torch.from_numpy(clip.frames).to(device).permute(0, 3, 1, 2)       # (32, 3, H, W)


def test_pad_query_shape_and_mask():
    n = QUERY_BUCKET + 3
    q = torch.randn(n, 16)
    padded, mask = pad_query(q)
    assert padded.shape == (2 * QUERY_BUCKET, 16) and mask.dtype == torch.bool
    assert torch.equal(padded[:n], q) and mask[:n].all() and not mask[n:].any() and not padded[n:].any()
    assert pad_query(torch.randn(QUERY_BUCKET, 16))[0].shape[0] == QUERY_BUCKET


@torch.inference_mode()
def test_padded_masked_query_realizes_what_the_query_does():
    torch.manual_seed(0)
    model = ARRCOC(query_dim=16).eval()
    query = torch.randn(11, 16)
    padded, mask = pad_query(query)
    frames = clip_frames(torch.device("cpu"))
    state_a = state_b = last = None
    for i in range(0, frames.shape[0], T):
        tex = model.extract(frames[i:i + T], last, GRID)
        a, state_a, _ = model.realize(tex, query, state_a)
        b, state_b, _ = model.realize(tex, padded, state_b, query_mask=mask)
        last = frames[i + T - 1].clone()
        torch.testing.assert_close(b.relevance, a.relevance, rtol=1e-5, atol=1e-6)
        assert torch.equal(b.tokens, a.tokens) and torch.equal(b.scene_change, a.scene_change)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_one_set_of_graphs_serves_queries_of_one_padded_length():
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = ARRCOC(query_dim=16).to(device).eval()
    frames = clip_frames(device)
    graphs = FrontendGraphs(model, GRID, torch.zeros(QUERY_BUCKET, 16, device=device))
    stream = torch.cuda.Stream()
    H, W = frames.shape[2:]
    for length in (5, QUERY_BUCKET - 2):                      # two "videos", one padded length
        query, mask = pad_query(torch.randn(length, 16, device=device))
        graphs.prepare(T, H, W, query, mask)
        eager_state = graph_state = last = None
        for i in range(0, frames.shape[0], T):
            batch = frames[i:i + T]
            tex = model.extract(batch, last, GRID)
            eager, eager_state, _ = model.realize(tex, query, eager_state, query_mask=mask)
            if graphable(graph_state):
                with torch.cuda.stream(stream):
                    gtex = graphs.extract(batch, last, stream)
                    vlm = torch.ones(T, dtype=torch.bool, device=device)
                    graphed, graph_state = graphs.realize(gtex, graph_state, vlm, stream, query, mask)
                stream.synchronize()
            else:
                graphed, graph_state, _ = model.realize(tex, query, graph_state, query_mask=mask)
            last = batch[-1].clone()
            for name in ("tokens", "lod", "scene_change", "selected"):
                assert torch.equal(getattr(graphed, name), getattr(eager, name)), (length, i, name)
            torch.testing.assert_close(graphed.relevance, eager.relevance)
    # the second query reused the first one's graphs: nothing new was captured
    assert len(graphs.texture_graphs) == 1 and len(graphs.realize_graphs) == 1
