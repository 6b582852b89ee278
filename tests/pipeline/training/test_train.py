"""Training: the loss goes down, checkpoints resume exactly, the VLM answer loss reaches ARR-COC and
nothing else, and the pipeline builds its model from the shipped weights (the checkpoint format
itself: tests/arr_coc/test_checkpoint.py)."""
import json

import numpy as np
import pytest
import torch

from arr_coc.model import ARRCOC
from pipeline.configio import load_config
from pipeline.training.train import QueryEmbedder, TrainConfig, train
from arr_coc.checkpoint import DEFAULT_WEIGHTS, load_weights

TINY = ["data.scenes=12", "data.hard_scenes=4", "data.clips=1", "data.clip_shots=2", "data.size=112",
        "data.val_scenes=4"]


def tiny_cfg(tmp_path, stages: str, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, "configs/train_default.yaml",
                       [*TINY, f"out_dir={tmp_path}", f"stages={stages}", *extra])


@pytest.fixture(scope="module")
def grounding_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = tiny_cfg(out, "[{name: grounding, epochs: 4, lr: 0.01, batch_size: 8}]")
    return out, train(cfg, log=lambda s: None)


class TestTraining:
    def test_loss_decreases(self, grounding_run):
        losses = [row["loss"] for row in grounding_run[1]["history"]]
        assert len(losses) == 4
        assert losses[-1] < 0.9 * losses[0], losses

    def test_logs_the_seed_checklist(self, grounding_run):
        row = grounding_run[1]["history"][-1]
        for key in ("tension_compress", "tension_exploit", "tension_focus", "steepness", "decay", "motion_boost"):
            assert key in row and np.isfinite(row[key])

    def test_resume_reproduces_the_uninterrupted_run(self, grounding_run, tmp_path):
        full_dir, _ = grounding_run
        stages = "[{name: grounding, epochs: %d, lr: 0.01, batch_size: 8}]"
        train(tiny_cfg(tmp_path, stages % 2), log=lambda s: None)  # "interrupted" after 2 epochs
        result = train(tiny_cfg(tmp_path, stages % 4), resume=True, log=lambda s: None)
        a = ARRCOC(query_dim=384)
        b = ARRCOC(query_dim=384)
        load_weights(a, full_dir / "model.safetensors")
        load_weights(b, result["weights"])
        for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(va, vb), k
        assert [r["epoch"] for r in result["history"]] == [1, 2, 3, 4]

    def test_every_stage_runs_and_the_temporal_stage_moves_decay(self, tmp_path):
        stages = ("[{name: static, epochs: 1, batch_size: 16}, {name: temporal, epochs: 2, lr: 0.05, batch_size: 1, "
                  "params: [realizer]}, {name: hard, epochs: 1, batch_size: 16}]")
        history = train(tiny_cfg(tmp_path, stages), log=lambda s: None)["history"]
        assert [r["stage"] for r in history] == ["static", "temporal", "temporal", "hard"]
        assert history[2]["decay"] != 0.5 or history[2]["motion_boost"] != pytest.approx(0.3, abs=1e-6)


@pytest.mark.skipif(not DEFAULT_WEIGHTS.is_file(), reason="the shipped checkpoint is not built yet")
def test_build_model_uses_the_shipped_weights():
    from pipeline.config import PipelineConfig
    from pipeline.core.setup import build_model
    trained = build_model(PipelineConfig(), torch.device("cpu"))
    none = load_config(PipelineConfig, None, ["runtime.model_weights=none"])
    untrained = build_model(none, torch.device("cpu"))
    assert float(trained.realizer.decay) != pytest.approx(float(untrained.realizer.decay), abs=1e-6) or \
        not torch.equal(trained.balancer.mix_logits, untrained.balancer.mix_logits)


