"""Outcome training: the sampled hard selection keeps exactly the allocator's budget, its
log-probability and REINFORCE gradient are right, a group of equal rewards teaches nothing, the loop
learns a toy task where one cell decides the answer, and the held-out renderer is refused."""
import itertools
import json

import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.attending import AttendingConfig, TokenAllocator
from arr_coc.model import ARRCOCConfig
from evaluation.renderers import HELD_OUT, HeldOutError
from pipeline.configio import load_config
from pipeline.training import outcome
from pipeline.training.outcome import OutcomeConfig, OutcomeData, OutcomeTrain, hard_accuracy, prepare
from pipeline.training.selection import advantages, ordered_log_prob, policy_loss, sample_selection
from pipeline.vlm.geometry import VLMGeometry


class TestSampledSelection:
    @pytest.mark.parametrize("retention", [0.05, 0.1, 0.25, 0.9])
    def test_keeps_exactly_the_budget_of_available_cells(self, retention):
        g = torch.Generator().manual_seed(0)
        T, N = 5, 64
        logits = torch.randn(T, N, generator=g) * 3
        available = torch.rand(T, N, generator=g) < 0.6
        available[0] = True                                   # a fresh frame: every cell
        available[1, :] = False
        available[1, :3] = True                               # three cells: the budget is capped by them
        budget = TokenAllocator(AttendingConfig(retention=retention)).frame_budget(available.sum(-1))
        keep, log_prob = sample_selection(logits, available, budget, 16, g)
        assert keep.shape == (16, T, N) and log_prob.shape == (16,)
        assert torch.equal(keep.sum(-1), budget.expand(16, T))
        assert not (keep & ~available).any()
        assert torch.isfinite(log_prob).all() and (log_prob <= 0).all()

    def test_a_budget_above_the_available_cells_is_an_error(self):
        with pytest.raises(ValueError, match="exceeds"):
            sample_selection(torch.zeros(1, 4), torch.tensor([[True, True, False, False]]), torch.tensor([3]), 2)

    def test_draws_follow_plackett_luce(self):
        """The frequency of each kept set matches its probability summed over its orders."""
        logits = torch.tensor([[1.5, 0.2, -0.5, 0.8]])
        available, budget = torch.ones(1, 4, dtype=torch.bool), torch.tensor([2])
        keep, _ = sample_selection(logits, available, budget, 40_000, torch.Generator().manual_seed(1))
        exact = _set_probabilities(logits[0], 2)
        for cells, p in exact.items():
            mask = torch.zeros(4, dtype=torch.bool)
            mask[list(cells)] = True
            freq = (keep[:, 0] == mask).all(-1).float().mean()
            assert float(freq) == pytest.approx(p, abs=0.01), cells


def _orders(n: int, k: int):
    return list(itertools.permutations(range(n), k))


