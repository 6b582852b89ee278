"""Pass 2 and tempering: the VLM's own query coupling picks the visual tokens it answers from.

Pass 1 is ARR-COC's front end (saliency, motion, scene changes, temporal redundancy, and the
question through MiniLM): with pass 2 on it keeps `vlm.candidate_factor` times the final budget as
candidates (the budget plan, pipeline/budget.py, says what every pass keeps). Pass 2 scores each
candidate against the actual question with the VLM itself, text-guided as in FastV / SparseVLM
(training-free): the prefix [system prompt, candidate visual tokens, question] runs through the
LM's first `vlm.pass2_layers` layers, and a candidate's score is the attention the question's tokens pay it
at the next layer, from that layer's own queries and keys (head- and token-averaged). The answer
is then prefilled from the best-scored `1 / candidate_factor` of the candidates, each at the M-RoPE
position the full video gives it, and decoded as usual (pipeline/vlm/generation.py).

Tempering (`vlm.tempering.ladder`) answers from the ladder's first budget; while the first answer
token's confidence (pipeline/vlm/tempering.py) is below `vlm.tempering.threshold` it answers
again from the next budget, the best-ranked candidates again, up to `max_passes`. Candidates are
ranked (`vlm.tempering.rank`) by pass 1's own realized relevance (`relevance`: pass 1 keeps the
top rung's budget and hands its relevance map over with the keep map, AnswerRequest.scores; no
pass 2 runs; each rung keeps the same share of every frame pair's candidates, the most relevant,
as ARR-COC budgets every frame) or by pass 2's attention (`attention`). Only the first token of a rejected pass is
computed (its prefill); the accepted pass is decoded. When no pass is confident enough, the
answer comes from the last pass, or (`vlm.tempering.fallback: most_confident`) from the pass
whose first token was the most confident. Budgets count tokens as the LM gets them: a pooled 2x2
token (arr_coc/lod.py) is one candidate and one token, scored by its block's best relevance.

Everything here runs inside VLM.answer / VLM.answer_questions, so its cost is in each answer's
latency (time to first token), and batches across streams (pipeline/vlm/batcher.py) as before.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Protocol

import torch

from arr_coc._validate import ConfigError
from pipeline.budget import BudgetPlan
from pipeline.vlm.decoding import StaticDecoder
from pipeline.vlm.generation import Generation
from pipeline.vlm.prefix import Prefix, WindowPrefix
from pipeline.vlm.selection import allocation_sizes
from pipeline.vlm.tempering import PER_TOKEN, EscalationShare
from pipeline.vlm.text_model import FastTextModel, unsupported
from pipeline.vlm_config import DEFAULT_PASS2_LAYERS, VLMConfig


class PassEngine(Protocol):
    """What multi-pass answering drives: prefixes over a window's candidates, their prefill, the
    first token's confidence, and decoding (pipeline/vlm/model.py's VLM implements it)."""
    config: VLMConfig
    device: torch.device
    model: torch.nn.Module          # the HF model: its config may name the layer pass 2 reads
    lm: torch.nn.Module             # the text decoder whose queries and keys pass 2 reads
    attn_impl: str

    def question_prefix(self, window: WindowPrefix, question: str) -> Prefix: ...

    def attention_masks(self, allowed: torch.Tensor | None) -> dict: ...

    def prefill(self, prefixes: list[Prefix], max_new_tokens: int | None = None
                ) -> tuple[StaticDecoder, torch.Tensor]: ...

    def generate_from(self, decoder: StaticDecoder, logits: torch.Tensor, batch: int, *,
                      confidence: torch.Tensor | None = None) -> Generation: ...

    def generate(self, prefixes: list[Prefix], *, confidence: torch.Tensor | None = None) -> Generation: ...

    def first_confidence(self, logits: torch.Tensor) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, length: int) -> str: ...


def pass2_layer(vlm: PassEngine) -> int:
    """The LM layer pass 2 reads: vlm.pass2_layers when set, else the one the model's snapshot
    names (config.json "arrcoc_pass2_layers", measured for that model), else DEFAULT_PASS2_LAYERS."""
    if vlm.config.pass2_layers is not None:
        return vlm.config.pass2_layers
    named = getattr(vlm.model.config, "arrcoc_pass2_layers", None)
    if named is None:
        return DEFAULT_PASS2_LAYERS
    if isinstance(named, bool) or not isinstance(named, int) or named < 0:
        raise ConfigError(f"the VLM snapshot's config.json names arrcoc_pass2_layers={named!r}: it must be a "
                          f"layer index >= 0 (or set vlm.pass2_layers)")
    return named


def question_attention(q: torch.Tensor, k: torch.Tensor, scaling: float, question: torch.Tensor,
                       keys: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 2's score (and the QA model's grounding target, pipeline/training/qa_forward.py): the
    attention that the question's tokens pay to every slot, averaged over heads and question tokens.

    q (B, H, L, hd) and k (B, H_kv, L, hd) one layer's rotated query and key states (grouped KV
    heads serve H // H_kv query heads each); question (B, L) bool: each row's question tokens;
    keys (B, L) bool: the slots a query may see (default all), causally -> (B, L) float32, zero
    where no question token looks. Differentiable (training shapes it)."""
    B, H, L, hd = q.shape
    nq = max(int(question.sum(-1).max()), 1)
    order = torch.sort(question.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :nq]  # (B, nq)
    valid = torch.gather(question, 1, order)                                  # (B, nq) real question slots
    qs = torch.gather(q, 2, order[:, None, :, None].expand(B, H, nq, hd)).float()
    ks = k.float().repeat_interleave(H // k.shape[1], 1)                      # (B, H, L, hd)
    logits = qs @ ks.transpose(-1, -2) * scaling                              # (B, H, nq, L)
    slots = torch.arange(L, device=q.device)
    seen = slots[None, None, :] <= order[:, :, None]                          # (B, nq, L) causal
    if keys is not None:
        seen = seen & (keys[:, None, :] | (slots[None, None, :] == order[:, :, None]))
    attention = logits.masked_fill(~seen[:, None], float("-inf")).softmax(-1) * valid[:, None, :, None]
    return attention.sum((1, 2)) / (H * valid.sum(-1).clamp_min(1))[:, None]


def coverage(attention: torch.Tensor, kept: torch.Tensor) -> float:
    """1 - the question's attention beyond uniform that the dropped candidates carry: the attention
    over all K candidates normalised to 1, each candidate's excess over 1 / K summed over those not
    kept. Diffuse attention (nothing in particular looked for) drops little excess; attention on an
    object the rung dropped drops most of it."""
    total = float(attention.sum())
    if total <= 0:
        return 1.0
    excess = (attention / total - 1.0 / attention.numel()).clamp_min(0)
    dropped = torch.ones_like(excess, dtype=torch.bool)
    dropped[kept] = False
    return min(max(1.0 - float(excess[dropped].sum()), 0.0), 1.0)


def keep_best(scores: torch.Tensor, n: int) -> torch.Tensor:
    """(K,) candidate scores -> the positions (ascending: the model's token order) of the best n
    of them (all of them when n >= K)."""
    K = scores.numel()
    if n >= K:
        return torch.arange(K, device=scores.device)
    return scores.topk(n).indices.sort().values                              # (n,)


def per_frame_order(scores: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    """(K,) relevance and (K,) frame (pair) of each token -> (K,) keys whose best n (keep_best) are
    about the same share n / K of every frame's tokens, each frame's most relevant first: tokens
    ordered by their rank's quantile within their frame, then by relevance. ARR-COC budgets each
    frame on its own (arr_coc/attending.py), and so does every rung: a global top-n would spend a
    small rung on the few frames whose relevance runs high and leave the others blind."""
    K = scores.numel()
    if K == 0:
        return scores.float()
    by_score = scores.float().argsort(descending=True, stable=True)           # (K,)
    grouped = by_score[frame[by_score].argsort(stable=True)]                  # by frame, best first in each
    _, counts = frame[grouped].unique_consecutive(return_counts=True)
    starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)       # (K,) each one's frame start
    sizes = torch.repeat_interleave(counts, counts)
    quantile = torch.empty(K, device=scores.device)
    quantile[grouped] = ((torch.arange(K, device=scores.device) - starts).float() + 0.5) / sizes.float()
    order = by_score[quantile[by_score].argsort(stable=True)]                # quantile, then relevance
    keys = torch.empty(K, device=scores.device)
    keys[order] = -torch.arange(K, device=scores.device, dtype=torch.float32)
    return keys


def blend_ranks(attention: torch.Tensor, relevance: torch.Tensor, weight: float) -> torch.Tensor:
    """vlm.pass2_blend: (K,) pass 2's attention and pass 1's relevance of the same candidates ->
    (K,) keys, (1 - weight) x attention's rank quantile + weight x relevance's (0: pass 2 alone,
    1: pass 1 alone), so each pass can only move a candidate as far as its share of the key."""
    def quantile(x: torch.Tensor) -> torch.Tensor:
        return x.float().argsort(stable=True).argsort().float() / max(x.numel() - 1, 1)
    return (1.0 - weight) * quantile(attention) + weight * quantile(relevance)


def token_pairs(window: WindowPrefix) -> torch.Tensor:
    """(K,) the frame pair of each of the window's visual tokens (its M-RoPE t)."""
    return window.positions[0, window.visual_slots()]


def missing_scores(rank: str, what: str) -> ValueError:
    """The error of a ranking by pass 1's relevance for a request that carries none."""
    return ValueError(f"vlm.tempering.rank={rank} {what}, and this request has none: pass scores= (T, gh, gw) "
                      f"with the keep map (AnswerRequest.scores, VLM.answer_questions(..., scores=))")


def narrow(window: WindowPrefix, keep: torch.Tensor) -> WindowPrefix:
    """The window with only the candidates `keep` (ascending positions among its visual tokens):
    the text before the video and every position stay as they are (the full video's M-RoPE).
    Qwen3-VL: the timestamps and markers stay, a candidate's DeepStack features go with it, and with
    drop_empty a frame group left without a token loses its slots."""
    K = window.tokens_kept
    if keep.numel() == K:
        return window                                         # the same object: shared prefills stay shared
    scores = None if window.scores is None else window.scores[keep]
    if window.visual is None:                                 # [prompt, video]: the last K slots are visual
        v0 = window.embeds.shape[0] - K
        rows = torch.cat([torch.arange(v0, device=keep.device), v0 + keep])     # (v0 + n,)
        return dataclasses.replace(window, embeds=window.embeds[rows], positions=window.positions[:, rows],
                                   tokens_kept=int(keep.numel()), scores=scores)
    slots = window.visual                                                    # (K,)
    kept = torch.ones(window.embeds.shape[0], dtype=torch.bool, device=keep.device)  # (S,)
    kept[slots] = False
    kept[slots[keep]] = True
    if window.drop_empty and window.groups is not None:
        groups = window.groups                                               # (S,), -1 outside every group
        seen = torch.zeros(window.embeds.shape[0] + 1, dtype=torch.bool, device=keep.device)
        seen[groups[slots[keep]]] = True                                     # groups that keep a token
        kept &= (groups < 0) | seen[groups.clamp(min=0)]
    rows = kept.nonzero().squeeze(1)                                         # (S',)
    return dataclasses.replace(
        window, embeds=window.embeds[rows], positions=window.positions[:, rows], tokens_kept=int(keep.numel()),
        scores=scores, visual=(kept.cumsum(0) - 1)[slots[keep]], groups=window.groups[rows],
        deepstack=None if window.deepstack is None else window.deepstack[:, rows])


class Passes:
    """Pass 2 and tempering over one engine (the VLM builds it when vlm.pass2 is on or a tempering
    ladder is set)."""

    def __init__(self, vlm: PassEngine) -> None:
        cfg = vlm.config
        self.vlm = vlm
        self.plan = BudgetPlan.of(cfg)                                       # what each answering pass keeps
        self.tempering = cfg.tempering
        t = cfg.tempering                     # escalate: the share asked again held by a running quantile
        self.share = None if t.escalate is None else EscalationShare(t.escalate, t.window, t.threshold)
        # relevance: pass 1's scores rank the candidates; attention: pass 2's (the VLM's own)
        self.rank = "attention" if cfg.pass2 != "off" else cfg.tempering.rank
        self.layer, self.text_model = 0, None
        # coverage: how much of the question's attention over the candidates a rung drops (pass 2's)
        self.coverage = cfg.tempering.confidence == "coverage"
        if self.rank == "attention" or self.coverage:
            reason = unsupported(vlm.lm)
            if reason is not None:
                asked = f"vlm.pass2={cfg.pass2}" if self.rank == "attention" else "vlm.tempering.confidence=coverage"
                raise ConfigError(f"{asked} needs the LM's queries and keys, which this model does not expose: "
                                  f"{reason}")
            self.layer = min(pass2_layer(vlm), len(vlm.lm.layers) - 1)       # an LM of fewer layers: its last
            # the fast forward's modules are the LM's own (a second one over them shares the fused weights)
            self.text_model = FastTextModel(vlm.lm, vlm.attn_impl)

    @torch.no_grad()
    def scores(self, windows: list[WindowPrefix], questions: list[str]) -> list[torch.Tensor]:
        """Pass 2: for each question about its window of candidates, (K,) float32 the attention its
        tokens (those after <|vision_end|>) pay to each candidate at LM layer pass2_layers,
        averaged over heads and tokens. One forward for all, left padded."""
        vlm, tm = self.vlm, self.text_model
        prefixes = [vlm.question_prefix(w, q) for w, q in zip(windows, questions)]
        lengths = [p.embeds.shape[0] for p in prefixes]
        B, L = len(prefixes), max(lengths)
        embeds = prefixes[0].embeds.new_zeros(B, L, prefixes[0].embeds.shape[1])  # (B, L, D)
        positions = torch.ones(3, B, L, dtype=torch.long, device=vlm.device)
        real = torch.zeros(B, L, dtype=torch.bool, device=vlm.device)
        deepstack = None                                                     # (n, B, L, D) Qwen3-VL
        if windows[0].deepstack is not None:
            deepstack = embeds.new_zeros(windows[0].deepstack.shape[0], B, L, embeds.shape[2])
        for b, p in enumerate(prefixes):
            embeds[b, L - lengths[b]:] = p.embeds
            positions[:, b, L - lengths[b]:] = p.positions
            real[b, L - lengths[b]:] = True
            if deepstack is not None:
                deepstack[:, b, L - lengths[b]:L - lengths[b] + p.deepstack.shape[1]] = p.deepstack
        mask = None                                                          # one length: plain causal
        if min(lengths) < L:
            slots = torch.arange(L, device=vlm.device)
            # causal over real keys; a padding slot sees itself only (a row with no key is NaN)
            allowed = (slots[None, :] <= slots[:, None]) & (real[:, None, :] | (slots[None, :] == slots[:, None]))
            mask = vlm.attention_masks(allowed[:, None])["full_attention"]  # (B, 1, L, L)
        # (B, H, L, hd), (B, H_kv, L, hd); Qwen3-VL: layer K's input holds DeepStack levels 0..K-1
        q, k = tm.attention_inputs(embeds, mask, positions, self.layer, deepstack)
        question = torch.zeros(B, L, dtype=torch.bool, device=vlm.device)
        for b, (w, n) in enumerate(zip(windows, lengths)):
            question[b, L - n + w.embeds.shape[0] + w.text_skip:] = True   # the tokens after <|vision_end|>
        attention = question_attention(q, k, tm.layers[self.layer].scaling, question, keys=real)   # (B, L)
        return [attention[b, L - n + w.visual_slots()] for b, (w, n) in enumerate(zip(windows, lengths))]  # (K,)

    @torch.no_grad()
    def answer(self, windows: list[WindowPrefix], questions: list[str], arrivals: list[float]) -> list[dict]:
        """One answer per (window of pass 1's candidates, question), as the fields of an AnswerResult
        (pipeline/vlm/model.py); arrivals: time.monotonic() each latency counts from. Windows may
        repeat (several questions about one window)."""
        vlm, n = self.vlm, len(questions)
        if self.rank == "allocation":                                        # each rung: its own allocation
            if any(w.scores is None and w.tokens_kept < w.tokens_full for w in windows):
                raise missing_scores("allocation", "answers each rung from pass 1's allocation at that rung")
            sizes = [allocation_sizes(w.scores, len(self.tempering.rungs)) if w.scores is not None
                     else [w.tokens_kept] for w in windows]                  # every token: one pass
        else:
            sizes = [self.plan.pass_sizes(w.tokens_kept) for w in windows]  # per answer, increasing
        scores = self.ranking(windows, questions, sizes)
        # coverage: the question's attention over each window's candidates (pass 2's, computed once
        # whatever ranks them); a rung's confidence is `coverage` of the tokens it keeps
        attention = self.scores(windows, questions) if self.coverage and len(self.tempering.rungs) > 1 else None
        most_confident = self.tempering.fallback == "most_confident"
        # a measure of the whole answer (PER_TOKEN) decodes every pass's answers before deciding
        per_token = self.tempering.confidence in PER_TOKEN
        final: list[Prefix | None] = [None] * n
        texts: list[str | None] = [None] * n                                 # per_token: the final pass's answer
        passes, spent, confidence = [0] * n, [0] * n, [-math.inf] * n
        undecided, out, k = list(range(n)), None, 0
        while undecided:                                # pass k + 1 of every answer still unsure
            kept = [keep_best(scores[i], sizes[i][k]) for i in undecided]
            prefixes = [vlm.question_prefix(narrow(windows[i], best), questions[i]) for i, best in zip(undecided, kept)]
            decoder, logits = vlm.prefill(prefixes)                           # (B, V)
            first = None                                                     # the first token's confidence
            if attention is not None:
                sure = [coverage(attention[i], best) for i, best in zip(undecided, kept)]
            elif per_token:
                gen = vlm.generate_from(decoder, logits, len(prefixes))
                sure = gen.confidence
            else:
                first = vlm.first_confidence(logits)                         # the probe's, or the measure's
                sure = first.tolist()
            threshold = self.tempering.threshold if self.share is None else \
                self.share.threshold_at(k, [c for i, c in zip(undecided, sure) if k < len(sizes[i]) - 1])
            accepted = [k == len(sizes[i]) - 1 or c >= threshold for i, c in zip(undecided, sure)]
            for j, i in enumerate(undecided):
                passes[i], spent[i] = k + 1, spent[i] + prefixes[j].tokens_kept
                # the answer's pass: the last one tried (the accepted one, or the last rung); with
                # fallback most_confident the most confident so far (an accepted pass is: those
                # before it were below the threshold; ties: the larger budget)
                if not most_confident or sure[j] >= confidence[i]:
                    final[i], confidence[i] = prefixes[j], sure[j]
                    if per_token:
                        texts[i] = vlm.decode(gen.tokens[j], gen.lengths[j])
            if not per_token and all(accepted) and len(undecided) == n and \
                    all(final[i] is prefixes[j] for j, i in enumerate(undecided)):
                # every answer from this prefill: decode on from it
                out = vlm.generate_from(decoder, logits, n, confidence=first)
            undecided, k = [i for i, a in zip(undecided, accepted) if not a], k + 1
        if not per_token:
            if out is None:                             # answered from different passes: one generate for all
                out = vlm.generate(final, confidence=None if attention is not None else torch.tensor(confidence))
            texts = [vlm.decode(out.tokens[i], out.lengths[i]) for i in range(n)]
        ready = time.monotonic()                        # the answers came back to the host: done
        return [dict(text=texts[i], tokens_kept=p.tokens_kept, tokens_full=p.tokens_full,
                     latency_s=ready - arrivals[i], passes=passes[i], tokens_spent=spent[i],
                     confidence=confidence[i])
                for i, p in enumerate(final)]

    def ranking(self, windows: list[WindowPrefix], questions: list[str], sizes: list[list[int]]) -> list[torch.Tensor]:
        """(K,) score per candidate of each window, higher kept first: pass 1's relevance
        (WindowPrefix.scores) or pass 2's attention; zeros where every pass keeps all of them."""
        if not any(s[0] < w.tokens_kept for s, w in zip(sizes, windows)):
            return [torch.zeros(w.tokens_kept, device=self.vlm.device) for w in windows]  # all kept: no ranking
        if self.rank == "attention":
            attention = self.scores(windows, questions)
            if weight := self.vlm.config.pass2_blend:                     # pass 1's relevance blended in
                attention = [a if w.scores is None else blend_ranks(a, w.scores, weight)
                             for a, w in zip(attention, windows)]
            if not self.vlm.config.pass2_per_frame:
                return attention
            return [per_frame_order(a, token_pairs(w)) for a, w in zip(attention, windows)]
        if self.rank == "allocation":                                        # keys: level first, then relevance
            return [w.scores if w.scores is not None else torch.zeros(w.tokens_kept, device=self.vlm.device)
                    for w in windows]
        if any(w.scores is None for s, w in zip(sizes, windows) if s[0] < w.tokens_kept):
            raise missing_scores("relevance", "ranks the visual tokens by pass 1's relevance")
        return [torch.zeros(w.tokens_kept, device=self.vlm.device) if w.scores is None   # every pass keeps all
                else per_frame_order(w.scores, token_pairs(w)) for w in windows]
