import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.balancing import (AdaptiveTensionBalancer, BalancingConfig, Spread, TensionBalancer,
                               make_balancer)
from arr_coc.knowing import KnowingScores

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DQ = 16
KINDS = [("tension", "softmax"), ("adaptive", "softmax"), ("adaptive", "sigmoid")]


def scores(B=3, gh=7, gw=9, seed=0) -> KnowingScores:
    g = torch.Generator().manual_seed(seed)
    return KnowingScores(*torch.rand(3, B, gh, gw, generator=g))


def balancer(kind, mode, **kw):
    torch.manual_seed(0)
    return make_balancer(BalancingConfig(kind=kind, weight_mode=mode, **kw), DQ)


class TestConfig:
    @pytest.mark.parametrize("kw, needle", [
        (dict(kind="fixed"), "balancing.kind='fixed' is not supported; allowed: tension, adaptive"),
        (dict(weight_mode="relu"), "allowed: softmax, sigmoid"),
        (dict(hidden_dim=0), "balancing.hidden_dim=0 is out of range; allowed: [1, inf)"),
        (dict(diversity_window=4), "balancing.diversity_window=4 must be odd"),
        (dict(diversity_window=17), "balancing.diversity_window=17 is out of range; allowed: [3, 15]"),
        (dict(initial_tension=1.0), "balancing.initial_tension=1.0 is out of range; allowed: (0.0, 1.0)"),
        (dict(hidden_dim=2.0), "balancing.hidden_dim must be an integer"),
    ])
    def test_bad_values_name_field_and_range(self, kw, needle):
        with pytest.raises(ConfigError) as e:
            BalancingConfig(**kw)
        assert needle in str(e.value) and "\n" not in str(e.value)

    def test_make_balancer_picks_the_kind(self):
        assert type(balancer("tension", "softmax")) is TensionBalancer
        assert type(balancer("adaptive", "sigmoid")) is AdaptiveTensionBalancer
        with pytest.raises(ConfigError, match="query_dim=0"):
            make_balancer(BalancingConfig(), 0)


class TestOutputs:
    @pytest.mark.parametrize("kind, mode", KINDS)
    def test_shapes_ranges_and_tensions(self, kind, mode):
        b = balancer(kind, mode)
        for s in (scores(), KnowingScores(*torch.ones(3, 3, 7, 9)), KnowingScores(*torch.zeros(3, 3, 7, 9))):
            out = b(s, torch.randn(3, DQ) * 10)
            assert out.relevance.shape == (3, 7, 9)
            assert out.relevance.min() >= 0 and out.relevance.max() <= 1
            assert {"compress", "exploit", "focus"} <= set(out.tensions)
            for name, t in out.tensions.items():
                assert t.shape == (3,) and (t > 0).all() and (t < 1).all(), name

    def test_fixed_tensions_are_the_learned_constants(self):
        b = balancer("tension", "softmax", initial_tension=0.3)
        out = b(scores(), torch.randn(3, DQ))
        for t in ("compress", "exploit", "focus"):
            assert torch.allclose(out.tensions[t], torch.full((3,), 0.3))

    def test_adaptive_tensions_follow_the_query(self):
        b = balancer("adaptive", "softmax")
        q = torch.randn(3, DQ)
        q[2] = q[0]
        s = KnowingScores(*torch.rand(3, 1, 7, 9).expand(3, 3, 7, 9))  # same maps in every frame
        out = b(s, q)
        assert torch.allclose(out.tensions["focus"][0], out.tensions["focus"][2])
        assert not torch.allclose(out.tensions["focus"][0], out.tensions["focus"][1])

    @pytest.mark.parametrize("kind, mode", KINDS)
    def test_frames_are_independent(self, kind, mode):
        b = balancer(kind, mode)
        s, q = scores(), torch.randn(3, DQ)
        a = b(s, q)
        x = s.stack().clone()
        x[1:] = torch.rand_like(x[1:])
        q2 = q.clone()
        q2[2] = torch.randn(DQ)
        c = b(KnowingScores(*x.unbind(1)), q2)
        assert torch.equal(a.relevance[0], c.relevance[0])
        assert not torch.equal(a.relevance[1], c.relevance[1])
        for name in a.tensions:
            assert torch.equal(a.tensions[name][0], c.tensions[name][0]), name


