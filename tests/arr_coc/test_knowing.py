import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.knowing import DEFAULT_CHANNELS, Knowing, KnowingConfig, KnowingScores

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DQ = 24


def make(**kw) -> Knowing:
    torch.manual_seed(0)
    return Knowing(KnowingConfig(query_dim=DQ, hidden_dim=kw.pop("hidden_dim", 16), **kw))


def texture(B=2, gh=7, gw=9, seed=1) -> torch.Tensor:
    return torch.randn(B, len(DEFAULT_CHANNELS), gh, gw, generator=torch.Generator().manual_seed(seed))


def maps(s: KnowingScores):
    return {"information": s.information, "salience": s.salience, "coupling": s.coupling}


class TestConfig:
    @pytest.mark.parametrize("kw, needle", [
        (dict(query_dim=0), "knowing.query_dim=0 is out of range; allowed: [1, inf)"),
        (dict(hidden_dim=-1), "knowing.hidden_dim=-1"),
        (dict(context_dim=-2), "knowing.context_dim=-2 is out of range; allowed: [0, inf)"),
        (dict(context_dim=2.0), "knowing.context_dim must be an integer"),
        (dict(information_window=4), "knowing.information_window=4 must be odd"),
        (dict(information_window=1), "knowing.information_window=1 is out of range; allowed: [3, 15]"),
        (dict(query_dim=3.5), "knowing.query_dim must be an integer"),
        (dict(salience_channels=("saliency", "glow")), "knowing.salience_channels='glow' is not supported"),
        (dict(salience_channels=()), "knowing.salience_channels must name at least one channel"),
        (dict(token_pooling="mean"), "allowed: max, attention"),
        (dict(channels=("a", "a")), "must be non-empty and unique"),
    ])
    def test_bad_values_name_field_and_range(self, kw, needle):
        with pytest.raises(ConfigError) as e:
            KnowingConfig(**kw)
        assert needle in str(e.value) and "\n" not in str(e.value)


class TestScores:
    @pytest.mark.parametrize("pooling", ["max", "attention"])
    @pytest.mark.parametrize("hidden_dim", [0, 16])
    def test_shapes_and_ranges(self, pooling, hidden_dim):
        k = make(token_pooling=pooling, hidden_dim=hidden_dim)
        x = texture() * 5
        for q, mask in [(torch.randn(2, DQ), None), (torch.randn(2, 4, DQ), torch.tensor([[1, 1, 0, 0], [1, 1, 1,
                                                                                                         1]]).bool())]:
            s = k(x, q, mask)
            for name, m in maps(s).items():
                assert m.shape == (2, 7, 9), name
                assert m.min() >= 0 and m.max() <= 1 and torch.isfinite(m).all(), name
            assert s.stack().shape == (2, 3, 7, 9)

    def test_custom_channel_layout(self):
        cfg = KnowingConfig(channels=("lum", "edge", "sal"), salience_channels=("sal", "edge"), query_dim=8)
        s = Knowing(cfg)(torch.rand(3, 3, 5, 4), torch.randn(3, 8))
        assert s.salience.shape == (3, 5, 4)

    def test_busy_cells_carry_more_information_than_flat_ones(self):
        x = torch.zeros(1, len(DEFAULT_CHANNELS), 8, 8)
        x[:, :, :, 4:] = torch.randn(1, len(DEFAULT_CHANNELS), 8, 4, generator=torch.Generator().manual_seed(0))
        info = make()(x, torch.randn(1, DQ)).information[0]
        assert info[:, :3].max() < info[:, 5:].min()

    def test_salient_cells_stand_out(self):
        x = torch.zeros(1, len(DEFAULT_CHANNELS), 6, 6)
        x[0, DEFAULT_CHANNELS.index("saliency"), 2, 3] = 3.0
        sal = make()(x, torch.randn(1, DQ)).salience[0]
        assert sal.flatten().argmax().item() == 2 * 6 + 3

    def test_frames_are_independent(self):
        k = make(token_pooling="attention")
        x, q = texture(), torch.randn(2, 3, DQ)
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
        v = torch.randn(2, 63, DQ)
        for visual in (None, v):
            a = k(x, q, mask, visual)
            x2, q2, m2, v2 = x.clone(), q.clone(), mask.clone(), v.clone()
            x2[1], q2[1], m2[1], v2[1] = torch.randn_like(x[1]) * 3, torch.randn_like(q[1]), True, -v[1]
            b = k(x2, q2, m2, None if visual is None else v2)
            for name, m in maps(a).items():
                assert torch.equal(m[0], maps(b)[name][0]), name
                assert not torch.equal(m[1], maps(b)[name][1]), name  # frame 1 did change


