"""The VLM's language-model decoding machinery: a static KV cache, fixed-shape decode steps and
short prefills replayed as CUDA graphs, sampling, and the packed-GQA sdpa used for decode steps.

`StaticDecoder` and `PrefillGraph` work for a DecoderHost (pipeline/vlm/prefill.py's DecoderPool:
its LM, dtype, device, counters and mask builder), which chooses shapes and keeps decoders.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Protocol

import torch

from pipeline.runtime.cuda import LEDGER, capture, to_device
from pipeline.vlm import hf



class DecoderHost(Protocol):
    """What StaticDecoder and PrefillGraph need of the model they decode for (DecoderPool provides it)."""
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module          # the HF model: its lm_head
    lm: torch.nn.Module             # the text decoder: embed_tokens, layers (the cache's shapes)
    attn_impl: str                  # the LM's attention implementation ("eager" takes additive masks)
    pad_token_id: int
    counters: dict[str, int]        # "decode_graphs", "prefill_graphs" captured

    def lm_step(self, embeds: torch.Tensor, attention_mask: dict | None, positions: torch.Tensor,
                cache, deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """The LM's layers: (B, L, D) embeddings -> (B, L, D) final hidden states, writing `cache`
        (deepstack (n, B, L, D): Qwen3-VL's DeepStack features, added after the first n layers)."""

    def attention_masks(self, allowed: torch.Tensor | None) -> dict:
        """(B, 1, Q, K) bool, True = may attend -> the mask mapping lm_step takes."""

    def make_room(self, nbytes: int, keep: StaticDecoder | None = None) -> None:
        """Free cached decoders (not `keep`) until nbytes more fit the KV-cache budget."""

MAX_PREFILL_GRAPHS = 8    # prefill graphs (one per padded prefix length) kept per decoder: with one
                          # max_new_tokens at most CACHE_BUCKET / PREFILL_BUCKET = 4 lengths share a decoder
PACKED_SDPA = "arr_coc_sdpa"          # sdpa, with GQA decode steps packed per KV head (sdpa_packed_gqa)


def sdpa_packed_gqa(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention, except for one query token against a masked static cache with grouped
    KV heads: there each KV head attends with its group of query heads side by side, where HF's
    sdpa (before transformers 5.2x) copies every cached key and value once per query head
    (repeat_kv), which for a long cache costs more memory traffic than the layer's weights."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, q_len, d = query.shape
    if q_len != 1 or groups == 1 or attention_mask is None or attention_mask.shape[1] != 1 or module.training:
        return hf.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    packed = query.reshape(B, H // groups, groups, d)                          # (B, H_kv, groups, d)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                           scale=kwargs.get("scaling"))
    return out.reshape(B, 1, H, d), None                                       # (B, q, H, d) like sdpa's


def register_packed_sdpa() -> None:
    hf.register_attention(PACKED_SDPA, sdpa_packed_gqa)


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

    Each row's prefix may hold one run of padding slots, its "hole" [hole_lo, hole_hi), that no
    query attends to: left padding is the hole [0, pad); questions over one shared window
    (prefill_shared) are [window, window padding, question padding, question], the hole in the middle.
    """

    def __init__(self, vlm: DecoderHost, rows: int, length: int) -> None:
        self.vlm, self.rows, self.length = vlm, rows, length
        self.batch = rows                                                    # real rows of this call (start())
        device = vlm.device
        self.cache = StaticKVCache(vlm.lm, rows, length, vlm.dtype, device)
        self.token = torch.full((rows,), vlm.pad_token_id, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)        # where the fed token goes
        self.rope_offset = torch.zeros(rows, dtype=torch.long, device=device)  # M-RoPE position - slot
        self.hole_lo = torch.zeros(rows, dtype=torch.long, device=device)   # per row: slots [lo, hi)
        self.hole_hi = torch.zeros(rows, dtype=torch.long, device=device)   # are padding, never attended
        self.key_slots = torch.arange(length, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None                             # the graph's output
        # prefill graphs by padded prefix length (shared-window ones by ("window", K, Lw) and
        # ("suffix", Lq)): they write this decoder's cache, so they live and die with it; least
        # recently used first
        self.prefill_graphs: OrderedDict[int | tuple, PrefillGraph] = OrderedDict()
        # the prefill shapes (prefill_graphs' keys) asked for on every device, least recently used
        # first, and whether decode steps were: what a GPU holds graphs for (see plan())
        self.planned: OrderedDict[int | tuple, None] = OrderedDict()
        self.stepped = False

    def label(self, key: int | tuple | None = None) -> str:
        """LEDGER's name of this decoder's decode-step graph (key None) or of a prefill graph."""
        shape = f"rows={self.rows} len={self.length}"
        if key is None:
            return f"decode {shape}"
        return f"prefill {shape} " + (f"L={key}" if isinstance(key, int) else " ".join(map(str, key)))

    def plan(self, key: int | tuple | None = None) -> None:
        """Note a graph shape asked for (a prefill key; None: decode steps), on every device, as
        prefill_graphs keeps them: each one new (or dropped since) goes to LEDGER. A CPU run so sees
        the graphs a GPU run would capture."""
        if key is None:
            if not self.stepped:
                self.stepped = True
                LEDGER.shape(self.label())
            return
        if key in self.planned:
            self.planned.move_to_end(key)
            return
        if len(self.planned) >= MAX_PREFILL_GRAPHS:
            self.planned.popitem(last=False)
        self.planned[key] = None
        LEDGER.shape(self.label(key))

    @property
    def nbytes(self) -> int:
        """Memory kv_cache_budget counts: the cache and the prefill graphs' static buffers."""
        return self.cache.nbytes + sum(g.nbytes for g in self.prefill_graphs.values())

    def release(self) -> None:
        """Let the cache and the graphs go when the pool drops this decoder (make_room). Its prefill
        graphs refer back to it, so without this the cycle would keep its memory past the budget
        until Python's cyclic collector ran, in whatever thread, maybe one capturing a graph, whose
        capture the freed graphs then broke ("operation not permitted when stream is capturing
        (function reset)", stock tokens under a small budget). Still usable after:
        a later prefill captures its graph again."""
        self.prefill_graphs.clear()
        self.planned.clear()

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, pads: list[int], pool=None,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """embeds (B, L, D), positions (3, B, L), left pads per row -> (B, V) float32 logits of the
        token after the last one; fills slots [0, L) of cache rows [0, B). With a CUDA graph pool
        (then B is all the decoder's rows), a graph per L (captured the first time) replays it, and
        the logits are its output buffer. deepstack (n, B, L, D): Qwen3-VL's DeepStack features."""
        vlm, (B, L) = self.vlm, embeds.shape[:2]
        if pool is None:
            # unpadded under sdpa: no mask, so its causal kernel
            pad = self._longs(pads) if any(pads) or vlm.attn_impl == "eager" else None
            return self.prefill_forward(embeds, positions, torch.arange(L, device=vlm.device), pad,
                                        deepstack=deepstack)
        self._check_rows(B)
        slots = torch.arange(L, device=vlm.device)
        inputs = {"embeds": embeds, "positions": positions, "pad": self._longs(pads)}
        if deepstack is not None:
            inputs["deepstack"] = deepstack
        graph = self._graph(L, lambda b: self.prefill_forward(b["embeds"], b["positions"], slots, b["pad"],
                                                              deepstack=b.get("deepstack")),
                            inputs, pool)
        return graph(**inputs)

    def prefill_shared(self, windows: torch.Tensor, window_positions: torch.Tensor, window_of: list[int],
                       window_lens: list[int], suffix: torch.Tensor, suffix_positions: torch.Tensor,
                       pads: list[int], pool=None, window_deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """Questions over K windows: each window once, then every row's own suffix after its window.

        windows (K, Lw, D), window_positions (3, K, Lw): the windows, window k real in its first
        window_lens[k] slots and right padded (padding there is later than every real token of the
        window, so causal attention never sees it); suffix (B, Lq, D), suffix_positions (3, B, Lq):
        each row's question, left padded by pads; window_of (B,): the window of each row. The
        windows go into slots [0, Lw) of rows [0, K), then each row gets a copy of its window's; the
        suffixes go into [Lw, Lw + Lq), each attending to its window's real slots and its own tokens.
        -> (B, V) float32 logits after each row's last token. With a pool, each stage replays a
        graph (the windows' per (K, Lw), the suffixes' per Lq: their start is an input), and B is all
        the decoder's rows."""
        vlm, (K, Lw), (B, Lq) = self.vlm, windows.shape[:2], suffix.shape[:2]
        lo = [window_lens[k] for k in window_of]
        hi = [Lw + p for p in pads]
        if pool is None:
            self._prefill_windows(windows, window_positions, self._longs(window_of), window_deepstack)
            return self.prefill_forward(suffix, suffix_positions, torch.arange(Lw, Lw + Lq, device=vlm.device),
                                        self._longs(hi), hole_lo=self._longs(lo), visible=Lw + Lq)
        self._check_rows(B)
        inputs = {"embeds": windows, "positions": window_positions, "window_of": self._longs(window_of)}
        if window_deepstack is not None:                                     # (n, K, Lw, D) Qwen3-VL
            inputs["deepstack"] = window_deepstack
        self._graph(("window", K, Lw), lambda b: self._prefill_windows(b["embeds"], b["positions"], b["window_of"],
                                                                       b.get("deepstack")),
                    inputs, pool)(**inputs)
        offsets = torch.arange(Lq, device=vlm.device)
        inputs = {"embeds": suffix, "positions": suffix_positions, "lo": self._longs(lo), "hi": self._longs(hi),
                  "start": self._longs([Lw])}
        graph = self._graph(("suffix", Lq), lambda b: self.prefill_forward(
            b["embeds"], b["positions"], b["start"] + offsets, b["hi"], hole_lo=b["lo"], visible=self.length),
            inputs, pool)
        return graph(**inputs)

    def _prefill_windows(self, embeds: torch.Tensor, positions: torch.Tensor, window_of: torch.Tensor,
                         deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """embeds (K, Lw, D) causal into slots [0, Lw) of rows [0, K), then row r gets a copy of
        row window_of[r]'s slots (window_of (R,) over all the decoder's rows)."""
        vlm, (K, L) = self.vlm, embeds.shape[:2]
        # eager attention takes no causal default: a mask with no padding
        pad = torch.zeros(K, dtype=torch.long, device=vlm.device) if vlm.attn_impl == "eager" else None
        logits = self.prefill_forward(embeds, positions, torch.arange(L, device=vlm.device), pad, deepstack=deepstack)
        for t in self.cache.keys + self.cache.values:                        # (R, H_kv, Lmax, hd)
            t[:window_of.shape[0], :, :L] = t[:, :, :L].index_select(0, window_of)
        return logits

    def _check_rows(self, B: int) -> None:
        if B != self.rows:
            raise ValueError(f"a replayed prefill fills every row of the decoder ({self.rows}), got {B} rows")

    def _longs(self, values) -> torch.Tensor:
        return to_device(values, self.vlm.device, torch.long)

    def _graph(self, key, fn, example: dict[str, torch.Tensor], pool) -> PrefillGraph:
        vlm = self.vlm
        graph = self.prefill_graphs.pop(key, None)
        if graph is None:
            if len(self.prefill_graphs) >= MAX_PREFILL_GRAPHS:
                self.prefill_graphs.popitem(last=False)
            vlm.make_room(PrefillGraph.buffer_bytes(example, vlm.model.lm_head.out_features), keep=self)
            graph = PrefillGraph(self, fn, example, pool, self.label(key))
        self.prefill_graphs[key] = graph                                     # most recently used last
        return graph

    def prefill_forward(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        pad: torch.Tensor | None, hole_lo: torch.Tensor | None = None,
                        visible: int | None = None, deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """The prefill itself, eager or under capture: embeds (B, L, D), positions (3, B, L) into the
        consecutive cache slots (L,), attending causally to slots [0, visible) (default L, for
        slots = arange(L)); pad (B,): each row's padding slots end there, starting from hole_lo (B,)
        (None: from 0, left padding); pad None: no padding -> (B, V) float32 logits at the last
        position. Everything stays on the device (no host values)."""
        vlm, (B, L) = self.vlm, embeds.shape[:2]
        visible = L if visible is None else visible
        cache = self.cache.rows(B)                                           # (B, H_kv, Lmax, hd) per layer
        cache.at(slots, visible)
        allowed = None
        if pad is not None:
            keys = torch.arange(visible, device=vlm.device)                  # (K,)
            real = keys >= pad[:, None, None]                                # (B, 1, K)
            if hole_lo is not None:
                real = real | (keys < hole_lo[:, None, None])
            allowed = (keys <= slots[:, None]) & real                        # (B, L, K) causal, real keys
            # a padded query row would have nothing to attend to, and a fully masked softmax row is
            # NaN, which the attention weights 0 * NaN would carry into every real row
            allowed = (allowed | (keys == slots[:, None]))[:, None]
        hidden = vlm.lm_step(embeds, vlm.attention_masks(allowed), positions, cache, deepstack)  # (B, L, D)
        return vlm.model.lm_head(hidden[:, -1]).float()                     # (B, V)

    def start(self, next_position: torch.Tensor, holes: list[tuple[int, int]], prefix_len: int) -> None:
        """Decoding continues at slot prefix_len with M-RoPE positions next_position (B,) onward for
        rows [0, B) (holes: their padding slots [lo, hi)); the other rows feed pad tokens that see
        only their own slots from prefix_len on."""
        B = self.batch = next_position.shape[0]
        self.slot.fill_(prefix_len)
        self.token.fill_(self.vlm.pad_token_id)
        self.rope_offset.zero_()
        self.rope_offset[:B].copy_(next_position - prefix_len)
        holes = list(holes[:B]) + [(0, prefix_len)] * (self.rows - B)
        self.hole_lo.copy_(self._longs([lo for lo, _ in holes]), non_blocking=True)
        self.hole_hi.copy_(self._longs([hi for _, hi in holes]), non_blocking=True)
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
        embeds = vlm.lm.embed_tokens(self.token)[:, None]                   # (R, 1, D)
        real = (self.key_slots < self.hole_lo[:, None]) | (self.key_slots >= self.hole_hi[:, None])
        allowed = real & (self.key_slots <= self.slot)                       # (R, Lmax)
        positions = (self.rope_offset + self.slot).view(1, -1, 1).expand(3, -1, 1)     # (3, R, 1)
        hidden = vlm.lm_step(embeds, vlm.attention_masks(allowed[:, None, None]), positions, self.cache)
        logits = vlm.model.lm_head(hidden[:, -1]).float()                    # (R, V)
        self.slot.add_(1)
        return logits

    def capture(self, pool) -> None:
        """Record one step as a CUDA graph (the buffers' values now do not matter: start() resets them)."""
        self.cache.at(self.slot, self.length)
        self.graph, self.logits = capture(self._forward, torch.cuda.Stream(self.vlm.device), pool,
                                          label=self.label())
        self.vlm.counters["decode_graphs"] += 1


class PrefillGraph:
    """One prefill shape of a decoder (StaticDecoder._graph), captured as a CUDA graph.

    Each call copies its inputs into static buffers (embeds, M-RoPE positions, the padding bounds
    from which the graph builds its own mask) and replays: the graph writes its slots of the
    decoder's cache and the (B, V) logits buffer, which stays valid until the VLM replays a graph
    again (all its graphs share one memory pool, so a later replay may reuse it).
    """

    def __init__(self, decoder: StaticDecoder, fn, example: dict[str, torch.Tensor], pool,
                 label: str = "prefill") -> None:
        self.decoder, self.fn, self.pool, self.label = decoder, fn, pool, label
        self.buffers = {k: torch.empty_like(v) for k, v in example.items()}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None                              # (B, V), the graph's output
        self.nbytes = self.buffer_bytes(example, decoder.vlm.model.lm_head.out_features)

    @staticmethod
    def buffer_bytes(example: dict[str, torch.Tensor], vocab: int) -> int:
        """Bytes of a graph's static inputs and its (rows, V) float32 logits (rows: the first input's)."""
        rows = next(iter(example.values())).shape[0]
        return sum(t.nbytes for t in example.values()) + rows * vocab * 4

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        for name, value in inputs.items():
            self.buffers[name].copy_(value, non_blocking=True)
        if self.graph is None:
            self.graph, self.logits = capture(lambda: self.fn(self.buffers),
                                              torch.cuda.Stream(self.decoder.vlm.device), self.pool, label=self.label)
            self.decoder.vlm.counters["prefill_graphs"] += 1
        self.graph.replay()
        return self.logits
