"""`batch --dataset msrvtt --root DIR`: answer every question of a split, locally or on Ray."""
from __future__ import annotations

import json
from typing import Any

from arr_coc._validate import ConfigError

from ..api import Pipeline
from .common import EXIT_OK, load_run_config


def cmd_batch(args: Any) -> int:
    if args.overlay:
        raise ConfigError("--overlay renders one video; batch does not support it")
    pipe = Pipeline(config=load_run_config(args))
    summary = pipe.batch(args.root, dataset=args.dataset, split=args.split, task=args.task, videos=args.videos,
                         limit=args.limit, shard=args.shard, out=args.out, ray=args.ray, workers=args.workers,
                         in_flight=args.in_flight, videos_per_task=args.videos_per_task,
                         stock_tokens=args.stock_tokens, progress=args.progress)
    row = summary.to_dict()
    if pipe.config.runtime.vlm.startswith("tiny-random"):
        row["notes"] = ["tiny-random is a built-in random model for smoke tests: its answers are meaningless"]
    print(json.dumps(row))
    return EXIT_OK