class TestVLMFineTune:
    def test_one_step_reaches_arr_coc_and_not_the_vlm(self):
        from pipeline.training.train_vlm import answer_loss
        from evaluation.synth_qa import where_answer
        from pipeline.vlm.loading import build_tiny_vlm
        from evaluation.scenes import make_scene

        vlm = build_tiny_vlm("qwen2_vl")
        for p in vlm.model.parameters():
            p.requires_grad_(False)
        scene = make_scene(3, size=(112, 112))
        target = scene.objects[scene.target]
        question = f"where is the {target.color} {target.shape}?"
        query = QueryEmbedder()(question)                                   # (1, 384): MiniLM, as in the pipeline
        model = ARRCOC(query_dim=query.shape[-1])
        before = {k: v.clone() for k, v in model.state_dict().items()}
        vlm_before = {k: v.clone() for k, v in vlm.model.state_dict().items()}
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        loss, _ = answer_loss(vlm, model, np.stack([scene.image] * 2), question,
                              where_answer(target.box, (112, 112)), query)
        assert torch.isfinite(loss)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        reached = [n for n, g in grads.items() if g is not None and g.abs().sum() > 0]
        for name in ("knowing.participatory.project.0.weight", "balancer.mix_logits", "allocator.offset"):
            assert name in reached, (name, reached)
        assert all(p.grad is None for p in vlm.model.parameters())
        opt.step()
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(torch.equal(vlm_before[k], v) for k, v in vlm.model.state_dict().items())

    def test_video_qa_stage_starts_from_init_and_moves_arr_coc(self, tmp_path):
        """vlm_qa: every question of generated video-QA clips through the VLM's answer loss, from the
        weights `init` names; the result differs from them, and nothing runs without a VLM."""
        from arr_coc.checkpoint import load_weights as load
        from pipeline.training.train_vlm import qa_clips
        stages = "[{name: vlm_qa, epochs: 1, lr: 0.01, batch_size: 2}]"
        with pytest.raises(Exception, match="stage 'vlm_qa' needs a VLM"):
            tiny_cfg(tmp_path, stages)
        clips = qa_clips([500_000, 500_001], 2.0)
        assert all(f.shape[0] >= 2 and qs for f, qs in clips)              # frames at 2 fps, every question
        result = train(tiny_cfg(tmp_path, stages, "vlm=tiny-random", "init=default", "data.qa_clips=2"),
                       log=lambda s: None)
        assert result["history"][-1]["stage"] == "vlm_qa" and np.isfinite(result["history"][-1]["loss"])
        tuned, shipped = ARRCOC(query_dim=384), ARRCOC(query_dim=384)
        load(tuned, result["weights"])
        load(shipped, DEFAULT_WEIGHTS)
        moved = [k for k, v in tuned.state_dict().items() if not torch.equal(v, shipped.state_dict()[k])]
        assert moved
        torch.manual_seed(0)
        fresh = ARRCOC(query_dim=384).state_dict()

        def distance(a):
            return sum(float((a[k] - v).abs().sum()) for k, v in shipped.state_dict().items())
        assert distance(tuned.state_dict()) < 0.5 * distance(fresh)         # a fine-tune of the shipped weights

    def test_where_answer(self):
        from arr_coc.lod import pair_soft as soft_keep
        from evaluation.synth_qa import where_answer
        assert where_answer((0, 0, 10, 10), (90, 90)) == "top left"
        assert where_answer((40, 40, 50, 50), (90, 90)) == "center"
        keep = soft_keep(torch.tensor([[[0.2]], [[0.6]], [[3.0]]]), 2)
        assert keep.flatten().tolist() == pytest.approx([0.4, 1.0])


class TestReproducibility:
    """README: bit for bit on the same CPU kind and torch build; elsewhere, where float reductions
    may run in another order, every tensor within REPRO_TOLERANCE of the shipped one."""
    REPRO_TOLERANCE = 0.01
    STAGES = "[{name: grounding, epochs: 2, lr: 0.01, batch_size: 8}, {name: static, epochs: 1, batch_size: 8}]"

    def _weights(self, out, threads: int) -> dict[str, torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            result = train(tiny_cfg(out, self.STAGES), log=lambda s: None)
        finally:
            torch.set_num_threads(before)
        model = ARRCOC(query_dim=384)
        load_weights(model, result["weights"])
        return model.state_dict()

    def test_same_machine_is_bit_for_bit_and_another_order_within_tolerance(self, tmp_path):
        a, b = self._weights(tmp_path / "a", 2), self._weights(tmp_path / "b", 2)
        assert all(torch.equal(a[k], b[k]) for k in a)
        # one thread instead of two: another order of the CPU's float reductions
        c = self._weights(tmp_path / "c", 1)
        worst = max(float((a[k].float() - c[k].float()).abs().max()) for k in a)
        assert worst <= self.REPRO_TOLERANCE, worst


def test_train_writes_only_under_out_dir(tmp_path, capsys):
    from pipeline.commands.cli import main
    shipped = DEFAULT_WEIGHTS.read_bytes()
    rc = main(["train", "--config", "configs/train_default.yaml", "--no-progress", *sum((["--set", s] for s in TINY),
                                                                                        []),
               "--set", f"out_dir={tmp_path / 'run'}", "--set", "stages=[{name: grounding, epochs: 1, batch_size: 16}]",
               "--export", str(tmp_path / "copy.safetensors")])
    assert rc == 0
    assert DEFAULT_WEIGHTS.read_bytes() == shipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.safetensors", "run"]


def test_train_cli_writes_weights(tmp_path, capsys):
    from pipeline.commands.cli import main
    rc = main(["train", "--config", "configs/train_default.yaml", "--no-progress", *sum((["--set", s] for s in TINY),
                                                                                        []),
               "--set", f"out_dir={tmp_path}", "--set", "stages=[{name: grounding, epochs: 1, batch_size: 16}]"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (tmp_path / "model.safetensors").is_file() and out["final"]["stage"] == "grounding"
