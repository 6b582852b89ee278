"""`run VIDEO --query Q`: one video file end to end."""
from __future__ import annotations

import argparse

from .common import EXIT_OK, load_run_config


def cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sources.video import check_file

    check_file(Path(args.video))   # a missing file is one line at once, before the model code loads
    from ..api import Pipeline
    from ..runners.run import print_summary

    pipe = Pipeline(config=load_run_config(args))
    result = pipe.run(args.video, args.query, out=args.out, overlay=args.overlay, progress=args.progress)
    print_summary(result, args.verbose)
    return EXIT_OK
