"""The VLM stage: pruned visual tokens in, answers out (Qwen2-VL / Qwen2.5-VL through HF transformers).

Per request: preprocess on the device -> vision tower on ALL patches (its attention needs the full
grid) -> merged tokens (T', gh, gw, D) -> keep/pool per the allocation -> LM prefix whose visual part
holds only the kept tokens, each at the M-RoPE position the full (unpruned) sequence gives it ->
our own KV-cached decoding loop, batched over requests with left padding.
"""
from __future__ import annotations

import inspect
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cudagraph import CAPTURE_LOCK
from pipeline.vlm.config import VLMConfig
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm.selection import pair_lod, select_tokens

SYSTEM_PROMPT = "You are a helpful assistant."
CACHE_BUCKET = 256        # static KV caches are this many slots apart, so nearby prompt lengths share one
MAX_DECODERS = 4          # (batch, cache length) decoders kept per VLM, each with its KV cache (and graph)
PREFILL_BUCKET = 64       # short prefixes are left padded up to a multiple of this, so prefill shapes repeat
MAX_PREFILL_GRAPHS = 4    # prefill graphs (one per padded prefix length) kept per decoder
DONE_CHECK_EVERY = 8      # decode steps between host checks for "every row has finished" (each one syncs)
PACKED_SDPA = "arr_coc_sdpa"          # sdpa, with GQA decode steps packed per KV head (sdpa_packed_gqa)
ATTENTION_IMPLS = ("sdpa", "eager", PACKED_SDPA)   # the ones that take our prebuilt 4-D masks


@dataclass(frozen=True)
class AnswerRequest:
    stream_id: str
    frames: np.ndarray | torch.Tensor   # (T, H, W, 3) uint8 RGB, already sampled at VLMConfig.fps
    keep: np.ndarray | torch.Tensor | None  # (T, gh, gw) int LOD (0 drop, 1 full, 2 pooled); None = stock
    question: str
    t_start: float
    t_end: float
    arrival_s: float | None = None      # time.monotonic() when the window was complete; latency starts here

    def __post_init__(self) -> None:
        shape = tuple(self.frames.shape)
        if len(shape) != 4 or shape[-1] != 3 or shape[0] < 1:
            raise ValueError(f"AnswerRequest.frames must be (T, H, W, 3) with T >= 1, got {shape}")
        if self.frames.dtype not in (np.uint8, torch.uint8):
            raise ValueError(f"AnswerRequest.frames must be uint8, got {self.frames.dtype}")
        if self.keep is not None and (len(self.keep.shape) != 3 or self.keep.shape[0] != shape[0]):
            raise ValueError(f"AnswerRequest.keep must be (T={shape[0]}, gh, gw), got {tuple(self.keep.shape)}")
        if not self.question.strip():
            raise ValueError("AnswerRequest.question is empty")


@dataclass(frozen=True)
class AnswerResult:
    text: str
    tokens_kept: int     # visual tokens actually sent to the LM
    tokens_full: int     # visual tokens the stock model would use for the same frames
    latency_s: float


@dataclass
class Prefix:
    """LM input of one request, pruned: embeds (L, D), positions (3, L) of the full sequence at the
    kept tokens, and next_position, the first generated token's position (full max + 1)."""
    embeds: torch.Tensor
    positions: torch.Tensor
    next_position: int
    tokens_kept: int
    tokens_full: int


@dataclass
class Generation:
    tokens: torch.Tensor               # (B, N) generated ids, pad after EOS
    lengths: list[int]                 # generated tokens per row up to and including EOS
    step_logits: list[torch.Tensor]    # N x (B, V) float32, only when requested
    decode_s: float = float("nan")     # first token -> last token wall time, only when timed


