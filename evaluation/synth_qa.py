"""Generated video QA with exact answers: the dataset command, and the generator's names.

    python -m evaluation.synth_qa --root DIR [--splits train,val,test] [--count N ...] [--quiet]
                                  [--renderers shapes,photo,busy | --leave-out NAME | --held-out]

Without a renderer option it writes the original generator's clips and seven question families
(evaluation/shapes_qa.py, what the shipped arrcoc-synth-qa learnt). --renderers draws them with the
renderers of evaluation/renderers.py (every question family, evaluation/questions.py, and per video
its objects' boxes in {split}_tracks.json), clip k from the (k mod n)-th; --leave-out NAME with every
training renderer but NAME; --held-out writes the held-out renderer's test split (evaluation only;
no other split of it exists).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .renderers import HELD_OUT, RENDERERS, training_renderers, write_renderer_split
from .shapes_qa import (ALL_FAMILIES, ANSWER_WORDS, COUNT_WORDS, DIRECTIONS, FAMILIES, QA, REGION_FAMILIES,
                        SPLIT_SEEDS, SPLITS, STYLES, TEMPLATES, WHERE_ANSWERS, WHERE_MARGIN, QAClip, QAScene, Split,
                        SplitStyle, Track, check_seed, direction_answer, make_qa_clip, make_qa_scene, where_answer,
                        write_split)

__all__ = ["ALL_FAMILIES", "ANSWER_WORDS", "COUNT_WORDS", "DIRECTIONS", "FAMILIES", "QA", "REGION_FAMILIES",
           "SPLIT_SEEDS", "SPLITS", "STYLES", "TEMPLATES", "WHERE_ANSWERS", "WHERE_MARGIN", "QAClip", "QAScene",
           "Split", "SplitStyle", "Track", "check_seed", "direction_answer", "main", "make_qa_clip", "make_qa_scene",
           "where_answer", "write_split"]

DEFAULT_COUNTS = {"train": 2000, "val": 200, "test": 500}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise _UsageError(f"{self.prog}: {message}")


@dataclass(frozen=True)
class _Request:
    root: Path
    plan: list[tuple[str, int]]
    quiet: bool
    renderers: tuple[str, ...] = ()      # empty: the original generator's seven families (write_split)
    evaluation: bool = False


def _renderers(args: argparse.Namespace, splits: list[str]) -> tuple[tuple[str, ...], bool]:
    """The renderers the command writes, and whether it writes the held-out one (for evaluation)."""
    if args.held_out:
        if args.renderers or args.leave_out:
            raise _UsageError("--held-out writes the held-out renderer alone: drop --renderers / --leave-out")
        if splits != ["test"]:
            raise _UsageError(f"--held-out writes only the test split of {HELD_OUT!r}: pass --splits test")
        return (HELD_OUT,), True
    if args.leave_out:
        if args.renderers:
            raise _UsageError("give --renderers or --leave-out, not both")
        if args.leave_out not in RENDERERS:
            raise _UsageError(f"unknown renderer {args.leave_out!r} in --leave-out; allowed: {', '.join(RENDERERS)}")
        return training_renderers(args.leave_out), False
    names = tuple(r.strip() for r in (args.renderers or "").split(",") if r.strip())
    if bad := [r for r in names if r not in RENDERERS]:
        raise _UsageError(f"unknown renderer {bad[0]!r} in --renderers; allowed: {', '.join(RENDERERS)}")
    if HELD_OUT in names:
        raise _UsageError(f"renderer {HELD_OUT!r} is held out of training and tuning; write its test split "
                          f"for evaluation with --held-out --splits test")
    return names, False


def _parse(argv: Sequence[str] | None) -> _Request:
    p = _Parser(prog="python -m evaluation.synth_qa",
                description="write generated video-QA splits (MSRVTT-QA layout): the original generator's or "
                            "the renderers'")
    p.add_argument("--root", required=True, help="output directory (MSRVTT-QA release layout)")
    p.add_argument("--splits", help="comma-separated splits (default: train,val,test; with --held-out: test)")
    p.add_argument("--count", type=int, nargs="+", metavar="N",
                   help="clips per split: one number for all, or one per split "
                        f"(default: {', '.join(f'{k} {v}' for k, v in DEFAULT_COUNTS.items())})")
    p.add_argument("--renderers", help="comma-separated renderers (evaluation/renderers.py), clip k from the "
                                       "(k mod n)-th; with every question family (default: the original "
                                       "generator, its seven families)")
    p.add_argument("--leave-out", metavar="NAME", help="every training renderer but NAME (leave-one-renderer-out)")
    p.add_argument("--held-out", action="store_true",
                   help="the held-out renderer's test split, for evaluation only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.splits = args.splits or ("test" if args.held_out else "train,val,test")
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    bad = [s for s in splits if s not in SPLITS]
    if bad or not splits:
        raise _UsageError(f"unknown split {(bad or [args.splits])[0]!r} in --splits; allowed: {', '.join(SPLITS)}")
    if len(set(splits)) != len(splits):
        raise _UsageError(f"--splits names a split twice: {args.splits}")
    counts = args.count or [DEFAULT_COUNTS[s] for s in splits]
    if len(counts) == 1:
        counts = counts * len(splits)
    if len(counts) != len(splits):
        raise _UsageError(f"--count has {len(counts)} numbers for {len(splits)} splits; give one, or one per split")
    for s, n in zip(splits, counts):
        if not 1 <= n <= len(SPLIT_SEEDS[s]):
            raise _UsageError(f"--count {n} for {s}: must be in 1..{len(SPLIT_SEEDS[s])}")
    root = Path(args.root)
    if root.exists() and not root.is_dir():
        raise _UsageError(f"--root {root} exists and is not a directory")
    renderers, evaluation = _renderers(args, splits)
    return _Request(root, list(zip(splits, counts)), args.quiet, renderers, evaluation)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        req = _parse(argv)
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for split, count in req.plan:
            if req.renderers:
                path = write_renderer_split(req.root, split, count, req.renderers,  # type: ignore[arg-type]
                                            evaluation=req.evaluation, progress=not req.quiet)
            else:
                path = write_split(req.root, split, count, progress=not req.quiet)
            which = f" ({', '.join(req.renderers)})" if req.renderers else ""
            print(f"{split}{which}: {count} clips, {len(json.loads(path.read_text()))} questions -> {path}")
    except (OSError, ModuleNotFoundError) as e:      # a full disk, a missing scikit-image (photo)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
