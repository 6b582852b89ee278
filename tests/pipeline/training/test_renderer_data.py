"""ARR-COC's training data from the QA renderers and the query table that lets it train without MiniLM."""
import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from evaluation.renderers import training_renderers
from pipeline.configio import load_config
from pipeline.training import query_table
from pipeline.training.query_table import QueryTable, question_texts
from pipeline.training.renderer_data import (RendererScenes, StillItem, qa_views, render_scenes, still_items,
                                             track_clips, union_coverage)
from pipeline.training.train import QueryEmbedder, TrainConfig, train


@pytest.fixture(scope="module")
def scenes():
    return render_scenes(RendererScenes(training_renderers()), range(400_000, 400_006))


class FakeEncoder:
    """A stand-in for MiniLM: a fixed unit vector per text."""
    def encode_many(self, texts):
        out = []
        for t in texts:
            g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(t)) % 2**31)
            out.append(torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0))
        return torch.stack(out)


@pytest.fixture(scope="module")
def table(tmp_path_factory, monkeypatch_module):
    import pipeline.core.query as query

    monkeypatch_module.setattr(query, "sentence_encoder", lambda device="cpu": FakeEncoder())
    return query_table.build(tmp_path_factory.mktemp("q") / "table.safetensors")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


class TestQueryTable:
    def test_holds_every_question_the_renderers_and_scenes_ask(self, scenes):
        from evaluation.scenes import make_scenes

        texts = set(question_texts())
        asked = {qa.question for sc in scenes for qa in sc.clip.qas}
        assert asked and asked <= texts, asked - texts
        assert {q for s in make_scenes(1, 20, (112, 112)) for q in s.queries} <= texts
        assert "where is the red car?" in texts and "a" in texts

    def test_round_trip_and_errors(self, table, tmp_path):
        t = QueryTable(table)
        text = "What color is the circle at the top left?"
        assert torch.allclose(t.encode(text), FakeEncoder().encode_many([text])[0])
        with pytest.raises(ConfigError, match="not in the query table"):
            t.encode("What is the meaning of life?")
        embed = QueryEmbedder(table=str(table))
        assert embed(text).shape == (1, 16)
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"not a table")
        with pytest.raises(ConfigError, match="not a query table"):
            QueryTable(bad)
        with pytest.raises(ConfigError, match="no such file"):
            load_config(TrainConfig, "configs/train_renderers.yaml", [f"queries={tmp_path}/missing.safetensors"])


class TestStillExamples:
    def test_items_name_visible_objects_with_their_boxes(self, scenes):
        frames, items = still_items(scenes, 2, seed=0)
        assert frames.shape == (12, 224, 224, 3) and items
        for it in items:
            sc = scenes[it.frame // 2]
            qa = next(q for q in sc.clip.qas if q.question == it.question)
            t = next(t for t in range(len(sc.clip.frames)) if np.array_equal(sc.clip.frames[t], frames[it.frame]))
            assert it.boxes == tuple(tuple(sc.tracks[i].boxes[t]) for i in qa.names)

    def test_union_coverage_is_the_cellwise_max_of_the_named_boxes(self):
        items = [StillItem(0, "q", ((0, 0, 28, 28), (0, 14, 28, 56))), StillItem(0, "q", ((56, 56, 84, 84),))]
        cov = union_coverage(items, (112, 112), (4, 4), "cpu")
        assert cov.shape == (2, 4, 4)
        assert cov[0, 0, 0] == 1 and cov[0, 0, 1] == 1 and cov[0, 1].sum() == 0
        assert cov[1, 2, 2] == 1 and cov[1].sum() == 1

    def test_track_clips_and_qa_views(self, scenes):
        clips = track_clips(scenes, seed=0)
        assert clips and all(len(c.boxes) == len(c.frames) == len(c.shot) for c in clips)
        views = qa_views(scenes, 2.0)
        assert all(len(f) < len(sc.clip.frames) and qas for (f, qas), sc in zip(views, scenes))


def test_relevance_training_on_renderers_lowers_its_loss(table, tmp_path):
    stages = "[{name: grounding, epochs: 3, lr: 0.01, batch_size: 16}]"
    cfg = load_config(TrainConfig, "configs/train_renderers.yaml",
                      ["device=cpu", "init=none", f"queries={table}", f"out_dir={tmp_path}", "data.render_clips=8",
                       "data.val_scenes=4", f"stages={stages}"])
    history = train(cfg, log=lambda s: None)["history"]
    assert len(history) == 3
    assert history[-1]["loss"] < history[0]["loss"]


def test_the_time_limit_stops_training_and_still_exports(table, tmp_path):
    # far more epochs than 0.5 s holds on any machine (one is ~0.1 s on 2 cores): the limit, not the
    # schedule, ends the run, inside the first stage
    stages = "[{name: grounding, epochs: 300, lr: 0.01, batch_size: 4}, {name: static, epochs: 50, batch_size: 4}]"
    cfg = load_config(TrainConfig, "configs/train_renderers.yaml",
                      ["device=cpu", "init=none", f"queries={table}", f"out_dir={tmp_path}", "data.render_clips=4",
                       "data.val_scenes=2", f"stages={stages}", "time_limit_s=0.5"])
    result = train(cfg, log=lambda s: None, export=tmp_path / "export.safetensors")
    assert len(result["history"]) < 300 and (tmp_path / "export.safetensors").is_file()
    assert all(row["stage"] == "grounding" for row in result["history"])
    assert all(np.isfinite(row["loss"]) for row in result["history"])
