"""The VLM's language-model forward with fewer kernels per decoder layer (VLMConfig.fast_lm).

HF's Qwen2-VL-family decoder layer launches about 40 kernels besides its GEMMs: each RMSNorm is six
(cast to float32, square, mean, rsqrt, multiply, cast back) plus the weight's, rotary embedding is
applied to queries and keys apart (slice, negate, concatenate, two products and a sum each), and q, k
and v are three GEMMs. A pruned prefill of ~500 tokens, or a decode step, is short enough for
those small kernels to cost as much as the GEMMs' waves (benchmarks/profile_prefill.py measures it).

This forward runs the same modules' weights through the same operations, fewer and larger:
  - RMSNorm: torch's fused rms_norm, the weight product included (float32 inside, as HF's);
  - q, k and v: one GEMM over their concatenated weights (the Linears' weights become views of it,
    no second copy), rotary embedding on q and k at once, the rotate-half written as one flip of the
    halves against a sign-folded sine and one addcmul;
  - the MLP's gate and up: one GEMM the same way (twice the columns: at a pruned prefill's ~512
    rows a GEMM of 8960 columns, the 2B's, fills its last wave of tiles poorly; one launch less);
  - prefill attention: torch's sdpa with grouped KV heads, where HF's copies K and V per query head
    whenever a mask is given; decode steps through the interface HF's layer calls (sdpa, eager or
    ours, see decoding.sdpa_packed_gqa), on the same cache object;
  - cos/sin built once per forward by the model's own rotary module.
Outputs equal HF's in float32 up to rounding (tests compare both, cached and uncached); in bfloat16
the fused norm and addcmul round once where HF rounds twice (its speed: docs/performance.md).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from pipeline.vlm import hf, rope_kernel
from pipeline.vlm.decoding import PACKED_SDPA


def concat_weights(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum out, in) weight (and bias) for Linears that read the same input; each Linear's
    weight and bias become views of its rows, so the model holds one copy and state_dict() is as before.
    Linears already concatenated (a second VLM over the same model) keep theirs."""
    fused = getattr(linears[0], "_arr_coc_fused", None)
    if fused is not None:
        weight, bias = fused
        rows = [weight[start:] for start in _starts(linears)]
        if sum(m.out_features for m in linears) == weight.shape[0] and all(
                m.weight.data_ptr() == r.data_ptr() for m, r in zip(linears, rows)):
            return weight, bias
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        biases = [m.bias for m in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else weight.new_zeros(m.out_features) for m, b in zip(linears,
                                                                                                       biases)])
    for m, start in zip(linears, _starts(linears)):
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
    linears[0]._arr_coc_fused = (weight, bias)                              # found again by a second call
    return weight, bias


def _starts(linears: list[nn.Linear]) -> list[int]:
    out, start = [], 0
    for m in linears:
        out.append(start)
        start += m.out_features
    return out


def unsupported(lm: nn.Module) -> str | None:
    """Why this forward cannot run `lm` (None: it can): plain Linears with the q/k/v, o, gate/up/down
    layout of Qwen2-VL-family text models, RMSNorms with a weight, the M-RoPE rotary module."""
    rotary = getattr(lm, "rotary_emb", None)
    if rotary is None or not hasattr(lm, "layers") or not hasattr(lm, "norm"):
        return "not a Qwen2-VL-family text model (layers, norm, rotary_emb)"
    if _mrope_section(lm) is None:
        return "no mrope_section in the rotary module or the config"
    for layer in lm.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        modules = [getattr(owner, n, None) for owner, n in names]
        if any(type(m) is not nn.Linear or hasattr(m, "_hf_hook") for m in modules):
            return "a projection is not a plain nn.Linear (quantized, offloaded or adapted layers)"
        for norm in (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)):
            if getattr(norm, "weight", None) is None or _eps(norm) is None:
                return "a layer norm without weight or epsilon"
        if getattr(mlp, "act_fn", None) is None:
            return "an MLP without act_fn"
    return None


def _eps(norm: nn.Module) -> float | None:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


def _mrope_section(lm: nn.Module) -> list[int] | None:
    section = getattr(lm.rotary_emb, "mrope_section", None)
    if section is None:
        for name in ("rope_parameters", "rope_scaling"):
            params = getattr(lm.config, name, None) or {}
            section = params.get("mrope_section") if isinstance(params, dict) else None
            if section is not None:
                break
    return list(section) if section is not None else None


