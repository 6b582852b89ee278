"""Where `pipeline batch` spends a video's time: each phase of VideoAnswerer.answer, summed.

    python3 benchmarks/profile_batch.py --device cuda --videos 8 --questions 16      # GPU
    python3 benchmarks/profile_batch.py --quick                                       # CPU smoke test

Runs the same generated MSRVTT-QA fixture as bench_batch (Qwen2-VL-2B architecture, random bf16
weights on CUDA; tiny-random with --quick) once per setting given by --settings, and prints per
setting the mean seconds per video of: opening the video, capturing the front end's CUDA graphs,
the whole graph run, and inside it the VLM's vision tower, prefixes (the window's selection +
M-RoPE, then each question's), and
generation; plus the graph's per-stage busy shares. The first video of each setting (model
build, first captures) is left out of the means.

With --kernels it profiles instead (torch.profiler, no device syncs, so the videos in flight keep
overlapping as in a real run) and prints per video the GPU kernel time, the kernels that took the
most of it and the videos per VLM call: the GPU work per video, which bounds a run whose processes
keep the GPU busy (bench_batch --processes N --mps).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import json
import shutil
import tempfile
import time
from collections import defaultdict

import torch

import benchmarks.bench_batch as bb
from benchmarks.common import PhaseTimers, fixed_query, kernel_summary
import pipeline.runners.batch as batch_mod
from pipeline.core import frontend_graphs as cudagraph, graph as graph_mod
from pipeline.runners.batch import VideoAnswerer, make_plan
from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from pipeline.vlm import encoder as vlm_encoder, model as vlm_model
from evaluation.fixtures import write_fixture
from sources.msrvtt import load_msrvtt

PHASES = {  # label: (owner, attribute) wrapped with a timer
    "open_video": (batch_mod, "open_source"),
    "frontend_capture": (cudagraph.FrontendGraphs, "prepare"),
    "graph_run": (graph_mod.Graph, "run"),
    "vlm_vision": (vlm_encoder.VisionEncoder, "window_tokens"),          # every patch or the kept cells (vlm.encode)
    "vlm_window_prefix": (vlm_model.VLM, "window_prefix"),
    "vlm_question_prefixes": (vlm_model.VLM, "question_prefixes"),
    "vlm_generate": (vlm_model.VLM, "generate"),
}


def profile_kernels(answerer, plan, in_flight: int) -> dict:
    """The steady run of profile() under torch.profiler: GPU kernel ms per video (kernel_summary)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    batcher = getattr(answerer, "_batcher", None)
    seen = len(batcher.batch_sizes) if batcher is not None else 0
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        outcomes = list(answerer.answer_all(plan[1:], in_flight))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    n = len(outcomes)
    calls = batcher.batch_sizes[seen:] if batcher is not None else []
    return {"videos": n, "s_per_video_profiled": round(wall / n, 4), "vlm_calls": len(calls),
            "videos_per_vlm_call": round(sum(calls) / len(calls), 2) if calls else None,
            **kernel_summary(prof, n)}


def profile(plan, cfg, factory, device, *, stock: bool, scratch: Path, in_flight: int, kernels: bool = False) -> dict:
    out = scratch / f"profile_{'stock' if stock else 'arrcoc'}.zarr"
    shutil.rmtree(out, ignore_errors=True)     # a complete video would be skipped
    # a fixed question vector: the GPU machines have no MiniLM (as bench_batch)
    answerer = VideoAnswerer(cfg, out, stock=stock, vlm_factory=factory, query_encoder=fixed_query)
    answerer.answer(plan[0])                       # model build, first captures: not in the means
    if kernels:
        return {"tokens": "stock" if stock else "arrcoc", **profile_kernels(answerer, plan, in_flight)}
    reports: list[list[dict]] = []                 # each graph run's per-stage report

    def keep_report(label: str, args: tuple) -> None:
        if label == "graph_run":
            reports.append(args[0].report())
    timers = PhaseTimers(device, PHASES, after=keep_report)
    with timers.installed():
        t0 = time.perf_counter()
        outcomes = list(answerer.answer_all(plan[1:], in_flight))
        wall = time.perf_counter() - t0
    n = len(outcomes)
    busy = defaultdict(float)
    for report in reports:
        for row in report:
            busy[row["stage"]] += row["busy"] / len(reports)
    return {"tokens": "stock" if stock else "arrcoc", "videos": n,
            "s_per_video": round(wall / n, 4),
            "questions_per_s": round(sum(o.questions for o in outcomes) / wall, 3),
            "frames_per_video": round(sum(o.frames for o in outcomes) / n, 1),
            "phases_s_per_video": {k: round(v / n, 4) for k, v in timers.s.items()},
            "stage_busy": {k: round(v, 3) for k, v in busy.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="CPU smoke test: tiny-random VLM, small videos")
    p.add_argument("--videos", type=int, default=8)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--size", type=int, nargs=2, default=[240, 320], metavar=("H", "W"))
    p.add_argument("--settings", nargs="*", default=[""],
                   help="extra config overrides per setting, ';'-separated (e.g. 'runtime.cuda_graphs=false')")
    p.add_argument("--in-flight", type=int, default=1, help="videos in work at once (phase sums then overlap)")
    p.add_argument("--kernels", action="store_true",
                   help="profile GPU kernel time per video (in all, the top kernels) instead (CUDA only)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.device, args.videos, args.questions, args.seconds, args.size = "cpu", 3, 3, 1.0, [64, 96]
    device = torch.device(args.device)
    if args.kernels and device.type != "cuda":
        sys.exit("--kernels profiles CUDA kernels: it needs --device cuda")
    scratch = Path(tempfile.mkdtemp(prefix="profile_batch_"))
    rows = []
    try:
        write_fixture(scratch / "msrvtt", videos=args.videos, questions_per_video=args.questions,
                      seconds=args.seconds, height=args.size[0], width=args.size[1], fps=30 if not args.quick else 10)
        plan = make_plan(load_msrvtt(scratch / "msrvtt"))
        for setting in args.settings:
            overrides = [f"runtime.device={args.device}", "model.attending.retention=0.25",
                         f"vlm.max_new_tokens={2 if args.quick else 8}", "vlm.fps=2.0",
                         "runtime.vlm=" + ("tiny-random" if args.quick else "qwen2-vl-2b-random")]
            overrides += [o for o in setting.split(";") if o]
            cfg = load_config(PipelineConfig, None, overrides)
            bb.BENCH_VLM = cfg.vlm
            factory = None if args.quick else bb.qwen2_vl_2b_factory
            for stock in (True, False):
                row = {"setting": setting or "default", **profile(plan, cfg, factory, device, stock=stock,
                                                                  scratch=scratch, in_flight=args.in_flight,
                                                                  kernels=args.kernels)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                                         "command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
