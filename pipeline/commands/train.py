"""`train --config configs/train_default.yaml`: train ARR-COC's parameters on generated scenes."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from arr_coc.checkpoint import DEFAULT_WEIGHTS

from ..configio import load_config
from ..training.train import TrainConfig, train
from .common import EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(TrainConfig, args.config, args.overrides)
    # CPU reductions depend on the thread count; a fixed count keeps the run bit-reproducible
    torch.set_num_threads(2)
    export = DEFAULT_WEIGHTS if args.export_shipped else args.export
    result = train(cfg, resume=args.resume, progress=args.progress, log=lambda s: print(s, file=sys.stderr),
                   export=export)
    print(json.dumps({"weights": str(result["weights"]), "final": result["history"][-1] if result["history"] else {}}))
    return EXIT_OK
