"""`live SOURCE [SOURCE ...] --query Q`: answer a question continuously over live video."""
from __future__ import annotations

import argparse
import json
import sys

from arr_coc._validate import ConfigError

from ..api import Pipeline
from .common import EXIT_FAILED, EXIT_OK, load_run_config


def cmd_live(args: argparse.Namespace) -> int:
    if args.overlay:
        raise ConfigError("--overlay is not supported by `live` (use `run` on a recording)")
    pipe = Pipeline(config=load_run_config(args))
    result = pipe.live(args.sources, args.query, out=args.out or "live.zarr", on_scene_change=args.on_scene_change,
                       duration=args.duration, realtime=args.realtime, transport=args.transport,
                       timeout=args.timeout, buffer=args.buffer, max_reconnects=args.max_reconnects,
                       metrics_every=args.metrics_every, answers_out=sys.stdout, vlm_process=args.vlm_process,
                       decode_threads=args.decode_threads, stagger=args.stagger,
                       capture_processes=args.capture_processes)
    summary = {"summary": {"out": str(result.out), "wall_s": round(result.wall_s, 2), "grid": list(result.grid),
                           "complete": result.complete, "streams": result.streams}}
    print(json.dumps(summary), file=sys.stderr)
    for note in result.notes:
        print(f"warning: {note}", file=sys.stderr)
    for sid in result.damaged:   # the source already warned about the damage itself
        print(f"warning: {sid}: stored the {result.streams[sid]['frames_out']} frames processed before the "
              "damage (complete=false, damaged=true)", file=sys.stderr)
    if args.verbose:
        for row in result.metrics:
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    for error in result.errors:
        print(f"error: {error}", file=sys.stderr)
    return EXIT_FAILED if result.errors else EXIT_OK