class TestCoupling:
    @pytest.mark.parametrize("pooling", ["max", "attention"])
    def test_masked_tokens_have_no_effect(self, pooling):
        k = make(token_pooling=pooling)
        x, q = texture(), torch.randn(2, 5, DQ)
        mask = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 1, 1, 0]]).bool()
        ref = k(x, q, mask).coupling
        q2 = q.clone()
        q2[~mask] = torch.randn(int((~mask).sum()), DQ) * 100
        assert torch.equal(k(x, q2, mask).coupling, ref)
        short = k(x[:1], q[:1, [0, 2]]).coupling  # frame 0 with only its unmasked tokens
        assert torch.allclose(short, ref[:1], atol=1e-6)
        q3 = q.clone()
        q3[0, 0] = torch.randn(DQ)  # an unmasked token does matter
        assert not torch.allclose(k(x, q3, mask).coupling[0], ref[0])

    # Pooling reduces the tokens' cosines per cell; the neighbourhood context then reads the pooled
    # map, so the pooling identities are checked without it.
    def test_max_pooling_is_the_best_single_token(self):
        k = make(token_pooling="max", context_dim=0)
        x, q = texture(), torch.randn(2, 3, DQ)
        per_token = torch.stack([k(x, q[:, i]).coupling for i in range(3)])  # (L, B, gh, gw)
        assert torch.allclose(k(x, q).coupling, per_token.amax(0), atol=1e-6)

    def test_attention_pooling_lies_between_tokens(self):
        k = make(token_pooling="attention", context_dim=0)
        x, q = texture(), torch.randn(2, 3, DQ)
        per_token = torch.stack([k(x, q[:, i]).coupling for i in range(3)])
        c = k(x, q).coupling
        assert (c <= per_token.amax(0) + 1e-6).all() and (c >= per_token.amin(0) - 1e-6).all()
        assert not torch.allclose(c, per_token.amax(0))

    def test_visual_tokens_replace_the_projection(self):
        k = make()
        q = torch.randn(2, DQ)
        v = torch.randn(2, 63, DQ)
        v[0, 17] = q[0] * 3  # a cell whose visual token says what the question says
        v[1, 40] = q[1]
        a = k(texture(seed=1), q, visual_tokens=v).coupling
        b = k(texture(seed=2), q, visual_tokens=v).coupling
        assert torch.equal(a, b), "with visual tokens the texture must not affect coupling"
        assert a[0].flatten().argmax().item() == 17 and a[1].flatten().argmax().item() == 40
        assert not torch.allclose(k(texture(seed=1), q).coupling, a)


