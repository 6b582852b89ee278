"""The VLM stage: pruned visual tokens in, answers out (Qwen2-VL, Qwen2.5-VL, dense Qwen3-VL).

Per request: preprocess on the device -> vision tower on every patch (vlm.encode: all) or on the kept
cells' patches only (kept) -> merged tokens (T', gh, gw, D) -> keep/pool per the allocation -> LM
prefix whose visual part holds only the kept tokens, each at the M-RoPE position the full (unpruned)
sequence gives it (Qwen3-VL: with a timestamp per frame group, and each token's DeepStack features,
which ride with it as extra channels from the tower on and are added after the LM's first layers)
-> our own KV-cached decoding loop, batched over requests with left padding. With
vlm.pass2 on, the keep map holds pass 1's candidates and pipeline/vlm/passes.py keeps the final
tokens among them (and answers again with more while unsure: vlm.tempering).

The engine's parts, each readable alone:
  encoder.py     VisionEncoder   frames -> merged visual tokens (every patch, or the kept cells')
  prefix.py      PrefixBuilder   chat format, M-RoPE layouts, selection -> WindowPrefix / Prefix
  prefill.py     DecoderPool     the LM's forward, prefill shapes, the decoders and their graphs
  generation.py  Generator       the decoding loop and the answers' confidence
  passes.py      Passes          pass 2 and tempering, driving the engine through PassEngine
  model.py       VLM             this facade: loads the parts and answers requests
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.runtime.cuda import read_back, upload
from pipeline.runtime.requests import AnswerRequest, AnswerResult, WindowQuestions
from pipeline.vlm import hf
from pipeline.vlm.decoding import StaticDecoder
from pipeline.vlm.encoder import VisionEncoder
from pipeline.vlm.feature_cache import FeatureCache
from pipeline.vlm.generation import Generation, Generator
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.kept_graph import KeptGraphs
from pipeline.vlm.kept_vision import KeptEncoder, KeptFeatures, any_on_device
from pipeline.vlm.passes import Passes
from pipeline.vlm.prefill import DecoderPool
from pipeline.vlm.prefix import Prefix, PrefixBuilder, WindowPrefix
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm.probe import Probe
from pipeline.vlm.vision_attention import patch_vision_attention
from pipeline.vlm.vision_blocks import patch_vision_blocks
from pipeline.vlm.vision_graph import VisionGraphs
from pipeline.vlm_config import VLMConfig


def snapshot_dir(name: str) -> str | None:
    """The snapshot directory of the VLM named `name`, else None: load_vlm names a VLM loaded from
    a snapshot (a shipped one by name, or a local directory) by that directory."""
    return name if name and Path(name).is_dir() else None


class VLM:
    """The answering facade over the engine's parts: `prefixes` (prompt and prefix building),
    `encoder` (the vision tower), `pool` (the LM's prefills and decoders) and `generator` (the
    decoding loop). It answers requests in one pass or through `passes` (pass 2 and tempering,
    which drive it through passes.PassEngine)."""

    def __init__(self, model, tokenizer, *, family: str, name: str, config: VLMConfig,
                 preprocessor: VideoPreprocessor, warning: str | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.family = family
        self.name = name
        self.preprocessor = preprocessor
        # set for tiny-random (its answers are meaningless) and outside transformers' tested range
        version_warning = hf.check_version()
        self.warning = "; ".join(w for w in (warning, version_warning) if w) or None
        if version_warning is not None:  # HF's own forward, every patch: the fast paths are tested on TESTED_RANGE only
            config = dataclasses.replace(config, fast_lm=False, fast_vision=False, encode="all")
        self.lm = hf.language_model(model)
        visual = hf.vision_tower(model)
        if version_warning is None:
            patch_vision_attention(visual)
        if config.fast_vision:
            patch_vision_blocks(visual)
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pool = DecoderPool(model, self.lm, config=config, pad_token_id=pad_token_id,
                                hf_fallback=version_warning is not None)
        self.device, self.dtype = self.pool.device, self.pool.dtype
        graphed = self.device.type == "cuda" and config.cuda_graphs
        # the tower over chosen cells only (encode: kept, and VLM.encode_cells), with live reuse
        cache = (FeatureCache(config.reuse_cells, config.reuse_threshold, preprocessor.image_std,
                              preprocessor.geometry.temporal_patch_size)
                 if config.encode == "kept" and config.reuse_cells else None)
        # off CUDA (cuda_graphs on), the graph caches only plan: they tell which shapes a GPU captures
        kept_graphs = (KeptGraphs(visual, self.dtype, self.pool.graph_pool,  # needs the patched attention
                                  plan_only=not graphed)
                       if config.cuda_graphs and version_warning is None else None)
        # Qwen3-VL: each token's DeepStack features ride along as more channels (hf.tower_tokens)
        token_width = self.lm.embed_tokens.embedding_dim * (1 + self.pool.deepstack)
        self.kept_encoder = KeptEncoder(visual, preprocessor, self.dtype, token_width,
                                        cache, kept_graphs, whole_windows=config.kept_windows == "whole",
                                        context=config.kept_context)
        self.encoder = VisionEncoder(visual, preprocessor, self.kept_encoder, config=config, dtype=self.dtype,
                                     device=self.device,
                                     vision_graphs=VisionGraphs(visual, self.dtype, self.pool.graph_pool,
                                                                capture_graphs=graphed)
                                     if config.cuda_graphs else None)
        self.prefixes = PrefixBuilder(model, self.lm, tokenizer, family=family, config=config,
                                      geometry=preprocessor.geometry, device=self.device)
        # vlm.tempering.confidence=probe: the learned confidence every answer reports (and tempering reads)
        self.probe = (Probe.load(config.tempering.probe, snapshot=snapshot_dir(name))
                      if config.tempering.confidence == "probe" else None)
        self.generator = Generator(self.pool, tokenizer, config=config, probe=self.probe)
        self._config = config
        # pass 2 and tempering (vlm.pass2, vlm.tempering): None while pass 2 is off
        self.passes = Passes(self) if config.multipass else None
        self.video_token_id = self.prefixes.video_token_id

    @property
    def config(self) -> VLMConfig:
        return self._config

    @config.setter
    def config(self, config: VLMConfig) -> None:
        """Another config for every part (benchmarks compare settings over one loaded model)."""
        self._config = config
        for part in (self.pool, self.encoder, self.prefixes, self.generator):
            part.config = config

    @property
    def geometry(self) -> VLMGeometry:
        return self.preprocessor.geometry

    @property
    def attn_impl(self) -> str:
        return self.pool.attn_impl

    @property
    def counters(self) -> dict[str, int]:
        return self.pool.counters

    @property
    def pad_token_id(self) -> int:
        return self.pool.pad_token_id

    @property
    def eos_ids(self) -> torch.Tensor:
        return self.generator.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: torch.Tensor) -> None:
        self.generator.eos_ids = ids

    # ---- the engine's operations (passes.PassEngine, and what callers ask of a VLM) ----
    def question_prefix(self, window: WindowPrefix, question: str) -> Prefix:
        return self.prefixes.question_prefix(window, question)

    def question_prefixes(self, window: WindowPrefix, questions: list[str]) -> list[Prefix]:
        return self.prefixes.question_prefixes(window, questions)

    def window_prefix(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
                      merged: torch.Tensor, scores: np.ndarray | torch.Tensor | None = None, *,
                      index: torch.Tensor | None = None, host_index: np.ndarray | None = None) -> WindowPrefix:
        return self.prefixes.window_prefix(frames, keep, merged, scores, index=index, host_index=host_index)

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        return self.prefixes.prefix_length(question, visual_tokens)

    def text_embeddings(self, question: str) -> torch.Tensor:
        """Participatory-knowing hook: the question in the LM's input embedding space, (L, D)."""
        return self.prefixes.text_embeddings(question)

    def visual_tokens(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        """(T', gh gw, D) the merged tokens (without Qwen3-VL's DeepStack features)."""
        return self.encoder.visual_tokens(frames)[..., :self.lm.embed_tokens.embedding_dim]

    def encode_cells(self, frames: np.ndarray | torch.Tensor, cells: np.ndarray | torch.Tensor | None) -> KeptFeatures:
        return self.encoder.encode_cells(frames, cells)

    def attention_masks(self, allowed: torch.Tensor | None) -> dict:
        return self.pool.attention_masks(allowed)

    def prefill(self, prefixes: list[Prefix], max_new_tokens: int | None = None) -> tuple[StaticDecoder, torch.Tensor]:
        return self.pool.prefill(prefixes, max_new_tokens)

    def warm_up(self, batch_sizes, prefix_lengths, *, max_new_tokens: int | None = None,
                frame_sizes=(), window_frames: int = 0) -> list[tuple[int, int]]:
        """Capture ahead of time (during setup) the graphs answering will replay: the decoders and
        prefill graphs of batches of these sizes and prefixes of these lengths (DecoderPool.warm_up),
        and, given frame_sizes ((height, width) each) and window_frames (the most frames of a
        window), the vision tower's (VisionEncoder.warm_up). -> DecoderPool.warm_up's keys."""
        sizes = list(batch_sizes)
        if frame_sizes and window_frames > 0 and sizes:
            self.encoder.warm_up(list(frame_sizes), window_frames, max(sizes))
        return self.pool.warm_up(sizes, prefix_lengths, max_new_tokens=max_new_tokens)

    def generate_from(self, decoder: StaticDecoder, logits: torch.Tensor, batch: int, **options) -> Generation:
        return self.generator.generate_from(decoder, logits, batch, **options)

    def first_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        return self.generator.first_confidence(logits)

    def decode(self, tokens: torch.Tensor, length: int) -> str:
        return self.generator.decode(tokens, length)

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
    def prepare(self, requests: list[AnswerRequest]) -> list[Prefix]:
        return [self.question_prefix(window, r.question)
                for window, r in zip(self._window_prefixes(requests), requests)]

    def _window_prefixes(self, requests: list[AnswerRequest]) -> list[WindowPrefix]:
        """Each request's window prefix, the vision tower run once for all of them."""
        keeps = [self.prefixes.snapped(r.keep, r.scores) for r in requests]          # uploaded once
        # the masks are worked out where each keep map already is: a map from the host (the
        # pipeline's stages hand over numpy) on the host, with no device round trip and no host
        # read; maps on the device are read back in one read (a sync, and under live load a wait
        # for the interpreter lock: one per batch, not one per request), before the vision tower
        # is queued: read after, it waited for the tower, and the host then built the prefixes
        # while the GPU idled
        sources = [self.prefixes.mask_source(r.keep, r.scores, keep) for r, keep in zip(requests, keeps)]
        # with every map on the host nothing here waits for the GPU: the tower is queued first and
        # the masks are worked out while it runs (an H200 profile of the Qwen3-VL 2B at 10% had the
        # GPU idle for the ~1 ms they took)
        merged_all = None if any_on_device(sources) else self.encoder.window_tokens(requests, sources)
        masks = read_back([self.prefixes.token_mask(r.frames, src) for r, src in zip(requests, sources)])
        # every window's token positions (on the host too: Qwen3-VL lays out its windows from them
        # without another read)
        host = [np.flatnonzero(mask) for mask in masks]
        indices = upload(host, self.device)
        if merged_all is None:
            merged_all = self.encoder.window_tokens(requests, sources)
        return [self.window_prefix(r.frames, keep, m, r.scores, index=index, host_index=h)
                for r, keep, m, index, h in zip(requests, keeps, merged_all, indices, host)]

    @torch.no_grad()
    def build_prefix(self, req: AnswerRequest, merged: torch.Tensor) -> Prefix:
        """Selection: merged tokens (T', gh, gw, D) of req's frames -> its pruned LM prefix."""
        return self.question_prefix(self.window_prefix(req.frames, req.keep, merged, req.scores), req.question)

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
        self.pool.sync()
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
            self.pool.sync()
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
