"""Command line: `python -m pipeline {run,demo,live,batch,eval,export,render,serve,
train,evaluate-relevance} ...`,
also installed as the console script `arrcoc`.

This module owns every parser; each command's function lives in its own module of this package
and is imported only when that command runs.

Every user error (bad option, missing or corrupt video, unwritable output, config value out of
range) ends with one line on stderr and a non-zero exit; never a traceback (unless --verbose).
Exit codes: 0 ok, 2 bad input or options, 1 a stage failed, 130 interrupted.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from arr_coc._validate import ConfigError

from .common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise UsageError(f"{self.prog}: {message}")


def _common(p: argparse.ArgumentParser, *, out: str = "<video stem>.zarr",
            vlm: str = "none: allocation only, no answers") -> None:
    p.add_argument("--out", help=f"output zarr store (default: {out})")
    p.add_argument("--config", help="YAML config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set model.attending.retention=0.1 (repeatable)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="where the model runs (default: auto)")
    p.add_argument("--decoder", choices=["pyav", "decord", "nvdec"],
                   help="video decoder (default: pyav); nvdec: the GPU's (pip install 'arr-coc-video[nvdec]'), "
                        "--set decode.fallback=true for pyav where it cannot be used")
    p.add_argument("--vlm", help="VLM: HF id, local snapshot path, arrcoc-synth-qa (shipped, offline; generated "
                                 f"scenes only), tiny-random, or none (default: {vlm})")
    p.add_argument("--every", type=float, metavar="SECONDS",
                   help="one answer per window of this length (one frame to a day)")
    p.add_argument("--overlay", metavar="FILE.mp4", help="also render the homunculus heat map over the video")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="force the progress bar (default: only on a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("-v", "--verbose", action="store_true", help="per-stage metrics; tracebacks on errors")


def build_parser(prog: str = "python -m pipeline") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="ARR-COC streaming video understanding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="process one video file")
    run.add_argument("video", help="video file")
    run.add_argument("--query", required=True, help="the question to answer / attend to")
    _common(run)
    run.set_defaults(func=_lazy("run", "cmd_run"))
    demo = sub.add_parser("demo", help="generate a sample video and run the pipeline on it",
                          description="Generate a sample clip, answer questions about it with the shipped model "
                                      "and draw the homunculus (overlay video, contact sheet). Each run starts "
                                      "its store afresh.")
    demo.add_argument("--query", help="with the QA model: one more question about the clip, after its own six; "
                                      "with --vlm none: the question relevance is realized for "
                                      "(default: 'where is the red square?')")
    _common(demo, out="out/demo.zarr, replaced on each run",
            vlm="arrcoc-synth-qa when installed, else none")
    demo.set_defaults(func=_lazy("demo", "cmd_demo"))
    _add_batch(sub)
    _add_eval(sub)
    _add_export(sub)
    _add_render(sub)
    _add_live(sub)
    _add_serve(sub)
    _add_train(sub)
    _add_evaluate_relevance(sub)
    return parser


# The choices and defaults the parsers show, written here because their homes import torch, zarr
# or PyAV (runners/batch.py, sinks/): --help and a one-line input error must not wait for those.
# tests/pipeline/commands/test_startup.py checks each against its home.
DATASETS = ("msrvtt",)              # pipeline.runners.batch.DATASETS
IN_FLIGHT = 4                       # pipeline.runners.batch.IN_FLIGHT
EXPORT_FORMATS = ("jsonl", "csv")   # sinks.export.EXPORT_FORMATS
COLOUR_BY = ("relevance", "tokens")  # sinks.overlay.COLOUR_BY


def _add_batch(sub: Any) -> None:
    from sources.msrvtt import TASKS

    p = sub.add_parser("batch", help="answer every question of a dataset split (resumable, optionally on Ray)")
    p.add_argument("--dataset", required=True, choices=DATASETS, help="dataset layout")
    p.add_argument("--root", required=True, help="dataset root (annotation JSON files; videos under videos/ ...)")
    p.add_argument("--split", default="test", help="train, val or test (default: %(default)s)")
    p.add_argument("--task", default="qa", choices=TASKS, help="qa (MSRVTT-QA) or caption (videodatainfo)")
    p.add_argument("--videos", help="directory holding video<N>.mp4 (default: found under --root)")
    p.add_argument("--limit", type=int, help="only the first N videos of the split")
    p.add_argument("--shard", metavar="I/N", help="answer every N-th video from the I-th (0-based)")
    p.add_argument("--ray", metavar="ADDRESS", help="run on Ray Data: 'auto' (a running cluster), 'local', "
                                                    "or a cluster address")
    p.add_argument("--workers", type=int, help="Ray: actors in the pool (default: one per GPU, else one; never "
                                               "more than the actor calls the plan makes, "
                                               "ceil(videos / --videos-per-task))")
    p.add_argument("--in-flight", type=int, default=IN_FLIGHT, metavar="N",
                   help="videos each worker has in work at once: the next is decoded and allocated while the "
                        "VLM answers the last (default: %(default)s)")
    p.add_argument("--videos-per-task", type=int, metavar="N",
                   help="Ray: videos each actor call answers, in_flight at a time (default: --in-flight); more "
                        "means fewer calls and fewer pauses where an actor's videos in flight drain together")
    p.add_argument("--stock-tokens", action="store_true",
                   help="send the VLM every visual token (the baseline ARR-COC is measured against)")
    p.add_argument("--processes", type=int, metavar="N",
                   help="run the local path as N processes side by side on one store (--shard i/N each): on "
                        "one GPU several keep it busier than one (default: 1). With --ray: N actors on every GPU "
                        "of the cluster, 1/N of it each")
    p.add_argument("--shared-vlm", action="store_true",
                   help="with --processes: one VLM process answers every process's videos, batched together, "
                        "instead of a VLM in each (one model in GPU memory; faster with stock tokens, slower "
                        "with ARR-COC's: docs/performance.md)")
    p.add_argument("--mps", action="store_true",
                   help="with --processes on a CUDA GPU (and --ray local): run the processes as clients of an "
                        "NVIDIA MPS daemon (the one running, else one started and stopped for the run; needs the "
                        "driver's "
                        "nvidia-cuda-mps-control), so that their kernels share the GPU at once instead of taking "
                        "turns (docs/performance.md)")
    p.add_argument("--overwrite", action="store_true",
                   help="start --out afresh. Without it a re-run resumes: it skips the videos already answered, "
                        "and refuses a store answered with other settings (docs/usage.md)")
    p.add_argument("--vlm-server", help=argparse.SUPPRESS)  # set by --processes: the shared VLM's socket
    _common(p)
    p.set_defaults(func=_lazy("batch", "cmd_batch"))


def _add_eval(sub: Any) -> None:
    from sources.msrvtt import TASKS

    p = sub.add_parser("eval", help="score a batch run: accuracy (overall, per type) and token statistics")
    p.add_argument("store", help="the batch run's zarr store")
    p.add_argument("--dataset", required=True, choices=("msrvtt",), help="dataset layout")
    p.add_argument("--root", required=True, help="dataset root (the annotations the run used)")
    p.add_argument("--split", default="test", help="train, val or test (default: %(default)s)")
    p.add_argument("--task", default="qa", choices=TASKS, help="qa or caption (default: %(default)s)")
    p.add_argument("--report", help="JSON report path (default: <store>.eval.json beside the store; for a "
                                    "URL store, in the working directory)")
    p.add_argument("--export-judge", metavar="FILE.json", help="also write predictions in the Video-ChatGPT "
                                                               "GPT-judge format")
    p.add_argument("--calibrate", nargs="?", const=0.0, type=_precision, metavar="PRECISION",
                   help="also print vlm.tempering.threshold calibrated on this run's answers (a validation split "
                        "answered in one pass at the ladder's first budget): the threshold that best separates "
                        "right from wrong answers, or with PRECISION the lowest whose accepted answers are "
                        "right that often")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(func=_lazy("eval", "cmd_eval"))


def _add_export(sub: Any) -> None:
    p = sub.add_parser("export", help="a store's answers and scene changes as JSON lines or CSV (one row each)")
    p.add_argument("store", help="the zarr store (a path or an fsspec URL)")
    p.add_argument("--stream", metavar="ID", help="only this stream (default: every stream of the store)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="jsonl or csv")
    p.add_argument("--out", metavar="FILE", help="write here (default: stdout)")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(func=_lazy("export", "cmd_export"))


def _add_render(sub: Any) -> None:
    p = sub.add_parser("render", help="a store's token maps over its video: an overlay video or a contact sheet, "
                                      "labelled, with a legend")
    p.add_argument("store", help="the zarr store (a path or an fsspec URL)")
    p.add_argument("--stream", required=True, metavar="ID", help="the stream to render (a video's file stem)")
    p.add_argument("--video", required=True, help="the video the stream was made from")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", metavar="OVERLAY.mp4", help="an overlay video of every stored frame (.mp4, .mkv, .mov)")
    what.add_argument("--contact-sheet", metavar="SHEET.png", help="a PNG grid of frames spread over the stream")
    p.add_argument("--color", choices=COLOUR_BY, default="tokens",
                   help="what the colours show: tokens per kept cell, or the relevance of every cell "
                        "(default: %(default)s)")
    p.add_argument("--tiles", type=int, default=8, metavar="N",
                   help="contact sheet: frames on it (default: %(default)s)")
    p.add_argument("--columns", type=int, default=4, metavar="N",
                   help="contact sheet: tiles per row (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(func=_lazy("render", "cmd_render"))


def _add_live(sub: Any) -> None:
    """Register `live` on the CLI's subparsers (common: the shared options of run/demo/batch)."""
    p = sub.add_parser("live",
                       help="answer a question continuously over live video (camera, RTSP/HTTP, --realtime file)")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="camera index (0), device (/dev/video0), rtsp(s):// or http(s):// URL, or a file with "
                        "--realtime; several share one GPU and one batched VLM")
    p.add_argument("--query", required=True, help="the question to answer / attend to")
    _common(p)
    p.set_defaults(every=2.0)
    p.add_argument("--on-scene-change", action="store_true",
                   help="answer at each scene change instead of every --every s")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="stop after this long (default: until Ctrl-C)")
    p.add_argument("--realtime", action="store_true", help="allow files, played at their real frame rate")
    p.add_argument("--max-reconnects", type=int, metavar="N",
                   help="give up a source after N failed reconnect attempts in a row, an attempt that opens but "
                        "brings no frame included (default: retry forever)")
    p.add_argument("--transport", choices=["tcp", "udp"], default="tcp", help="RTSP transport (default: tcp)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="open / read timeout: a stream silent this long is reconnected (default: 5)")
    p.add_argument("--buffer", type=int, default=16, metavar="FRAMES",
                   help="newest frames kept per source; older ones are dropped and counted (default: %(default)s)")
    p.add_argument("--metrics-every", type=float, default=5.0, metavar="SECONDS",
                   help="period of the JSON metrics on stderr when it is not a terminal (default: 5)")
    p.add_argument("--stagger", action=argparse.BooleanOptionalAction, default=True,
                   help="spread the sources' answer times over the --every period, so that sources started "
                        "together do not queue behind each other's answers (default: on; --no-stagger: "
                        "every source answers at once)")
    p.add_argument("--decode-threads", type=int, default=2, metavar="N",
                   help="FFmpeg decoding threads per network stream, each holding a frame back (latencies count "
                        "it; default: %(default)s; 1: none held back; 0: FFmpeg's choice, up to one per core)")
    p.add_argument("--capture-processes", type=int, default=None, metavar="N",
                   help="capture the sources in N worker processes (PyAV), frames handed over through shared "
                        "memory, so that many streams' decoding does not hold up the pipeline's threads; 0: a "
                        "capture thread per source in this process (default: 4 processes from 16 sources on, "
                        "threads below)")
    p.add_argument("--vlm-process", action="store_true",
                   help="run the VLM in a process of its own (no interpreter lock shared with the capture and "
                        "front-end threads; off by default: docs/performance.md)")
    p.set_defaults(func=_lazy("live", "cmd_live"))


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (video questions, live streams) and a web viewer",
                       description="Serve /v1/chat/completions with video, live streams and the viewer at /. "
                                   "--out names the server's store: every request's homunculus, under the "
                                   "request's id (default: serve.zarr).")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s; any other needs --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--allow-dir", dest="allow_dirs", action="append", default=[], metavar="DIR",
                   help="serve file:// videos from inside this directory (repeatable; default: none)")
    p.add_argument("--api-key", action="append", help="require `Authorization: Bearer KEY` on every /v1 route "
                   "(default: the ARRCOC_API_KEY environment variable); repeat for several clients, each "
                   "seeing only its own files and streams")
    p.add_argument("--uploads", metavar="DIR", help="where uploaded videos are kept (default: <store>.uploads)")
    p.add_argument("--max-upload-mb", type=float, default=512.0, metavar="MB",
                   help="largest upload or data: URL (default: %(default)g)")
    p.add_argument("--max-fetch-mb", type=float, default=512.0, metavar="MB",
                   help="largest http(s):// video fetched for a request (default: %(default)g)")
    p.add_argument("--live-window", type=float, default=4.0, metavar="SECONDS",
                   help="an rtsp:// video in a chat request is answered over this much live video (default: "
                        "%(default)g)")
    p.add_argument("--max-concurrent", type=int, default=8, metavar="N",
                   help="requests doing work at once; more get 429 with Retry-After (default: %(default)s)")
    p.add_argument("--max-streams", type=int, default=8, metavar="N",
                   help="live streams over HTTP at once (default: %(default)s)")
    p.add_argument("--max-question-chars", type=int, default=8192, metavar="N",
                   help="longest question a request may ask, in characters (default: %(default)s)")
    p.add_argument("--header-timeout-s", type=float, default=10.0, metavar="SECONDS",
                   help="close a connection whose request head is not in by then (default: %(default)g)")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="open connections; at the cap the oldest one still sending its head is closed "
                        "(default: %(default)s, at most half the open-file limit)")
    _add_serve_limits(p)
    p.add_argument("--ray", metavar="ADDRESS", help="deploy on Ray Serve instead: 'local' (start Ray here), 'auto' "
                                                    "(a running cluster) or a cluster address")
    p.add_argument("--replicas", default="1", metavar="MIN[:MAX]",
                   help="Ray Serve: autoscaling bounds of the VLM deployment's replicas (default: %(default)s)")
    p.add_argument("--stream-groups", type=int, default=0, metavar="N",
                   help="Ray Serve: run the live streams on N deployments of a GPU and a VLM each, a new stream "
                        "on the least-loaded one (default: 0, in the ingress; docs/deployment.md)")
    _common(p)
    p.set_defaults(func=_lazy("serve", "cmd_serve"))