def _closed_form(s: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    left, total = list(range(len(s))), torch.zeros((), dtype=s.dtype)
    for i in order:
        total = total + s[i] - torch.logsumexp(s[left], 0)
        left.remove(i)
    return total


def _set_probabilities(s: torch.Tensor, k: int) -> dict:
    out: dict = {}
    for order in _orders(len(s), k):
        key = tuple(sorted(order))
        out[key] = out.get(key, 0.0) + float(_closed_form(s, order).exp())
    return out


def _full_order(order: tuple[int, ...], n: int) -> torch.Tensor:
    return torch.tensor(list(order) + [c for c in range(n) if c not in order])


class TestLogProbability:
    def test_matches_the_closed_form_and_sums_to_one(self):
        s = torch.tensor([[0.3, -1.2, 2.0, 0.7, 0.1]], dtype=torch.float64)
        available, budget = torch.ones(1, 5, dtype=torch.bool), torch.tensor([3])
        orders = _orders(5, 3)
        lp = ordered_log_prob(s, available, torch.stack([_full_order(o, 5) for o in orders])[:, None], budget)
        expected = torch.stack([_closed_form(s[0], o) for o in orders])
        assert torch.allclose(lp, expected, atol=1e-10)
        assert float(lp.exp().sum()) == pytest.approx(1.0, abs=1e-9)

    def test_unavailable_cells_carry_no_probability(self):
        s = torch.tensor([[0.3, 5.0, 2.0, 0.7]], dtype=torch.float64)
        available = torch.tensor([[True, False, True, True]])
        orders = [o for o in _orders(4, 2) if 1 not in o]
        lp = ordered_log_prob(s, available, torch.stack([_full_order(o, 4) for o in orders])[:, None],
                              torch.tensor([2]))
        assert float(lp.exp().sum()) == pytest.approx(1.0, abs=1e-9)

    def test_gradient_of_the_expected_reward(self):
        """Autograd through the exact expectation matches finite differences, and the REINFORCE
        estimate from sampled selections matches both."""
        n, k = 4, 2
        reward = {cells: float(1 in cells) + 0.5 * float(cells == (0, 3))
                  for cells in itertools.combinations(range(n), k)}
        available, budget = torch.ones(1, n, dtype=torch.bool), torch.tensor([k])
        orders = _orders(n, k)
        index = torch.stack([_full_order(o, n) for o in orders])[:, None]
        r = torch.tensor([reward[tuple(sorted(o))] for o in orders], dtype=torch.float64)

        def expected(s):
            return (ordered_log_prob(s, available, index, budget).exp() * r).sum()

        s = torch.tensor([[0.4, -0.3, 0.9, 0.1]], dtype=torch.float64, requires_grad=True)
        exact = torch.autograd.grad(expected(s), s)[0]
        eps, fd = 1e-6, torch.zeros_like(exact)
        for c in range(n):
            d = torch.zeros_like(s)
            d[0, c] = eps
            fd[0, c] = (expected(s.detach() + d) - expected(s.detach() - d)) / (2 * eps)
        assert torch.allclose(exact, fd, atol=1e-7)

        G = 60_000
        keep, lp = sample_selection(s, available, budget, G, torch.Generator().manual_seed(3))
        by_bits = torch.zeros(2 ** n, dtype=torch.float64)
        for cells, value in reward.items():
            by_bits[sum(2 ** c for c in cells)] = value
        sampled = by_bits[(keep[:, 0].long() * 2 ** torch.arange(n)).sum(-1)]          # (G,) each draw's reward
        estimate = torch.autograd.grad((lp * sampled).mean(), s)[0]
        assert torch.allclose(estimate, exact, atol=0.01), (estimate, exact)


class TestAdvantages:
    @pytest.mark.parametrize("mode", ["group", "group_norm"])
    def test_equal_rewards_give_zero_advantage_and_gradient(self, mode):
        s = torch.randn(3, 16, requires_grad=True)
        keep, lp = sample_selection(s, torch.ones(3, 16, dtype=torch.bool), torch.tensor([2, 2, 2]), 6)
        rewards = torch.tensor([[1.0] * 6, [0.0] * 6])                 # two questions, each all right / all wrong
        log_prob = torch.stack([lp, lp * 0.5])
        assert torch.equal(advantages(rewards, mode), torch.zeros(2, 6))
        policy_loss(log_prob, rewards, mode).backward()
        assert torch.equal(s.grad, torch.zeros_like(s))

    def test_mixed_rewards_push_towards_the_rewarded_samples(self):
        rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
        assert torch.allclose(advantages(rewards, "group"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
        assert torch.allclose(advantages(rewards, "group_norm"), torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-5)
        assert torch.equal(advantages(rewards, "none"), rewards)
        log_prob = torch.zeros(1, 4, requires_grad=True)
        policy_loss(log_prob, rewards, "group").backward()
        assert (log_prob.grad[0, [0, 3]] < 0).all() and (log_prob.grad[0, [1, 2]] > 0).all()   # descent raises them


# ---------------------------------------------------------------- the toy task
KEY = (3, 1)            # the cell that decides the answer, on the 4 x 4 grid of 112 x 112 frames


class KeyCellAnswerer:
    """Right exactly when the selection keeps the key cell in some frame (and counts its calls)."""
    geometry = VLMGeometry(max_pixels=224 * 224)
    fps = 2.0

    def __init__(self):
        self.views = 0

    def __call__(self, samples):
        out = [bool(keep[:, KEY[0], KEY[1]].any()) for s in samples for keep in s.keeps]
        self.views += len(out)
        return torch.tensor(out)


def _embed(text: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, text)))
    return torch.nn.functional.normalize(torch.randn(1, 16, generator=g), dim=-1)


def _toy_items(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (2, 112, 112, 3), dtype=np.uint8), [("What is in the key cell?", "red")])
            for _ in range(n)]


