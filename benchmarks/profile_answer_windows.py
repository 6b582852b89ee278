"""One batch-mode VLM call (`VLM.answer_windows`) alone and beside other CUDA processes.

    python3 benchmarks/profile_answer_windows.py --json out.json          # GPU
    python3 benchmarks/profile_answer_windows.py --quick                  # CPU smoke test (tiny-random)

Why: `batch --processes N` runs N processes on one GPU, and a shared VLM process was slower for
ARR-COC than a VLM in each (docs/performance.md). This times, for the random-weight Qwen2-VL-2B
architecture and bench_batch's clip shape (20 frames of 320x240, 16 questions, 8 answer tokens),
the call that answers V videos at once, for stock tokens and for an ARR-COC-like keep map (random
cells, about 8% of the tokens): its wall time, its phases (timed with a device sync around each:
vision tower, window prefix, question prefixes, generation), the GPU kernel time and kernel count
of the call (torch.profiler), and then the same ARR-COC call while K other processes keep their
own CUDA contexts busy with small kernels (a stand-in for the front ends of other shard processes:
20 convolutions over a 20-frame batch, a sync, 10 ms asleep, again).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import PhaseTimers, kernel_summary, profiler_device, profiler_vlm  # noqa: E402
from pipeline.vlm import encoder as vlm_encoder, model as vlm_model  # noqa: E402
from pipeline.runtime.requests import WindowQuestions  # noqa: E402

PHASES = {"vision": (vlm_encoder.VisionEncoder, "window_tokens")} | {label: (vlm_model.VLM, attr) for label, attr in (
    ("window_prefix", "window_prefix"), ("question_prefixes", "question_prefixes"), ("generate", "generate"))}
OTHER_CONTEXT = r'''
import sys, time, torch
x = torch.randn(20, 3, 240, 320, device="cuda"); k = torch.randn(8, 3, 3, 3, device="cuda")
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        torch.nn.functional.conv2d(x, k, padding=1).relu().mean()
    torch.cuda.synchronize()
    time.sleep(0.01)
'''


def build_vlm(device: torch.device, quick: bool):
    return profiler_vlm(device, quick, ["vlm.max_new_tokens=8" if not quick else "vlm.max_new_tokens=2",
                                        "vlm.fps=2.0", "vlm.kept_context=0"])


def make_jobs(vlm, videos: int, stock: bool, shape: tuple[int, int, int], questions: int) -> list[WindowQuestions]:
    T, H, W = shape
    gh, gw = vlm.geometry.grid(H, W)
    qs = [f"what is the colour of object number {i} in the clip?" for i in range(questions)]
    jobs = []
    for i in range(videos):
        rng = np.random.default_rng(100 + i)
        keep = None if stock else rng.choice(3, size=(T, gh, gw), p=(0.95, 0.035, 0.015)).astype(np.int64)
        jobs.append(WindowQuestions(rng.integers(0, 255, (T, H, W, 3), dtype=np.uint8), keep, qs, None))
    return jobs


def call_ms(vlm, jobs, device, repeats: int) -> float:
    for _ in range(3):                                                       # captures, first shapes
        vlm.answer_windows(jobs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        vlm.answer_windows(jobs)
    sync()
    return 1e3 * (time.perf_counter() - t0) / repeats


def kernel_stats(vlm, jobs, repeats: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            vlm.answer_windows(jobs)
        torch.cuda.synchronize()
    summary = kernel_summary(prof, repeats, top=0)
    return {"gpu_kernel_ms": round(summary["kernel_ms"], 1), "kernels": summary["kernels"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--videos", type=int, nargs="+", default=[1, 4, 8], help="videos per call")
    ap.add_argument("--contexts", type=int, nargs="*", default=[1, 4],
                    help="other busy CUDA processes to time the ARR-COC call beside (GPU only)")
    ap.add_argument("--beside-videos", type=int, default=4, help="videos per call beside other contexts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny-random, small frames")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    device = profiler_device(args.quick)
    shape, questions = ((4, 56, 84), 3) if args.quick else ((20, 240, 320), 16)
    vlm = build_vlm(device, args.quick)
    rows = []
    print(f"{'tokens':>6} {'videos':>6} {'call ms':>8} {'ms/video':>8} {'kernel ms':>9} {'kernels':>7}  phases ms")
    for stock in (False, True):
        for videos in args.videos:
            jobs = make_jobs(vlm, videos, stock, shape, questions)
            ms = call_ms(vlm, jobs, device, args.repeats)
            timer = PhaseTimers(device, PHASES)
            with timer.installed():
                for _ in range(args.repeats):
                    result = vlm.answer_windows(jobs)
            row = {"tokens": "stock" if stock else "arrcoc", "videos": videos, "call_ms": round(ms, 1),
                   "ms_per_video": round(ms / videos, 1), "tokens_kept": result[0][0].tokens_kept,
                   "phases_ms": {k: round(1e3 * v / args.repeats, 1) for k, v in timer.s.items()}}
            if device.type == "cuda":
                row.update(kernel_stats(vlm, jobs))
            rows.append(row)
            print(f"{row['tokens']:>6} {videos:>6} {row['call_ms']:>8} {row['ms_per_video']:>8} "
                  f"{row.get('gpu_kernel_ms', '-'):>9} {row.get('kernels', '-'):>7}  {row['phases_ms']}", flush=True)
    beside = []
    if device.type == "cuda":
        jobs = make_jobs(vlm, args.beside_videos, False, shape, questions)
        for n in [0] + list(args.contexts):
            others = [subprocess.Popen([sys.executable, "-c", OTHER_CONTEXT, "30"]) for _ in range(n)]
            try:
                time.sleep(8 if n else 0)                                    # their CUDA start-up
                ms = call_ms(vlm, jobs, device, args.repeats)
            finally:
                for p in others:
                    p.kill()
                    p.wait()
            beside.append({"other_contexts": n, "videos": args.beside_videos, "call_ms": round(ms, 1)})
            print(f"ARR-COC call of {args.beside_videos} videos beside {n} busy CUDA processes: {ms:.1f} ms",
                  flush=True)
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "vlm": "tiny-random" if args.quick else "qwen2-vl-2b (random bf16)",
              "clip": {"frames": shape[0], "height": shape[1], "width": shape[2], "questions": questions},
              "calls": rows, "beside_other_contexts": beside, "command": " ".join(["python3"] + sys.argv)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