def _add_serve_limits(p: Any) -> None:
    """serve: outbound fetch policy, admission, retention (docs/deploying.md)."""
    p.add_argument("--max-concurrent-per-key", type=int, metavar="N",
                   help="requests one API key may run at once (default: --max-concurrent)")
    p.add_argument("--max-streams-per-key", type=int, metavar="N",
                   help="live streams one API key may run at once (default: --max-streams)")
    p.add_argument("--request-timeout-s", type=float, default=600.0, metavar="SECONDS",
                   help="a request still working after this long is stopped (504) and its slot freed "
                        "(default: %(default)g)")
    p.add_argument("--allow-media-host", dest="allow_media_hosts", action="append", default=[], metavar="HOST",
                   help="fetch from this host whatever address it resolves to (loopback, private); wildcards "
                        "as *.example.com; repeatable")
    p.add_argument("--allow-private-media", action="store_true",
                   help="let every http(s)/rtsp URL reach loopback, private and link-local addresses (off: refused)")
    p.add_argument("--media-hosts-only", action="store_true",
                   help="refuse every media host not named by --allow-media-host")
    p.add_argument("--media-resolve", action="append", default=[], metavar="HOST=ADDRESS",
                   help="resolve HOST to ADDRESS for media fetches instead of DNS, like curl --resolve (the "
                        "address is still checked); repeatable")
    p.add_argument("--retention-s", type=float, default=6 * 3600.0, metavar="SECONDS",
                   help="uploads and stored homunculi are removed this long after they were written "
                        "(default: %(default)g)")
    p.add_argument("--max-storage-gb", type=float, default=20.0, metavar="GB",
                   help="uploads, fetches and stored homunculi together stay under this; the oldest go first "
                        "(default: %(default)g)")


