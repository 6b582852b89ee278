"""`live SOURCE [SOURCE ...] --query Q`: answer a question continuously over live video."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arr_coc._validate import ConfigError
from sinks import store_location
from sources.live import LiveConfig

from ..core.live_stages import LiveOptions
from ..runners.live import run_live
from .common import EXIT_FAILED, EXIT_OK, load_run_config

def cmd_live(args: argparse.Namespace) -> int:
    if args.overlay:
        raise ConfigError("--overlay is not supported by `live` (use `run` on a recording)")
    cfg = load_run_config(args)
    live = LiveConfig(transport=args.transport, open_timeout_s=args.timeout, read_timeout_s=args.timeout,
                      max_reconnects=args.max_reconnects, buffer_frames=args.buffer, realtime=args.realtime)
    options = LiveOptions(every_s=args.every, on_scene_change=args.on_scene_change, duration_s=args.duration,
                          metrics_every_s=args.metrics_every)
    out = store_location(args.out) if args.out else Path("live.zarr")
    result = run_live(args.sources, args.query, out, cfg, live=live, options=options, answers_out=sys.stdout)
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
