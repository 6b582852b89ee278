import math

import pytest
import torch

from arr_coc._validate import ConfigError
from arr_coc.attending import Allotment, AttendingConfig, TokenAllocator

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def expected_budget(cfg: AttendingConfig, n: torch.Tensor) -> torch.Tensor:
    if cfg.selection == "topk":
        return torch.minimum(n, torch.full_like(n, cfg.top_k))
    k = torch.tensor([math.floor(cfg.retention * int(v) + 0.5) for v in n])
    return torch.minimum(torch.clamp(k, min=cfg.min_tokens), n)


def expected_pooled(cfg: AttendingConfig, n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    share = torch.tensor([math.floor(int(v) * cfg.pooled_share) for v in k])
    return torch.minimum(share, torch.div(n - k, 3, rounding_mode="floor"))


def check_allotment(out: Allotment, cfg: AttendingConfig, relevance: torch.Tensor, available: torch.Tensor):
    B, gh, gw = relevance.shape
    n = available.flatten(1).sum(1)
    k = expected_budget(cfg, n)
    assert out.tokens.dtype == torch.int32 and out.lod.dtype == torch.int8
    assert out.budget.dtype == torch.int64 and out.selected.dtype == torch.int64
    assert out.tokens.shape == out.lod.shape == out.soft.shape == (B, gh, gw)
    assert torch.equal(out.budget, k)
    assert torch.equal(out.tokens.flatten(1).sum(1).long(), k)
    assert out.tokens.min() >= 0 and out.tokens.max() <= 1
    assert not (out.tokens.bool() & ~available).any(), "token on an unavailable cell"
    assert not ((out.lod > 0) & ~available).any(), "unavailable cell marked as seen"
    assert torch.equal(out.tokens.bool() & (out.lod == 0), torch.zeros_like(available))
    assert ((out.lod == 1) <= out.tokens.bool()).all(), "every full-detail cell holds its token"
    # pooled blocks: aligned 2x2, no full cell inside, exactly one token on the block's most relevant cell
    lod = out.lod.long()
    pad_h, pad_w = gh % 2, gw % 2
    lod_p = torch.nn.functional.pad(lod, (0, pad_w, 0, pad_h))
    tok_p = torch.nn.functional.pad(out.tokens.long(), (0, pad_w, 0, pad_h))
    rel_p = torch.nn.functional.pad(relevance, (0, pad_w, 0, pad_h), value=-1.0)
    def blocks(x):
        return x.unfold(1, 2, 2).unfold(2, 2, 2).reshape(B, -1, 4)
    b_lod, b_tok, b_rel = blocks(lod_p), blocks(tok_p), blocks(rel_p)
    pooled_block = (b_lod == 2).any(-1)
    assert not ((b_lod == 1).any(-1) & pooled_block).any(), "full cell inside a pooled block"
    assert torch.equal((b_tok * (b_lod == 2)).sum(-1), pooled_block.long())
    top = torch.where(b_lod == 2, b_rel, torch.full_like(b_rel, -2)).argmax(-1, keepdim=True)
    assert (b_tok.gather(-1, top).squeeze(-1)[pooled_block] == 1).all()
    # selected: the token cells in raster order, then -1, as wide as any frame of this grid can need
    alloc = TokenAllocator(cfg)
    assert out.selected.shape == (B, alloc.max_budget(gh * gw)) and out.selected.shape[1] >= int(k.max())
    for b in range(B):
        cells = out.tokens[b].flatten().nonzero().squeeze(1)
        assert torch.equal(out.selected[b, : k[b]], cells)
        assert (out.selected[b, k[b]:] == -1).all()
    # soft budget: non-negative, zero off the available cells, same total as the hard budget
    soft = out.soft.detach().double()
    assert soft.min() >= 0 and soft[~available].abs().sum() == 0
    assert torch.allclose(soft.flatten(1).sum(1), k.double(), atol=1e-3)


class TestConfig:
    @pytest.mark.parametrize("field, value, needle", [
        ("retention", 0.0, "attending.retention=0.0"),
        ("retention", 1.5, "(0.0, 1.0]"),
        ("top_k", 0, "attending.top_k=0"),
        ("top_k", 2.5, "attending.top_k must be an integer"),
        ("steepness", -1.0, "attending.steepness=-1.0"),
        ("offset", 2.0, "[-1.0, 1.0]"),
        ("min_budget", 0.0, "attending.min_budget=0.0"),
        ("max_budget", 0.01, "attending.max_budget=0.01 is out of range; allowed: [0.05, 1.0]"),
        ("pooled_share", 1.0, "attending.pooled_share=1.0"),
        ("min_tokens", -1, "attending.min_tokens=-1"),
        ("soft_temperature", 0.0, "attending.soft_temperature=0.0"),
        ("curve", "cubic", "allowed: power, exponential, linear"),
        ("selection", "all", "allowed: fraction, topk"),
    ])
    def test_bad_values_name_field_and_range(self, field, value, needle):
        with pytest.raises(ConfigError) as e:
            AttendingConfig(**{field: value})
        assert needle in str(e.value)
        assert "\n" not in str(e.value)


class TestExactBudget:
    @pytest.mark.parametrize("selection", ["fraction", "topk"])
    @pytest.mark.parametrize("with_available", [False, True])
    @pytest.mark.parametrize("pooled_share", [0.0, 0.3, 0.9])
    def test_random_cases(self, selection, with_available, pooled_share):
        g = torch.Generator().manual_seed(hash((selection, with_available, pooled_share)) % 2**31)
        for case in range(12):
            gh, gw = [(7, 9), (1, 1), (3, 5), (8, 8), (2, 7), (5, 1)][case % 6]
            B = 1 + case % 4
            cfg = AttendingConfig(
                selection=selection, pooled_share=pooled_share,
                retention=float(torch.rand(1, generator=g).clamp_min(0.02)),
                top_k=int(torch.randint(1, gh * gw + 3, (1,), generator=g)),
                min_tokens=int(torch.randint(0, 4, (1,), generator=g)),
                curve=["power", "exponential", "linear"][case % 3])
            relevance = torch.rand(B, gh, gw, generator=g)
            if case % 5 == 0:  # ties and plateaus
                relevance = (relevance * 3).round() / 3
            if with_available:
                available = torch.rand(B, gh, gw, generator=g) < torch.rand(B, 1, 1, generator=g)
            else:
                available = torch.ones(B, gh, gw, dtype=torch.bool)
            out = TokenAllocator(cfg)(relevance, None if not with_available else available)
            check_allotment(out, cfg, relevance, available)

    def test_different_budget_per_frame(self):
        cfg = AttendingConfig(retention=0.5, pooled_share=0.4)
        relevance = torch.rand(3, 7, 9, generator=torch.Generator().manual_seed(1))
        available = torch.ones(3, 7, 9, dtype=torch.bool)
        available[1, :3] = False  # 36 cells left
        available[2] = False
        available[2, 0, :5] = True  # 5 cells left
        out = TokenAllocator(cfg)(relevance, available)
        assert out.budget.tolist() == [32, 18, 3]
        check_allotment(out, cfg, relevance, available)
        assert (out.lod == 2).any(), "pooled tokens expected with pooled_share=0.4"

    def test_nothing_available_spends_nothing(self):
        out = TokenAllocator(AttendingConfig(min_tokens=4))(torch.rand(2, 3, 3), torch.zeros(2, 3, 3, dtype=torch.bool))
        assert out.budget.tolist() == [0, 0] and out.tokens.sum() == 0 and out.lod.sum() == 0
        assert out.selected.shape == (2, 4) and (out.selected == -1).all() and out.soft.abs().sum() == 0

    def test_min_tokens_and_topk_limits(self):
        rel = torch.rand(1, 4, 4)
        assert TokenAllocator(AttendingConfig(retention=0.01, min_tokens=3))(rel).budget.item() == 3
        assert TokenAllocator(AttendingConfig(retention=0.01, min_tokens=30))(rel).budget.item() == 16
        assert TokenAllocator(AttendingConfig(selection="topk", top_k=40))(rel).budget.item() == 16
        assert TokenAllocator(AttendingConfig(selection="topk", top_k=5))(rel).budget.item() == 5


class TestLOD:
    def test_blocks_running_short_are_topped_up_with_full_tokens(self):
        # One very relevant cell in each 2x2 block of a 4x4 grid: all 6 full tokens (K=8, P=2)
        # land in every block, no block is left for pooling, the 2 pooled tokens become full ones.
        relevance = torch.zeros(1, 4, 4)
        relevance[0, 0, 0], relevance[0, 0, 2], relevance[0, 2, 0], relevance[0, 2, 2] = 0.9, 0.91, 0.92, 0.93
        relevance[0, 1, 1], relevance[0, 3, 3] = 0.8, 0.81
        relevance[0, 1, 3], relevance[0, 3, 1] = 0.5, 0.4  # next best: the top-ups
        cfg = AttendingConfig(retention=0.5, pooled_share=0.5)
        out = TokenAllocator(cfg)(relevance)
        assert out.budget.item() == 8 and out.tokens.sum().item() == 8
        assert (out.lod != 2).all()
        assert torch.equal(out.tokens.bool(), relevance >= 0.4)

    def test_pooled_tokens_capped_so_budget_stays_exact(self):
        # 2x4 grid, K=7: a pooled block would cover 4 cells with one token and leave no room.
        cfg = AttendingConfig(retention=7 / 8, pooled_share=0.9)
        out = TokenAllocator(cfg)(torch.rand(1, 2, 4))
        assert out.tokens.sum().item() == 7 and (out.lod == 1).sum().item() == 7

    def test_pooled_cap_keeps_an_odd_grid_exact(self):
        # Issue 35's counterexample: 4x5 grid (its right edge blocks are 2x1), 17 cells available,
        # K = floor(17 x 0.43 + 0.5) = 7, P = min(floor(7 x 0.88), (17 - 7) // 3) = 3. A looser cap,
        # (n - K) // 2 = 5, leaves 2 full tokens, pools 4 blocks covering 14 cells, and the one free
        # cell cannot make up the fifth: 6 tokens for a budget of 7.
        relevance = torch.tensor([[[0.32, 0.88, 0.72, 0.77, 0.45],
                                   [0.67, 0.69, 0.62, 0.81, 0.94],
                                   [0.08, 0.49, 0.44, 0.88, 0.34],
                                   [0.12, 0.23, 0.84, 0.38, 0.98]]])
        available = torch.ones(1, 4, 5, dtype=torch.bool)
        available.view(-1)[[4, 14, 17]] = False
        cfg = AttendingConfig(retention=0.43, pooled_share=0.88)
        out = TokenAllocator(cfg)(relevance, available)
        assert out.budget.item() == 7 and out.tokens.sum().item() == 7
        assert out.lod.eq(2).any()
        check_allotment(out, cfg, relevance, available)

    def test_pooled_blocks_prefer_larger_total_demand(self):
        relevance = torch.zeros(1, 2, 6)
        relevance[0, 0, 0] = 1.0  # the one full token
        relevance[0, :, 2:4] = 0.5  # broad warm block
        relevance[0, 0, 4] = 0.6  # one warmer cell alone
        cfg = AttendingConfig(selection="topk", top_k=2, pooled_share=0.5, curve="linear")
        out = TokenAllocator(cfg)(relevance)
        assert out.lod[0].tolist() == [[1, 0, 2, 2, 0, 0], [0, 0, 2, 2, 0, 0]]
        assert out.tokens[0].sum().item() == 2

    def test_lod_off_is_all_full_detail(self):
        out = TokenAllocator(AttendingConfig(retention=0.3))(torch.rand(2, 7, 9))
        assert torch.equal(out.lod == 1, out.tokens.bool()) and not (out.lod == 2).any()


class TestOrdering:
    def test_monotone_tokens_and_soft(self):
        g = torch.Generator().manual_seed(3)
        for curve in ("power", "exponential", "linear"):
            cfg = AttendingConfig(retention=0.37, curve=curve, min_budget=0.2, max_budget=0.7)
            relevance = torch.rand(4, 7, 9, generator=g)
            available = torch.rand(4, 7, 9, generator=g) > 0.3
            out = TokenAllocator(cfg)(relevance, available)
            for b in range(4):
                r = relevance[b][available[b]]
                t = out.tokens[b][available[b]]
                s = out.soft[b].detach()[available[b]]
                higher = r[:, None] > r[None, :]
                assert (t[:, None] >= t[None, :])[higher].all()
                assert (s[:, None] >= s[None, :] - 1e-6)[higher].all()

    def test_full_detail_goes_to_the_most_relevant_cells_with_lod(self):
        g = torch.Generator().manual_seed(4)
        cfg = AttendingConfig(retention=0.3, pooled_share=0.4)
        relevance = torch.rand(6, 7, 9, generator=g)
        available = torch.rand(6, 7, 9, generator=g) > 0.2
        out = TokenAllocator(cfg)(relevance, available)
        n = available.flatten(1).sum(1)
        k = expected_budget(cfg, n)
        p = expected_pooled(cfg, n, k)
        checked = 0
        for b in range(6):
            full = (out.lod[b] == 1)
            if full.sum() != k[b] - p[b]:
                continue  # blocks ran short and were topped up; covered by the top-up test
            rest = available[b] & ~full
            assert relevance[b][full].min() > relevance[b][rest].max()
            checked += 1
        assert checked >= 4

    def test_frames_are_independent(self):
        cfg = AttendingConfig(retention=0.4, pooled_share=0.3)
        alloc = TokenAllocator(cfg)
        relevance = torch.rand(2, 7, 9)
        available = torch.rand(2, 7, 9) > 0.2
        a = alloc(relevance, available)
        relevance2, available2 = relevance.clone(), available.clone()
        relevance2[1] = torch.rand(7, 9)
        available2[1] = True
        b = alloc(relevance2, available2)
        assert a.budget[1] != b.budget[1]
        for name in ("tokens", "lod", "soft"):
            assert torch.equal(getattr(a, name)[0], getattr(b, name)[0]), name
        assert torch.equal(a.budget[0], b.budget[0])
        k0 = int(a.budget[0])
        assert torch.equal(a.selected[0, :k0], b.selected[0, :k0])


class TestGradients:
    @pytest.mark.parametrize("curve", ["power", "exponential", "linear"])
    def test_soft_budget_reaches_every_parameter_and_the_relevance(self, curve):
        alloc = TokenAllocator(AttendingConfig(curve=curve, retention=0.3, soft_temperature=0.2))
        relevance = torch.rand(2, 7, 9, requires_grad=True)
        out = alloc(relevance)
        target = torch.rand(2, 7, 9, generator=torch.Generator().manual_seed(0))
        (out.soft * target).sum().backward()
        names = [name for name, _ in alloc.named_parameters()]
        assert names == (["offset"] if curve == "linear" else ["steepness_raw", "offset"])
        for name, p in alloc.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        assert relevance.grad.abs().sum() > 0 and torch.isfinite(relevance.grad).all()

    def test_soft_budget_shares_tokens_by_demand(self):
        # With every cell making the cut, the soft budget is the K tokens split in proportion
        # to the per-cell budget curve.
        alloc = TokenAllocator(AttendingConfig(retention=1.0, curve="power", steepness=2.0, min_budget=0.1))
        relevance = torch.rand(1, 4, 5)
        demand = (relevance ** 2).clamp(0.1, 1.0)
        soft = alloc(relevance).soft.detach()
        assert torch.allclose(soft, 20 * demand / demand.sum(), rtol=1e-3)

    def test_zero_relevance_has_finite_gradients(self):
        alloc = TokenAllocator(AttendingConfig(curve="power"))
        relevance = torch.zeros(1, 3, 3, requires_grad=True)
        (alloc(relevance).soft * torch.arange(9.0).view(1, 3, 3)).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in alloc.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype):
    cfg = AttendingConfig(retention=0.3, pooled_share=0.3)
    relevance = torch.rand(2, 7, 9)
    ref = TokenAllocator(cfg)(relevance.to(dtype).float())
    out = TokenAllocator(cfg)(relevance.to(dtype))
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.lod, ref.lod)
    assert out.soft.dtype == torch.promote_types(dtype, torch.float32)


def test_bad_inputs_are_named():
    alloc = TokenAllocator()
    with pytest.raises(ValueError, match=r"relevance must be \(B, gh, gw\)"):
        alloc(torch.rand(7, 9))
    with pytest.raises(ValueError, match="available must be a bool tensor"):
        alloc(torch.rand(1, 7, 9), torch.ones(1, 7, 9))


@pytest.mark.cuda
@cuda
def test_cpu_and_cuda_agree():
    cfg = AttendingConfig(retention=0.35, pooled_share=0.4, curve="exponential")
    alloc = TokenAllocator(cfg)
    relevance = torch.rand(4, 7, 9)
    available = torch.rand(4, 7, 9) > 0.2
    cpu = alloc(relevance, available)
    gpu = alloc.cuda()(relevance.cuda(), available.cuda())
    for name in ("tokens", "lod", "budget", "selected"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
    assert torch.allclose(cpu.soft, gpu.soft.cpu(), atol=1e-5)
