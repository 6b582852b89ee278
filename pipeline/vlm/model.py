"""The VLM stage: pruned visual tokens in, answers out (Qwen2-VL / Qwen2.5-VL through HF transformers).

Per request: preprocess on the device -> vision tower on every patch (vlm.encode: all) or on the kept
cells' patches only (kept: pipeline.vlm.kept_vision) -> merged tokens (T', gh, gw, D) -> keep/pool
per the allocation -> LM prefix whose visual part holds only the kept tokens, each at the M-RoPE
position the full (unpruned) sequence gives it -> our own KV-cached decoding loop, batched over
requests with left padding. With vlm.pass2 on, the keep map holds pass 1's candidates and
pipeline/vlm/passes.py keeps the final tokens among them (and answers again with more while
unsure: vlm.tempering).
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from arr_coc.lod import token_frames
from pipeline.core.cuda import to_device
from pipeline.vlm.config import KV_CACHE_GIB, VLMConfig
from pipeline.vlm.decoding import (MAX_PREFILL_GRAPHS, PACKED_SDPA, PrefillGraph, StaticDecoder,  # noqa: F401
                                   StaticKVCache, register_packed_sdpa, sample_next, sdpa_packed_gqa)
from pipeline.vlm import hf
from pipeline.vlm.feature_cache import FeatureCache
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.kept_graph import KeptGraphs
from pipeline.vlm.kept_vision import KeptEncoder, KeptFeatures, nonzero_each
from pipeline.vlm.passes import Passes
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm.probe import Probe
from pipeline.vlm.selection import (allocation_keys, pair_lod, select_tokens, snap_to_windows, token_cells,
                                    token_relevance)
from pipeline.vlm.tempering import PER_TOKEN, first_token_confidence
from pipeline.vlm.text_model import FastTextModel, unsupported
from pipeline.vlm.vision_attention import batched_attention, patch_vision_attention
from pipeline.vlm.vision_blocks import patch_vision_blocks
from pipeline.vlm.vision_graph import VisionGraphs

SYSTEM_PROMPT = "You are a helpful assistant."
CACHE_BUCKET = 256        # static KV caches are this many slots apart, so nearby prompt lengths share one
PREFILL_BUCKET = 64       # short prefixes are left padded up to a multiple of this, so prefill shapes repeat
SUFFIX_BUCKET = 16        # questions after a shared window are left padded up to a multiple of this
# Decoders (one per (batch bucket, cache length), see batch_bucket) are kept, least recently used
# dropped first, while their KV caches and prefill-graph input buffers fit vlm.kv_cache_gib (6 GiB by
# default: KV_CACHE_BUDGET bytes). A cache slot of one row holds K and V of every layer: 2 x 28
# layers x 2 KV heads x 128 dims x 2 bytes
# (bf16) = 28 KiB for Qwen2-VL-2B, 56 KiB for Qwen2.5-VL-7B (4 KV heads). 6 GiB are 224k slot-rows
# (2B) or 112k (7B). Every bucket 1+2+4+8+16 = 31 rows at the live-mode cache length 768 (a pruned
# ~500-token prefix + 64 new tokens) is 23.8k slot-rows, 0.64 GiB (2B) / 1.27 GiB (7B): 9 (2B) or
# 4 (7B) such cache lengths of all five buckets fit; at the longest graphed prefix (2048 + 64 new ->
# 2304 slots) one full set is 1.91 / 3.81 GiB. (The 4 decoders the old count cap kept could hold
# up to 4 x 16 x 2304 slot-rows: 3.9 GiB for the 2B, 7.9 GiB for the 7B.) Not counted: the graphs'
# shared memory pool (decode-step activations are small; prefill activations are reused across
# prefill graphs, which never run at once).
KV_CACHE_BUDGET = int(KV_CACHE_GIB * (1 << 30))       # bytes, at vlm.kv_cache_gib's default
# A graph-replayed prefill runs every row of the batch bucket, padding rows included. An eager
# prefill of a short prefix is bound by its ~20 ms of kernel launches (28 layers, whatever the model
# size), which is about what an H100 needs for this many FLOPs (~600 TFLOP/s dense bf16). So a batch
# is row padded (and replayed) only while the padded prefill's compute stays under that: then the
# replay beats the eager launches; past it the eager prefill at the true batch is GPU-bound and
# cheaper than computing the padding rows. At 2 FLOPs per decoder-layer parameter and token this
# allows ~4.6k padded tokens for the 2B (1.3B parameters in its layers: bucket 16 up to 256 tokens,
# 8 up to 512, 4 up to 1088), ~900 for the 7B (6.5B); a batch that fills its bucket has no padding
# rows and is replayed up to graph_prefill_max_tokens as before.
PREFILL_LAUNCH_FLOPS = 12e12
MAX_LAYOUTS = 16          # prompt layouts (per visual grid: embeddings, M-RoPE positions) kept per VLM
DONE_CHECK_EVERY = 8      # decode steps between host checks for "every row has finished" (each one syncs)
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
    reuse_key: str | None = None        # live stream whose cached vision features may serve (encode: kept)
    scene_change: bool = False          # a cut since reuse_key's previous request: its cache is dropped first
    # (T, gh, gw) float pass 1's realized relevance of each cell (ARR-COC's, as the keep map's): the
    # tempering ladder's passes keep the best-scored tokens (vlm.tempering.rank: relevance); None: none
    scores: np.ndarray | torch.Tensor | None = None

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
        if self.reuse_key is not None and not isinstance(self.reuse_key, str):
            raise ValueError(f"AnswerRequest.reuse_key must be a string or None, got {self.reuse_key!r}")
        if self.scores is not None:
            check_scores(self.scores, shape[0] if self.keep is None else tuple(self.keep.shape))


def check_scores(scores: np.ndarray | torch.Tensor, expected: int | tuple[int, ...]) -> None:
    """Pass 1's relevance map: (T, gh, gw) finite floats, T frames (an int) or the keep map's shape."""
    if not isinstance(scores, (np.ndarray, torch.Tensor)):
        raise ValueError(f"AnswerRequest.scores must be a (T, gh, gw) float array, got {type(scores).__name__}")
    shape = tuple(scores.shape)
    fits = len(shape) == 3 and (shape[0] == expected if isinstance(expected, int) else shape == expected)
    if not fits:
        want = f"(T={expected}, gh, gw)" if isinstance(expected, int) else f"the keep map's shape {expected}"
        raise ValueError(f"AnswerRequest.scores must be {want}, got {shape}")
    floating = scores.is_floating_point() if isinstance(scores, torch.Tensor) else np.issubdtype(scores.dtype, np.floating)
    if not floating:
        raise ValueError(f"AnswerRequest.scores must be floats, got {scores.dtype}")
    finite = bool(torch.isfinite(scores).all()) if isinstance(scores, torch.Tensor) else bool(np.isfinite(scores).all())
    if not finite:
        raise ValueError("AnswerRequest.scores must be finite (pass 1's relevance), got NaN or inf")


@dataclass(frozen=True)
class WindowQuestions:
    """Questions about one window of frames (VLM.answer_windows): frames (T, H, W, 3), keep
    (T, gh, gw) LOD or None (every token), scores pass 1's relevance or None, as AnswerRequest's."""
    frames: np.ndarray | torch.Tensor
    keep: np.ndarray | torch.Tensor | None
    questions: list[str]
    scores: np.ndarray | torch.Tensor | None = None


@dataclass(frozen=True)
class AnswerResult:
    text: str
    tokens_kept: int     # visual tokens actually sent to the LM (in the final pass)
    tokens_full: int     # visual tokens the stock model would use for the same frames
    latency_s: float
    passes: int = 1      # answering passes (tempering: one per rung of the budget ladder tried)
    tokens_spent: int | None = None   # visual tokens over all passes (None: tokens_kept, one pass)
    confidence: float = float("nan")  # of the first answer token (vlm.tempering.confidence; NaN: unknown)

    def __post_init__(self) -> None:
        if self.tokens_spent is None:
            object.__setattr__(self, "tokens_spent", self.tokens_kept)
        if self.passes < 1 or self.tokens_spent < self.tokens_kept:
            raise ValueError(f"AnswerResult: passes ({self.passes}) must be >= 1 and tokens_spent "
                             f"({self.tokens_spent}) >= tokens_kept ({self.tokens_kept})")


@dataclass
class Prefix:
    """LM input of one request, pruned: embeds (L, D), positions (3, L) of the full sequence at the
    kept tokens, and next_position, the first generated token's position (full max + 1)."""
    embeds: torch.Tensor
    positions: torch.Tensor
    next_position: int
    tokens_kept: int
    tokens_full: int
    window: WindowPrefix | None = None  # the window whose tokens lead embeds (question_prefix)


