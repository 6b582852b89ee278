"""The vision tower's blocks with less memory traffic between their GEMMs (VLMConfig.fast_vision).

Profiled (benchmarks/profile_vision.py; figures in docs/performance.md), HF's vision blocks spent
more time outside their GEMMs than in them:
  - rotary embedding: HF casts q and k to float32 and rotates each apart (two products, a slice,
    a negation, a concatenation and a sum per tensor, then casts back);
  - QuickGELU (Qwen2-VL): x * sigmoid(1.702 x) is three kernels over the (patches, 5120) activation;
  - Qwen2.5-VL's MLP width, 3420, is not a multiple of 8: rows of 6840 bytes cannot be read by
    TMA-based GEMM kernels, so cuBLAS fell back to an older kernel for all three MLP GEMMs; its
    RMSNorms are six kernels each.

What this does instead, same modules, same weights, same results up to rounding:
  - rotary on q and k at once, straight from the fused qkv output, in float32 as HF's (bfloat16
    q/k times float32 cos/sin) and rounded to the input dtype once, but without HF's float32 copies
    and concatenations (rotate_qk);
  - QuickGELU through silu: x * sigmoid(1.702 x) = silu(1.702 x) / 1.702, the 1.702 folded into fc1
    (the GEMM's alpha, the bias scaled once) and the 1 / 1.702 into fc2's alpha: one kernel;
  - an MLP width that is not a multiple of 8 padded with zero rows (gate, up) and zero columns
    (down): the padded units compute act(0) * 0 = 0 and add nothing. gate and up become views of
    their padded weights (no second copy); down's padded weight is a copy (Qwen2.5-VL-7B: 8.8 MB a
    block, 280 MB in all);
  - RMSNorm: torch's fused rms_norm (as pipeline.vlm.text_model);
  - the patch embedding, a Conv3d whose kernel is its stride over rows that are whole patches, as
    the GEMM it is (rows x weight viewed (D, C tp p p)): cuDNN ran it as a much slower
    implicit-GEMM convolution.
Qwen3-VL's blocks (LayerNorm, a tanh-GELU fc MLP named linear_fc1 / linear_fc2) take the same
forward: there the joint rotary replaces HF's float32 rotation, which on a kept-cells call of the 2B
tower (736 cells) was 2.4 of its 7.7 ms (benchmarks/profile_ttft.py).
Blocks of other layouts keep HF's forward; so does training.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.vlm import hf, rope_kernel
from pipeline.vlm.text_model import _eps, rms_norm

QUICK_GELU = 1.702    # QuickGELU(x) = x * sigmoid(1.702 x)
ALIGN = 8             # 16 bytes of bf16/fp16: GEMM rows a multiple of this reach the sm90 kernels
# an fc MLP's (first linear, second linear, activation): Qwen2-VL's, Qwen3-VL's
FC_MLP_NAMES = (("fc1", "fc2", "act"), ("linear_fc1", "linear_fc2", "act_fn"))


def patch_vision_blocks(visual: nn.Module) -> int:
    """Give each vision block of `visual` the faster forward (see the module doc) and its attention
    the joint rotary; returns how many blocks were patched. Patching a block twice does nothing."""
    _patch_embedding(getattr(visual, "patch_embed", None))
    count = 0
    for block in getattr(visual, "blocks", []):
        if getattr(block, "_arr_coc_fast", False):
            count += 1
            continue
        parts = _parts(block)
        if parts is None:
            continue
        block.forward = _block_forward(block, block.forward, *parts)
        block.attn._arr_coc_fast_rotary = True
        block._arr_coc_fast = True
        count += 1
    return count


def _patch_embedding(embed: nn.Module | None) -> None:
    """The patch embedding's forward as one GEMM (see the module doc), where it is HF's PatchEmbed:
    a Conv3d with kernel = stride and no padding over rows of exactly one kernel's values."""
    proj = getattr(embed, "proj", None)
    if (getattr(embed, "_arr_coc_fast", False) or not isinstance(proj, nn.Conv3d)
            or tuple(proj.kernel_size) != tuple(proj.stride) or any(proj.padding) or proj.groups != 1):
        return
    hf_forward = embed.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if embed.training:
            return hf_forward(hidden_states)
        weight = proj.weight                                                 # (D, C, tp, p, p)
        rows = hidden_states.to(weight.dtype).reshape(-1, weight[0].numel())
        return F.linear(rows, weight.view(weight.shape[0], -1), proj.bias)
    embed.forward = forward
    embed._arr_coc_fast = True