class _Layer:
    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.idx = getattr(attn, "layer_idx", None)
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.qkv_weight, self.qkv_bias = concat_weights([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_weight, self.gate_up_bias = concat_weights([mlp.gate_proj, mlp.up_proj])
        self.inter = mlp.gate_proj.out_features
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.in_eps, self.post_eps = _eps(self.in_norm), _eps(self.post_norm)
        self.scaling = getattr(attn, "scaling", self.head_dim ** -0.5)
        # Qwen3: an RMSNorm over each head's dims of q and of k, before the rotary embedding
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2 RMSNorm (x * rsqrt(mean(x^2) + eps) in float32, times the weight) as one fused
    kernel: HF rounds to x's dtype before the weight product, this once after it (the same in
    float32; at most a unit in the last place apart in bfloat16)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_deepstack(hidden: torch.Tensor, deepstack: torch.Tensor | None, layer: int) -> torch.Tensor:
    """hidden (B, L, D) after LM layer `layer`, plus DeepStack feature `layer` of deepstack (n, B, L, D)
    where there is one (layer < n). The features are zero outside the kept visual slots, where the
    sum is exact, so adding everywhere equals transformers' add at the visual positions only, with
    no mask or gather (a replayed graph takes the same shapes whatever is kept)."""
    if deepstack is None or layer >= deepstack.shape[0]:
        return hidden
    return hidden + deepstack[layer].to(hidden.dtype)


class FastTextModel:
    """The forward of a Qwen2-VL-family text model (VLM.lm_step): (B, L, D) embeddings, a mask (or
    None: causal), M-RoPE positions (3, B, L) and an optional cache with HF's update() -> (B, L, D)
    hidden states after the final norm."""

    def __init__(self, lm: nn.Module, attn_impl: str) -> None:
        reason = unsupported(lm)
        if reason is not None:
            raise ValueError(f"the fast LM forward cannot run this model: {reason}")
        self.lm = lm
        self.layers = [_Layer(layer) for layer in lm.layers]
        for i, layer in enumerate(self.layers):
            if layer.idx is None:
                layer.idx = i
        self.attn_impl = attn_impl
        self.sdpa = attn_impl in ("sdpa", PACKED_SDPA)                       # prefill attention through torch's sdpa
        self.mrope_section = _mrope_section(lm)
        self.attention = hf.attention_function(lm, attn_impl)
        self.final_eps = _eps(lm.norm)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (B, L, 1, hd) in x's dtype, sin with its first half negated (see _rope)."""
        cos, sin = self.lm.rotary_emb(x, positions)
        if cos.dim() == 4:                                                   # older transformers: (3, B, L, hd)
            section = self.mrope_section * 2                                 # each section from its axis
            cos, sin = (torch.cat([m[i % 3] for i, m in enumerate(t.split(section, dim=-1))], dim=-1)
                        for t in (cos, sin))
        return cos[:, :, None], rope_kernel.signed_sin(sin)[:, :, None]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """HF's x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): the same as
        x * cos + cat(x2, x1) * cat(-sin1, sin2), the halves swapped by one flip, the second
        product and the sum one addcmul (rounded once where HF rounds the product first)."""
        hd = x.shape[-1]
        swapped = x.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2)
        return torch.addcmul(x * cos, swapped, signed_sin)

    def _rotate(self, qkv: torch.Tensor, n: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of the first n heads of qkv (B, L, heads, hd) -> (B, L, n, hd): one Triton
        kernel where it runs (rope_kernel: float32 inside, rounded once), else _rope."""
        B, L, heads, hd = qkv.shape
        if rope_kernel.available(qkv) and qkv.is_contiguous():
            out = rope_kernel.apply(qkv.view(B * L, heads, hd)[:, :n], cos.reshape(B * L, hd),
                                    signed_sin.reshape(B * L, hd))
            if out is not None:
                return out.view(B, L, n, hd)
        return self._rope(qkv[:, :, :n], cos, signed_sin)

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache,
                 deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """deepstack (n, B, L, D) or None: Qwen3-VL's DeepStack features, feature i added to the
        hidden states after layer i (zeros at every slot that is not a kept visual token)."""
        cos, sin = self.rotary(embeds, positions)
        mask = self._causal(embeds, mask, cache)
        hidden = embeds
        for i, layer in enumerate(self.layers):
            hidden = self._layer(layer, hidden, mask, cos, sin, cache)
            hidden = add_deepstack(hidden, deepstack, i)
        return rms_norm(hidden, self.lm.norm.weight, self.final_eps)

    def attention_inputs(self, embeds: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
                         index: int, deepstack: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [0, index) over embeds as __call__ runs them (no cache), then the query and key
        states layer `index` attends with, rotary applied: q (B, H, L, hd), k (B, H_kv, L, hd).
        Its attention scores are softmax(q k^T * layers[index].scaling) (pipeline/vlm/passes.py
        reads them: no eager-attention model needed for attention weights)."""
        if not 0 <= index < len(self.layers):
            raise ValueError(f"Invalid layer index ({index}): this LM has layers 0..{len(self.layers) - 1}")
        cos, sin = self.rotary(embeds, positions)
        mask = self._causal(embeds, mask, None)
        hidden = embeds
        for i, layer in enumerate(self.layers[:index]):
            hidden = self._layer(layer, hidden, mask, cos, sin, None)
            hidden = add_deepstack(hidden, deepstack, i)               # layer index's input has index levels
        q, k, _ = self._qkv(self.layers[index], hidden, cos, sin)
        return q, k

    def _causal(self, embeds: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor | None:
        """The mask the layers take: as given, or for eager attention (which has no causal default)
        an additive causal one. A boolean mask for sdpa becomes additive here, once per forward:
        given a boolean one, sdpa converts it in every layer (a few elementwise kernels each), to
        the same values (0 where allowed, the
        dtype's minimum elsewhere: every row allows at least its own slot, so no row is all -inf)."""
        B, L, _ = embeds.shape
        if mask is not None and mask.dtype == torch.bool and self.sdpa:
            return torch.zeros(mask.shape, dtype=embeds.dtype, device=embeds.device).masked_fill_(
                ~mask, torch.finfo(embeds.dtype).min)
        if mask is None and self.attn_impl == "eager" and L > 1:
            K = L if cache is None else cache.visible
            keys = torch.arange(K, device=embeds.device)
            allowed = keys[None, :] <= torch.arange(K - L, K, device=embeds.device)[:, None]
            mask = torch.zeros((1, 1, L, K), dtype=embeds.dtype, device=embeds.device).masked_fill_(
                ~allowed, torch.finfo(embeds.dtype).min)
        return mask

    def _qkv(self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q (B, H, L, hd), k (B, H_kv, L, hd) rotated, v (B, H_kv, L, hd) of one layer."""
        B, L, _ = hidden.shape
        x = rms_norm(hidden, layer.in_norm.weight, layer.in_eps)
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias).view(B, L, -1, layer.head_dim)
        if layer.q_norm is not None:                                         # Qwen3: per-head q/k norms first
            qkv = torch.cat([rms_norm(qkv[:, :, :layer.heads], layer.q_norm.weight, _eps(layer.q_norm)),
                             rms_norm(qkv[:, :, layer.heads:layer.heads + layer.kv_heads], layer.k_norm.weight,
                                      _eps(layer.k_norm)),
                             qkv[:, :, layer.heads + layer.kv_heads:]], 2)   # (B, L, heads, hd)
        qk = self._rotate(qkv, layer.heads + layer.kv_heads, cos, sin)
        q = qk[:, :, :layer.heads].transpose(1, 2)                           # (B, H, L, hd)
        k = qk[:, :, layer.heads:].transpose(1, 2)                           # (B, H_kv, L, hd)
        v = qkv[:, :, layer.heads + layer.kv_heads:].transpose(1, 2)
        return q, k, v

    def _layer(self, layer: _Layer, hidden: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, cache) -> torch.Tensor:
        B, L, _ = hidden.shape
        attn, mlp = layer.attn, layer.mlp
        q, k, v = self._qkv(layer, hidden, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, layer.idx)
        if L > 1 and self.sdpa:
            # sdpa with grouped KV heads itself: HF's repeats K and V per query head whenever a
            # mask is given. No mask: causal, as HF's (queries and keys the same slots [0, L))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                 scale=layer.scaling, enable_gqa=True).transpose(1, 2)
        else:
            out, _ = self.attention(attn, q, k, v, mask, dropout=0.0, scaling=layer.scaling, sliding_window=None)
        hidden = hidden + attn.o_proj(out.reshape(B, L, -1))
        x = rms_norm(hidden, layer.post_norm.weight, layer.post_eps)
        gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)         # (B, L, 2 * inter)
        return hidden + mlp.down_proj(mlp.act_fn(gate_up[..., :layer.inter]) * gate_up[..., layer.inter:])
