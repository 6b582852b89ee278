"""Prefill planning: the LM's forward, the pool of decoders (static KV caches, decode graphs and
prefill graphs) kept within vlm.kv_cache_gib, and the shapes (padded lengths, batch buckets) a
batch of prefixes is prefilled at, so nearby shapes share one cache and one captured graph.

The pool is the DecoderHost of pipeline/vlm/decoding.py: its decoders run the LM through it.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from pipeline.runtime.cuda import to_device
from pipeline.vlm import hf, qwen3_vl
from pipeline.vlm.decoding import PACKED_SDPA, StaticDecoder, register_packed_sdpa
from pipeline.vlm.prefix import Prefix, WindowPrefix, shared_windows
from pipeline.vlm.text_model import FastTextModel, unsupported
from pipeline.vlm_config import KV_CACHE_GIB, VLMConfig

CACHE_BUCKET = 256        # static KV caches are this many slots apart, so nearby prompt lengths share one
PREFILL_BUCKET = 64       # short prefixes are left padded up to a multiple of this, so prefill shapes repeat
SUFFIX_BUCKET = 16        # questions after a shared window are left padded up to a multiple of this
# Decoders (one per (batch bucket, cache length), see batch_bucket) are kept, least recently used
# dropped first, while their KV caches and prefill-graph input buffers fit vlm.kv_cache_gib
# (KV_CACHE_BUDGET bytes by default). A cache slot of one row holds K and V of every layer: 2 x
# layers x KV heads x head dims x the dtype's bytes (docs/performance.md works it out for the
# shipped sizes). Not counted: the graphs' shared memory pool (decode-step activations are small;
# prefill activations are reused across prefill graphs, which never run at once).
KV_CACHE_BUDGET = int(KV_CACHE_GIB * (1 << 30))       # bytes, at vlm.kv_cache_gib's default
# A graph-replayed prefill runs every row of the batch bucket, padding rows included. An eager
# prefill of a short prefix is bound by its kernel launches (a few hundred, whatever the model
# size); PREFILL_LAUNCH_FLOPS is about the compute a GPU does in that time. So a batch is row padded
# (and replayed) only while the padded prefill's compute stays under it: then the replay beats the
# eager launches; past it the eager prefill at the true batch is GPU-bound and cheaper than
# computing the padding rows (2 FLOPs per decoder-layer parameter and token). A batch that fills its
# bucket has no padding rows and is replayed up to graph_prefill_max_tokens.
PREFILL_LAUNCH_FLOPS = 12e12
ATTENTION_IMPLS = ("sdpa", "eager", PACKED_SDPA)   # the ones that take our prebuilt 4-D masks


def batch_bucket(batch: int) -> int:
    """Rows of the decoder a batch of this many requests runs in: the next power of two, so batches
    of 1..16 share 5 shapes (cache, decode graph, prefill graphs). Decode steps are memory-bound (the
    weights are read once per step whatever the rows; a padding row adds only its own KV reads), so
    up to 2x rows cost little there; finer buckets would mean more captures for the same range."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"Invalid batch size ({batch!r}): must be an integer >= 1")
    return 1 << (batch - 1).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class DecoderPool:
    """The LM of one model run as prefills and cached decoding: its forward (FastTextModel where the
    model allows it, else HF's), the decoders it keeps, and the shapes each prefill runs at.

    hf_fallback: the fast paths are off (transformers outside the tested range): the LM keeps HF's
    own attention implementation."""

    def __init__(self, model, lm, *, config: VLMConfig, pad_token_id: int, hf_fallback: bool = False) -> None:
        self.model, self.lm, self.config = model, lm, config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.pad_token_id = pad_token_id
        self._cache_kw = hf.cache_keyword(lm)
        self.attn_impl = hf.attention_implementation(lm.config)
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"Invalid LM attention implementation ({self.attn_impl!r}). "
                             f"Supported values are {', '.join(ATTENTION_IMPLS)}.")
        if self.attn_impl == "sdpa" and not hf_fallback:  # the LM's config only: the vision tower keeps its own
            register_packed_sdpa()
            hf.set_attention_implementation(lm.config, PACKED_SDPA)
            self.attn_impl = PACKED_SDPA
        # our forward of the LM's layers (same results, fewer kernels), where the model allows it
        self._fast_lm = FastTextModel(lm, self.attn_impl) if config.fast_lm and unsupported(lm) is None else None
        layer_types = set(getattr(lm.config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(f"Invalid LM layer types ({sorted(layer_types)}): only full attention is "
                             f"supported (a sliding window needs its own mask)")
        # (rows, cache length) -> decoder, least recently used first; kept within kv_cache_budget bytes
        self._decoders: OrderedDict[tuple[int, int], StaticDecoder] = OrderedDict()
        self.kv_cache_budget = int(config.kv_cache_gib * (1 << 30))         # bytes
        # decoders of batch_bucket(batch) rows (their graphs captured once per bucket); False: of the
        # exact batch, as with cuda_graphs off, where no capture is amortised
        self.bucket_batches = config.cuda_graphs
        # the most tokens (rows x padded length) a prefill with padding rows may compute: PREFILL_LAUNCH_FLOPS
        layer_params = sum(p.numel() for p in lm.layers.parameters())
        self.row_padded_prefill_tokens = int(PREFILL_LAUNCH_FLOPS // (2 * layer_params))
        attn = lm.layers[0].self_attn
        # bytes of one cache slot of one row: K and V of every layer
        self._slot_bytes = 2 * len(lm.layers) * attn.k_proj.out_features * self.dtype.itemsize
        self.counters = {"decoders": 0, "evicted": 0, "decode_graphs": 0, "prefill_graphs": 0}
        self._graph_pool = None             # one CUDA memory pool for every captured graph (decode, prefill, vision)
        self._pad_embed: torch.Tensor | None = None
        # Qwen3-VL: DeepStack features per visual slot, one per LM layer they are added after (0: none)
        self.deepstack = qwen3_vl.deepstack_count(model)

    def lm_step(self, embeds, attention_mask, positions, cache, deepstack=None):
        """The LM's layers: embeds (B, L, D), _masks()'s mapping (None: causal), positions (3, B, L),
        a cache with update() or None, deepstack (n, B, L, D) Qwen3-VL's DeepStack features (zeros
        but at visual slots) or None -> (B, L, D) final hidden states; through FastTextModel when on."""
        if self._fast_lm is not None:
            return self._fast_lm(embeds, None if attention_mask is None else attention_mask["full_attention"],
                                 positions, cache, deepstack)
        return self._hf_lm_step(embeds, attention_mask, positions, cache, deepstack)

    def _hf_lm_step(self, embeds, attention_mask, positions, cache, deepstack=None):
        """lm_step through HF's own text model forward (which takes any mask form it knows; Qwen3-VL's
        takes no per-layer-type mapping, and a 4-D mask as given)."""
        if self.deepstack and isinstance(attention_mask, dict):
            attention_mask = attention_mask["full_attention"]
            if attention_mask is None:        # causal, made here: its own would ask the cache for offsets
                L = embeds.shape[1]
                K = L if cache is None else cache.visible
                keys = torch.arange(K, device=self.device)
                allowed = keys[None, :] <= torch.arange(K - L, K, device=self.device)[:, None]  # (L, K)
                attention_mask = self.attention_masks(allowed.expand(embeds.shape[0], 1, L, K))["full_attention"]
        out = self.lm(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                       use_cache=cache is not None, **{self._cache_kw: cache},
                       **qwen3_vl.deepstack_lm_kwargs(deepstack))
        return out.last_hidden_state                                         # (B, L, D)

    def _left_pad(self, prefixes: list[Prefix], length: int | None = None,
                  rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """-> embeds (R, L, D), positions (3, R, L), and how many pad slots lead each row;
        L = length (at least the longest prefix), None: the longest prefix; R = rows (at least one
        per prefix), None: one per prefix. Rows past the prefixes are all padding (pad slots L)."""
        B, L = len(prefixes), max(p.embeds.shape[0] for p in prefixes)
        if length is not None:
            if length < L:
                raise ValueError(f"cannot left pad prefixes of up to {L} tokens to {length}")
            L = length
        R = B if rows is None else rows
        if R < B:
            raise ValueError(f"cannot fit {B} prefixes into {R} rows")
        D = prefixes[0].embeds.shape[1]
        pad = self._pad_embedding()                                          # (D,)
        embeds = pad.expand(R, L, D).clone()                                 # (R, L, D)
        positions = torch.ones(3, R, L, dtype=torch.long, device=self.device)
        pads = []
        for b, p in enumerate(prefixes):
            n = p.embeds.shape[0]
            embeds[b, L - n:] = p.embeds
            positions[:, b, L - n:] = p.positions
            pads.append(L - n)
        return embeds, positions, pads + [L] * (R - B)

    def _left_pad_deepstack(self, prefixes: list[Prefix], pads: list[int], shape: torch.Size) -> torch.Tensor | None:
        """Qwen3-VL: (n, R, L, D) the prefixes' DeepStack features at the slots _left_pad gave them
        (pads), zeros elsewhere (embeds' shape (R, L, D)); None for a model without DeepStack."""
        if not self.deepstack:
            return None
        deepstack = torch.zeros(self.deepstack, *shape, dtype=self.dtype, device=self.device)
        for b, (p, pad) in enumerate(zip(prefixes, pads)):
            if p.deepstack is not None:
                deepstack[:, b, pad:pad + p.deepstack.shape[1]] = p.deepstack
        return deepstack

    def _pad_embedding(self) -> torch.Tensor:
        """(D,) embedding of the pad token, made once (a tensor made from host values waits for the GPU)."""
        if self._pad_embed is None:
            with torch.no_grad():
                self._pad_embed = self.lm.embed_tokens(torch.tensor(self.pad_token_id, device=self.device))
        return self._pad_embed

    def attention_masks(self, allowed: torch.Tensor | None) -> dict:
        """(B, 1, Q, K) bool, True = may attend -> the per-layer-type mask mapping the HF text model
        takes as given (so it builds none of its own, with its host-side checks). None: plain causal."""
        if allowed is not None and self.attn_impl == "eager":             # eager adds the mask to the scores
            allowed = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~allowed, torch.finfo(self.dtype).min)
        return {"full_attention": allowed}

    def _rows(self, batch: int) -> int:
        """Rows of the decoder (KV cache, decode graph) a batch runs in."""
        return batch_bucket(batch) if self.bucket_batches else batch

    def _prefill_shape(self, prefix_len: int, batch: int) -> tuple[int, int, bool]:
        """Longest prefix length, batch size -> (length, rows, graphed): the prefill runs over `rows`
        rows of `length` slots, replayed as a CUDA graph when graphed.

        Up to config.graph_prefill_max_tokens the length is rounded up to PREFILL_BUCKET with more
        left padding, and the batch up to its bucket with padding rows, so nearby shapes share one
        graph: there the eager prefill is bound by the host launching a few hundred kernels
        (whatever the model size), not by the GPU. Padding rows compute like real
        ones, so a batch short of its bucket is padded only while rows x length stays within
        row_padded_prefill_tokens (see PREFILL_LAUNCH_FLOPS). Other prefills run eagerly, unpadded,
        at the true batch (into the first rows of the bucketed cache). The shapes do not depend on
        the device, so a CPU run computes the very shapes a GPU replays."""
        padded = _round_up(prefix_len, PREFILL_BUCKET)
        rows = self._replay_rows(padded, padded, batch)
        if rows is None:
            return prefix_len, batch, False
        return padded, rows, self.device.type == "cuda"

    def _replay_rows(self, length: int, row_length: int, batch: int) -> int | None:
        """Rows a padded prefill of `length` slots (padding rows holding `row_length` each) runs
        over when it may be replayed (_prefill_shape's rules), None when it runs eagerly."""
        cfg = self.config
        rows = self._rows(batch)
        # transformers' Qwen3-VL text model adds DeepStack through a boolean-mask gather (a host
        # read, which a capture cannot take): through it, prefills run eagerly
        hf_deepstack = self._fast_lm is None and self.deepstack > 0
        if (not cfg.cuda_graphs or hf_deepstack or length > cfg.graph_prefill_max_tokens
                or (rows > batch and rows * row_length > self.row_padded_prefill_tokens)):
            return None
        return rows

    def _prefill_plan(self, prefix_len: int, batch: int = 1) -> tuple[int, bool]:
        """(length, graphed) of _prefill_shape."""
        length, _, graphed = self._prefill_shape(prefix_len, batch)
        return length, graphed

    def graph_pool(self):
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def _decoder(self, rows: int, length: int, steps: bool) -> StaticDecoder:
        """The (rows, Lmax) decoder, reused across calls; on CUDA with cuda_graphs its step is a graph,
        captured the first time decode steps are asked for (a one-token answer needs none)."""
        key = (rows, length)
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            self.make_room(self._slot_bytes * rows * length)
            decoder = StaticDecoder(self, rows, length)
            self.counters["decoders"] += 1
        self._decoders[key] = decoder                                        # most recently used last
        if steps and self.config.cuda_graphs:
            decoder.plan()                                                   # LEDGER, on every device
            if decoder.graph is None and self.device.type == "cuda":
                decoder.capture(self.graph_pool())
        return decoder

    def make_room(self, nbytes: int, keep: StaticDecoder | None = None) -> None:
        """Drop least recently used decoders (with their caches and graphs), except `keep`, until
        nbytes more fit kv_cache_budget (what does not fit even then is allocated all the same)."""
        held = sum(d.nbytes for d in self._decoders.values())
        for key in list(self._decoders):
            if held + nbytes <= self.kv_cache_budget:
                break
            if self._decoders[key] is not keep:
                dropped = self._decoders.pop(key)
                held -= dropped.nbytes
                dropped.release()
                self.counters["evicted"] += 1

    @torch.no_grad()
    def prefill(self, prefixes: list[Prefix], max_new_tokens: int | None = None) -> tuple[StaticDecoder, torch.Tensor]:
        """The first half of generate: prefixes prefilled (sharing windows where they do) into a
        decoder with room for max_new_tokens -> the decoder and the (B, V) float32 logits of the
        first generated token (valid until the VLM replays a graph again). generate_from goes on."""
        max_new = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        return self._prefill(prefixes, max_new, shared_windows(prefixes))

    @torch.no_grad()
    def _prefill(self, prefixes: list[Prefix], max_new: int,
                 shared: tuple[list[WindowPrefix], list[int]] | None = None) -> tuple[StaticDecoder, torch.Tensor]:
        """Left-padded prefixes into a static cache with room for max_new tokens -> the decoder,
        ready for its first step, and the (B, V) float32 logits of the first generated token (a
        graph's output when the prefill was replayed: valid until the VLM replays a graph again).
        shared: (windows, window_of) where every prefix starts with a window (question_prefix):
        each window is prefilled once (_prefill_shared)."""
        B = len(prefixes)
        if shared:
            return self._prefill_shared(prefixes, max_new, *shared)
        longest = max(p.embeds.shape[0] for p in prefixes)
        L, rows, graphed = self._prefill_shape(longest, B)
        embeds, positions, pads = self._left_pad(prefixes, L, rows)         # (rows, L, D), (3, rows, L)
        deepstack = self._left_pad_deepstack(prefixes, pads, embeds.shape)  # (n, rows, L, D) or None
        decoder = self._decoder(self._rows(B), self._cache_length(L, max_new), steps=max_new > 1)
        padded = _round_up(longest, PREFILL_BUCKET)
        if self._replay_rows(padded, padded, B) is not None:
            decoder.plan(L)                                                  # a replayed shape (on CUDA)
        logits = decoder.prefill(embeds, positions, pads, pool=self.graph_pool() if graphed else None,
                                 deepstack=deepstack)[:B]                     # (B, V)
        next_pos = to_device([p.next_position for p in prefixes], self.device, torch.long)  # (B,)
        decoder.start(next_pos, [(0, pad) for pad in pads], L)
        return decoder, logits

    @staticmethod
    def _cache_length(prefix_len: int, max_new: int) -> int:
        # the last token fed back sits at slot prefix_len + max_new - 2; rounding up lets nearby
        # prompt lengths share one cache (and one graph)
        return _round_up(prefix_len + max_new - 1, CACHE_BUCKET)

    def _prefill_shared(self, prefixes: list[Prefix], max_new: int, windows: list[WindowPrefix],
                        window_of: list[int]) -> tuple[StaticDecoder, torch.Tensor]:
        """_prefill of prefixes that each start with one of `windows` (window_of: which): every
        window is prefilled once (right padded to a common multiple of PREFILL_BUCKET), each
        prefix's rest after it (left padded to a multiple of SUFFIX_BUCKET), graphed or eager as
        for _prefill_shape's rules."""
        B, K = len(prefixes), len(windows)
        lens = [w.embeds.shape[0] for w in windows]
        suffixes = [Prefix(p.embeds[lens[k]:], p.positions[:, lens[k]:], p.next_position, 0, 0)
                    for p, k in zip(prefixes, window_of)]
        longest = max(s.embeds.shape[0] for s in suffixes)
        Lw, Lq, rows, graphed = self._shared_shape(max(lens), longest, B)
        pad = self._pad_embedding()                                          # (D,)
        embeds = pad.expand(K, Lw, -1).clone()                               # (K, Lw, D), right padded
        positions = torch.ones(3, K, Lw, dtype=torch.long, device=self.device)
        deepstack = embeds.new_zeros(self.deepstack, *embeds.shape) if self.deepstack else None  # (n, K, Lw, D)
        for k, (w, n) in enumerate(zip(windows, lens)):
            embeds[k, :n] = w.embeds
            positions[:, k, :n] = w.positions
            if deepstack is not None and w.deepstack is not None:
                deepstack[:, k, :n] = w.deepstack
        sfx, sfx_pos, pads = self._left_pad(suffixes, Lq, rows)             # (rows, Lq, D), (3, rows, Lq)
        decoder = self._decoder(self._rows(B), self._cache_length(Lw + Lq, max_new), steps=max_new > 1)
        if self._replay_rows(_round_up(max(lens), PREFILL_BUCKET), _round_up(longest, SUFFIX_BUCKET), B) is not None:
            decoder.plan(("window", K, Lw))                                  # replayed shapes (on CUDA)
            decoder.plan(("suffix", Lq))
        # padding rows (all padding after the window) copy window 0
        logits = decoder.prefill_shared(embeds, positions, window_of + [0] * (rows - B), lens, sfx, sfx_pos, pads,
                                        pool=self.graph_pool() if graphed else None,
                                        window_deepstack=deepstack)[:B]        # (B, V)
        next_pos = to_device([p.next_position for p in prefixes], self.device, torch.long)  # (B,)
        decoder.start(next_pos, [(lens[k], Lw + p) for k, p in zip(window_of, pads)], Lw + Lq)
        return decoder, logits

    def _shared_shape(self, window_len: int, suffix_len: int, batch: int) -> tuple[int, int, int, bool]:
        """-> (window length, suffix length, rows, graphed) of a shared-window prefill: padded and
        replayed under the rules of _prefill_shape (the questions are the rows; the windows, one
        row each, are not row padded)."""
        Lw, Lq = _round_up(window_len, PREFILL_BUCKET), _round_up(suffix_len, SUFFIX_BUCKET)
        rows = self._replay_rows(Lw, Lq, batch)
        if rows is None:
            return window_len, suffix_len, batch, False
        return Lw, Lq, rows, self.device.type == "cuda"

    @torch.no_grad()
    def warm_up(self, batch_sizes, prefix_lengths, *, max_new_tokens: int | None = None) -> list[tuple[int, int]]:
        """Allocate ahead of time, and on CUDA capture, what generate() will use for batches of these
        sizes and prefixes of these lengths (VLM.prefix_length): the decoder of each batch bucket
        (cache and decode graph) and the prefill graph of each padded length. Run during setup, this
        keeps captures (a few hundred ms each) off the answering path. Returns the (rows, cache
        length) keys of the decoders it warmed that kv_cache_budget still holds."""
        max_new = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"Invalid max_new_tokens ({max_new!r}): must be an integer >= 1")
        lengths = list(prefix_lengths)
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Invalid prefix length ({n!r}): must be an integer >= 1")
        lengths = sorted(set(lengths))
        sizes = list(batch_sizes)
        for b in sizes:
            batch_bucket(b)                                                  # rejects what is not a batch size
        buckets = sorted({self._rows(b) for b in sizes})
        pad = self._pad_embedding()                                          # (D,)
        keys = []
        for n in lengths:
            # the pad token at text positions: finite, like any prompt; the cache it writes is
            # overwritten by the next real prefill before anything reads it
            prefix = Prefix(pad.expand(n, -1), torch.arange(n, device=self.device).expand(3, n), n, 0, 0)
            for rows in buckets:
                decoder, _ = self._prefill([prefix] * rows, max_new)
                keys.append((decoder.rows, decoder.length))
        self.sync()
        return [k for k in dict.fromkeys(keys) if k in self._decoders]

    def sync(self) -> None:
        """Wait for this thread's VLM work (the current stream, where every replay lands too). Not a
        device-wide sync: that would wait on, and so invalidate, a graph another thread is capturing
        (seen in live mode: "operation failed due to a previous error during capture" in texture)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