def rotate_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv (N, 3, H, hd), cos and sin (N, hd) -> rotated q and k, (N, H, hd) each in qkv's dtype:
    HF's apply_rotary_pos_emb_vision (q * cos + rotate_half(q) * sin, in float32 when cos and sin
    are, then cast back) on q and k together: on CUDA one Triton kernel (rope_kernel), else four
    kernels where HF launches about sixteen: per half of the head one product and one addcmul
    written straight into the output's dtype (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2), no float32
    copy of q and k, no concatenation (99.998% of values bit-equal to HF's, the rest one rounding
    apart)."""
    N, _, H, hd = qkv.shape
    half = hd // 2
    if rope_kernel.available(qkv) and qkv.is_contiguous():                   # one Triton kernel
        out = rope_kernel.apply(qkv.view(N, 3 * H, hd)[:, :2 * H], cos, rope_kernel.signed_sin(sin))
        if out is not None:
            out = out.view(N, 2, H, hd)
            return out[:, 0], out[:, 1]
    x = qkv[:, :2]
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = (t[:, None, None] for t in (cos[:, :half], cos[:, half:], sin[:, :half], sin[:, half:]))
    if torch.is_grad_enabled() and qkv.requires_grad:                        # out= records no gradient
        out = torch.cat([torch.addcmul(x1 * c1, x2, -s1), torch.addcmul(x2 * c2, x1, s2)], dim=-1).to(x.dtype)
        return out[:, 0], out[:, 1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.addcmul(x1 * c1, x2, -s1, out=out[..., :half])
    torch.addcmul(x2 * c2, x1, s2, out=out[..., half:])
    return out[:, 0], out[:, 1]


def _norm(module: nn.Module):
    if type(module) is nn.LayerNorm:
        return module                                            # already one fused kernel
    weight, eps = getattr(module, "weight", None), _eps(module)
    if hf.is_rms_norm(module) and weight is not None and eps is not None:
        return lambda x: rms_norm(x, weight, eps)
    return None


def _plain(*modules: nn.Module) -> bool:
    return all(type(m) is nn.Linear and not hasattr(m, "_hf_hook") for m in modules)


def _parts(block: nn.Module):
    """(norm1, norm2, mlp) as callables for a block this forward knows, else None."""
    norms = [_norm(getattr(block, n, None)) for n in ("norm1", "norm2")]
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if None in norms or attn is None or mlp is None or not hasattr(attn, "qkv"):
        return None
    for names in FC_MLP_NAMES:
        if all(hasattr(mlp, n) for n in names) and _plain(*(getattr(mlp, n) for n in names[:2])):
            return (*norms, _fc_mlp(*(getattr(mlp, n) for n in names)))
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) and \
            _plain(mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        return (*norms, _gated_mlp(mlp))
    return None


def _fc_mlp(fc1: nn.Linear, fc2: nn.Linear, act: nn.Module):
    if not hf.is_quick_gelu(act) or fc1.bias is None or fc2.bias is None:
        return lambda x: fc2(act(fc1(x)))
    with torch.no_grad():
        bias1 = fc1.bias * QUICK_GELU                            # alpha scales the product, not the bias

    def quick_gelu_mlp(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return fc2(act(fc1(x)))
        y = F.silu(torch.addmm(bias1, x, fc1.weight.t(), alpha=QUICK_GELU))
        return torch.addmm(fc2.bias, y, fc2.weight.t(), alpha=1.0 / QUICK_GELU)
    return quick_gelu_mlp


def _gated_mlp(mlp: nn.Module):
    gate, up, down, act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
    down_weight = down.weight
    pad = -gate.out_features % ALIGN
    if pad:
        for m in (gate, up):
            _pad_rows(m, pad)
        with torch.no_grad():
            down_weight = F.pad(down.weight, (0, pad))           # zero columns: a copy

    def gated_mlp(x: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, *_padded(gate)), F.linear(x, *_padded(up))
        return F.linear(act(g) * u, down_weight, down.bias)
    return gated_mlp


def _pad_rows(linear: nn.Linear, pad: int) -> None:
    """linear's weight (and bias) become views of the first rows of zero-padded ones (kept as
    `_arr_coc_padded`), so the padded GEMM reads the same memory."""
    with torch.no_grad():
        weight = F.pad(linear.weight, (0, 0, 0, pad))
        bias = None if linear.bias is None else F.pad(linear.bias, (0, pad))
    rows = linear.out_features
    linear.weight = nn.Parameter(weight[:rows], requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias[:rows], requires_grad=False)
    linear._arr_coc_padded = (weight, bias)


def _padded(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return getattr(linear, "_arr_coc_padded", (linear.weight, linear.bias))


def _block_forward(block: nn.Module, original, norm1, norm2, mlp):
    def forward(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if block.training or args:
            return original(hidden_states, cu_seqlens, *args, **kwargs)
        hidden_states = hidden_states + block.attn(norm1(hidden_states), cu_seqlens=cu_seqlens, **kwargs)
        return hidden_states + mlp(norm2(hidden_states))
    return forward
