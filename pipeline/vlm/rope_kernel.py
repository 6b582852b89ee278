"""Rotary embedding of q and k as one Triton kernel (CUDA), for the LM (text_model) and the vision
tower (vision_blocks).

out = x * cos + swap(x) * signed_sin, where swap exchanges the two halves of the head and
signed_sin is sin with its first half negated: HF's x * cos + rotate_half(x) * sin. In PyTorch
that is three kernels over q and k (a product, the swap, an addcmul) plus HF's dtype casts; each
reads and writes the whole tensor. This kernel reads each head once, computes in float32 and writes
the result once in x's dtype (benchmarks/profile_vision.py times both).

Used where it can run: a CUDA tensor, Triton importable, no autograd graph being recorded through
x (the kernel has no backward: train_vlm's gradients go through the PyTorch path), and the layouts
below; elsewhere callers keep their PyTorch form. `apply` returns None when it cannot run, also
when Triton fails to build or launch the kernel (it compiles on first use and needs a C compiler
and a GPU it supports): it warns once and is not tried again.
"""
from __future__ import annotations

import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                                          # CPU wheels ship no Triton
    triton = None

ROWS = 16             # heads per program


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


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with the first half of its last dim negated: rotate_half(x) * sin = swap(x) * signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


_failed: str | None = None      # why the kernel could not be built or launched: then never tried again


def available(x: torch.Tensor) -> bool:
    return (triton is not None and _failed is None and x.is_cuda
            and not (torch.is_grad_enabled() and x.requires_grad))


def _launch(x, cos, signed_sin, out, n_rows, rows_per_pos, x_pos_stride, cs_pos_stride, half, hd, BLOCK) -> None:
    _rope[(triton.cdiv(n_rows, ROWS),)](x, cos, signed_sin, out, n_rows, rows_per_pos, x_pos_stride, cs_pos_stride,
                                        half, hd, ROWS=ROWS, BLOCK=BLOCK)


def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor | None:
    """x (P, R, hd): R heads at each of P positions, heads contiguous (stride hd, last dim 1), any
    stride between positions; cos and signed_sin (P, hd), last dim contiguous -> (P, R, hd) in x's
    dtype, contiguous. None where the kernel cannot run (see the module doc)."""
    P, R, hd = x.shape
    if (not available(x) or hd % 2 or x.stride(2) != 1 or x.stride(1) != hd or cos.shape != (P, hd)
            or signed_sin.shape != (P, hd) or cos.stride() != signed_sin.stride() or cos.stride(1) != 1):
        return None
    out = torch.empty((P, R, hd), dtype=x.dtype, device=x.device)
    n_rows = P * R
    if n_rows:
        half = hd // 2
        try:
            _launch(x, cos, signed_sin, out, n_rows, R, x.stride(0), cos.stride(0), half, hd,
                    BLOCK=triton.next_power_of_2(half))
        except Exception as e:  # noqa: BLE001 - Triton builds on first use: no C compiler, an unsupported GPU...
            global _failed
            _failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"the Triton rotary kernel cannot run here ({_failed}); using the PyTorch form",
                          RuntimeWarning, stacklevel=2)
            return None
    return out
