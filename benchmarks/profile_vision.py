"""Where the vision tower's GPU time goes: one window's frames through VLM._vision (the tower with
the pipeline's batched attention, and its CUDA graph where one runs), timed (median of --reps) and
profiled eagerly (CUDA kernel time summed by kind, as profile_prefill.py does), per architecture.

    python3 benchmarks/profile_vision.py --arch qwen2-vl-2b qwen2.5-vl-7b               # GPU: 32 x 448x448
    python3 benchmarks/profile_vision.py --arch qwen2-vl-2b --frames 20 --size 240 320   # a batch video
    python3 benchmarks/profile_vision.py --hf-vision                                     # HF's block forward
    python3 benchmarks/profile_vision.py --tiny                                          # CPU smoke test

Random bf16 weights and a synthetic window: the tower's cost depends on its shapes only.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import functools

import torch

from benchmarks.bench_vlm import build_vlm, synthetic_window, timed
from benchmarks.profile_prefill import profile
from pipeline.vlm.config import VLMConfig


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["qwen2-vl-2b", "qwen2.5-vl-7b"])
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--size", type=int, nargs="+", default=[448], help="H [W] of the frames")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--hf-vision", action="store_true", help="HF's own vision block forward (VLMConfig.fast_vision off)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    archs = ["tiny-qwen2_vl", "tiny-qwen2_5_vl"] if args.tiny else args.arch
    H, W = (args.size * 2)[:2]
    frames_n, H, W = (4, 56, 84) if args.tiny else (args.frames, H, W)
    frames = synthetic_window(frames_n, H, W)
    for arch in archs:
        vlm = build_vlm(arch, device, dtype, VLMConfig(dtype=str(dtype)[6:], max_pixels=max(H * W, 56 * 56),
                                                         fast_vision=not args.hf_vision))
        pixels, grid = vlm._preprocess([frames])
        fn = functools.partial(vlm._vision, pixels, grid)
        ms = timed(fn, device, args.reps)[0] * 1e3
        graphs, vlm._vision_graphs = vlm._vision_graphs, None                # the kernels, launched eagerly
        eager_ms = timed(fn, device, args.reps)[0] * 1e3
        by_kind, kernels = profile(fn, device)
        vlm._vision_graphs = graphs
        total = sum(by_kind.values())
        print(f"\n== {arch}{' hf-vision' if args.hf_vision else ''} {frames_n} frames {H}x{W} (grid {grid.tolist()}, {pixels.shape[0]} patches): "
              f"{ms:.2f} ms as run, {eager_ms:.2f} ms eager (medians of {args.reps}); "
              f"kernels {total:.2f} ms, {sum(k[1] for k in kernels)} launches")
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {k:12s} {v:8.2f} ms  {100 * v / max(total, 1e-9):5.1f}%")
        for t, n, name in kernels[:args.top]:
            print(f"    {t:8.2f} ms  x{n:<4d} {name[:120]}")
        del vlm
    return 0


if __name__ == "__main__":
    sys.exit(main())