def _toy_cfg(tmp_path, **train) -> OutcomeConfig:
    t = dict(steps=40, clips_per_step=4, samples=8, temperature=0.05, lr=0.1, val_every=0, log_every=5,
             checkpoint_every=10, grad_clip=0.0)
    t.update(train)
    return OutcomeConfig(init="none", out_dir=str(tmp_path), data=OutcomeData(clips=1, val_clips=0),
                         model=ARRCOCConfig(attending=AttendingConfig(retention=0.1)), train=OutcomeTrain(**t))


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    torch.manual_seed(0)
    answerer = KeyCellAnswerer()
    result = outcome.train(_toy_cfg(out), answerer=answerer, items=(_toy_items(12, 0), _toy_items(8, 1)),
                           embed=_embed, log=lambda s: None)
    return out, result, answerer


class TestToyTask:
    def test_reward_rises_and_the_hard_selection_finds_the_key_cell(self, toy_run):
        _, result, _ = toy_run
        rewards = [row["reward"] for row in result["history"] if "reward" in row]
        vals = [row["val_hard_accuracy"] for row in result["history"] if "val_hard_accuracy" in row]
        assert len(rewards) == 8
        assert rewards[-1] > rewards[0] + 0.3, rewards
        assert vals[0] < 0.5 and vals[-1] >= 0.75, vals

    def test_every_question_gets_its_samples(self, toy_run):
        _, result, answerer = toy_run
        # 40 steps x 4 questions x 8 samples; validation: 8 questions at the start (hard selection and
        # every token) and at the end
        assert answerer.views == 40 * 4 * 8 + 3 * 8

    def test_writes_loadable_weights_and_resumes(self, toy_run, tmp_path):
        out, result, _ = toy_run
        from arr_coc.checkpoint import read_weights
        from arr_coc.model import ARRCOC

        _, meta = read_weights(result["weights"])
        assert meta["format"] == "arr-coc-weights/1"
        ARRCOC.from_pretrained(result["weights"], config=_toy_cfg(out).model, query_dim=16)
        items = (_toy_items(4, 0), _toy_items(1, 1))
        outcome.train(_toy_cfg(tmp_path, steps=10), answerer=KeyCellAnswerer(), items=items, embed=_embed,
                      log=lambda s: None)
        resumed = outcome.train(_toy_cfg(tmp_path, steps=12), resume=True, answerer=KeyCellAnswerer(), items=items,
                                embed=_embed, log=lambda s: None)
        steps = [row["step"] for row in resumed["history"] if "reward" in row]
        assert steps == [5, 10, 12]

    def test_without_a_baseline_equal_rewards_still_teach(self, tmp_path):
        """The group baseline is what makes an all-right group neutral: with advantage none the
        same run moves the weights on steps whose samples all scored 1."""
        model_cfg = _toy_cfg(tmp_path).model
        from arr_coc.model import ARRCOC
        model = ARRCOC(model_cfg, query_dim=16)
        clip = prepare(model, _toy_items(1, 0)[0], _embed, (4, 4), "cpu")
        always = lambda samples: torch.ones(sum(len(s.keeps) for s in samples), dtype=torch.bool)  # noqa: E731
        for mode, moved in (("group", False), ("none", True)):
            model.zero_grad()
            loss, _ = outcome.sample_step(model, [clip], always, OutcomeTrain(advantage=mode, samples=4))
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert any(bool(g.abs().sum() > 0) for g in grads) == moved, mode
        assert hard_accuracy(model, [clip], always) == 1.0


