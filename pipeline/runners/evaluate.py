"""`python -m pipeline eval STORE --dataset msrvtt --root DIR`: score a batch run.

Accuracy is exact match after normalization (lower case, punctuation and articles dropped,
whitespace collapsed), overall and per question type, over the questions of done streams: complete
ones, and those answered up to where damage stopped decoding the video (core/damage.py; the
report says how many answers came from those); coverage says how many of the split's questions
that is. GPT-judge scoring is out of scope; the
predictions can be exported in the Video-ChatGPT judge format for people who run it.

Answers are matched to the ground truth by (video, question text, occurrence): a batch writes a
video's answers in annotation order, so the k-th answer to a text is the k-th question with it.
"""
from __future__ import annotations

import math
import re
import string
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinks import ZarrStore
from sources.msrvtt import Dataset, Question

from ..core.damage import damaged_streams
from .settings import check_one_run

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize(text: str) -> str:
    text = PUNCTUATION.sub(" ", text.lower())
    return " ".join(ARTICLES.sub(" ", text).split())


def is_correct(prediction: str, question: Question) -> bool:
    pred = normalize(prediction)
    return any(pred == normalize(truth) for truth in (question.answer, *question.references))


@dataclass
class Prediction:
    question: Question
    text: str
    correct: bool
    confidence: float = float("nan")   # the VLM's, in its answer's first token (NaN: not stored)


@dataclass
class EvalReport:
    questions: int                     # in the split
    predictions: list[Prediction] = field(default_factory=list)
    videos_complete: int = 0           # done: complete, or answered up to the damage (counted here too)
    videos_damaged: int = 0            # done up to where damage stopped decoding
    answers_from_damaged: int = 0      # predictions that come from those
    videos_incomplete: int = 0         # groups present but not done (a resumed run redoes them)
    duplicates: int = 0                # answers beyond one per question (must be 0)
    unmatched: int = 0                 # answers to questions the annotations do not have
    # per complete video, the mean over its answers (pass 2 keeps each question's own tokens;
    # tokens_spent counts every tempering pass)
    tokens_kept: list[float] = field(default_factory=list)
    tokens_full: list[float] = field(default_factory=list)
    tokens_spent: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        n = len(self.predictions)
        by_type: dict[str, list[bool]] = defaultdict(list)
        for p in self.predictions:
            by_type[p.question.type].append(p.correct)
        kept, full, spent = sum(self.tokens_kept), sum(self.tokens_full), sum(self.tokens_spent)
        videos = len(self.tokens_kept)
        return {
            "questions": self.questions, "answered": n,
            "coverage": round(n / self.questions, 6) if self.questions else 0.0,
            "accuracy": round(sum(p.correct for p in self.predictions) / n, 6) if n else 0.0,
            "accuracy_by_type": {t: {"accuracy": round(sum(v) / len(v), 6), "questions": len(v)}
                                 for t, v in sorted(by_type.items())},
            "videos_complete": self.videos_complete, "videos_damaged": self.videos_damaged,
            "answers_from_damaged_videos": self.answers_from_damaged, "videos_incomplete": self.videos_incomplete,
            "duplicates": self.duplicates, "unmatched": self.unmatched,
            "tokens": {"kept_over_full": round(kept / full, 6) if full else 0.0,
                       "spent_over_full": round(spent / full, 6) if full else 0.0,
                       "mean_kept_per_video": round(kept / videos, 3) if videos else 0.0,
                       "mean_spent_per_video": round(spent / videos, 3) if videos else 0.0,
                       "mean_full_per_video": round(full / videos, 3) if videos else 0.0},
        }


