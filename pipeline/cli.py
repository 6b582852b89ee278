"""Command line: `python -m pipeline {run,demo} ...`.

Every user error (bad option, missing or corrupt video, unwritable output, config value out of
range) ends with one line on stderr and a non-zero exit; never a traceback (unless --verbose).
Exit codes: 0 ok, 2 bad input or options, 1 a stage failed, 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Sequence

from arr_coc._validate import ConfigError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A bad command line (one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise UsageError(f"{self.prog}: {message}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="output zarr store (default: <video stem>.zarr)")
    p.add_argument("--config", help="YAML config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set model.attending.retention=0.1 (repeatable)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="where the model runs (default: auto)")
    p.add_argument("--decoder", choices=["pyav", "decord"], help="video decoder (default: pyav)")
    p.add_argument("--vlm", help="VLM: HF id, local snapshot path, tiny-random, or none (default: none)")
    p.add_argument("--every", type=float, metavar="SECONDS", help="one answer per window of this length")
    p.add_argument("--overlay", metavar="FILE.mp4", help="also render the homunculus heat map over the video")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="force the progress bar (default: only on a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("-v", "--verbose", action="store_true", help="per-stage metrics; tracebacks on errors")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m pipeline", description="ARR-COC streaming video understanding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="process one video file")
    run.add_argument("video", help="video file")
    run.add_argument("--query", required=True, help="the question to answer / attend to")
    _common(run)
    run.set_defaults(func=cmd_run)
    demo = sub.add_parser("demo", help="generate a sample video and run the pipeline on it")
    demo.add_argument("--query", default="where is the red square?", help="question (default: %(default)s)")
    _common(demo)
    demo.set_defaults(func=cmd_demo)
    from .batch import add_batch_parser; add_batch_parser(sub, _common)  # noqa: E702 (one registration line)
    from .evaluate import add_eval_parser; add_eval_parser(sub)  # noqa: E702 (one registration line)
    from .live import add_live_parser; add_live_parser(sub, _common)  # noqa: E702 (one registration line)
    from . import evaluate_relevance, train; train.add_parser(sub); evaluate_relevance.add_parser(sub)  # noqa: E702
    return parser


def load_run_config(args: argparse.Namespace):
    from .config import PipelineConfig
    from .configio import load_config

    overrides = list(args.overrides)
    for flag, key in (("device", "runtime.device"), ("decoder", "decode.decoder"), ("vlm", "runtime.vlm"),
                      ("every", "runtime.every_s")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(PipelineConfig, args.config, overrides)


def cmd_run(args: argparse.Namespace) -> int:
    from sinks import store_location

    from .run import run_video

    cfg = load_run_config(args)
    video = Path(args.video)
    out = store_location(args.out) if args.out else Path(f"{video.stem}.zarr")
    result = run_video(video, args.query, out, cfg, overlay_path=args.overlay, progress=args.progress)
    _report(result, args.verbose)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from sinks import contact_sheet, read_stream
    from sources.synthetic import default_demo_clip, write_video

    from .run import run_video

    cfg = load_run_config(args)
    out = Path(args.out) if args.out else Path("out/demo.zarr")
    out.parent.mkdir(parents=True, exist_ok=True)
    video = out.parent / "sample.mp4"
    if not video.exists():
        clip = default_demo_clip()
        write_video(video, clip.frames, fps=25)
        print(f"generated sample video {video} ({len(clip.frames)} frames, cuts at {clip.cuts})", file=sys.stderr)
    overlay = args.overlay or str(out.parent / "demo_overlay.mp4")
    result = run_video(video, args.query, out, cfg, overlay_path=overlay, progress=args.progress)
    data = read_stream(out, result.stream_id)
    from sources import open_video
    with open_video(video) as src:
        frames = [f.rgb for f in src]
    picks = list(range(0, len(frames), max(1, len(frames) // 8)))[:8]
    sheet = out.parent / "demo_contact.png"
    contact_sheet([frames[i] for i in picks], data["tokens"][picks], sheet)
    _report(result, args.verbose)
    print(f"overlay video: {overlay}\ncontact sheet: {sheet}")
    return EXIT_OK


def _report(result: Any, verbose: bool) -> None:
    from sinks import read_stream

    data = read_stream(result.out, result.stream_id)
    tokens = data["tokens"].reshape(len(data["tokens"]), -1).sum(1) if len(data["tokens"]) else []
    gh, gw = result.grid
    summary = {
        "stream": result.stream_id, "out": str(result.out), "frames": result.frames,
        "fps": round(result.fps, 1), "grid": [gh, gw], "complete": result.complete,
        "scene_changes": [int(i) for i in data["frame_index"][data["scene_change"]]],
        "mean_tokens_per_frame": round(float(sum(tokens)) / max(1, len(tokens)), 2),
        "tokens_per_frame_full": gh * gw,
        "answers": [{"t_start": a.t_start, "t_end": a.t_end, "text": a.text, "tokens_kept": a.tokens_kept,
                     "tokens_full": a.tokens_full} for a in result.answers],
    }
    if result.notes:
        summary["notes"] = result.notes
    print(json.dumps(summary))
    for note in result.notes:
        print(f"warning: {note}", file=sys.stderr)
    if result.truncated:  # the source already warned about the damage itself
        print(f"warning: {result.stream_id}: stored the {result.frames} frames decoded before the damage "
              "(complete=false)", file=sys.stderr)
    if verbose:
        for row in result.metrics:
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)


def _user_errors() -> tuple[type[BaseException], ...]:
    from sinks import SinkError
    from sources import SourceError

    from .query import QueryEncoderError
    errors: list[type[BaseException]] = [UsageError, ConfigError, SourceError, SinkError, QueryEncoderError]
    try:
        from .vlm import VLMLoadError
        errors.append(VLMLoadError)
    except ImportError:
        pass
    return tuple(errors)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM ends cleanly, like Ctrl-C
    warnings.formatwarning = _one_line_warning
    _quiet_ffmpeg()
    verbose = "-v" in (argv or sys.argv[1:]) or "--verbose" in (argv or sys.argv[1:])
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted: the store was closed and stays valid (complete=false)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # one line for the user; the traceback only on request
        from .graph import StageError

        if verbose:
            traceback.print_exc()
        user = isinstance(e, _user_errors()) or (isinstance(e, StageError) and isinstance(e.error, _user_errors()))
        message = str(e.error) if isinstance(e, StageError) and user else str(e)
        first = message.strip().splitlines()[0] if message.strip() else type(e).__name__
        if not user and not isinstance(e, StageError):
            first = f"{type(e).__name__}: {first}"
        print(f"error: {first}", file=sys.stderr)
        return EXIT_USAGE if user else EXIT_FAILED


def _quiet_ffmpeg() -> None:
    """FFmpeg's own log lines (e.g. on a damaged file) would break the one-line error rule:
    damage is reported by the sources as a warning or a SourceError instead.

    PyAV's level None is its no-op log callback. Any level (even PANIC) installs a callback that
    takes the GIL inside FFmpeg's own decoding threads for every error-level line, and that
    deadlocks: a codec context freed while its thread holds the GIL (a garbage collection, in any
    thread) waits for those decoding threads, one of which waits for the GIL to log. A batch test
    hung exactly so (py-spy: avcodec_free_context under gc in zarr's IO thread, av_log ->
    logging_log_callback in an FFmpeg thread)."""
    try:
        import av.logging
        av.logging.set_level(None)
    except (ImportError, AttributeError):
        pass


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
