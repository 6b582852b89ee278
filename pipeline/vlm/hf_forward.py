"""Answering through transformers' own forward: the VLM for families the fast engine does not
cover (Qwen3-VL-MoE; dense Qwen3-VL loads into the fast engine, and tests and bench_vlm use this one
over it as the reference; pipeline/vlm/qwen3_vl.py owns their internals).

The same answering interface as pipeline.vlm.model.VLM (answer, answer_windows, answer_questions,
warm_up, prefix_length, geometry, config, warning), so run, live, batch, serve and the Python API
take it as they take the fast engine. Per window: our preprocessing (HF's rule, on the device) ->
the vision tower on every patch -> merged tokens and DeepStack features (T', gh, gw, D) -> the
allocation's tokens picked from both with one selection (selection.select_tokens: a pooled token's
DeepStack feature is its block's mean, as its token is) -> the prompt with a timestamp per frame
group (pipeline/vlm/frame_groups.py), each kept slot at the M-RoPE position the full prompt gives
it (the model's own get_rope_index over the unpruned prompt) -> transformers' text model forward
with the kept tokens' DeepStack features at their positions (none for a dropped token) -> greedy or
nucleus decoding over a DynamicCache, one request at a time (questions about one window start from
a copy of its prefilled cache).

Not here (yet): static KV caches, CUDA graphs, batched prefill and decoding, `vlm.encode: kept`
(the tower attends over whole frames, so encoding only the kept patches would change the kept
tokens), pass 2 and tempering (refused at load with one line).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from arr_coc._validate import ConfigError
from arr_coc.lod import token_frames
from pipeline.runtime.cuda import to_device
from pipeline.runtime.requests import AnswerRequest, AnswerResult, WindowQuestions
from pipeline.vlm import hf, qwen3_vl
from pipeline.vlm.decoding import sample_next
from pipeline.vlm.frame_groups import group_timestamps, kept_slots, stamp_ids, video_layout
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.model import snapshot_dir
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm.probe import Probe
from pipeline.vlm.selection import pair_lod, select_tokens, snap_to_windows
from pipeline.vlm.tempering import PER_TOKEN, first_token_confidence
from pipeline.vlm_config import VLMConfig

FALLBACK_WARNING = ("{family} runs through transformers' own forward (no static KV cache, CUDA graphs or "
                    "batched decoding yet; every patch through the vision tower): slower than the fast engine")
ENGINE = "transformers forward"
MAX_LAYOUTS = 16          # prompt layouts (per frame count and grid) kept


@dataclass
class Window:
    """What every question about one window shares: embeds (S, D) of the prompt up to the end of
    the video with only the kept visual tokens, positions (3, S) the full prompt's at those slots,
    visual (S,) bool the kept visual slots, deepstack one (K, D) feature per DeepStack layer for
    the K kept tokens in slot order, text_start the position of the first slot after the video."""
    embeds: torch.Tensor
    positions: torch.Tensor
    visual: torch.Tensor
    deepstack: list[torch.Tensor]
    text_start: int
    tokens_kept: int
    tokens_full: int


@dataclass
class Decoded:
    tokens: list[int]               # generated ids, up to and including EOS
    confidence: float               # vlm.tempering.confidence of the answer (first token, or its least sure)
    decode_s: float                 # wall time from the first token to the last


@dataclass
class Prompt:
    """One question's LM input: the window's slots, then its text at consecutive positions."""
    window: Window
    embeds: torch.Tensor            # (L, D)
    positions: torch.Tensor         # (3, L)
    next_position: int              # of the first generated token


class HFForwardVLM:
    engine = ENGINE

    def __init__(self, model, tokenizer, *, family: str, name: str, config: VLMConfig,
                 preprocessor: VideoPreprocessor, warning: str | None = None) -> None:
        if config.multipass:
            raise ConfigError(f"{_display(family)} runs through transformers' own forward, which has no pass 2 or "
                              f"tempering yet: set vlm.pass2=off and vlm.tempering.ladder=[] (got "
                              f"pass2={config.pass2}, ladder={list(config.tempering.ladder)})")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.family = family
        self.name = name
        # what runs, recorded as such: every patch through HF's own tower and LM
        self.config = dataclasses.replace(config, encode="all", fast_lm=False, fast_vision=False)
        self.preprocessor = preprocessor
        self.warning = "; ".join(w for w in (warning, FALLBACK_WARNING.format(family=_display(family)),
                                             hf.check_version()) if w)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.passes = None
        self.video_token_id = model.config.video_token_id
        self._vision_start = model.config.vision_start_token_id
        self._vision_end = model.config.vision_end_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        self.eos_ids = {i for i in eos if i is not None and i >= 0}
        self.probe = (Probe.load(config.tempering.probe, snapshot=snapshot_dir(name))
                      if config.tempering.confidence == "probe" else None)
        self._embed = qwen3_vl.embed_tokens(model)
        self._layouts: dict[tuple[int, int, int], tuple] = {}
        self._header = self.tokenizer("<|im_start|>user\n<|vision_start|>").input_ids

    @property
    def geometry(self) -> VLMGeometry:
        return self.preprocessor.geometry

    # ---- prompt ----
    def question_ids(self, question: str) -> list[int]:
        """Ids after the video: the question and the assistant's turn (Qwen3-VL's template: no system turn)."""
        return self.tokenizer(f"{question}<|im_end|>\n<|im_start|>assistant\n").input_ids

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        """Prompt tokens of `question` with `visual_tokens` kept, not counting the timestamps and
        markers of the frame groups (their number is the window's, unknown here): for usage only,
        nothing is allocated by it."""
        return len(self._header) + visual_tokens + 1 + len(self.question_ids(question))

    def _layout(self, T: int, gh: int, gw: int) -> tuple:
        """(VideoLayout, positions (3, L) of its slots, text_start) for T frames on a (gh, gw) grid,
        made once. The timestamps are of the T frames (the last one's index repeated to fill the
        last group, as HF's processor does), not of the repeated frame the patches are padded with."""
        key = (T, gh, gw)
        if key not in self._layouts:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.pop(next(iter(self._layouts)))                 # the oldest
            tp = self.geometry.temporal_patch_size
            Tp = token_frames(T, tp)
            times = group_timestamps(range(T), self.config.fps, tp)
            stamps = stamp_ids(times, lambda text: self.tokenizer(text).input_ids)
            layout = video_layout(self._header, stamps, gh * gw, vision_start=self._vision_start,
                                  vision_end=self._vision_end, video_token=self.video_token_id)
            ids = layout.ids.to(self.device)
            m = self.geometry.merge_size
            grid = torch.tensor([[Tp, gh * m, gw * m]], device=self.device)
            positions = qwen3_vl.rope_index(self.model, ids[None], grid, self.video_token_id)[:, 0]  # (3, L)
            # the template's closing <|vision_end|> is text: the question follows it on one axis
            self._layouts[key] = (layout, positions, int(positions[0, -1]) + 1)
        return self._layouts[key]

    def full_prompt_ids(self, question: str, T: int, gh: int, gw: int) -> torch.Tensor:
        """(L,) ids of the unpruned prompt (every video token) about T frames on a (gh, gw) grid."""
        layout = self._layout(T, gh, gw)[0]
        return torch.cat([layout.ids, torch.tensor(self.question_ids(question))])

    # ---- vision ----
    def features(self, frames: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """frames (T, H, W, 3) -> merged tokens (T', gh, gw, D) and DeepStack features, one
        (T', gh, gw, D) per DeepStack layer, from the vision tower on every patch."""
        return self.features_of([frames])[0]

    @torch.no_grad()
    def features_of(self, videos: list) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """features() of several windows (any sizes) from one vision tower call."""
        pixels, grids = zip(*(self.preprocessor(v, self.device) for v in videos))
        merged, deepstack = qwen3_vl.vision_features(self.model, torch.cat(pixels).to(self.dtype),
                                                     torch.stack(grids).to(self.device))
        m = self.geometry.merge_size
        shapes = [(t, h // m, w // m, -1) for t, h, w in torch.stack(grids).tolist()]
        sizes = [t * h * w for t, h, w, _ in shapes]
        layers = [d.split(sizes) for d in deepstack]                         # per layer: per window
        return [(x.view(shape), [layer[i].view(shape) for layer in layers])
                for i, (x, shape) in enumerate(zip(merged.split(sizes), shapes))]

    @torch.no_grad()
    def visual_tokens(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        merged = self.features(frames)[0]                                    # (T', gh, gw, D)
        return merged.flatten(1, 2)                                          # (T', gh*gw, D)

    @torch.no_grad()
    def text_embeddings(self, question: str) -> torch.Tensor:
        return self._embed(to_device(self.tokenizer(question).input_ids, self.device, torch.long))  # (L, D)

    # ---- selection ----
    def _lod(self, frames, keep, scores, grid: tuple[int, int, int]) -> torch.Tensor:
        """keep (T, gh, gw) LOD or None (all) -> (T', gh, gw) LOD per video token (the pairing rule)."""
        Tp, gh, gw = grid
        if keep is None:
            return torch.ones(Tp, gh, gw, dtype=torch.int8, device=self.device)
        keep = to_device(keep, self.device)
        expected = (frames.shape[0], gh, gw)
        if tuple(keep.shape) != expected:
            raise ValueError(f"keep map shape {tuple(keep.shape)} does not match the VLM grid {expected} "
                             f"for {frames.shape[2]}x{frames.shape[1]} frames")
        if self.config.snap_windows and scores is not None:
            keep = snap_to_windows(keep, to_device(scores, self.device), self.config.snap_windows,
                                   self.geometry.temporal_patch_size)
        return pair_lod(keep, self.geometry.temporal_patch_size)

    @torch.no_grad()
    def window(self, frames: np.ndarray | torch.Tensor, keep: np.ndarray | torch.Tensor | None,
               scores: np.ndarray | torch.Tensor | None = None, features: tuple | None = None) -> Window:
        """The question-independent prompt of a window: frames (T, H, W, 3), keep (T, gh, gw) LOD or
        None; features: the frames' features() when the caller has them already."""
        merged, deepstack = self.features(frames) if features is None else features
        Tp, gh, gw, _ = merged.shape
        lod = self._lod(frames, keep, scores, (Tp, gh, gw))
        tokens, index = select_tokens(merged, lod)                           # (K, D), (K,) raster cells
        kept_deepstack = [select_tokens(d, lod, index)[0] for d in deepstack]  # (K, D) per layer
        layout, positions, text_start = self._layout(frames.shape[0], gh, gw)
        slots = kept_slots(layout, index, gh * gw, self.config.empty_frame_groups)  # (L,) bool
        ids = layout.ids.to(self.device)[slots]                              # (S,)
        visual = ids == self.video_token_id                                  # (S,) in raster order, as tokens
        embeds = self._embed(ids)                                            # (S, D)
        embeds[visual] = tokens.to(embeds.dtype)
        return Window(embeds, positions[:, slots], visual, kept_deepstack, text_start, int(index.numel()),
                      Tp * gh * gw)

    @torch.no_grad()
    def prompt(self, window: Window, question: str) -> Prompt:
        ids = to_device(self.question_ids(question), self.device, torch.long)
        n = ids.numel()
        text_pos = (window.text_start + torch.arange(n, device=self.device)).expand(3, n)
        return Prompt(window, torch.cat([window.embeds, self._embed(ids)]), torch.cat([window.positions, text_pos], 1),
                      window.text_start + n)

    # ---- language model ----
    def _forward(self, window: Window, embeds: torch.Tensor, positions: torch.Tensor, visual: torch.Tensor,
                 cache) -> torch.Tensor:
        """Slots starting with `window`'s through transformers' text model: embeds (L, D), positions
        (3, L), visual (L,) bool the window's kept visual slots, which get its DeepStack features ->
        hidden states (L, D)."""
        kept = window.tokens_kept > 0
        hidden = qwen3_vl.lm_forward(self.model, embeds[None], positions[:, None], cache,
                                     visual[None] if kept else None, window.deepstack if kept else None)
        return hidden[0]

    def _prefill(self, prompt: Prompt, cache) -> torch.Tensor:
        """The whole prompt -> hidden states (L, D)."""
        visual = torch.zeros(prompt.embeds.shape[0], dtype=torch.bool, device=self.device)
        visual[:prompt.window.visual.numel()] = prompt.window.visual
        return self._forward(prompt.window, prompt.embeds, prompt.positions, visual, cache)

    @torch.no_grad()
    def window_cache(self, window: Window):
        """The KV cache of a window's slots (DeepStack added at its visual ones), for the questions
        about it to start from (generate's window_cache): the window is prefilled once."""
        cache = qwen3_vl.new_cache(self.model)
        self._forward(window, window.embeds, window.positions, window.visual, cache)
        return cache

    def first_logits(self, prompt: Prompt, window_cache=None) -> tuple[torch.Tensor, object]:
        """The prompt prefilled -> (1, V) float32 logits of the first generated token and the cache
        to decode on; window_cache (window_cache()): only the question's text is prefilled, on a
        copy of it."""
        if window_cache is None:
            cache = qwen3_vl.new_cache(self.model)
            hidden = self._prefill(prompt, cache)
        else:
            cache = qwen3_vl.copy_cache(window_cache)
            S = prompt.window.embeds.shape[0]
            hidden = qwen3_vl.lm_forward(self.model, prompt.embeds[None, S:], prompt.positions[:, None, S:], cache)[0]
        return qwen3_vl.lm_head(self.model)(hidden[-1:]).float(), cache

    @torch.no_grad()
    def prompt_logits(self, prompt: Prompt) -> torch.Tensor:
        """(L, V) float32 logits over the whole prompt (each predicting the next token)."""
        hidden = self._prefill(prompt, qwen3_vl.new_cache(self.model))
        return qwen3_vl.lm_head(self.model)(hidden).float()

    def first_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        if self.probe is not None:
            return self.probe.confidence(logits)
        return first_token_confidence(logits, self.config.tempering.confidence)

    @torch.no_grad()
    def generate(self, prompt: Prompt, *, max_new_tokens: int | None = None, window_cache=None) -> Decoded:
        """Decode from a prompt (greedy or nucleus, as vlm.temperature / top_p say); window_cache:
        the prompt's window already prefilled (window_cache())."""
        cfg = self.config
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        head = qwen3_vl.lm_head(self.model)
        logits, cache = self.first_logits(prompt, window_cache)              # (1, V)
        confidence = self.first_confidence(logits)
        per_token = cfg.tempering.confidence in PER_TOKEN
        tokens: list[int] = []
        first = time.perf_counter()
        for step in range(max_new):
            if per_token and step:
                confidence = torch.minimum(confidence, first_token_confidence(logits, cfg.tempering.confidence))
            token = sample_next(logits, cfg.temperature, cfg.top_p, gen)     # (1,)
            tokens.append(int(token))
            if tokens[-1] in self.eos_ids or step == max_new - 1:
                break
            position = torch.full((3, 1, 1), prompt.next_position + step, device=self.device)
            hidden = qwen3_vl.lm_forward(self.model, self._embed(token)[None], position, cache)
            logits = head(hidden[0, -1:]).float()
        return Decoded(tokens, float(confidence[0]), time.perf_counter() - first)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    # ---- answering ----
    def _answer(self, window: Window, question: str, started: float, window_cache=None) -> AnswerResult:
        out = self.generate(self.prompt(window, question), window_cache=window_cache)
        return AnswerResult(text=self.decode(out.tokens), tokens_kept=window.tokens_kept,
                            tokens_full=window.tokens_full, latency_s=time.monotonic() - started,
                            confidence=out.confidence)

    def answer(self, requests: list[AnswerRequest]) -> list[AnswerResult]:
        """Each request answered in turn, the vision tower run once for all of them."""
        started = time.monotonic()
        features = self.features_of([r.frames for r in requests]) if requests else []
        return [self._answer(self.window(r.frames, r.keep, r.scores, f), r.question,
                             started if r.arrival_s is None else r.arrival_s) for r, f in zip(requests, features)]

    @torch.no_grad()
    def answer_questions(self, frames, keep, questions: list[str], *, max_batch: int | None = None,
                         scores=None) -> list[AnswerResult]:
        return self.answer_windows([WindowQuestions(frames, keep, list(questions), scores)], max_batch=max_batch)[0]

    @torch.no_grad()
    def answer_windows(self, windows: list[WindowQuestions], *,
                       max_batch: int | None = None) -> list[list[AnswerResult]]:
        """One vision tower call for every window, each window's selection and prefill once, then
        its questions one after another from the window's cache (max_batch: accepted for the fast engine's interface;
        answers here are not batched)."""
        started = time.monotonic()
        for w in windows:      # AnswerRequest validates the window's arrays and every question
            for q in w.questions:
                AnswerRequest("", w.frames, w.keep, q, 0.0, 0.0, scores=w.scores)
        asked = [w for w in windows if w.questions]
        features = dict(zip(map(id, asked), self.features_of([w.frames for w in asked]))) if asked else {}
        results = []
        for w in windows:
            if not w.questions:
                results.append([])
                continue
            shared = self.window(w.frames, w.keep, w.scores, features[id(w)])
            cache = self.window_cache(shared) if len(w.questions) > 1 else None
            results.append([self._answer(shared, q, started, cache) for q in w.questions])
        return results

    def warm_up(self, batch_sizes, prefix_lengths, *, max_new_tokens: int | None = None,
                frame_sizes=(), window_frames: int = 0) -> list[tuple[int, int]]:
        """Nothing to capture ahead of time: no static caches or graphs here."""
        return []


def _display(family: str) -> str:
    return {"qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE"}.get(family, family)


def model_card(vlm) -> dict[str, str]:
    """What /v1/models says of a loaded VLM: its family, architecture (the transformers class) and
    the engine that runs it."""
    return {"family": str(getattr(vlm, "family", "")), "architecture": type(vlm.model).__name__,
            "engine": getattr(vlm, "engine", "fast engine")}
