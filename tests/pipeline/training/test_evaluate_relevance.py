"""evaluate-relevance: the batched still path equals the pipeline's path, and the benchmark's
numbers obey the identities the metrics promise (uniform = box area share, query-blind
baselines have zero distinctiveness)."""
import json

import pytest
import torch

from arr_coc.model import ARRCOC
from pipeline.training.evaluate_relevance import EvalConfig
from pipeline.training.train import QueryEmbedder, scene_examples, still_forward, take
from evaluation.scenes import make_scenes


def test_still_forward_matches_realize_frame_by_frame():
    torch.manual_seed(0)
    model = ARRCOC(query_dim=384).eval()
    embed = QueryEmbedder()
    ex = scene_examples(model, make_scenes(7, 3, (112, 112)), embed, (4, 4), torch.device("cpu"))
    with torch.no_grad():
        _, _, relevance, allot = still_forward(model, take(ex.texture, ex.scene), ex.query, ex.query_mask)
        for i in range(len(ex)):
            tex = take(ex.texture, ex.scene[i:i + 1])
            alloc, _, _ = model.realize(tex, ex.query[i], None, query_mask=ex.query_mask[i])
            assert torch.allclose(alloc.relevance[0], relevance[i], atol=1e-6)
            assert torch.equal(alloc.tokens[0], allot.tokens[i])


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory):
    from pipeline.commands.cli import main
    out = tmp_path_factory.mktemp("eval") / "r.json"
    assert main(["evaluate-relevance", "--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


class TestQuickBenchmark:
    def test_uniform_scores_the_box_area_share(self, quick_result):
        a = quick_result["methods"]["uniform"]["allocation"]
        assert a["token_share"] == pytest.approx(a["box_area_share"], rel=1e-5)
        assert quick_result["methods"]["uniform"]["query"]["distinctiveness"] == pytest.approx(0.0, abs=1e-6)

    def test_saliency_ignores_the_query(self, quick_result):
        assert quick_result["methods"]["saliency"]["query"]["distinctiveness"] == pytest.approx(0.0, abs=1e-6)

    def test_every_method_and_detector_is_reported(self, quick_result):
        assert set(quick_result["methods"]) == {"uniform", "saliency", "untrained", "trained"}
        assert {"arr_coc_trained", "pyscenedetect_content", "pyscenedetect_adaptive"} <= set(quick_result["scene_cuts"])
        for row in quick_result["scene_cuts"].values():
            assert 0 <= row["precision"] <= 1 and 0 <= row["recall"] <= 1 and row["events"] > 0
        assert quick_result["budget_tokens"] == 6

    def test_trained_beats_the_baselines_on_allocation(self, quick_result):
        m = quick_result["methods"]
        share = {k: v["allocation"]["token_share"] for k, v in m.items()}
        assert share["trained"] > max(share["uniform"], share["saliency"], share["untrained"]) + 0.2, share
        assert m["trained"]["query"]["distinctiveness"] > 0.3


def test_config_validation():
    from arr_coc._validate import ConfigError
    with pytest.raises(ConfigError, match="retention=0.0 is out of range"):
        EvalConfig(retention=0.0)