def _add_train(sub: Any) -> None:
    p = sub.add_parser("train", help="train the ARR-COC parameters on generated scenes (curriculum)")
    p.add_argument("--config", required=True, help="training YAML (configs/train_*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training config field, e.g. --set stages=[] (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/last.safetensors")
    export = p.add_mutually_exclusive_group()
    export.add_argument("--export", metavar="FILE.safetensors", help="also copy the final weights here")
    export.add_argument("--export-shipped", action="store_true",
                        help="also replace the shipped default checkpoint (arr_coc/weights/default.safetensors)")
    p.add_argument("--progress", dest="progress", action="store_true", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=_lazy("train", "cmd_train"))


def _add_evaluate_relevance(sub: Any) -> None:
    p = sub.add_parser("evaluate-relevance", help="score allocation, query awareness and temporal coherence "
                                                  "on held-out generated scenes against baselines")
    p.add_argument("--weights", default="default", help="trained weights: default, none or a .safetensors path")
    p.add_argument("--seed", type=int, default=1000, help="benchmark seed (held out from training)")
    p.add_argument("--quick", action="store_true", help="a small benchmark (smoke test)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", metavar="FILE.json", help="also write the full results here")
    p.set_defaults(func=_lazy("evaluate_relevance", "cmd_evaluate"))