class TestContext:
    def _with_context(self) -> Knowing:
        k = make()
        with torch.no_grad():  # a trained-sized context term, not the near-zero initial one
            k.participatory.context[2].weight.mul_(100.0)
        return k

    def test_a_cells_coupling_reads_only_its_5x5_neighbourhood(self):
        k = self._with_context()
        x, q = texture(B=1, gh=9, gw=9), torch.randn(1, DQ)
        x2 = x.clone()
        x2[0, :, 4, 4] = torch.randn(len(DEFAULT_CHANNELS)) * 5  # change one cell's texture
        changed = (k(x, q).coupling[0] != k(x2, q).coupling[0])  # (gh, gw)
        near = torch.zeros(9, 9, dtype=torch.bool)
        near[2:7, 2:7] = True
        assert changed[4, 4] and changed[4, 2] and changed[2, 6], "two 3x3 convs reach 2 cells away"
        assert not changed[~near].any(), "and no further"

    def test_without_context_a_cell_reads_only_itself(self):
        k = make(context_dim=0)
        assert k.participatory.context is None
        x, q = texture(B=1, gh=9, gw=9), torch.randn(1, DQ)
        x2 = x.clone()
        x2[0, :, 4, 4] = torch.randn(len(DEFAULT_CHANNELS)) * 5
        changed = (k(x, q).coupling[0] != k(x2, q).coupling[0])
        assert changed.sum() == 1 and changed[4, 4]

    def test_starts_close_to_the_per_cell_coupling(self):
        torch.manual_seed(0)
        with_ctx = Knowing(KnowingConfig(query_dim=DQ, hidden_dim=16))
        torch.manual_seed(0)
        plain = Knowing(KnowingConfig(query_dim=DQ, hidden_dim=16, context_dim=0))
        plain.participatory.project.load_state_dict(with_ctx.participatory.project.state_dict())
        x, q = texture(), torch.randn(2, DQ)
        a, b = with_ctx(x, q).coupling, plain(x, q).coupling
        assert (a - b).abs().max() < 0.01 and not torch.equal(a, b)

    def test_also_applies_to_visual_tokens(self):
        k = self._with_context()
        q = torch.randn(1, DQ)
        v = torch.randn(1, 63, DQ)
        v2 = v.clone()
        v2[0, 4 * 9 + 4] = q[0] * 3  # cell (4, 4) now says what the question says
        changed = k(texture(B=1), q, visual_tokens=v).coupling[0] != k(texture(B=1), q, visual_tokens=v2).coupling[0]
        assert changed[4, 4] and changed[3, 5] and changed[2, 4] and not changed[4, 7]


class TestGradients:
    @pytest.mark.parametrize("pooling", ["max", "attention"])
    @pytest.mark.parametrize("hidden_dim", [0, 16])
    def test_every_parameter_gets_a_gradient(self, pooling, hidden_dim):
        k = make(token_pooling=pooling, hidden_dim=hidden_dim)
        s = k(texture(), torch.randn(2, 3, DQ), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool())
        w = torch.rand(3, 2, 7, 9, generator=torch.Generator().manual_seed(0))
        (s.stack().transpose(0, 1) * w).sum().backward()
        for name, p in k.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name

    def test_flat_texture_has_finite_gradients(self):
        k = make()
        x = torch.zeros(1, len(DEFAULT_CHANNELS), 4, 4, requires_grad=True)
        k(x, torch.randn(1, DQ)).stack().sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in k.parameters())


def test_bad_inputs_are_named():
    k = make()
    with pytest.raises(ValueError, match=r"texture_data must be \(B, 17, gh, gw\), got \(2, 5, 7, 9\)"):
        k(torch.rand(2, 5, 7, 9), torch.randn(2, DQ))
    with pytest.raises(ValueError, match=r"query must be \(2, 24\) or \(2, L, 24\)"):
        k(texture(), torch.randn(2, 7))
    with pytest.raises(ValueError, match="masks every token"):
        k(texture(), torch.randn(2, 2, DQ), torch.tensor([[True, False], [False, False]]))
    with pytest.raises(ValueError, match=r"visual_tokens must be \(2, 63, 24\)"):
        k(texture(), torch.randn(2, DQ), visual_tokens=torch.randn(2, 60, DQ))


def test_half_precision_input():
    k = make()
    s = k(texture().half(), torch.randn(2, DQ).half())
    assert s.coupling.dtype == torch.float32 and torch.isfinite(s.stack()).all()


@pytest.mark.cuda
@cuda
def test_cpu_and_cuda_agree():
    k = make(token_pooling="attention")
    x, q = texture(), torch.randn(2, 3, DQ)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    cpu = k(x, q, mask)
    gpu = k.cuda()(x.cuda(), q.cuda(), mask.cuda())
    for name, m in maps(cpu).items():
        assert torch.allclose(m, maps(gpu)[name].cpu(), atol=1e-4), name
