"""pipeline.vlm.rope_kernel: the Triton rotary kernel (CUDA) against the PyTorch forms it replaces,
in the layouts the LM (heads of a fused qkv at each position) and the vision tower use."""
import pytest
import torch

from pipeline.vlm import rope_kernel
from pipeline.vlm.text_model import FastTextModel
from pipeline.vlm.vision_blocks import rotate_qk

def signed(sin):
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def reference(x, cos, ssin):
    """x * cos + swap(x) * signed sin in float64."""
    x, cos, ssin = x.double(), cos.double(), ssin.double()
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], -1)
    return x * cos + swapped * ssin


def test_cpu_and_autograd_keep_the_pytorch_form():
    x = torch.randn(5, 4, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    assert not rope_kernel.available(x) and rope_kernel.apply(x, cos, sin) is None
    qkv = torch.randn(5, 3, 2, 8)
    q, k = rotate_qk(qkv, cos, sin)                                          # the PyTorch form
    assert q.shape == k.shape == (5, 2, 8)


def test_a_kernel_that_cannot_build_falls_back_once(monkeypatch):
    """Triton compiles on first use (a C compiler, a supported GPU): when that fails, apply warns once,
    returns None (callers keep their PyTorch form) and is not tried again."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
    fake_triton = type("T", (), {"next_power_of_2": staticmethod(lambda n: n)})
    monkeypatch.setattr(rope_kernel, "triton", rope_kernel.triton or fake_triton)
    monkeypatch.setattr(rope_kernel, "_failed", None)
    monkeypatch.setattr(rope_kernel, "_launch", broken)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x, cos = torch.randn(4, 3, 8), torch.randn(4, 8)
    with pytest.warns(RuntimeWarning, match="cannot run here .*C compiler"):
        assert rope_kernel.apply(x, cos, cos) is None
    assert rope_kernel.apply(x, cos, cos) is None and len(calls) == 1
    assert not rope_kernel.available(x)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [80, 16, 128])
def test_vision_layout_equals_pytorch(dtype, hd):
    g = torch.Generator(device="cuda").manual_seed(hd)
    N, H = 1001, 3
    qkv = torch.randn(N, 3, H, hd, device="cuda", generator=g).to(dtype)
    angles = torch.randn(N, hd // 2, device="cuda", generator=g) * 20
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos(), emb.sin()                                           # float32, as HF's tower
    with torch.no_grad():
        got = rotate_qk(qkv, cos, sin)                                       # the kernel
        out = rope_kernel.apply(qkv.view(N, 3 * H, hd)[:, :2 * H], cos, signed(sin))
        assert out is not None and out.is_contiguous()
    want = reference(qkv[:, :2], cos[:, None, None], signed(sin)[:, None, None])
    for i, a in enumerate(got):
        assert a.dtype == dtype and a.shape == (N, H, hd)
        exact = want[:, i].to(dtype)
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(a, exact, atol=tol, rtol=tol)
        if dtype == torch.bfloat16:          # float32 inside, so one rounding of the exact value
            assert (a == exact).float().mean() > 0.99


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,L", [(1, 450), (3, 1), (2, 37)])
def test_lm_layout_equals_pytorch(B, L):
    """Heads of a fused (B, L, H + 2 H_kv, hd) qkv, bf16 cos and sin as the LM's rotary gives them:
    the kernel against FastTextModel._rope (which rounds its first product to bf16, the kernel
    does not)."""
    g = torch.Generator(device="cuda").manual_seed(L)
    H, Hkv, hd = 7, 1, 128
    qkv = torch.randn(B, L, H + 2 * Hkv, hd, device="cuda", generator=g).bfloat16()
    angles = torch.randn(B, L, hd // 2, device="cuda", generator=g) * 20
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().bfloat16()[:, :, None], signed(emb.sin()).bfloat16()[:, :, None]
    with torch.no_grad():
        out = rope_kernel.apply(qkv.view(B * L, H + 2 * Hkv, hd)[:, :H + Hkv], cos.reshape(B * L, hd),
                                sin.reshape(B * L, hd))
    assert out is not None
    out = out.view(B, L, H + Hkv, hd)
    torch_form = FastTextModel._rope(qkv[:, :, :H + Hkv], cos, sin)
    exact = reference(qkv[:, :, :H + Hkv], cos, sin)
    torch.testing.assert_close(out, exact.bfloat16(), atol=2 ** -7, rtol=2 ** -7)
    assert (out == exact.bfloat16()).float().mean() > 0.99
    torch.testing.assert_close(out, torch_form, atol=2 ** -6, rtol=2 ** -6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layouts_it_cannot_take_return_none():
    x = torch.randn(4, 3, 10, device="cuda")
    cos = torch.randn(4, 10, device="cuda")
    assert rope_kernel.apply(x[:, :, :9], cos[:, :9], cos[:, :9]) is None   # odd head dim
    assert rope_kernel.apply(x.transpose(0, 1), cos[:3], cos[:3]) is None   # heads not contiguous
    assert rope_kernel.apply(x, cos.t().contiguous().t(), cos) is None      # cos columns strided
    x.requires_grad_(True)
    assert rope_kernel.apply(x, cos, cos) is None                           # autograd: the PyTorch form
    with torch.no_grad():
        assert rope_kernel.apply(x, cos, cos) is not None