def _precision(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command's function, imported when it runs: --help and parse errors stay fast."""
    def call(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(args)
    return call


# the user errors of modules a command may import: (module, class)
_USER_ERRORS = (("sources.errors", "SourceError"), ("sinks.store_files", "SinkError"),
                (f"{__package__.rpartition('.')[0]}.core.query", "QueryEncoderError"),
                (f"{__package__.rpartition('.')[0]}.vlm.loading", "VLMLoadError"))


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean bad input. An exception of a class can only exist once its
    module was imported, so only the modules already loaded are asked: an input error found before
    the model code loads (a missing file) is reported without importing torch for it."""
    errors: list[type[BaseException]] = [UsageError, ConfigError]
    for module, name in _USER_ERRORS:
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def _stage_error() -> type[BaseException] | None:
    graph = sys.modules.get(f"{__package__.rpartition('.')[0]}.core.graph")
    return graph.StageError if graph is not None else None


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


PACKAGES = ("arr_coc", "evaluation", "pipeline", "sinks", "sources")   # whose loggers the CLI shows


class _StderrHandler(logging.StreamHandler):
    """Our packages' log records on whatever sys.stderr is now: "warning: ..." / "error: ..." lines,
    info lines as they are (a server's address, the per-stage metrics of -v)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


def _configure_logging(verbose: bool) -> None:
    """What the library modules log is shown on stderr: info and up (debug with -v). Only our own
    packages' loggers: third-party libraries keep their own levels."""
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
            logger.removeHandler(old)                  # main() runs more than once in one process (tests)
        logger.addHandler(_StderrHandler())
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    verbose = "-v" in (argv or sys.argv[1:]) or "--verbose" in (argv or sys.argv[1:])
    # everything inside the try: a Ctrl-C that lands while the set-up imports PyAV (a batch shard
    # stopped as it starts) is an interrupt like any other, not a traceback
    try:
        from ..core.graph import INTERRUPTS

        INTERRUPTS.reset()
        # SIGTERM ends cleanly, like Ctrl-C
        signal.signal(signal.SIGTERM, functools.partial(_raise_interrupt, INTERRUPTS))
        warnings.formatwarning = _one_line_warning
        _quiet_ffmpeg()
        _quiet_progress_bars()
        _configure_logging(verbose)
        args = build_parser(_prog()).parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)   # batch --processes starts itself again
        return args.func(args)
    except KeyboardInterrupt:
        # the graph waited for its threads and closed the store (core/graph.py: Graph.run); a
        # signal from here on must not turn the exit into a traceback
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            print("interrupted: the store was closed and stays valid (complete=false)", file=sys.stderr)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return EXIT_INTERRUPTED
    except Exception as e:  # one line for the user; the traceback only on request
        if verbose:
            traceback.print_exc()
        from sources.errors import DecoderCrashed

        StageError = _stage_error()
        staged = StageError is not None and isinstance(e, StageError)
        cause = e.error if staged else e
        # a decoder that died (out of memory?) is a failed stage, not bad input
        user = isinstance(cause, _user_errors()) and not isinstance(cause, DecoderCrashed)
        message = str(cause) if staged and isinstance(cause, _user_errors()) else str(e)
        first = message.strip().splitlines()[0] if message.strip() else type(e).__name__
        if not user and not staged:
            first = f"{type(e).__name__}: {first}"
        print(f"error: {first}", file=sys.stderr)
        return EXIT_USAGE if user else EXIT_FAILED


def _prog() -> str:
    """How the user called us, for usage lines: the console script or the module."""
    return "arrcoc" if Path(sys.argv[0]).name == "arrcoc" else "python -m pipeline"


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


def _quiet_progress_bars() -> None:
    """Hugging Face's progress bars ("Loading weights" ...) only on a terminal: piped into a file
    or a log they are carriage-return noise between the one-line errors and JSON metric lines.
    The environment variable is read when huggingface_hub is first imported (after this) and is
    inherited by the processes a command starts; a value the user set is kept."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _raise_interrupt(interrupts: Any, signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: while a graph waits (or once the command was interrupted) the signal is
    queued for the wait to act on (core/graph.py: Interrupts), else KeyboardInterrupt."""
    if not interrupts.absorb():
        raise KeyboardInterrupt
