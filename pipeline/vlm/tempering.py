"""How sure the VLM is of an answer, and the threshold that decides when to answer again.

Tempering (vlm.tempering, run by pipeline/vlm/passes.py) answers with a small visual budget first
and again with a larger one while the VLM is unsure. Its signal is the distribution of the answer's
first generated token: short answers (a colour, a count, yes/no) are decided there.

  margin:  p1 - p2, the top probability minus the runner-up's, in [0, 1]
  entropy: 1 - H(p) / log V over the vocabulary of V tokens, in [0, 1]
  answer:  the smallest margin over every token of the answer, its end included (an answer of
           several tokens, "bottom right", is often sure of its first word and not of its second)
  coverage: not the answer's: 1 - the question's attention (pass 2's) beyond uniform over the
           candidates that a rung drops (pipeline/vlm/passes.py); answers report the first token's margin
  probe:   learned, 1 - the probability that the answer should be asked again, from a logistic
           regression over a summary of the first token's distribution (pipeline/vlm/probe.py)

All lie in [0, 1]; all but probe are 1 for a certain answer and near 0 for a flat distribution
(the probe is as sure as its fit makes it). `calibrate` picks the
threshold from answers of a validation split whose correctness is known.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from typing import Literal, Sequence

import torch

from arr_coc._validate import check_choice, check_range

Measure = Literal["margin", "entropy", "answer", "coverage"]
MEASURES = ("margin", "entropy", "answer", "coverage")
PER_TOKEN = ("answer",)              # measures of the whole answer: known once it is decoded


def first_token_confidence(logits: torch.Tensor, measure: Measure = "margin") -> torch.Tensor:
    """(B, V) logits of the first generated token -> (B,) float32 confidence in [0, 1] (at
    temperature 1, whatever the sampling temperature: the model's own belief)."""
    check_choice("confidence measure", measure, MEASURES)
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"logits must be (B, V) with V >= 2, got {tuple(logits.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)                        # (B, V)
    if measure in ("margin", "answer", "coverage"):                          # answer: its first token's
        top = logp.topk(2, dim=-1).values.exp()                              # (B, 2)
        return (top[:, 0] - top[:, 1]).clamp(0.0, 1.0)
    entropy = -(logp.exp() * logp).sum(-1)                                  # (B,) nats
    return (1.0 - entropy / math.log(logits.shape[1])).clamp(0.0, 1.0)


def calibrate(confidence: Sequence[float], correct: Sequence[bool], *, precision: float | None = None,
              escalate: float | None = None) -> float:
    """The tempering threshold from a validation split's answers: their confidences (as
    first_token_confidence measures them, in one pass at the budget tempering starts with) and
    whether each was correct. An answer is accepted (not asked again) when confidence >= threshold.

    precision None: the threshold that best tells correct answers from wrong ones (the most answers
    on the right side: correct ones accepted, wrong ones asked again). precision p: the lowest
    threshold whose accepted answers are correct at least p of the time (as few passes as that
    allows); when none reaches p, just above the highest confidence (at most 1: every answer asked
    again). escalate q: a token budget instead: the threshold under which at most a share q of the
    answers fall (those asked again are the least confident; q = 0: none), whatever their
    correctness (the mean tokens spent then follow: first rung + q x the next).
    Thresholds lie halfway between neighbouring confidences; ties favour the lower one."""
    conf = [float(c) for c in confidence]
    right = [bool(c) for c in correct]
    if len(conf) != len(right) or not conf:
        raise ValueError(f"calibrate needs as many confidences as correctness flags, at least one "
                         f"(got {len(conf)} and {len(right)})")
    for c in conf:
        check_range("confidence", c, 0.0, 1.0)
    if precision is not None:
        check_range("precision", precision, 0.0, 1.0, lo_open=True)
    if escalate is not None:
        if precision is not None:
            raise ValueError("calibrate takes a precision or an escalate share, not both")
        check_range("escalate", escalate, 0.0, 1.0)
        return share_threshold(conf, escalate)
    levels = sorted(set(conf))
    # candidates: accept all, between each pair of neighbours, accept none
    thresholds = [0.0] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [min(1.0, levels[-1] + 1e-6)]
    best, best_score = thresholds[-1], -1.0
    for t in thresholds:
        accepted = [r for c, r in zip(conf, right) if c >= t]
        if precision is not None:
            if accepted and sum(accepted) / len(accepted) >= precision - 1e-12:
                return t
            continue
        score = sum(accepted) + sum(not r for c, r in zip(conf, right) if c < t)
        if score > best_score:
            best, best_score = t, score
    return best


def share_threshold(confidence: Sequence[float], share: float) -> float:
    """The threshold under which at most `share` of these confidences fall (the least confident
    are asked again): halfway between neighbours, 0 when none may be, just above the highest (at
    most 1) when all are."""
    ordered = sorted(confidence)
    k = math.floor(share * len(ordered) + 1e-9)                             # answers that may be asked again
    if k == 0:
        return 0.0
    if k >= len(ordered):
        return min(1.0, ordered[-1] + 1e-6)
    return (ordered[k - 1] + ordered[k]) / 2


MIN_SEEN = 32                          # confidences a rung must have seen before its share decides


class EscalationShare:
    """vlm.tempering.escalate: asks again the least confident `share` of the answers at each rung,
    whatever the confidences' level. A threshold calibrated on a validation split drifts with the
    input (test clips less sure than validation ones ask again more often, and spend more tokens);
    this one follows it: each decision's threshold is share_threshold over the last `window`
    confidences that rung saw, the decision's own batch included. Until MIN_SEEN of them, the
    fixed threshold decides. Decisions depend on the order answers come in (one VLM's answers,
    every stream's together)."""

    def __init__(self, share: float, window: int, threshold: float) -> None:
        self.share, self.window, self.threshold = share, window, threshold
        self._seen: dict[int, deque[float]] = {}
        self._lock = threading.Lock()                                       # answers from several threads

    def threshold_at(self, rung: int, confidence: Sequence[float]) -> float:
        """The threshold of rung's decision on these confidences (of answers that have a next
        rung), which it then remembers."""
        with self._lock:
            seen = self._seen.setdefault(rung, deque(maxlen=self.window))
            seen.extend(c if math.isfinite(c) else 0.0 for c in (float(x) for x in confidence))
            if len(seen) < MIN_SEEN:
                return self.threshold
            return share_threshold(seen, self.share)
