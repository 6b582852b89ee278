"""Fit tempering's confidence probe (vlm.tempering.confidence: probe, pipeline/vlm/probe.py) on a split.

Answers every question of ROOT's split at the tempering ladder's first rung exactly as tempering's
first pass does (the tempering variant of benchmarks/bench_accuracy.py at threshold 0: `batch`, then
`eval`), keeps each answer's probe_features and whether it was right; with --target fixable (the
default) also answers it in one pass at the ladder's top rung. It then fits the logistic regression
(pipeline.vlm.probe.fit_probe) to the answers worth asking again, `wrong` (wrong at the first rung)
or `fixable` (wrong there and right at the top rung: a wrong answer that more tokens do not fix
costs a pass for nothing), and writes the probe file that vlm.tempering.probe names:

    python benchmarks/fit_probe.py --root CALIB --split val --vlm arrcoc-synth-qa --ladder 0.05,0.25 \
        --out probe.json

Fit it on clips that are neither the validation split its threshold is then calibrated on
(bench_accuracy --confidence probe --probe probe.json --val-root VAL --escalate q) nor a test
split. The answers' features are matched to their questions by the first token's margin, which
eval keeps with each answer (the run uses confidence margin: no probe exists yet).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_accuracy import load_answerer, run_config, run_row, tempering_overrides  # noqa: E402
from pipeline.core.setup import resolve_device  # noqa: E402
from pipeline.vlm.probe import fit_probe, probe_features  # noqa: E402
from pipeline.vlm.tempering import first_token_confidence  # noqa: E402


class FirstRungRecorder:
    """Wraps a VLM's tempering passes: for every answer of the first rung, (question, margin as
    float32, probe_features (F,)) in `rows`."""

    def __init__(self, vlm) -> None:
        self.rows: list[tuple[str, float, torch.Tensor]] = []
        self._logits: list[torch.Tensor] = []
        prefill, answer = vlm.prefill, vlm.passes.answer

        def record_prefill(prefixes, *args, **kwargs):
            decoder, logits = prefill(prefixes, *args, **kwargs)
            self._logits.append(logits.float().clone())                      # a replay would overwrite them
            return decoder, logits

        def record_answer(windows, questions, arrivals):
            self._logits.clear()
            out = answer(windows, questions, arrivals)
            logits = self._logits[0]                                         # (B, V) the first rung's prefill
            margins = first_token_confidence(logits, "margin").tolist()
            self.rows += [(q, float(np.float32(m)), f) for q, m, f in zip(questions, margins, probe_features(logits))]
            return out
        vlm.prefill, vlm.passes.answer = record_prefill, record_answer


def match(rows: list[tuple[str, float, torch.Tensor]], predictions) -> tuple[torch.Tensor, list]:
    """Recorded rows and eval's predictions (their margins) -> features (N, F) and the predictions
    in the same order."""
    pool: dict[tuple[str, float], list[torch.Tensor]] = defaultdict(list)
    for question, margin, features in rows:
        pool[(question, margin)].append(features)
    features, matched = [], []
    for p in predictions:
        found = pool.get((p.question.question, float(np.float32(p.confidence))))
        if not found:
            raise SystemExit(f"fit_probe: no recorded features for {p.question.video_id}: {p.question.question!r}")
        features.append(found.pop(0))
        matched.append(p)
    return torch.stack(features), matched


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="split root ({split}_qa.json + videos/)")
    ap.add_argument("--split", default="val", help="the split's name under ROOT (default: val)")
    ap.add_argument("--vlm", default="arrcoc-synth-qa")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--limit", type=int, help="only the first N clips")
    ap.add_argument("--ladder", default="0.1,0.25", help="tempering's budget ladder (default: %(default)s)")
    ap.add_argument("--rank", choices=("allocation", "relevance", "attention"), default="allocation")
    ap.add_argument("--target", choices=("fixable", "wrong"), default="fixable",
                    help="the answers the probe learns to ask again (default: %(default)s)")
    ap.add_argument("--l2", type=float, default=10.0, help="L2 penalty of the regression (default: %(default)s)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--query-embeddings", type=Path, help="a .pt {question: (384,) tensor} of MiniLM embeddings")
    ap.add_argument("--out", type=Path, required=True, help="the probe file to write")
    args = ap.parse_args(argv)
    from pipeline.runners.batch import make_plan
    from sources.msrvtt import load_msrvtt

    if not (args.root / f"{args.split}_qa.json").is_file():
        ap.error(f"--root {args.root}: no {args.split}_qa.json")
    ladder = tuple(float(r) for r in args.ladder.split(",") if r)
    dataset = load_msrvtt(args.root, args.split)
    plan = make_plan(dataset, limit=args.limit)
    cfg = run_config(args, *tempering_overrides(ladder, 0.0, rank=args.rank), "vlm.tempering.confidence=margin")
    vlm = load_answerer(cfg, resolve_device(args.device))
    recorder = FirstRungRecorder(vlm)
    query_encoder = None
    if args.query_embeddings is not None:
        table = torch.load(args.query_embeddings)
        query_encoder = lambda question: table[question]  # noqa: E731
    workdir = Path(tempfile.mkdtemp(prefix="fit_probe_"))
    row = run_row("arrcoc", ladder[-1], plan, dataset, cfg, vlm, workdir, query_encoder, "first-rung")
    features, answers = match(recorder.rows, row["_report"].predictions)
    ask_again = [not p.correct for p in answers]
    if args.target == "fixable":                                            # the top rung in one pass
        base = run_config(args)
        top = run_row("arrcoc", ladder[-1], plan, dataset, base, load_answerer(base, vlm.device), workdir,
                      query_encoder)
        right = {(p.question.video_id, p.question.question): p.correct for p in top["_report"].predictions}
        ask_again = [a and right[(p.question.video_id, p.question.question)] for a, p in zip(ask_again, answers)]
        print(f"top rung {ladder[-1]:g}: accuracy {top['accuracy']:.4f}", file=sys.stderr)
    target = {"wrong": "wrong at the first rung",
              "fixable": "wrong at the first rung and right at the top rung"}[args.target]
    probe = fit_probe(features, torch.tensor(ask_again), l2=args.l2, fitted_on={
        "root": str(args.root), "split": args.split, "clips": len(plan), "vlm": args.vlm, "ladder": list(ladder),
        "rank": args.rank, "target": target, "command": " ".join(["python", *sys.argv])})
    probe.save(args.out)
    print(f"fit on {len(answers)} answers ({sum(ask_again)} {args.target}, first-rung accuracy "
          f"{row['accuracy']:.4f}); wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
