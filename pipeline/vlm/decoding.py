"""The VLM's language-model decoding machinery: a static KV cache, fixed-shape decode steps and
short prefills replayed as CUDA graphs, sampling, and the packed-GQA sdpa used for decode steps.

`StaticDecoder` and `PrefillGraph` work for a `pipeline.vlm.model.VLM` (its LM, dtype, device,
counters and mask builder); the VLM chooses shapes and keeps decoders (see VLM._decoder).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from pipeline.cudagraph import CAPTURE_LOCK, capture

if TYPE_CHECKING:
    from pipeline.vlm.model import VLM

MAX_PREFILL_GRAPHS = 8    # prefill graphs (one per padded prefix length) kept per decoder: with one
                          # max_new_tokens at most CACHE_BUCKET / PREFILL_BUCKET = 4 lengths share a decoder
PACKED_SDPA = "arr_coc_sdpa"          # sdpa, with GQA decode steps packed per KV head (sdpa_packed_gqa)


def sdpa_packed_gqa(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention, except for one query token against a masked static cache with grouped
    KV heads: there each KV head attends with its group of query heads side by side, where HF's
    sdpa (before transformers 5.2x) copies every cached key and value once per query head
    (repeat_kv), which for a long cache costs more memory traffic than the layer's weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    B, H, q_len, d = query.shape
    if q_len != 1 or groups == 1 or attention_mask is None or attention_mask.shape[1] != 1 or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    packed = query.reshape(B, H // groups, groups, d)                          # (B, H_kv, groups, d)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                           scale=kwargs.get("scaling"))
    return out.reshape(B, 1, H, d), None                                       # (B, q, H, d) like sdpa's


def register_packed_sdpa() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(PACKED_SDPA, sdpa_packed_gqa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)                  # masks exactly as for sdpa


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """logits (B, V) -> (B,) ids: argmax at temperature 0, else nucleus sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    outside = sorted_p.cumsum(-1) - sorted_p > top_p                         # tokens past the nucleus
    sorted_p = sorted_p.masked_fill(outside, 0)
    choice = torch.multinomial(sorted_p, 1, generator=generator)              # renormalises internally
    return order.gather(-1, choice).squeeze(-1)


class StaticKVCache:
    """Preallocated keys and values per LM layer, (B, H_kv, Lmax, hd) each, written in place.

    It implements the one cache method the Qwen2-VL-family attention layers call, update(), so it
    fits every transformers version alike (StaticCache's constructor and position handling differ
    between them); the attention masks come prebuilt, so nothing asks the cache for its length.
    """

    def __init__(self, lm, batch: int, length: int, dtype: torch.dtype, device: torch.device) -> None:
        attn = lm.layers[0].self_attn
        shape = (batch, attn.k_proj.out_features // attn.head_dim, length, attn.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in lm.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in lm.layers]
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        self.visible = length

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def rows(self, n: int) -> StaticKVCache:
        """The first n rows, in the same memory (a prefill of fewer rows than the decoder has)."""
        if n == self.keys[0].shape[0]:
            return self
        view = copy.copy(self)                                               # own slots / visible
        view.keys, view.values = [k[:n] for k in self.keys], [v[:n] for v in self.values]
        return view

    def at(self, slots: torch.Tensor, visible: int) -> None:
        """The next forward's tokens go to `slots` (n,); attention sees slots [0, visible)."""
        self.slots, self.visible = slots, visible

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)                          # (B, H_kv, n, hd) in
        values.index_copy_(2, self.slots, value_states)
        return keys[:, :, :self.visible], values[:, :, :self.visible]