class TestOpponentProcessing:
    def _pin(self, b: TensionBalancer, compress, exploit, focus, mix):
        with torch.no_grad():
            b.tension_logits.copy_(torch.tensor([compress, exploit, focus]))
            b.mix_logits.copy_(torch.tensor(mix))

    def test_each_tension_moves_between_its_poles(self):
        b = balancer("tension", "softmax")
        s = scores()
        self._pin(b, 30.0, 0.0, 0.0, [30.0, -30.0, -30.0])  # compress fully, only that term
        assert torch.allclose(b(s).relevance, s.information, atol=1e-5)
        self._pin(b, -30.0, 0.0, 0.0, [30.0, -30.0, -30.0])  # particularize
        assert torch.allclose(b(s).relevance, s.coupling, atol=1e-5)
        self._pin(b, 0.0, 30.0, 0.0, [-30.0, 30.0, -30.0])  # exploit
        assert torch.allclose(b(s).relevance, s.salience, atol=1e-5)
        self._pin(b, 0.0, -30.0, 0.0, [-30.0, 30.0, -30.0])  # explore
        assert torch.allclose(b(s).relevance, 1 - s.salience, atol=1e-5)
        self._pin(b, 0.0, 0.0, 30.0, [-30.0, -30.0, 30.0])  # focus: the fused map as is
        focused = b(s).relevance
        self._pin(b, 0.0, 0.0, -30.0, [-30.0, -30.0, 30.0])  # diversify: neighbourhood-suppressed
        assert torch.allclose(b(s).relevance, Spread(3)(focused), atol=1e-5)

    def test_spread_keeps_isolated_peaks_and_damps_blobs(self):
        x = torch.zeros(1, 9, 9)
        x[0, 1, 1] = 1.0  # isolated
        x[0, 4:9, 4:9] = 1.0  # blob
        y = Spread(3)(x)[0]
        assert y[1, 1] == 1.0
        assert y[6, 6] == 0.0  # fully surrounded by relevance
        assert 0 < y[4, 4] < 1 and y[8, 8] == 0.0  # corner of the grid: 3 neighbours, all relevant
        assert torch.equal(y[x[0] == 0], torch.zeros(int((x[0] == 0).sum())))

    def test_softmax_and_sigmoid_weight_modes(self):
        s = KnowingScores(torch.ones(2, 5, 5), torch.zeros(2, 5, 5), torch.zeros(2, 5, 5))
        q = torch.randn(2, DQ)
        out = {}
        for mode in ("softmax", "sigmoid"):
            b = balancer("adaptive", mode)
            with torch.no_grad():  # pin: all weight logits +5, focus tension 1, mix only on focus
                b.policy[-1].weight.zero_()
                b.policy[-1].bias.copy_(torch.tensor([0.0, 0.0, 30.0, 5.0, 5.0, 5.0]))
                b.mix_logits.copy_(torch.tensor([-30.0, -30.0, 30.0]))
            out[mode] = b(s, q)
        w_soft = torch.stack([out["softmax"].tensions[f"weight_{n}"] for n in ("information", "salience",
                                                                               "coupling")], 1)
        w_sig = torch.stack([out["sigmoid"].tensions[f"weight_{n}"] for n in ("information", "salience", "coupling")],
                            1)
        assert torch.allclose(w_soft, torch.full((2, 3), 1 / 3))  # competing: they share one unit
        assert torch.allclose(w_sig, torch.full((2, 3), torch.sigmoid(torch.tensor(5.0)).item()))  # gates
        # softmax: a convex mix, information alone gives 1/3; sigmoid: noisy-OR, one strong score suffices
        assert torch.allclose(out["softmax"].relevance, torch.full((2, 5, 5), 1 / 3), atol=1e-5)
        assert torch.allclose(out["sigmoid"].relevance, w_sig[:, :1, None].expand(2, 5, 5), atol=1e-5)

    def test_sigmoid_mode_is_a_noisy_or(self):
        b = balancer("adaptive", "sigmoid")
        with torch.no_grad():
            b.policy[-1].weight.zero_()
            b.policy[-1].bias.copy_(torch.tensor([0.0, 0.0, 30.0, 0.0, 1.0, -1.0]))
            b.mix_logits.copy_(torch.tensor([-30.0, -30.0, 30.0]))
        s = scores()
        w = torch.sigmoid(torch.tensor([0.0, 1.0, -1.0]))
        expected = 1 - (1 - w[0] * s.information) * (1 - w[1] * s.salience) * (1 - w[2] * s.coupling)
        assert torch.allclose(b(s, torch.randn(3, DQ)).relevance, expected, atol=1e-5)


class TestGradients:
    @pytest.mark.parametrize("kind, mode", KINDS)
    def test_every_parameter_and_the_scores_get_gradients(self, kind, mode):
        b = balancer(kind, mode)
        x = torch.rand(3, 3, 7, 9, requires_grad=True)
        out = b(KnowingScores(*x.unbind(1)), torch.randn(3, DQ))
        w = torch.rand(3, 7, 9, generator=torch.Generator().manual_seed(1))
        (out.relevance * w).sum().backward()
        for name, p in b.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        assert x.grad.abs().sum() > 0

    @pytest.mark.parametrize("grid", [(4, 4), (1, 1)])
    def test_blank_frame_and_single_cell_grid_stay_finite(self, grid):
        b = balancer("adaptive", "softmax")
        x = torch.full((1, 3, *grid), 0.5, requires_grad=True)  # scores come from the trained scorers
        out = b(KnowingScores(*x.unbind(1)), torch.randn(1, DQ))
        assert torch.isfinite(out.relevance).all()
        out.relevance.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in b.parameters())


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind, mode", KINDS)
def test_cpu_and_cuda_agree(kind, mode):
    b = balancer(kind, mode)
    s, q = scores(), torch.randn(3, DQ)
    cpu = b(s, q)
    gpu = b.cuda()(KnowingScores(*s.stack().cuda().unbind(1)), q.cuda())
    assert torch.allclose(cpu.relevance, gpu.relevance.cpu(), atol=1e-5)
    for name in cpu.tensions:
        assert torch.allclose(cpu.tensions[name], gpu.tensions[name].cpu(), atol=1e-5), name