# ---------------------------------------------------------------- config and data
class TestRenderers:
    def test_the_held_out_renderer_is_refused(self, tmp_path, capsys):
        with pytest.raises(ConfigError, match="held out"):
            OutcomeData(renderers=("shapes", HELD_OUT))
        with pytest.raises(ConfigError, match="held out"):
            load_config(OutcomeConfig, "configs/train_outcome.yaml", [f"data.renderers=[photo, {HELD_OUT}]"])
        from pipeline.training.renderer_data import RendererScenes
        with pytest.raises(HeldOutError):
            RendererScenes((HELD_OUT,))
        assert outcome.main(["--config", "configs/train_outcome.yaml", "--set", f"data.renderers=[{HELD_OUT}]",
                             "--set", f"out_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "held out" in err and "Traceback" not in err

    def test_bad_settings_are_one_line(self, tmp_path, capsys):
        assert outcome.main(["--config", "configs/train_outcome.yaml", "--set", "train.samples=1"]) == 2
        assert "group baseline" in capsys.readouterr().err
        assert outcome.main(["--config", "configs/train_outcome.yaml", "--set",
                             "model.attending.pooled_share=0.5"]) == 2
        assert "pooled_share" in capsys.readouterr().err
        assert outcome.main(["--config", "configs/train_outcome.yaml", "--set", f"queries={tmp_path}/none.st"]) == 2

    def test_render_items_draws_only_training_renderers_with_every_family(self):
        cfg = load_config(OutcomeConfig, "configs/train_outcome.yaml", ["data.clips=6", "data.val_clips=3"])
        train_items, val_items = outcome.render_items(cfg, 2.0)
        assert len(train_items) == 6 and len(val_items) == 3
        frames, qas = train_items[0]
        assert frames.dtype == np.uint8 and frames.shape[1:] == (224, 224, 3)
        assert all(isinstance(q, str) and isinstance(a, str) for q, a in qas)


def test_the_configs_load_and_train_on_renderers():
    from pipeline.training.train import TrainConfig

    for path in ("configs/train_renderers.yaml", "configs/train_renderers_vlm_qa.yaml"):
        cfg = load_config(TrainConfig, path, [])
        assert cfg.data.source == "renderers" and HELD_OUT not in cfg.data.renderers
        with pytest.raises(ConfigError, match="held out"):
            load_config(TrainConfig, path, [f"data.renderers=[{HELD_OUT}]"])
    cfg = load_config(OutcomeConfig, "configs/train_outcome.yaml", [])
    assert json.loads(json.dumps(list(cfg.data.renderers))) == ["shapes", "photo", "busy"]


def test_compare_scores_each_weights_spec_through_the_vlm(tmp_path, monkeypatch):
    """--compare: the same weights twice give the same accuracy; every number is a share."""
    import pipeline.core.query as query
    from arr_coc.checkpoint import save_weights
    from arr_coc.model import ARRCOC
    from pipeline.training import query_table

    class Fake:
        def encode_many(self, texts):
            return torch.nn.functional.normalize(torch.stack([_embed(t)[0] for t in texts]), dim=-1)
    monkeypatch.setattr(query, "sentence_encoder", lambda device="cpu": Fake())
    table = query_table.build(tmp_path / "table.safetensors")
    torch.manual_seed(0)
    model = ARRCOC(query_dim=16)
    specs = [str(save_weights(model, tmp_path / f"w{i}.safetensors")) for i in range(2)]
    cfg = load_config(OutcomeConfig, "configs/train_outcome.yaml",
                      ["device=cpu", "vlm=tiny-random", f"queries={table}", "data.val_clips=2"])
    out = outcome.compare(cfg, specs, log=lambda s: None)
    scores = [out["hard_selection"][s] for s in specs]
    assert out["val_clips"] == 2 and out["questions"] > 2
    assert scores[0] == scores[1] and 0.0 <= scores[0] <= 1.0 and 0.0 <= out["every_token"] <= 1.0


def test_the_reward_is_the_pipelines_own_greedy_answer():
    """VLMAnswerer (teacher-forced, one forward) calls an answer right exactly when the pipeline's
    VLM, given the same keep map, generates it."""
    from pipeline.training.outcome import VLMAnswerer, clip_sample
    from pipeline.vlm.loading import load_vlm

    vlm = load_vlm("arrcoc-synth-qa", device="cpu", dtype="float32")
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (4, 224, 224, 3), dtype=np.uint8)
    keep = (rng.random((4, *vlm.geometry.grid(224, 224))) < 0.3).astype(np.int8)
    questions = ["What color is the circle at the top left?", "How many objects are there?", "Is there a red square?"]
    texts = [r.text for r in vlm.answer_questions(frames, keep, questions)]
    wrong = [next(w for w in ("purple", "five", "yes") if w != t) for t in texts]
    right = VLMAnswerer(vlm)([clip_sample(frames, questions * 2, texts + wrong, [keep] * 6)])
    assert right.tolist() == [True] * 3 + [False] * 3, texts
