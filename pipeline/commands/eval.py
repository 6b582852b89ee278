"""`eval STORE --dataset msrvtt --root DIR`: score a batch run."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sinks import SinkError, ZarrStore, store_location
from sources.msrvtt import load_msrvtt

from ..runners.evaluate import calibrate_threshold, evaluate, format_report, judge_predictions
from .common import EXIT_OK, EXIT_USAGE


def cmd_eval(args: Any) -> int:
    store = store_location(args.store)                                         # a local path or an fsspec URL
    try:
        ZarrStore.open(store, mode="r")
    except SinkError as e:
        raise SinkError(f"{e}; pass the --out of a batch run") from None
    dataset = load_msrvtt(args.root, args.split, task=args.task)
    report = evaluate(store, dataset)
    row = report.to_dict()
    row.update(store=str(store), dataset=args.dataset, split=args.split, task=args.task, layout=dataset.layout)
    if args.calibrate is not None:
        try:
            row["tempering"] = calibrate_threshold(report, args.calibrate or None)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
    # default: beside a local store; for a URL, in the working directory under the store's name
    name = (store.name if isinstance(store, Path) else store.rstrip("/").rsplit("/", 1)[-1]) + ".eval.json"
    path = Path(args.report) if args.report else (store.with_name(name) if isinstance(store, Path) else Path(name))
    try:
        path.write_text(json.dumps(row, indent=2))
        if args.export_judge:
            Path(args.export_judge).write_text(json.dumps(judge_predictions(report), indent=1))
    except OSError as e:
        raise SinkError(f"cannot write the report {e.filename}: {e.strerror}") from None
    print(format_report(row))
    if "tempering" in row:
        t = row["tempering"]
        kept = "-" if t["accepted_accuracy"] is None else f"{t['accepted_accuracy']:.4f}"
        print(f"tempering: --set vlm.tempering.threshold={t['threshold']:g}  ({t['answers']} answers: "
              f"{t['accepted']} accepted, {kept} of them right; {t['asked_again']} would be asked again)")
    print(f"report: {path}", file=sys.stderr)
    return EXIT_OK