@dataclass
class WindowPrefix:
    """What every question about one window shares: the system prompt and the kept visual tokens,
    embeds (S, D) and positions (3, S); text_start, the M-RoPE position of the first token after the
    video; max_position, the largest position of the full (unpruned) prompt up to there; scores
    (tokens_kept,) float32 pass 1's relevance of each kept visual token, in their order (None: none
    given): a frame pair's token the higher of its two cells, a pooled token its block's best."""
    embeds: torch.Tensor
    positions: torch.Tensor
    text_start: int
    max_position: int
    tokens_kept: int
    tokens_full: int
    scores: torch.Tensor | None = None


@dataclass(frozen=True)
class _Layout:
    """The prompt up to the end of the video for one visual grid, whatever the keep map: embeddings
    of the ids before the video (v0, D), M-RoPE positions of those ids and of every video token
    (3, v0 + n_full), and where the text after the video starts (text_start; max_position as above)."""
    before: torch.Tensor
    positions: torch.Tensor
    text_start: int
    max_position: int


@dataclass
class Generation:
    tokens: torch.Tensor               # (B, N) generated ids, pad after EOS
    lengths: list[int]                 # generated tokens per row up to and including EOS
    step_logits: list[torch.Tensor]    # N x (B, V) float32, only when requested
    decode_s: float = float("nan")     # first token -> last token wall time, only when timed
    confidence: list[float] | None = None   # (B) of the first token, or of the answer's least sure one
                                            # (vlm.tempering.confidence; tempering.first_token_confidence)


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


