"""`batch --dataset msrvtt --root DIR`: answer every question of a split, locally or on Ray."""
from __future__ import annotations

import json
from typing import Any

from arr_coc._validate import ConfigError
from sources.msrvtt import load_msrvtt

from ..runners.batch import make_plan, parse_shard, run_batch
from .common import EXIT_OK, load_run_config

def cmd_batch(args: Any) -> int:
    if args.overlay:
        raise ConfigError("--overlay renders one video; batch does not support it")
    cfg = load_run_config(args)
    dataset = load_msrvtt(args.root, args.split, task=args.task, videos_dir=args.videos)
    plan = make_plan(dataset, limit=args.limit, shard=parse_shard(args.shard))
    out = args.out or f"{args.dataset}_{args.split}.zarr"
    if args.ray:
        from ..runners.ray_batch import run_ray_batch
        summary = run_ray_batch(plan, out, cfg, address=args.ray, stock=args.stock_tokens,
                                workers=args.workers, progress=args.progress, in_flight=args.in_flight,
                                videos_per_task=args.videos_per_task)
    else:
        if args.videos_per_task is not None:
            raise ConfigError("--videos-per-task is for --ray runs (actor calls); the local path streams its videos")
        summary = run_batch(plan, out, cfg, stock=args.stock_tokens, progress=args.progress,
                            in_flight=args.in_flight)
    row = summary.to_dict()
    if cfg.runtime.vlm.startswith("tiny-random"):
        row["notes"] = ["tiny-random is a built-in random model for smoke tests: its answers are meaningless"]
    print(json.dumps(row))
    return EXIT_OK
