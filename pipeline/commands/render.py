"""`render STORE --stream ID --video VIDEO (--out OVERLAY.mp4 | --contact-sheet SHEET.png)`: look at a
finished store: its token maps over the video, labelled, with a legend."""
from __future__ import annotations

import argparse
import json

from .common import EXIT_OK


def cmd_render(args: argparse.Namespace) -> int:
    from ..runners.render import render_store

    result = render_store(args.store, args.stream, args.video, overlay=args.out, sheet=args.contact_sheet,
                          colour_by=args.color, tiles=args.tiles, columns=args.columns)
    print(json.dumps({"out": str(result.out), "frames": result.frames}))
    return EXIT_OK
