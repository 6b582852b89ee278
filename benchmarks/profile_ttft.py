"""Where one time to first token goes: bench_vlm's window (32 frames at 448x448, ARR-COC's
allocation at --retention) through VLM.prepare + generate(1 token), timed (median of --reps) and
then profiled (torch.profiler, CPU and CUDA): the GPU's busy time in it, the host syncs and copies
it makes, the gaps where the GPU waits for the host, and the kernels by time.

    python3 benchmarks/profile_ttft.py --arch qwen2.5-vl-7b                      # GPU: 7B, kept, 10%
    python3 benchmarks/profile_ttft.py --arch qwen2-vl-2b --encode all --trace /tmp/t.json
    python3 benchmarks/profile_ttft.py --tiny                                    # CPU smoke test

A TTFT whose GPU busy time is well under its wall time is bound by the host: `gaps_ms` lists the
largest idle stretches (start within the profiled call, length) to look for in --trace (a Chrome
trace). --json writes the summary (summarize() also reads a saved trace).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import collections
import gzip
import json
import statistics
import tempfile
import time

import torch

from benchmarks.bench_vlm import QUESTION, build_vlm, keep_maps, relevance_map, synthetic_window
from pipeline.runtime.cuda import window_frames
from pipeline.vlm_config import VLMConfig
from pipeline.runtime.requests import AnswerRequest

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def summarize(events: list[dict], calls: int, top: int = 12) -> dict:
    """Chrome-trace events of `calls` profiled calls -> per call: GPU busy ms, host syncs and copies
    and graph launches, the idle gaps over 50 us (start ms from the first GPU activity, length
    us), the kernels taking the most time."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    runtime = collections.Counter(e["name"] for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime")
    kernels: collections.Counter = collections.Counter()
    for e in gpu:
        if e.get("cat") == "kernel":
            kernels[e["name"][:100]] += e["dur"]
    start = gpu[0]["ts"] if gpu else 0.0
    gaps = []
    for a, b in zip(gpu, gpu[1:]):
        idle = b["ts"] - (a["ts"] + a["dur"])
        if idle > 50:
            gaps.append((round((a["ts"] + a["dur"] - start) / 1e3, 2), round(idle)))
    per = 1.0 / max(calls, 1)
    return {
        "gpu_busy_ms": round(sum(e["dur"] for e in gpu) * per / 1e3, 3),
        "syncs": round(sum(runtime[n] for n in SYNCS) * per, 1),
        "memcpy_calls": round(runtime["cudaMemcpyAsync"] * per, 1),
        "graph_launches": round(runtime["cudaGraphLaunch"] * per, 1),
        "kernel_launches": round(runtime["cudaLaunchKernel"] * per, 1),
        "gaps_ms": sorted(gaps, key=lambda g: -g[1])[:top],
        "kernels_ms": [(name, round(us * per / 1e3, 3)) for name, us in kernels.most_common(top)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny random Qwen2.5-VL")
    ap.add_argument("--arch", default="qwen2.5-vl-7b", help="architecture (default %(default)s)")
    ap.add_argument("--encode", choices=("all", "kept"), default="kept")
    ap.add_argument("--kept-windows", choices=("whole", "cells"), default="whole")
    ap.add_argument("--retention", type=float, default=0.1)
    ap.add_argument("--kept-context", type=int, default=None, help="vlm.kept_context (default: the config's)")
    ap.add_argument("--keep-on", choices=("host", "device"), default="host",
                    help="where the keep map is handed over (as bench_vlm --keep-on; default %(default)s)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls (the profile records 3)")
    ap.add_argument("--trace", type=Path, help="also write the Chrome trace here (.gz: compressed)")
    ap.add_argument("--json", type=Path, help="write the summary here")
    args = ap.parse_args(argv)
    arch = "tiny-qwen2_5_vl" if args.tiny else args.arch
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_ttft: no CUDA GPU here; use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.tiny else torch.bfloat16
    T, size = (4, 112) if args.tiny else (32, 448)
    extra = {} if args.kept_context is None else {"kept_context": args.kept_context}
    cfg = VLMConfig(max_pixels=size * size, max_new_tokens=1, dtype=str(dtype)[6:], encode=args.encode,
                    kept_windows=args.kept_windows, **extra)
    frames = synthetic_window(T, size, size)
    window = window_frames(list(frames), device.type == "cuda")
    vlm = build_vlm(arch, device, dtype, cfg)
    relevance, *_ = relevance_map(vlm, frames, 1)
    keep = keep_maps(relevance, [args.retention], vlm.geometry.temporal_patch_size)[args.retention]
    if args.keep_on == "host":                  # as the pipeline's stages hand it over
        keep = keep.cpu().numpy()
    request = AnswerRequest("profile", window, keep, QUESTION, 0.0, T / vlm.config.fps)

    def call():
        vlm.generate(vlm.prepare([request]), max_new_tokens=1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(5):                                    # captures, first shapes
        call()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    calls = 3
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        profiled_s = (time.perf_counter() - t0) / calls
    trace = args.trace or Path(tempfile.mkdtemp(prefix="profile_ttft_")) / "trace.json"
    raw = trace.with_suffix("") if trace.suffix == ".gz" else trace
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    if trace.suffix == ".gz":
        trace.write_bytes(gzip.compress(raw.read_bytes()))
    if args.trace is None or trace.suffix == ".gz":
        raw.unlink()
    summary = {"arch": arch, "encode": args.encode, "kept_windows": args.kept_windows, "keep_on": args.keep_on,
               "kept_context": cfg.kept_context, "retention": args.retention,
               "ttft_ms": round(statistics.median(times) * 1e3, 3), "profiled_ms": round(profiled_s * 1e3, 3),
               **summarize(events, calls)}
    print(f"{arch} {args.encode} {args.retention:g}: TTFT {summary['ttft_ms']:.2f} ms (profiled "
          f"{summary['profiled_ms']:.2f}), GPU busy {summary['gpu_busy_ms']:.2f} ms, {summary['syncs']:g} host "
          f"syncs, {summary['memcpy_calls']:g} copies, {summary['kernel_launches']:g} launches + "
          f"{summary['graph_launches']:g} graphs per call")
    print("largest GPU idle gaps (ms from start, us):", summary["gaps_ms"][:6])
    for name, ms in summary["kernels_ms"]:
        print(f"  {ms:8.3f} ms  {name}")
    if args.json:
        out = {"command": "profile_ttft.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, **summary}
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
