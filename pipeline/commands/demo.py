"""`demo`: generate a sample video and run the pipeline on it (overlay, contact sheet)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import EXIT_OK, load_run_config

def cmd_demo(args: argparse.Namespace) -> int:
    from sinks import contact_sheet, read_stream
    from sources.synthetic import default_demo_clip, write_video

    from ..api import Pipeline
    from ..runners.run import print_summary

    pipe = Pipeline(config=load_run_config(args))
    out = Path(args.out) if args.out else Path("out/demo.zarr")
    out.parent.mkdir(parents=True, exist_ok=True)
    video = out.parent / "sample.mp4"
    if not video.exists():
        clip = default_demo_clip()
        write_video(video, clip.frames, fps=25)
        print(f"generated sample video {video} ({len(clip.frames)} frames, cuts at {clip.cuts})", file=sys.stderr)
    overlay = args.overlay or str(out.parent / "demo_overlay.mp4")
    result = pipe.run(video, args.query, out=out, overlay=overlay, progress=args.progress)
    data = read_stream(out, result.stream_id)
    from sources import open_video
    with open_video(video) as src:
        frames = [f.rgb for f in src]
    picks = list(range(0, len(frames), max(1, len(frames) // 8)))[:8]
    sheet = out.parent / "demo_contact.png"
    contact_sheet([frames[i] for i in picks], data["tokens"][picks], sheet)
    print_summary(result, args.verbose)
    print(f"overlay video: {overlay}\ncontact sheet: {sheet}")
    return EXIT_OK
