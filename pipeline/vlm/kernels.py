"""Triton kernels (CUDA) for the element-wise work between the VLM's GEMMs, where PyTorch launches
several kernels that each read and write whole tensors:

  - rope: rotary embedding of q and k, out = x * cos + swap(x) * signed_sin (swap exchanges the two
    halves of the head; signed_sin is sin with its first half negated), HF's x * cos +
    rotate_half(x) * sin. PyTorch: a product, the swap, an addcmul, plus HF's dtype casts (H100,
    Qwen2-VL-2B's vision tower, 16384 patches: 0.49 ms a layer in PyTorch, 0.14 ms here). Used by
    the LM (text_model) and the vision tower (vision_blocks).
  - silu_mul: the gated MLP's act(gate) * up for SiLU, one kernel instead of two.
  - add_rms_norm: the residual sum and the next RMSNorm in one pass, writing both (PyTorch: an add,
    then the norm reading the sum back).
Each computes in float32 and rounds once to the input dtype (PyTorch rounds after every op; the
results agree to that rounding: tests on CUDA).

Each entry point returns None where its kernel cannot run, and callers keep their PyTorch form: no
CUDA tensor, no Triton (CPU wheels ship none), an autograd graph being recorded through the
inputs (the kernels have no backward: train_vlm's gradients go through PyTorch), a layout the
kernel does not take, or Triton failing to build or launch it (it compiles on first use and needs
a C compiler and a GPU it supports): then it warns once and is not tried again.
"""
from __future__ import annotations

import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                                          # CPU wheels ship no Triton
    triton = None

ROWS = 16             # rope: heads per program

_failed: str | None = None      # why a kernel could not be built or launched: then none is tried again


if triton is not None:
    @triton.jit
    def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, rows_per_pos, x_pos_stride, cs_pos_stride,
              half, hd, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                 # (ROWS,) head rows
        cols = tl.arange(0, BLOCK)                                           # (BLOCK,) within a half
        mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
        pos = (rows // rows_per_pos).to(tl.int64)
        head = (rows % rows_per_pos).to(tl.int64)
        src = x_ptr + (pos * x_pos_stride + head * hd)[:, None] + cols[None, :]
        cs = (pos * cs_pos_stride)[:, None] + cols[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + half, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + half, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + (rows.to(tl.int64) * hd)[:, None] + cols[None, :]
        tl.store(dst, (x1 * c1 + x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, D, eps, HAS_DELTA: tl.constexpr,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        h = tl.load(h_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            h += tl.load(d_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            h = h.to(sum_ptr.dtype.element_ty)                               # the sum, rounded as stored
            tl.store(sum_ptr + row * D + cols, h, mask=mask)
            h = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * D + cols, (h * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def available(*tensors: torch.Tensor) -> bool:
    return (triton is not None and _failed is None and all(t.is_cuda for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _run(kernel, grid: tuple[int, ...], *args, **meta) -> bool:
    """Launch; False (and the kernels off from then on, with one warning) where Triton cannot."""
    global _failed
    try:
        kernel[grid](*args, **meta)
        return True
    except Exception as e:  # noqa: BLE001 - Triton builds on first use: no C compiler, an unsupported GPU...
        _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"the Triton kernels cannot run here ({_failed}); using the PyTorch forms",
                      RuntimeWarning, stacklevel=3)
        return False


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor | None:
    """x (P, R, hd): R heads at each of P positions, heads contiguous (stride hd, last dim 1), any
    stride between positions; cos and signed_sin (P, hd), last dim contiguous -> (P, R, hd) in x's
    dtype, contiguous; None where the kernel cannot run."""
    P, R, hd = x.shape
    if (not available(x) or hd % 2 or x.stride(2) != 1 or x.stride(1) != hd or cos.shape != (P, hd)
            or signed_sin.shape != (P, hd) or cos.stride() != signed_sin.stride() or cos.stride(1) != 1):
        return None
    out = torch.empty((P, R, hd), dtype=x.dtype, device=x.device)
    n_rows, half = P * R, hd // 2
    if n_rows and not _run(_rope, (triton.cdiv(n_rows, ROWS),), x, cos, signed_sin, out, n_rows, R, x.stride(0),
                           cos.stride(0), half, hd, ROWS=ROWS, BLOCK=triton.next_power_of_2(half)):
        return None
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for two contiguous tensors of one shape and dtype; None where the kernel
    cannot run."""
    if (not available(gate, up) or gate.shape != up.shape or gate.dtype != up.dtype
            or not gate.is_contiguous() or not up.is_contiguous()):
        return None
    out = torch.empty_like(gate)
    n, block = gate.numel(), 2048
    if n and not _run(_silu_mul, (triton.cdiv(n, block),), gate, up, out, n, BLOCK=block):
        return None
    return out


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden + delta, RMSNorm(hidden + delta) * weight) over the last dim, the norm taken of the sum
    as rounded to hidden's dtype (as PyTorch's add then norm); delta None: (hidden, its norm).
    Contiguous (..., D) tensors of one dtype, weight (D,); None where the kernel cannot run."""
    D = hidden.shape[-1]
    tensors = [hidden, weight] + ([delta] if delta is not None else [])
    if (not available(*tensors) or weight.shape != (D,) or not all(t.is_contiguous() for t in tensors)
            or (delta is not None and (delta.shape != hidden.shape or delta.dtype != hidden.dtype))
            or D > 16384):
        return None
    total = torch.empty_like(hidden) if delta is not None else hidden
    out = torch.empty_like(hidden)
    rows = hidden.numel() // D if D else 0
    block = triton.next_power_of_2(D)
    if rows and not _run(_add_rms_norm, (rows,), hidden, hidden if delta is None else delta, weight, total, out,
                         D, eps, HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(4, block // 512))):
        return None
    return total, out
