"""`run VIDEO --query Q`: one video file end to end."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import EXIT_OK, load_run_config

def cmd_run(args: argparse.Namespace) -> int:
    from sinks import store_location

    from ..runners.run import print_summary, run_video

    cfg = load_run_config(args)
    video = Path(args.video)
    out = store_location(args.out) if args.out else Path(f"{video.stem}.zarr")
    result = run_video(video, args.query, out, cfg, overlay_path=args.overlay, progress=args.progress)
    print_summary(result, args.verbose)
    return EXIT_OK
