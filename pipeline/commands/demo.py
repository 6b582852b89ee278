"""`demo`: generate a sample video, answer questions about it, and draw the homunculus.

With the shipped video-QA model (`--vlm arrcoc-synth-qa`, the default when it is installed) the
sample is a held-out clip of the generated QA dataset (evaluation/synth_qa.py) and the demo asks its
questions, printing each answer next to the exact one and the visual tokens kept / full. With
`--vlm none` it shows allocation only, on a clip with three cuts (sources/synthetic.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import EXIT_OK, load_run_config

DEMO_SEED = 2_000_001   # a test-split clip (evaluation.synth_qa.SPLIT_SEEDS): a moving object, a cut, 6 questions
ALLOCATION_QUERY = "where is the red square?"   # --vlm none: what relevance is realized for


def cmd_demo(args: argparse.Namespace) -> int:
    if args.vlm is None and _shipped_qa_model():
        args.vlm = "arrcoc-synth-qa"
    cfg = load_run_config(args)
    out = Path(args.out) if args.out else Path("out/demo.zarr")
    out.parent.mkdir(parents=True, exist_ok=True)
    # a demo shows this run's answers: its store starts afresh (a resume would skip the answered clip),
    # and only an arr-coc store is ever replaced (sinks.ZarrStore.open, mode "w")
    overlay = Path(args.overlay or out.parent / "demo_overlay.mp4")
    sheet = out.parent / "demo_contact.png"
    if cfg.runtime.vlm == "none":
        return _allocation_demo(args, cfg, out, overlay, sheet)
    return _qa_demo(args, cfg, out, overlay, sheet)


def _shipped_qa_model() -> bool:
    from ..vlm.loading import SHIPPED
    return (SHIPPED["arrcoc-synth-qa"] / "config.json").is_file()


def _qa_demo(args, cfg, out: Path, overlay: Path, sheet: Path) -> int:
    from sources.msrvtt import Question, VideoWork
    from evaluation.synth_qa import make_qa_clip
    from sources.synthetic import write_video

    from ..runners.batch import VideoAnswerer, run_batch
    from ..runners.render import render_store

    clip = make_qa_clip(DEMO_SEED, split="test")
    video = out.parent / "qa_sample.mp4"
    write_video(video, clip.frames, fps=round(clip.fps))
    print(f"generated sample video {video} ({len(clip.frames)} frames, {len(clip.qas)} questions)", file=sys.stderr)
    asked = [(qa.question, qa.answer, qa.family) for qa in clip.qas]
    if args.query:   # the user's own question: answered, not scored (it has no known answer)
        asked.append((args.query, "", "user"))
    work = VideoWork("qa_sample", video, tuple(Question(str(k), "qa_sample", q, a, family)
                                               for k, (q, a, family) in enumerate(asked)))
    VideoAnswerer.create_store(cfg, out, overwrite=True)
    summary = run_batch([work], out, cfg, progress=args.progress, in_flight=1)
    if summary.count("done") != 1:
        raise RuntimeError(f"the demo clip was not answered: {summary.to_dict()}")
    from sinks import read_stream
    data = read_stream(out, "qa_sample")
    answers = data["answers"]
    rows = []
    for (question, expected, _), text, kept, full in zip(asked, answers["text"], answers["tokens_kept"],
                                                          answers["tokens_full"]):
        rows.append({"question": question, "answer": str(text), "expected": expected or None,
                     "correct": str(text).strip().lower() == expected if expected else None,
                     "tokens_kept": int(kept), "tokens_full": int(full)})
    scored = [r for r in rows if r["expected"] is not None]
    render_store(out, "qa_sample", video, overlay=overlay)
    render_store(out, "qa_sample", video, sheet=sheet)
    print(json.dumps({"stream": "qa_sample", "out": str(out), "vlm": cfg.runtime.vlm,
                      "correct": f"{sum(bool(r['correct']) for r in scored)}/{len(scored)}",
                      "scene_changes": [int(i) for i in data["frame_index"][data["scene_change"]]],
                      "answers": rows}))
    for r in rows:
        mark = {True: "ok ", False: "NO ", None: "?  "}[r["correct"]]
        expected = f"expected {r['expected']}" if r["expected"] else "your question"
        print(f"{mark} {r['question']:<45} -> {r['answer']:<12} ({expected}; "
              f"{r['tokens_kept']}/{r['tokens_full']} visual tokens)", file=sys.stderr)
    print(f"overlay video: {overlay}\ncontact sheet: {sheet}")
    return EXIT_OK


def _allocation_demo(args, cfg, out: Path, overlay: Path, sheet: Path) -> int:
    from sinks import ZarrStore
    from sources.synthetic import default_demo_clip, write_video

    from ..api import Pipeline
    from ..configio import to_dict
    from ..runners.render import render_store
    from ..runners.run import print_summary

    video = out.parent / "sample.mp4"
    if not video.exists():
        clip = default_demo_clip()
        write_video(video, clip.frames, fps=25)
        print(f"generated sample video {video} ({len(clip.frames)} frames, cuts at {clip.cuts})", file=sys.stderr)
    ZarrStore.open(out, config=to_dict(cfg), mode="w")
    result = Pipeline(config=cfg).run(video, args.query or ALLOCATION_QUERY, out=out, overlay=overlay,
                                      progress=args.progress)
    render_store(out, result.stream_id, video, sheet=sheet)   # labelled, with a legend and the cuts
    print_summary(result, args.verbose)
    print(f"overlay video: {overlay}\ncontact sheet: {sheet}")
    return EXIT_OK