class VLM:
    def __init__(self, model, tokenizer, *, family: str, name: str, config: VLMConfig,
                 preprocessor: VideoPreprocessor, warning: str | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.family = family
        self.name = name
        self.config = config
        self.preprocessor = preprocessor
        self.warning = warning              # set for tiny-random: its answers are meaningless
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._lm = model.model.language_model
        self._visual = model.model.visual
        self._cache_kw = "cache" if "cache" in inspect.signature(self._lm.forward).parameters else "past_key_values"
        self._rope_takes_types = "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters
        self._attn_impl = self._lm.config._attn_implementation
        if self._attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"Invalid LM attention implementation ({self._attn_impl!r}). "
                             f"Supported values are {', '.join(ATTENTION_IMPLS)}.")
        if self._attn_impl == "sdpa":       # the LM's config only: the vision tower keeps its own
            register_packed_sdpa()
            self._lm.config._attn_implementation = self._attn_impl = PACKED_SDPA
        layer_types = set(getattr(self._lm.config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(f"Invalid LM layer types ({sorted(layer_types)}): only full attention is "
                             f"supported (a sliding window needs its own mask)")
        self._decoders: dict[tuple[int, int], StaticDecoder] = {}
        self._graph_pool = None             # one CUDA memory pool for every captured graph (decode, prefill)
        self.video_token_id = model.config.video_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        self.eos_ids = torch.tensor([i for i in eos if i is not None and i >= 0], device=self.device)

    @property
    def geometry(self) -> VLMGeometry:
        return self.preprocessor.geometry

    # ---- participatory-knowing hooks (same embedding space as the LM input) ----
    @torch.no_grad()
    def text_embeddings(self, question: str) -> torch.Tensor:
        ids = torch.tensor(self.tokenizer(question).input_ids, device=self.device)
        return self._lm.embed_tokens(ids)                                   # (L, D)

    @torch.no_grad()
    def visual_tokens(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        merged = self._merged_tokens([frames])[0]                            # (T', gh, gw, D)
        return merged.flatten(1, 2)                                          # (T', gh*gw, D)

    # ---- front end: preprocess + vision tower + selection ----
    def _merged_tokens(self, videos: list) -> list[torch.Tensor]:
        return self._vision(*self._preprocess(videos))

    def _preprocess(self, videos: list) -> tuple[torch.Tensor, torch.Tensor]:
        pixels, grids = zip(*(self.preprocessor(v, self.device) for v in videos))
        return torch.cat(pixels).to(self.dtype), torch.stack(grids).to(self.device)  # (N_patches, F), (N, 3)

    def _vision(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """All patches through the vision tower -> per video merged tokens (T', gh, gw, D)."""
        out = self._visual(pixels, grid_thw=grid_thw)
        merged = out.pooler_output if hasattr(out, "pooler_output") else out  # (sum T'gh gw, D)
        m = self.geometry.merge_size
        sizes = (grid_thw.prod(-1) // m**2).tolist()
        return [x.view(int(g[0]), int(g[1]) // m, int(g[2]) // m, -1) for x, g in zip(merged.split(sizes), grid_thw)]

    def prompt_ids(self, question: str, n_video_tokens: int) -> tuple[list[int], list[int]]:
        """Qwen chat format around one video: ids before and after the video pad tokens."""
        before = (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|vision_start|>")
        after = f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
        return self.tokenizer(before).input_ids, self.tokenizer(after).input_ids

    def full_input_ids(self, question: str, n_video_tokens: int) -> torch.Tensor:
        before, after = self.prompt_ids(question, n_video_tokens)
        return torch.tensor(before + [self.video_token_id] * n_video_tokens + after, device=self.device)

    def rope_positions(self, input_ids: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(L,) unpruned ids, grid (3,) -> (3, L) M-RoPE positions from the model's own get_rope_index."""
        kwargs = dict(input_ids=input_ids[None], video_grid_thw=grid_thw[None].to(self.device))
        if self._rope_takes_types:
            kwargs["mm_token_type_ids"] = (input_ids[None] == self.video_token_id).int() * 2
        if self.family == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor([self.geometry.temporal_patch_size / self.config.fps])
        positions, _ = self.model.model.get_rope_index(**kwargs)
        return positions[:, 0]                                               # (3, L)

    @torch.no_grad()
    def prepare(self, requests: list[AnswerRequest]) -> list[Prefix]:
        merged_all = self._merged_tokens([r.frames for r in requests])
        return [self.build_prefix(req, merged) for req, merged in zip(requests, merged_all)]

    @torch.no_grad()
    def build_prefix(self, req: AnswerRequest, merged: torch.Tensor) -> Prefix:
        """Selection: merged tokens (T', gh, gw, D) of req's frames -> its pruned LM prefix."""
        Tp, gh, gw, _ = merged.shape
        n_full = Tp * gh * gw
        if req.keep is None:
            lod = torch.ones(Tp, gh, gw, dtype=torch.int8, device=self.device)
        else:
            keep = torch.as_tensor(req.keep, device=self.device)
            expected = (req.frames.shape[0], gh, gw)
            if tuple(keep.shape) != expected:
                raise ValueError(f"keep map shape {tuple(keep.shape)} does not match the VLM grid {expected} "
                                 f"for {req.frames.shape[2]}x{req.frames.shape[1]} frames")
            lod = pair_lod(keep, self.geometry.temporal_patch_size)
        tokens, index = select_tokens(merged, lod)                           # (K, D), (K,)
        ids = self.full_input_ids(req.question, n_full)                      # (L_full,)
        m = self.geometry.merge_size
        full_pos = self.rope_positions(ids, torch.tensor([Tp, gh * m, gw * m]))  # (3, L_full)
        v0 = int((ids == self.video_token_id).nonzero()[0])
        text = self._lm.embed_tokens(ids)                                    # (L_full, D)
        embeds = torch.cat([text[:v0], tokens.to(text.dtype), text[v0 + n_full:]])
        positions = torch.cat([full_pos[:, :v0], full_pos[:, v0 + index], full_pos[:, v0 + n_full:]], 1)
        return Prefix(embeds, positions, int(full_pos.max()) + 1, int(index.numel()), n_full)

    # ---- language model: prefill + cached decoding ----
    def _lm_step(self, embeds, attention_mask, positions, cache):
        out = self._lm(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                       use_cache=cache is not None, **{self._cache_kw: cache})
        return out.last_hidden_state                                         # (B, L, D)

    def _left_pad(self, prefixes: list[Prefix],
                  length: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """-> embeds (B, L, D), positions (3, B, L), and how many pad slots lead each row;
        L = length (at least the longest prefix), None: the longest prefix."""
        B, L = len(prefixes), max(p.embeds.shape[0] for p in prefixes)
        if length is not None:
            if length < L:
                raise ValueError(f"cannot left pad prefixes of up to {L} tokens to {length}")
            L = length
        D = prefixes[0].embeds.shape[1]
        pad = self._lm.embed_tokens(torch.tensor(self.pad_token_id, device=self.device))
        embeds = pad.expand(B, L, D).clone()                                 # (B, L, D)
        positions = torch.ones(3, B, L, dtype=torch.long, device=self.device)
        pads = []
        for b, p in enumerate(prefixes):
            n = p.embeds.shape[0]
            embeds[b, L - n:] = p.embeds
            positions[:, b, L - n:] = p.positions
            pads.append(L - n)
        return embeds, positions, pads

    def _masks(self, allowed: torch.Tensor | None) -> dict:
        """(B, 1, Q, K) bool, True = may attend -> the per-layer-type mask mapping the HF text model
        takes as given (so it builds none of its own, with its host-side checks). None: plain causal."""
        if allowed is not None and self._attn_impl == "eager":             # eager adds the mask to the scores
            allowed = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~allowed, torch.finfo(self.dtype).min)
        return {"full_attention": allowed}

    def _prefill_plan(self, prefix_len: int) -> tuple[int, bool]:
        """Longest prefix length -> (the length it is prefilled at, whether a CUDA graph replays it).

        Up to config.graph_prefill_max_tokens the length is rounded up to PREFILL_BUCKET with more
        left padding, so nearby lengths share one graph: there the eager prefill is bound by the
        host launching a few hundred kernels (about 20 ms for 28 layers, whatever the model size),
        not by the GPU. Longer prefixes are GPU-bound and run eagerly, unpadded. The padding does
        not depend on the device, so a CPU run computes the very shapes a GPU replays."""
        cfg = self.config
        padded = -(-prefix_len // PREFILL_BUCKET) * PREFILL_BUCKET
        if not cfg.cuda_graphs or padded > cfg.graph_prefill_max_tokens:
            return prefix_len, False
        return padded, self.device.type == "cuda"

    def _pool(self):
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def _decoder(self, batch: int, length: int, steps: bool) -> StaticDecoder:
        """The (B, Lmax) decoder, reused across calls; on CUDA with cuda_graphs its step is a graph,
        captured the first time decode steps are asked for (a one-token answer needs none)."""
        key = (batch, length)
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            if len(self._decoders) >= MAX_DECODERS:                          # each holds a KV cache
                self._decoders.pop(next(iter(self._decoders)))
            decoder = StaticDecoder(self, batch, length)
        if steps and decoder.graph is None and self.device.type == "cuda" and self.config.cuda_graphs:
            decoder.capture(self._pool())
        self._decoders[key] = decoder                                        # most recently used last
        return decoder

    @torch.no_grad()
    def _prefill(self, prefixes: list[Prefix], max_new: int) -> tuple[StaticDecoder, torch.Tensor]:
        """Left-padded prefixes into a static cache with room for max_new tokens -> the decoder,
        ready for its first step, and the (B, V) float32 logits of the first generated token (a
        graph's output when the prefill was replayed: valid until the VLM replays a graph again)."""
        L, graphed = self._prefill_plan(max(p.embeds.shape[0] for p in prefixes))
        embeds, positions, pads = self._left_pad(prefixes, L)               # (B, L, D), (3, B, L)
        B = embeds.shape[0]
        # the last token fed back sits at slot L + max_new - 2; rounding up lets nearby prompt
        # lengths share one cache (and one graph)
        length = -(-(L + max_new - 1) // CACHE_BUCKET) * CACHE_BUCKET
        decoder = self._decoder(B, length, steps=max_new > 1)
        logits = decoder.prefill(embeds, positions, pads, pool=self._pool() if graphed else None)  # (B, V)
        next_pos = torch.tensor([p.next_position for p in prefixes], device=self.device)  # (B,)
        decoder.start(next_pos, pads, L)
        return decoder, logits

    @torch.no_grad()
    def generate(self, prefixes: list[Prefix], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 return_logits: bool = False, timed: bool = False) -> Generation:
        cfg = self.config
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = cfg.temperature if temperature is None else temperature
        top_p = cfg.top_p if top_p is None else top_p
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed if seed is None else seed)
        B = len(prefixes)
        decoder, logits = self._prefill(prefixes, max_new)                   # (B, V)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        tokens, step_logits = [], []
        t_first = None
        for step in range(max_new):
            if return_logits:
                step_logits.append(logits.clone())                           # a graph overwrites its output
            token = sample_next(logits, temperature, top_p, gen)             # (B,)
            token = torch.where(done, self.pad_token_id, token)
            lengths += (~done).long()
            tokens.append(token)
            done |= torch.isin(token, self.eos_ids)
            if timed and step == 0:
                self._sync()
                t_first = time.perf_counter()
            # bool() waits for the GPU, so it is asked only every few steps; the steps in between
            # emit pad for finished rows and are trimmed below
            if step == max_new - 1 or (step % DONE_CHECK_EVERY == DONE_CHECK_EVERY - 1 and bool(done.all())):
                break
            logits = decoder.step(token)
        decode_s = float("nan")
        if timed:
            self._sync()
            decode_s = time.perf_counter() - t_first
        lengths_list = lengths.tolist()
        n = max(lengths_list)
        return Generation(torch.stack(tokens[:n], 1), lengths_list, step_logits[:n], decode_s)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def logits_without_cache(self, prefix: Prefix, continuation: torch.Tensor) -> torch.Tensor:
        """Reference for the cached loop: one uncached forward over prefix + continuation (N,) ids
        -> (N + 1, V) float32 logits predicting each next token."""
        cont = self._lm.embed_tokens(continuation.to(self.device))            # (N, D)
        embeds = torch.cat([prefix.embeds, cont])[None]                      # (1, L + N, D)
        pos_cont = prefix.next_position + torch.arange(continuation.numel(), device=self.device)
        positions = torch.cat([prefix.positions, pos_cont.expand(3, -1)], 1)[:, None]  # (3, 1, L + N)
        hidden = self._lm_step(embeds, None, positions, None)[0, prefix.embeds.shape[0] - 1:]
        return self.model.lm_head(hidden).float()

    def decode(self, tokens: torch.Tensor, length: int) -> str:
        ids = tokens[:length].tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def answer(self, requests: list[AnswerRequest]) -> list[AnswerResult]:
        if not requests:
            return []
        started = time.monotonic()
        prefixes = self.prepare(requests)
        out = self.generate(prefixes)
        self._sync()
        ready = time.monotonic()
        return [AnswerResult(text=self.decode(out.tokens[b], out.lengths[b]), tokens_kept=p.tokens_kept,
                             tokens_full=p.tokens_full,
                             latency_s=ready - (r.arrival_s if r.arrival_s is not None else started))
                for b, (r, p) in enumerate(zip(requests, prefixes))]

    @torch.no_grad()
    def answer_questions(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
                         questions: list[str], *, max_batch: int | None = None) -> list[AnswerResult]:
        """Several questions about one window: the vision tower runs once, each question gets its own
        prefix over the same selected tokens, and they decode together (`max_batch` per generate call,
        None: all at once). latency_s is the time from this call to each answer."""
        if not questions:
            return []
        started = time.monotonic()
        requests = [AnswerRequest("", frames, keep, q, 0.0, 0.0) for q in questions]
        merged = self._merged_tokens([frames])[0]                            # (T', gh, gw, D)
        prefixes = [self.build_prefix(r, merged) for r in requests]
        step = len(prefixes) if max_batch is None else max_batch
        results = []
        for i in range(0, len(prefixes), step):
            chunk = prefixes[i:i + step]
            out = self.generate(chunk)
            self._sync()
            ready = time.monotonic()
            results += [AnswerResult(text=self.decode(out.tokens[b], out.lengths[b]), tokens_kept=p.tokens_kept,
                                     tokens_full=p.tokens_full, latency_s=ready - started)
                        for b, p in enumerate(chunk)]
        return results


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

    def at(self, slots: torch.Tensor, visible: int) -> None:
        """The next forward's tokens go to `slots` (n,); attention sees slots [0, visible)."""
        self.slots, self.visible = slots, visible

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)                          # (B, H_kv, n, hd) in
        values.index_copy_(2, self.slots, value_states)
        return keys[:, :, :self.visible], values[:, :, :self.visible]


class StaticDecoder:
    """Prefill into a static cache of (B, Lmax) slots, then fixed-shape decode steps.

    A step's inputs live in buffers the step reads and advances on the device (the cache slot of
    the token fed back, its M-RoPE position), so a step needs no host values and no host sync:
    on CUDA it is captured once as a graph and replayed, one launch per token instead of hundreds.
    """

    def __init__(self, vlm: VLM, batch: int, length: int) -> None:
        self.vlm, self.length = vlm, length
        device = vlm.device
        self.cache = StaticKVCache(vlm._lm, batch, length, vlm.dtype, device)
        self.token = torch.full((batch,), vlm.pad_token_id, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)        # where the fed token goes
        self.rope_offset = torch.zeros(batch, dtype=torch.long, device=device)  # M-RoPE position - slot
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)      # first real slot per row
        self.key_slots = torch.arange(length, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None                             # the graph's output
        # prefill graphs by padded prefix length: they write this decoder's cache, so they live
        # and die with it; least recently used first
        self.prefill_graphs: OrderedDict[int, PrefillGraph] = OrderedDict()

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, pads: list[int], pool=None) -> torch.Tensor:
        """embeds (B, L, D), positions (3, B, L), left pads per row -> (B, V) float32 logits of the
        token after the last one; fills slots [0, L). With a CUDA graph pool, a graph per L (captured
        the first time) replays it, and the logits are its output buffer."""
        vlm, L = self.vlm, embeds.shape[1]
        if pool is None:
            # unpadded under sdpa: no mask, so its causal kernel
            pad = torch.tensor(pads, device=vlm.device) if any(pads) or vlm._attn_impl == "eager" else None
            return self.prefill_forward(embeds, positions, torch.arange(L, device=vlm.device), pad)
        graph = self.prefill_graphs.pop(L, None)
        if graph is None:
            if len(self.prefill_graphs) >= MAX_PREFILL_GRAPHS:
                self.prefill_graphs.popitem(last=False)
            graph = PrefillGraph(self, embeds, positions, pool)
        self.prefill_graphs[L] = graph                                       # most recently used last
        return graph(embeds, positions, pads)

    def prefill_forward(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        pad: torch.Tensor | None) -> torch.Tensor:
        """The prefill itself, eager or under capture: embeds (B, L, D), positions (3, B, L), slots
        (L,) = arange(L), pad (B,) first real slot per row (None: no padding) -> (B, V) float32
        logits at the last position. Everything stays on the device (no host values)."""
        vlm, L = self.vlm, embeds.shape[1]
        self.cache.at(slots, L)
        allowed = None
        if pad is not None:
            allowed = (slots[:, None] >= slots) & (slots >= pad[:, None, None])  # (B, L, L) causal, real keys
            # a padded query row would have nothing to attend to, and a fully masked softmax row is
            # NaN, which the attention weights 0 * NaN would carry into every real row
            allowed = (allowed | torch.eye(L, dtype=torch.bool, device=vlm.device))[:, None]
        hidden = vlm._lm_step(embeds, vlm._masks(allowed), positions, self.cache)  # (B, L, D)
        return vlm.model.lm_head(hidden[:, -1]).float()                     # (B, V)

    def start(self, next_position: torch.Tensor, pads: list[int], prefix_len: int) -> None:
        """Decoding continues at slot prefix_len with M-RoPE positions next_position (B,) onward."""
        self.slot.fill_(prefix_len)
        self.rope_offset.copy_(next_position - prefix_len)
        self.pad.copy_(torch.tensor(pads))
        self.cache.at(self.slot, self.length)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed token (B,) -> (B, V) float32 logits of the next one (a graph's: valid until the next step)."""
        self.token.copy_(token)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits

    def _forward(self) -> torch.Tensor:
        vlm = self.vlm
        embeds = vlm._lm.embed_tokens(self.token)[:, None]                   # (B, 1, D)
        allowed = (self.key_slots >= self.pad[:, None]) & (self.key_slots <= self.slot)  # (B, Lmax)
        positions = (self.rope_offset + self.slot).view(1, -1, 1).expand(3, -1, 1)     # (3, B, 1)
        hidden = vlm._lm_step(embeds, vlm._masks(allowed[:, None, None]), positions, self.cache)
        logits = vlm.model.lm_head(hidden[:, -1]).float()                    # (B, V)
        self.slot.add_(1)
        return logits

    def capture(self, pool) -> None:
        """Record one step as a CUDA graph (the buffers' values now do not matter: start() resets them)."""
        self.cache.at(self.slot, self.length)
        stream = torch.cuda.Stream(self.vlm.device)
        stream.wait_stream(torch.cuda.current_stream(self.vlm.device))
        with torch.cuda.stream(stream):
            for _ in range(2):              # kernels get chosen and workspaces allocated before capture
                self._forward()
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: in live mode the other stages keep launching work from their threads;
            # CAPTURE_LOCK: but not allocating page-locked memory, which fails during a capture
            with CAPTURE_LOCK, torch.cuda.graph(self.graph, pool=pool, stream=stream,
                                                capture_error_mode="thread_local"):
                self.logits = self._forward()
        torch.cuda.current_stream(self.vlm.device).wait_stream(stream)


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
        device = self.decoder.vlm.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):              # kernels get chosen and workspaces allocated before capture
                self._forward()
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: in live mode the other stages keep launching work from their threads;
            # CAPTURE_LOCK: but not allocating page-locked memory, which fails during a capture
            with CAPTURE_LOCK, torch.cuda.graph(self.graph, pool=self.pool, stream=stream,
                                                capture_error_mode="thread_local"):
                self.logits = self._forward()
        torch.cuda.current_stream(device).wait_stream(stream)