class StaticDecoder:
    """Prefill into a static cache of (R, Lmax) slots, then fixed-shape decode steps.

    A step's inputs live in buffers the step reads and advances on the device (the cache slot of
    the token fed back, its M-RoPE position), so a step needs no host values and no host sync:
    on CUDA it is captured once as a graph and replayed, one launch per token instead of hundreds.
    R is a batch bucket: a batch of B <= R requests uses rows [0, B); the other rows decode pad
    tokens that attend only to themselves (their slots from the prefix length on), so they stay
    finite and, every op being per row, never reach a real row.
    """

    def __init__(self, vlm: VLM, rows: int, length: int) -> None:
        self.vlm, self.rows, self.length = vlm, rows, length
        self.batch = rows                                                    # real rows of this call (start())
        device = vlm.device
        self.cache = StaticKVCache(vlm._lm, rows, length, vlm.dtype, device)
        self.token = torch.full((rows,), vlm.pad_token_id, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)        # where the fed token goes
        self.rope_offset = torch.zeros(rows, dtype=torch.long, device=device)  # M-RoPE position - slot
        self.pad = torch.zeros(rows, dtype=torch.long, device=device)       # first real slot per row
        self.key_slots = torch.arange(length, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None                             # the graph's output
        # prefill graphs by padded prefix length: they write this decoder's cache, so they live
        # and die with it; least recently used first
        self.prefill_graphs: OrderedDict[int, PrefillGraph] = OrderedDict()

    @property
    def nbytes(self) -> int:
        """Memory kv_cache_budget counts: the cache and the prefill graphs' static buffers."""
        return self.cache.nbytes + sum(g.nbytes for g in self.prefill_graphs.values())

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, pads: list[int], pool=None) -> torch.Tensor:
        """embeds (B, L, D), positions (3, B, L), left pads per row -> (B, V) float32 logits of the
        token after the last one; fills slots [0, L) of cache rows [0, B). With a CUDA graph pool
        (then B is all the decoder's rows), a graph per L (captured the first time) replays it, and
        the logits are its output buffer."""
        vlm, (B, L) = self.vlm, embeds.shape[:2]
        if pool is None:
            # unpadded under sdpa: no mask, so its causal kernel
            pad = torch.tensor(pads, device=vlm.device) if any(pads) or vlm._attn_impl == "eager" else None
            return self.prefill_forward(embeds, positions, torch.arange(L, device=vlm.device), pad)
        if B != self.rows:
            raise ValueError(f"a replayed prefill fills every row of the decoder ({self.rows}), got {B} rows")
        graph = self.prefill_graphs.pop(L, None)
        if graph is None:
            if len(self.prefill_graphs) >= MAX_PREFILL_GRAPHS:
                self.prefill_graphs.popitem(last=False)
            vlm._make_room(PrefillGraph.buffer_bytes(embeds, positions, vlm.model.lm_head.out_features), keep=self)
            graph = PrefillGraph(self, embeds, positions, pool)
        self.prefill_graphs[L] = graph                                       # most recently used last
        return graph(embeds, positions, pads)

    def prefill_forward(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        pad: torch.Tensor | None) -> torch.Tensor:
        """The prefill itself, eager or under capture: embeds (B, L, D), positions (3, B, L), slots
        (L,) = arange(L), pad (B,) first real slot per row (None: no padding) -> (B, V) float32
        logits at the last position. Everything stays on the device (no host values)."""
        vlm, L = self.vlm, embeds.shape[1]
        cache = self.cache.rows(embeds.shape[0])                             # (B, H_kv, Lmax, hd) per layer
        cache.at(slots, L)
        allowed = None
        if pad is not None:
            allowed = (slots[:, None] >= slots) & (slots >= pad[:, None, None])  # (B, L, L) causal, real keys
            # a padded query row would have nothing to attend to, and a fully masked softmax row is
            # NaN, which the attention weights 0 * NaN would carry into every real row
            allowed = (allowed | torch.eye(L, dtype=torch.bool, device=vlm.device))[:, None]
        hidden = vlm._lm_step(embeds, vlm._masks(allowed), positions, cache)  # (B, L, D)
        return vlm.model.lm_head(hidden[:, -1]).float()                     # (B, V)

    def start(self, next_position: torch.Tensor, pads: list[int], prefix_len: int) -> None:
        """Decoding continues at slot prefix_len with M-RoPE positions next_position (B,) onward for
        rows [0, B) (pads: their left padding); the other rows feed pad tokens that see only their
        own slots from prefix_len on."""
        B = self.batch = next_position.shape[0]
        self.slot.fill_(prefix_len)
        self.token.fill_(self.vlm.pad_token_id)
        self.rope_offset.zero_()
        self.rope_offset[:B].copy_(next_position - prefix_len)
        self.pad.copy_(torch.tensor(list(pads[:B]) + [prefix_len] * (self.rows - B)))
        self.cache.at(self.slot, self.length)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed token (B,) -> (B, V) float32 logits of the next one (a graph's: valid until the next step)."""
        self.token[:self.batch].copy_(token)
        if self.graph is None:
            return self._forward()[:self.batch]
        self.graph.replay()
        return self.logits[:self.batch]

    def _forward(self) -> torch.Tensor:
        vlm = self.vlm
        embeds = vlm._lm.embed_tokens(self.token)[:, None]                   # (R, 1, D)
        allowed = (self.key_slots >= self.pad[:, None]) & (self.key_slots <= self.slot)  # (R, Lmax)
        positions = (self.rope_offset + self.slot).view(1, -1, 1).expand(3, -1, 1)     # (3, R, 1)
        hidden = vlm._lm_step(embeds, vlm._masks(allowed[:, None, None]), positions, self.cache)
        logits = vlm.model.lm_head(hidden[:, -1]).float()                    # (R, V)
        self.slot.add_(1)
        return logits

    def capture(self, pool) -> None:
        """Record one step as a CUDA graph (the buffers' values now do not matter: start() resets them)."""
        self.cache.at(self.slot, self.length)
        self.graph, self.logits = capture(self._forward, torch.cuda.Stream(self.vlm.device), pool)
        self.vlm.counters["decode_graphs"] += 1


class PrefillGraph:
    """A decoder's prefill at one padded prefix length L, captured as a CUDA graph.

    Each call copies its inputs into static buffers (the embeds, the M-RoPE positions and the
    per-row left padding, from which the graph builds its own mask) and replays: the graph writes
    cache slots [0, L) of its decoder and the (B, V) logits buffer, which stays valid until the VLM
    replays a graph again (all its graphs share one memory pool, so a later replay may reuse it).
    """

    def __init__(self, decoder: StaticDecoder, embeds: torch.Tensor, positions: torch.Tensor, pool) -> None:
        device = decoder.vlm.device
        self.decoder, self.pool = decoder, pool
        self.embeds = torch.empty_like(embeds)                               # (B, L, D)
        self.positions = torch.empty_like(positions)                         # (3, B, L)
        self.pad = torch.zeros(embeds.shape[0], dtype=torch.long, device=device)  # (B,)
        self.slots = torch.arange(embeds.shape[1], device=device)            # (L,)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None                              # (B, V), the graph's output
        self.nbytes = self.buffer_bytes(embeds, positions, decoder.vlm.model.lm_head.out_features)

    @staticmethod
    def buffer_bytes(embeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> int:
        """Bytes of a graph's static inputs (embeds, positions, pad, slots) and (B, V) float32 logits."""
        (B, L), long = embeds.shape[:2], torch.long.itemsize
        return embeds.nbytes + positions.nbytes + (B + L) * long + B * vocab * 4

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, pads: list[int]) -> torch.Tensor:
        self.embeds.copy_(embeds)
        self.positions.copy_(positions)
        # from page-locked memory the copy is queued like a kernel, with no wait for the GPU
        with CAPTURE_LOCK:  # a page-locked allocation: not while another thread captures
            pads = torch.tensor(pads).pin_memory()
        self.pad.copy_(pads, non_blocking=True)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _forward(self) -> torch.Tensor:
        return self.decoder.prefill_forward(self.embeds, self.positions, self.slots, self.pad)

    def _capture(self) -> None:
        self.graph, self.logits = capture(self._forward, torch.cuda.Stream(self.decoder.vlm.device), self.pool)
        self.decoder.vlm.counters["prefill_graphs"] += 1
