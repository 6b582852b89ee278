"""`evaluate-relevance`: score allocation, query awareness and temporal coherence against baselines."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..training.evaluate_relevance import EvalConfig, evaluate, quick_config, summary
from .common import EXIT_OK

def cmd_evaluate(args: argparse.Namespace) -> int:
    kwargs = dict(seed=args.seed, weights=args.weights, device=args.device)
    cfg = quick_config(**kwargs) if args.quick else EvalConfig(**kwargs)
    result = evaluate(cfg, log=lambda s: print(s, file=sys.stderr))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary(result)))
    return EXIT_OK