def evaluate(store_path: str | Path, dataset: Dataset) -> EvalReport:
    store = ZarrStore.open(store_path, mode="r")
    present, damaged_done = set(store.stream_ids()), damaged_streams(store)
    report = EvalReport(questions=len(dataset.questions))
    configs: list[tuple[str, Any]] = []   # (video, its recorded config): one run only
    for work in dataset.videos():
        if work.video_id not in present:
            continue
        damaged = work.video_id in damaged_done
        if not (damaged or store.is_complete(work.video_id)):
            report.videos_incomplete += 1
            continue
        report.videos_complete += 1
        report.videos_damaged += damaged
        data = store.read(work.video_id)   # the store opened once, not per video
        answers = data["answers"]
        configs.append((work.video_id, data["attrs"].get("config")))
        predicted = len(report.predictions)
        pending: dict[str, list[Question]] = defaultdict(list)
        for q in work.questions:
            pending[q.question].append(q)
        confidences = answers["confidence"].tolist()
        for question_text, text, conf in zip(answers["question"].tolist(), answers["text"].tolist(), confidences):
            queue = pending.get(question_text)
            if not queue:
                asked = question_text in {q.question for q in work.questions}
                report.duplicates += asked
                report.unmatched += not asked
                continue
            q = queue.pop(0)
            report.predictions.append(Prediction(q, text, is_correct(text, q), float(conf)))
        if damaged:
            report.answers_from_damaged += len(report.predictions) - predicted
        if len(answers["text"]):
            report.tokens_kept.append(float(answers["tokens_kept"].mean()))
            report.tokens_full.append(float(answers["tokens_full"].mean()))
            report.tokens_spent.append(float(answers["tokens_spent"].mean()))
    check_one_run(store.path, configs)
    return report


def calibrate_threshold(report: EvalReport, precision: float | None = None,
                        escalate: float | None = None) -> dict[str, Any]:
    """vlm.tempering.threshold from a run on a validation split (one pass at the budget tempering
    starts with): pipeline.vlm.tempering.calibrate over the answers' stored confidences and
    correctness, with how the split's answers fall on either side of it."""
    from pipeline.vlm.tempering import calibrate

    scored = [p for p in report.predictions if math.isfinite(p.confidence)]
    if not scored:
        raise ValueError("no answer of this store has a confidence (stores written before answers kept one, "
                         "or no answers): run batch again to calibrate")
    threshold = calibrate([p.confidence for p in scored], [p.correct for p in scored], precision=precision,
                          escalate=escalate)
    accepted = [p.correct for p in scored if p.confidence >= threshold]
    return {"threshold": round(threshold, 6), "answers": len(scored), "precision_target": precision,
            "escalate_target": escalate,
            "accepted": len(accepted), "accepted_accuracy": round(sum(accepted) / len(accepted),
                                                                  6) if accepted else None,
            "asked_again": len(scored) - len(accepted),
            "accuracy": round(sum(p.correct for p in scored) / len(scored), 6)}


def judge_predictions(report: EvalReport) -> list[dict[str, str]]:
    """The Video-ChatGPT judge's input (video_name, Q, A, pred), plus the id/question/answer keys the
    Video-LLaVA variant of that script reads, so either runs on the file unchanged."""
    return [{"video_name": p.question.video_id, "id": p.question.question_id, "Q": p.question.question,
             "A": p.question.answer, "question": p.question.question, "answer": p.question.answer, "pred": p.text}
            for p in report.predictions]


def format_report(row: dict[str, Any]) -> str:
    lines = [f"accuracy {row['accuracy']:.4f} over {row['answered']} of {row['questions']} questions "
             f"(coverage {row['coverage']:.4f})"]
    for t, v in row["accuracy_by_type"].items():
        lines.append(f"  {t:<8} {v['accuracy']:.4f}  ({v['questions']} questions)")
    tok = row["tokens"]
    lines.append(f"tokens kept/full {tok['kept_over_full']:.4f}, spent/full {tok['spent_over_full']:.4f}; per video: "
                 f"kept {tok['mean_kept_per_video']}, spent {tok['mean_spent_per_video']}, "
                 f"full {tok['mean_full_per_video']}")
    if row["videos_damaged"]:
        n = row["videos_damaged"]
        lines.append(f"note: {row['answers_from_damaged_videos']} answers come from {n} damaged video{'s' * (n != 1)}, "
                     "answered over the frames decoded before the damage")
    if row["videos_incomplete"] or row["duplicates"] or row["unmatched"]:
        lines.append(f"warning: {row['videos_incomplete']} incomplete videos, {row['duplicates']} duplicate and "
                     f"{row['unmatched']} unmatched answers")
    return "\n".join(lines)