def shared_windows(prefixes: list[Prefix]) -> tuple[list[WindowPrefix], list[int]] | None:
    """(windows, window of each prefix) where every prefix starts with a window (question_prefix)
    and some window leads several: questions about one window then share its prefill. None: no
    sharing (a prefix without a window, or one prefix per window)."""
    windows: list[WindowPrefix] = []
    index: dict[int, int] = {}
    window_of = []
    for p in prefixes:
        if p.window is None:
            return None
        if id(p.window) not in index:
            index[id(p.window)] = len(windows)
            windows.append(p.window)
        window_of.append(index[id(p.window)])
    return (windows, window_of) if len(windows) < len(prefixes) else None


def snapshot_dir(name: str) -> str | None:
    """The snapshot directory of the VLM named `name`, else None: load_vlm names a VLM loaded from
    a snapshot (a shipped one by name, or a local directory) by that directory."""
    return name if name and Path(name).is_dir() else None


class VLM:
    def __init__(self, model, tokenizer, *, family: str, name: str, config: VLMConfig,
                 preprocessor: VideoPreprocessor, warning: str | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.family = family
        self.name = name
        self.config = config
        self.preprocessor = preprocessor
        # set for tiny-random (its answers are meaningless) and outside transformers' tested range
        version_warning = hf.check_version()
        self.warning = "; ".join(w for w in (warning, version_warning) if w) or None
        if version_warning is not None:  # HF's own forward, every patch: the fast paths are tested on TESTED_RANGE only
            config = dataclasses.replace(config, fast_lm=False, fast_vision=False, encode="all")
            self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.lm = hf.language_model(model)
        self._visual = hf.vision_tower(model)
        if version_warning is None:
            patch_vision_attention(self._visual)
        if config.fast_vision:
            patch_vision_blocks(self._visual)
        self._cache_kw = hf.cache_keyword(self.lm)
        self.attn_impl = hf.attention_implementation(self.lm.config)
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"Invalid LM attention implementation ({self.attn_impl!r}). "
                             f"Supported values are {', '.join(ATTENTION_IMPLS)}.")
        if self.attn_impl == "sdpa" and version_warning is None:  # the LM's config only: the vision tower keeps its own
            register_packed_sdpa()
            hf.set_attention_implementation(self.lm.config, PACKED_SDPA)
            self.attn_impl = PACKED_SDPA
        # our forward of the LM's layers (same results, fewer kernels), where the model allows it
        self._fast_lm = FastTextModel(self.lm, self.attn_impl) if config.fast_lm and unsupported(self.lm) is None else None
        layer_types = set(getattr(self.lm.config, "layer_types", None) or ["full_attention"])
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
        layer_params = sum(p.numel() for p in self.lm.layers.parameters())
        self.row_padded_prefill_tokens = int(PREFILL_LAUNCH_FLOPS // (2 * layer_params))
        attn = self.lm.layers[0].self_attn
        # bytes of one cache slot of one row: K and V of every layer
        self._slot_bytes = 2 * len(self.lm.layers) * attn.k_proj.out_features * self.dtype.itemsize
        self.counters = {"decoders": 0, "evicted": 0, "decode_graphs": 0, "prefill_graphs": 0}
        self._graph_pool = None             # one CUDA memory pool for every captured graph (decode, prefill, vision)
        self._vision_graphs = (VisionGraphs(self._visual, self.dtype, self._pool)
                               if self.device.type == "cuda" and config.cuda_graphs else None)
        # the tower over chosen cells only (encode: kept, and VLM.encode_cells), with live reuse
        cache = (FeatureCache(config.reuse_cells, config.reuse_threshold, preprocessor.image_std,
                              preprocessor.geometry.temporal_patch_size)
                 if config.encode == "kept" and config.reuse_cells else None)
        kept_graphs = (KeptGraphs(self._visual, self.dtype, self._pool)     # needs the patched attention
                       if self.device.type == "cuda" and config.cuda_graphs and version_warning is None else None)
        self.kept_encoder = KeptEncoder(self._visual, preprocessor, self.dtype, self.lm.embed_tokens.embedding_dim,
                                        cache, kept_graphs, whole_windows=config.kept_windows == "whole",
                                        context=config.kept_context)
        self._layouts: OrderedDict[tuple[int, int, int], _Layout] = OrderedDict()
        self._before_ids: list[int] | None = None
        self._pad_embed: torch.Tensor | None = None
        # vlm.tempering.confidence=probe: the learned confidence every answer reports (and tempering reads)
        self.probe = (Probe.load(config.tempering.probe, snapshot=snapshot_dir(name))
                      if config.tempering.confidence == "probe" else None)
        # pass 2 and tempering (vlm.pass2, vlm.tempering): None while pass 2 is off
        self.passes = Passes(self) if config.multipass else None
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
        ids = to_device(self.tokenizer(question).input_ids, self.device, torch.long)
        return self.lm.embed_tokens(ids)                                   # (L, D)

    @torch.no_grad()
    def visual_tokens(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        merged = self._merged_tokens([frames])[0]                            # (T', gh, gw, D)
        return merged.flatten(1, 2)                                          # (T', gh*gw, D)

    # ---- front end: preprocess + vision tower + selection ----
    def _merged_tokens(self, videos: list) -> list[torch.Tensor]:
        return self._vision(*self._preprocess(videos))

    def _preprocess(self, videos: list) -> tuple[torch.Tensor, torch.Tensor]:
        """-> pixels (N_patches, F) on the device, grid_thw (N, 3) on the host."""
        pixels, grids = zip(*(self.preprocessor(v, self.device) for v in videos))
        return torch.cat(pixels).to(self.dtype), torch.stack(grids)

    def _vision(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """All patches through the vision tower (a replayed graph where one runs them) -> per video
        merged tokens (T', gh, gw, D)."""
        grids = grid_thw.tolist()
        merged = self._vision_graphs(pixels, grids) if self._vision_graphs is not None else None
        if merged is None:
            same_size = len({(h, w) for _, h, w in grids}) == 1
            with batched_attention(grids[0][1] * grids[0][2] if same_size else None):  # one attention call per layer
                out = self._visual(pixels, grid_thw=grid_thw.to(self.device))
            merged = out.pooler_output if hasattr(out, "pooler_output") else out  # (sum T'gh gw, D)
        m = self.geometry.merge_size
        sizes = [t * h * w // m**2 for t, h, w in grids]
        return [x.view(t, h // m, w // m, -1) for x, (t, h, w) in zip(merged.split(sizes), grids)]

    def prompt_ids(self, question: str, n_video_tokens: int) -> tuple[list[int], list[int]]:
        """Qwen chat format around one video: ids before and after the video pad tokens."""
        if self._before_ids is None:
            before = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            self._before_ids = self.tokenizer(before).input_ids
        after = f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
        return list(self._before_ids), self.tokenizer(after).input_ids

    def full_input_ids(self, question: str, n_video_tokens: int) -> torch.Tensor:
        before, after = self.prompt_ids(question, n_video_tokens)
        return torch.tensor(before + [self.video_token_id] * n_video_tokens + after, device=self.device)

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        """LM prefix length of `question` about a window of which `visual_tokens` tokens are kept
        (what warm_up needs to know ahead of time)."""
        before, after = self.prompt_ids(question, visual_tokens)
        return len(before) + visual_tokens + len(after)

    def rope_positions(self, input_ids: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(L,) unpruned ids, grid (3,) -> (3, L) M-RoPE positions from the model's own get_rope_index."""
        seconds = (torch.tensor([self.geometry.temporal_patch_size / self.config.fps])
                   if self.family == "qwen2_5_vl" else None)
        positions = hf.rope_index(self.model, input_ids[None], grid_thw[None].to(self.device), self.video_token_id,
                                  seconds)                                   # (3, 1, L)
        return positions[:, 0]                                               # (3, L)

    def encode_cells(self, frames: np.ndarray | torch.Tensor, cells: np.ndarray | torch.Tensor | None) -> KeptFeatures:
        """The vision tower on the given cells only: frames (T, H, W, 3), cells (T, gh, gw) nonzero
        where wanted (e.g. a pass's candidates) -> their merged tokens (pipeline.vlm.kept_vision)."""
        return self.kept_encoder.encode(frames, cells)

    def _window_tokens(self, requests: list[AnswerRequest], keeps: list | None = None) -> list[torch.Tensor]:
        """Per request merged tokens (T', gh, gw, D) to select from: every cell's (encode: all), or
        the kept cells' only, zeros elsewhere (encode: kept); keeps: the requests' keep maps already
        on the device (default: theirs)."""
        if self.config.encode == "all":
            return self._merged_tokens([r.frames for r in requests])
        reuse = [(r.reuse_key, r.scene_change) if r.reuse_key is not None else None for r in requests]
        keeps = [r.keep for r in requests] if keeps is None else keeps
        return self.kept_encoder.merged([r.frames for r in requests], keeps, reuse)

    @torch.no_grad()
    def prepare(self, requests: list[AnswerRequest]) -> list[Prefix]:
        return [self.question_prefix(window, r.question)
                for window, r in zip(self._window_prefixes(requests), requests)]

    def _window_prefixes(self, requests: list[AnswerRequest]) -> list[WindowPrefix]:
        """Each request's window prefix, the vision tower run once for all of them."""
        keeps = [self._snapped(r.keep, r.scores) for r in requests]          # uploaded once
        # every window's token positions from one nonzero (a host read, and under live load a wait
        # for the interpreter lock: one per batch, not one per request), read before the vision
        # tower is queued: read after, it waited for the tower, and the host then built the
        # prefixes while the GPU idled
        indices = nonzero_each([self._token_mask(r.frames, keep) for r, keep in zip(requests, keeps)])
        merged_all = self._window_tokens(requests, keeps)
        return [self.window_prefix(r.frames, keep, m, r.scores, index=index)
                for r, keep, m, index in zip(requests, keeps, merged_all, indices)]

    def _snapped(self, keep: np.ndarray | torch.Tensor | None,
                 scores: np.ndarray | torch.Tensor | None) -> torch.Tensor | None:
        """A request's keep map on the device, its tokens moved into whole windows when
        vlm.snap_windows asks for it and pass 1's relevance is there (selection.snap_to_windows)."""
        if keep is None:
            return None
        keep = to_device(keep, self.device)
        side = self.config.snap_windows
        if not side or scores is None:
            return keep
        return snap_to_windows(keep, to_device(scores, self.device), side, self.geometry.temporal_patch_size)

    def _token_mask(self, frames: np.ndarray | torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """(T' gh gw,) bool: the cells of frames (T, H, W, 3) that carry a token under keep (None:
        all), worked out from the grid alone, before any encoding (selection.token_cells)."""
        T, H, W = frames.shape[:3]
        grid = (token_frames(T, self.geometry.temporal_patch_size), *self.geometry.grid(H, W))
        return token_cells(self._window_lod(frames, keep, grid)).flatten()

    @torch.no_grad()
    def build_prefix(self, req: AnswerRequest, merged: torch.Tensor) -> Prefix:
        """Selection: merged tokens (T', gh, gw, D) of req's frames -> its pruned LM prefix."""
        return self.question_prefix(self.window_prefix(req.frames, req.keep, merged, req.scores), req.question)

    def _window_lod(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
                    grid: tuple[int, int, int]) -> torch.Tensor:
        """keep (T, gh, gw) LOD or None (all), checked against the frames' grid -> (T', gh, gw) LOD
        per video token (the pairing rule)."""
        Tp, gh, gw = grid
        if keep is None:
            return torch.ones(Tp, gh, gw, dtype=torch.int8, device=self.device)
        keep = to_device(keep, self.device)                                  # a no-op for a device tensor
        expected = (frames.shape[0], gh, gw)
        if tuple(keep.shape) != expected:
            raise ValueError(f"keep map shape {tuple(keep.shape)} does not match the VLM grid {expected} "
                             f"for {frames.shape[2]}x{frames.shape[1]} frames")
        return pair_lod(keep, self.geometry.temporal_patch_size)

    @torch.no_grad()
    def window_prefix(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
                      merged: torch.Tensor, scores: np.ndarray | torch.Tensor | None = None, *,
                      index: torch.Tensor | None = None) -> WindowPrefix:
        """The question-independent part of the prefix: frames (T, H, W, 3) (only their shape is
        used), keep (T, gh, gw) LOD or None (all tokens), merged tokens (T', gh, gw, D) of them,
        scores (T, gh, gw) pass 1's relevance or None (WindowPrefix.scores); index: the kept tokens'
        cells when the caller read them already (selection.token_cells' nonzero)."""
        Tp, gh, gw, _ = merged.shape
        keep = None if keep is None else to_device(keep, self.device)       # (already there from prepare)
        lod = self._window_lod(frames, keep, (Tp, gh, gw))
        tokens, index = select_tokens(merged, lod, index)                    # (K, D), (K,)
        layout = self._layout(Tp, gh, gw)
        v0 = layout.before.shape[0]
        embeds = torch.cat([layout.before, tokens.to(layout.before.dtype)])  # (v0 + K, D)
        positions = torch.cat([layout.positions[:, :v0], layout.positions[:, v0 + index]], 1)  # (3, v0 + K)
        token_scores = None
        if scores is not None:
            expected = (frames.shape[0], gh, gw)
            if tuple(scores.shape) != expected:
                raise ValueError(f"scores shape {tuple(scores.shape)} does not match the VLM grid {expected} "
                                 f"for {frames.shape[2]}x{frames.shape[1]} frames")
            scores = to_device(scores, self.device).float()
            tempering = self.config.tempering
            allocation = tempering.ladder and tempering.rank == "allocation" and self.config.pass2 == "off"
            if allocation and keep is not None:
                scores = allocation_keys(keep, scores, tempering.rungs)      # each rung's own allocation
            if not (allocation and keep is None):                            # every token, no allocation: one pass
                token_scores = token_relevance(scores, lod, index, self.geometry.temporal_patch_size)  # (K,)
        return WindowPrefix(embeds, positions, layout.text_start, layout.max_position, int(index.numel()),
                            Tp * gh * gw, token_scores)

    @torch.no_grad()
    def question_prefix(self, window: WindowPrefix, question: str) -> Prefix:
        """One question's prefix over a window's shared part: only the text after the video is new,
        at consecutive M-RoPE positions (t = h = w) from window.text_start on."""
        return self.question_prefixes(window, [question])[0]

    @torch.no_grad()
    def question_prefixes(self, window: WindowPrefix, questions: list[str]) -> list[Prefix]:
        """question_prefix of each question, their text embedded in one lookup (one host copy)."""
        afters = [self.prompt_ids(q, 0)[1] for q in questions]
        texts = self.lm.embed_tokens(to_device([i for a in afters for i in a], self.device, torch.long))
        prefixes = []
        for after, text in zip(afters, texts.split([len(a) for a in afters])):  # (n, D) each
            n = len(after)
            positions = (window.text_start + torch.arange(n, device=self.device)).expand(3, n)
            next_position = max(window.max_position, window.text_start + n - 1) + 1  # the full prompt's max + 1
            prefixes.append(Prefix(torch.cat([window.embeds, text]), torch.cat([window.positions, positions], 1),
                                   next_position, window.tokens_kept, window.tokens_full, window))
        return prefixes

    def _layout(self, Tp: int, gh: int, gw: int) -> _Layout:
        key = (Tp, gh, gw)
        layout = self._layouts.pop(key, None)
        if layout is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.popitem(last=False)
            layout = self._make_layout(Tp, gh, gw)
        self._layouts[key] = layout                                          # most recently used last
        return layout

    def _make_layout(self, Tp: int, gh: int, gw: int) -> _Layout:
        """get_rope_index (python-heavy) once per visual grid, on the full prompt of a probe question:
        M-RoPE puts the text after the video on one run of consecutive positions whatever its ids,
        so the probe tells where any question's text starts (checked here, not assumed)."""
        n_full = Tp * gh * gw
        before, probe = self.prompt_ids("?", n_full)
        ids = torch.tensor(before + [self.video_token_id] * n_full + probe, device=self.device)
        m = self.geometry.merge_size
        full_pos = self.rope_positions(ids, torch.tensor([Tp, gh * m, gw * m]))  # (3, L_full)
        end = len(before) + n_full
        text_pos = full_pos[:, end:]                                         # (3, len(probe))
        text_start = int(text_pos[0, 0])
        if not torch.equal(text_pos, text_start + torch.arange(len(probe), device=self.device).expand(3, -1)):
            raise RuntimeError(f"get_rope_index of this transformers version does not place the text after "
                               f"the video at consecutive positions ({text_pos.tolist()}): questions cannot "
                               f"share a window's positions")
        return _Layout(self.lm.embed_tokens(torch.tensor(before, device=self.device)), full_pos[:, :end],
                       text_start, int(full_pos[:, :end].max()))

    # ---- language model: prefill + cached decoding ----
    def lm_step(self, embeds, attention_mask, positions, cache):
        """The LM's layers: embeds (B, L, D), _masks()'s mapping (None: causal), positions (3, B, L),
        a cache with update() or None -> (B, L, D) final hidden states; through FastTextModel when on."""
        if self._fast_lm is not None:
            return self._fast_lm(embeds, None if attention_mask is None else attention_mask["full_attention"],
                                 positions, cache)
        return self._hf_lm_step(embeds, attention_mask, positions, cache)

    def _hf_lm_step(self, embeds, attention_mask, positions, cache):
        """lm_step through HF's own text model forward (which takes any mask form it knows)."""
        out = self.lm(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                       use_cache=cache is not None, **{self._cache_kw: cache})
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
        graph: there the eager prefill is bound by the host launching a few hundred kernels (about
        20 ms for 28 layers, whatever the model size), not by the GPU. Padding rows compute like real
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
        if (not cfg.cuda_graphs or length > cfg.graph_prefill_max_tokens
                or (rows > batch and rows * row_length > self.row_padded_prefill_tokens)):
            return None
        return rows

    def _prefill_plan(self, prefix_len: int, batch: int = 1) -> tuple[int, bool]:
        """(length, graphed) of _prefill_shape."""
        length, _, graphed = self._prefill_shape(prefix_len, batch)
        return length, graphed

    def _pool(self):
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
        if steps and decoder.graph is None and self.device.type == "cuda" and self.config.cuda_graphs:
            decoder.capture(self._pool())
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
        L, rows, graphed = self._prefill_shape(max(p.embeds.shape[0] for p in prefixes), B)
        embeds, positions, pads = self._left_pad(prefixes, L, rows)         # (rows, L, D), (3, rows, L)
        decoder = self._decoder(self._rows(B), self._cache_length(L, max_new), steps=max_new > 1)
        logits = decoder.prefill(embeds, positions, pads, pool=self._pool() if graphed else None)[:B]  # (B, V)
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
        Lw, Lq, rows, graphed = self._shared_shape(max(lens), max(s.embeds.shape[0] for s in suffixes), B)
        pad = self._pad_embedding()                                          # (D,)
        embeds = pad.expand(K, Lw, -1).clone()                               # (K, Lw, D), right padded
        positions = torch.ones(3, K, Lw, dtype=torch.long, device=self.device)
        for k, (w, n) in enumerate(zip(windows, lens)):
            embeds[k, :n] = w.embeds
            positions[:, k, :n] = w.positions
        sfx, sfx_pos, pads = self._left_pad(suffixes, Lq, rows)             # (rows, Lq, D), (3, rows, Lq)
        decoder = self._decoder(self._rows(B), self._cache_length(Lw + Lq, max_new), steps=max_new > 1)
        # padding rows (all padding after the window) copy window 0
        logits = decoder.prefill_shared(embeds, positions, window_of + [0] * (rows - B), lens, sfx, sfx_pos, pads,
                                        pool=self._pool() if graphed else None)[:B]     # (B, V)
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
        self._sync()
        return [k for k in dict.fromkeys(keys) if k in self._decoders]

    @torch.no_grad()
    def generate(self, prefixes: list[Prefix], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 return_logits: bool = False, timed: bool = False,
                 confidence: torch.Tensor | None = None) -> Generation:
        max_new = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        decoder, logits = self.prefill(prefixes, max_new)                    # (B, V)
        return self.generate_from(decoder, logits, len(prefixes), max_new_tokens=max_new, temperature=temperature,
                                  top_p=top_p, seed=seed, return_logits=return_logits, timed=timed,
                                  confidence=confidence)

    @torch.no_grad()
    def prefill(self, prefixes: list[Prefix], max_new_tokens: int | None = None) -> tuple[StaticDecoder, torch.Tensor]:
        """The first half of generate: prefixes prefilled (sharing windows where they do) into a
        decoder with room for max_new_tokens -> the decoder and the (B, V) float32 logits of the
        first generated token (valid until the VLM replays a graph again). generate_from goes on."""
        max_new = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        return self._prefill(prefixes, max_new, shared_windows(prefixes))

    @torch.no_grad()
    def generate_from(self, decoder: StaticDecoder, logits: torch.Tensor, batch: int, *,
                      max_new_tokens: int | None = None, temperature: float | None = None,
                      top_p: float | None = None, seed: int | None = None, return_logits: bool = False,
                      timed: bool = False, confidence: torch.Tensor | None = None) -> Generation:
        """The decoding loop after prefill(): `batch` rows, from the first token's logits (B, V) on.
        confidence: the first token's (B,) first_confidence, where the caller already has it (None:
        computed here)."""
        cfg = self.config
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = cfg.temperature if temperature is None else temperature
        top_p = cfg.top_p if top_p is None else top_p
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed if seed is None else seed)
        B = batch
        measure = cfg.tempering.confidence
        if confidence is None:
            confidence = self.first_confidence(logits)                       # (B,), before a replay overwrites
        else:
            confidence = confidence.to(self.device, torch.float32)
        per_token = measure in PER_TOKEN                                      # the least sure of every token
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        tokens, step_logits = [], []
        t_first = None
        for step in range(max_new):
            if return_logits:
                step_logits.append(logits.clone())                           # a graph overwrites its output
            if per_token and step:                                           # step 0: `confidence` already
                confidence = torch.where(done, confidence, torch.minimum(confidence,
                                                                         first_token_confidence(logits, measure)))
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
        return Generation(torch.stack(tokens[:n], 1), lengths_list, step_logits[:n], decode_s, confidence.tolist())

    def first_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) first-token logits -> (B,) float32 confidence in [0, 1] by vlm.tempering.confidence
        (the probe's when it is `probe`; `answer` and `coverage` report the first token's margin)."""
        if self.probe is not None:
            return self.probe.confidence(logits)
        return first_token_confidence(logits, self.config.tempering.confidence)

    def _sync(self) -> None:
        """Wait for this thread's VLM work (the current stream, where every replay lands too). Not a
        device-wide sync: that would wait on, and so invalidate, a graph another thread is capturing
        (seen in live mode: "operation failed due to a previous error during capture" in texture)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def logits_without_cache(self, prefix: Prefix, continuation: torch.Tensor) -> torch.Tensor:
        """Reference for the cached loop: one uncached forward over prefix + continuation (N,) ids
        -> (N + 1, V) float32 logits predicting each next token."""
        cont = self.lm.embed_tokens(continuation.to(self.device))            # (N, D)
        embeds = torch.cat([prefix.embeds, cont])[None]                      # (1, L + N, D)
        pos_cont = prefix.next_position + torch.arange(continuation.numel(), device=self.device)
        positions = torch.cat([prefix.positions, pos_cont.expand(3, -1)], 1)[:, None]  # (3, 1, L + N)
        hidden = self.lm_step(embeds, None, positions, None)[0, prefix.embeds.shape[0] - 1:]
        return self.model.lm_head(hidden).float()

    def decode(self, tokens: torch.Tensor, length: int) -> str:
        ids = tokens[:length].tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def answer(self, requests: list[AnswerRequest]) -> list[AnswerResult]:
        if not requests:
            return []
        started = time.monotonic()
        prefixes = self.prepare(requests)
        if self.passes is not None:                                          # pass 2 (and tempering)
            return [AnswerResult(**fields) for fields in self.passes.answer(
                [p.window for p in prefixes], [r.question for r in requests],
                [started if r.arrival_s is None else r.arrival_s for r in requests])]
        out = self.generate(prefixes)
        self._sync()
        ready = time.monotonic()
        return [AnswerResult(text=self.decode(out.tokens[b], out.lengths[b]), tokens_kept=p.tokens_kept,
                             tokens_full=p.tokens_full,
                             latency_s=ready - (r.arrival_s if r.arrival_s is not None else started),
                             confidence=out.confidence[b])
                for b, (r, p) in enumerate(zip(requests, prefixes))]

    @torch.no_grad()
    def answer_questions(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
                         questions: list[str], *, max_batch: int | None = None,
                         scores: np.ndarray | torch.Tensor | None = None) -> list[AnswerResult]:
        """Several questions about one window: the vision tower, the selection and the M-RoPE positions
        run once, each question adds only its own text to the shared prefix (prefilled once), and they
        decode together (`max_batch` per generate call, None: all at once). latency_s is the time from
        this call to each answer. scores: pass 1's relevance (T, gh, gw), as AnswerRequest.scores."""
        return self.answer_windows([WindowQuestions(frames, keep, list(questions), scores)], max_batch=max_batch)[0]

    @torch.no_grad()
    def answer_windows(self, windows: list[WindowQuestions], *,
                       max_batch: int | None = None) -> list[list[AnswerResult]]:
        """answer_questions for several windows at once (a batch job's videos in flight): one vision
        tower call for all of them, each window's selection and positions once, and every question
        of every window decoded together (`max_batch` rows per generate call, None: all at once),
        each window's prefix prefilled once. -> each window's answers, in order."""
        started = time.monotonic()
        # AnswerRequest validates each window's arrays and every question
        requests = [[AnswerRequest("", w.frames, w.keep, q, 0.0, 0.0, scores=w.scores) for q in w.questions]
                    for w in windows]
        asked = [(w, r) for w, r in zip(windows, requests) if r]
        prefixes = self._window_prefixes([r[0] for _, r in asked]) if asked else []   # selection, positions
        pairs = [(window, q) for window, (w, _) in zip(prefixes, asked) for q in w.questions]
        step = max(1, len(pairs) if max_batch is None else max_batch)
        flat: list[AnswerResult] = []
        for i in range(0, len(pairs), step):
            chunk = pairs[i:i + step]
            if self.passes is not None:                                      # pass 2 (and tempering)
                flat += [AnswerResult(**fields) for fields in self.passes.answer(
                    [w for w, _ in chunk], [q for _, q in chunk], [started] * len(chunk))]
                continue
            chunk_prefixes = [p for window, qs in _by_window(chunk) for p in self.question_prefixes(window, qs)]
            out = self.generate(chunk_prefixes)
            self._sync()
            ready = time.monotonic()
            flat += [AnswerResult(text=self.decode(out.tokens[b], out.lengths[b]), tokens_kept=p.tokens_kept,
                                  tokens_full=p.tokens_full, latency_s=ready - started, confidence=out.confidence[b])
                     for b, p in enumerate(chunk_prefixes)]
        results, at = [], 0
        for w in windows:
            results.append(flat[at:at + len(w.questions)])
            at += len(w.questions)
        return results


def _by_window(pairs: list[tuple[WindowPrefix, str]]) -> list[tuple[WindowPrefix, list[str]]]:
    """Consecutive (window, question) pairs grouped into (window, its questions), order kept."""
    groups: list[tuple[WindowPrefix, list[str]]] = []
    for window, question in pairs:
        if groups and groups[-1][0] is window:
            groups[-1][1].append(question)
        else:
            groups.append((window, [question]))
    return groups
