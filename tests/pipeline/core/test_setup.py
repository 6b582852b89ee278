"""pipeline.core.setup: ARR-COC reads MiniLM's question vector whatever VLM answers, so the shipped
checkpoint applies whole; with pass 2 the allocator keeps candidate_factor times the budget."""
from __future__ import annotations

import warnings

import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.checkpoint import DEFAULT_WEIGHTS, read_weights
from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from pipeline.budget import BudgetPlan
from pipeline.core.setup import QUERY_DIM, build_model, check_query, encode_query

CPU = torch.device("cpu")


def config(*overrides: str) -> PipelineConfig:
    return load_config(PipelineConfig, None, list(overrides))


def candidate_attending(cfg: PipelineConfig):
    """Pass 1's allocator config when a VLM answers (what build_model(answering=True) builds)."""
    return BudgetPlan.of(cfg.vlm).pass1(cfg.model.attending)


def test_the_query_is_minilm_whatever_the_vlm():
    q = encode_query("where is the red car?", CPU)
    assert q.shape == (QUERY_DIM,) == (384,) and q.dtype == torch.float32
    assert float(q.norm()) == pytest.approx(1.0, abs=1e-5)
    assert not torch.allclose(q, encode_query("how many people?", CPU))


@pytest.mark.skipif(not DEFAULT_WEIGHTS.is_file(), reason="the shipped checkpoint is not built yet")
@pytest.mark.parametrize("overrides", [(), ("runtime.vlm=tiny-random",),
                                       ("runtime.vlm=Qwen/Qwen2.5-VL-7B-Instruct", "vlm.pass2=attention"),
                                       ("runtime.vlm=tiny-random", "vlm.pass2=attention",
                                        "vlm.tempering.ladder=[0.05,0.1]",
                                        "vlm.tempering.rank=attention"),
                                       ("runtime.vlm=tiny-random", "vlm.tempering.ladder=[0.05,0.1]")])
def test_the_shipped_checkpoint_loads_every_tensor_under_any_vlm(overrides):
    """No query-facing layer keeps its initial values, and nothing warns about it."""
    tensors, _ = read_weights(DEFAULT_WEIGHTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = build_model(config(*overrides), CPU, answering=True)
    state = model.state_dict()
    assert set(state) == set(tensors)
    assert all(torch.equal(v, tensors[k]) for k, v in state.items())


class TestCandidates:
    def test_pass2_off_keeps_the_budget(self):
        cfg = config("model.attending.retention=0.2")
        assert candidate_attending(cfg) == cfg.model.attending
        assert build_model(cfg, CPU, answering=True).allocator.cfg.retention == 0.2

    def test_pass2_keeps_candidate_factor_times_the_budget(self):
        cfg = config("model.attending.retention=0.1", "vlm.pass2=attention", "vlm.candidate_factor=3")
        assert candidate_attending(cfg).retention == pytest.approx(0.3)
        assert build_model(cfg, CPU, answering=True).allocator.cfg.retention == pytest.approx(0.3)
        assert build_model(cfg, CPU).allocator.cfg.retention == 0.1        # no VLM answers: the budget itself
        topk = config("model.attending.selection=topk", "model.attending.top_k=20", "vlm.pass2=attention",
                      "vlm.candidate_factor=2.5")
        assert candidate_attending(topk).top_k == 50
        one = config("vlm.pass2=attention", "vlm.candidate_factor=1")
        assert candidate_attending(one) == one.model.attending

    def test_tempering_keeps_candidate_factor_times_the_top_rung(self):
        cfg = config("model.attending.selection=topk", "vlm.pass2=attention", "vlm.candidate_factor=2",
                     "vlm.tempering.ladder=[0.05,0.1,0.2,0.4]", "vlm.tempering.max_passes=3",
                     "vlm.tempering.rank=attention")
        a = candidate_attending(cfg)
        assert (a.selection, a.retention) == ("fraction", pytest.approx(0.4))   # 2 x 0.2, the third rung

    def test_relevance_tempering_keeps_the_top_rung(self):
        """rank relevance (pass 2 off): pass 1 keeps the top rung used, whatever candidate_factor."""
        cfg = config("model.attending.selection=topk", "vlm.pass2=off", "vlm.candidate_factor=2",
                     "vlm.tempering.ladder=[0.05,0.1,0.2,0.4]", "vlm.tempering.max_passes=3")
        a = candidate_attending(cfg)
        assert (a.selection, a.retention) == ("fraction", pytest.approx(0.2))
        assert build_model(cfg, CPU, answering=True).allocator.cfg.retention == pytest.approx(0.2)

    def test_more_candidates_than_cells_is_refused(self):
        with pytest.raises(ConfigError, match=r"model.attending.retention=0.5 times vlm.candidate_factor=3.0 is "
                                              r"more than every cell.*at most 2"):
            config("model.attending.retention=0.5", "vlm.pass2=attention", "vlm.candidate_factor=3")
        config("model.attending.retention=0.5", "vlm.candidate_factor=3")      # pass 2 off: no candidates


@pytest.mark.parametrize("query, match", [
    (torch.zeros(16), r"got \(16,\)"),
    (torch.zeros(2, 384), r"got \(2, 384\)"),
    (torch.zeros(384, dtype=torch.long), r"got \(384,\)"),
    ([0.0] * 384, r"got list"),
])
def test_a_given_query_must_be_a_minilm_vector(query, match):
    with pytest.raises(ValueError, match=r"query_embedding must be a \(384,\) float tensor .*" + match):
        check_query(query)


def test_a_run_with_a_vlm_warns_about_nothing(tmp_path):
    """The whole run (MiniLM query, shipped weights, tiny VLM, pass 2 on) without a single warning."""
    from pipeline.runners.run import run_video
    from sources.synthetic import Shot, render_clip, write_video

    clip = render_clip([Shot("moving_object", 8, speed=2.0)], height=96, width=128, seed=1)
    video = write_video(tmp_path / "clip.mp4", clip.frames, fps=8)
    cfg = config("runtime.vlm=tiny-random", "runtime.device=cpu", "runtime.batch_size=4", "decode.process=false",
                 "vlm.max_new_tokens=2", "vlm.pass2=attention")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = run_video(video, "where is the square?", tmp_path / "out.zarr", cfg, progress=False)
    assert len(result.answers) == 1 and result.answers[0].tokens_kept > 0
