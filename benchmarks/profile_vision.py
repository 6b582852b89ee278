"""Where the vision tower's GPU time goes, with HF's block forward and with the pipeline's
(VLMConfig.fast_vision, pipeline/vlm/vision_blocks.py), in one run: one window's frames through
VLM._vision (the tower with the pipeline's batched attention; its CUDA graph where one runs), timed
(median of --reps), timed eagerly, and profiled eagerly (CUDA kernel time summed by kind, as
profile_prefill.py does), per architecture.

    python3 benchmarks/profile_vision.py                                                 # GPU: 2B and 7B, 32 x 448x448
    python3 benchmarks/profile_vision.py --arch qwen2-vl-2b --frames 20 --size 240 320   # a batch video
    python3 benchmarks/profile_vision.py --tiny                                          # CPU smoke test

Random bf16 weights and a synthetic window: the tower's cost depends on its shapes only. --json
writes the rows (ms as run and eager, kernel ms by kind, launches) and the speed-ups.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import functools
import gc
import json
import platform

import torch

from benchmarks.bench_vlm import build_vlm, synthetic_window, timed
from benchmarks.profile_prefill import print_profile, profile
from pipeline.vlm_config import VLMConfig

MODES = {"hf": False, "fast": True}     # label: VLMConfig.fast_vision


@torch.no_grad()
def measure(arch, mode, frames, device, dtype, reps, top) -> dict:
    H, W = frames.shape[1:3]
    vlm = build_vlm(arch, device, dtype, VLMConfig(dtype=str(dtype)[6:], max_pixels=max(H * W, 56 * 56),
                                                   fast_vision=MODES[mode]))
    pixels, grid = vlm.encoder.preprocess([frames])
    fn = functools.partial(vlm.encoder.vision, pixels, grid)
    ms = timed(fn, device, reps)[0] * 1e3
    # the same kernels, launched eagerly
    vlm.encoder._vision_graphs = None
    eager_ms = timed(fn, device, reps)[0] * 1e3
    by_kind, kernels = profile(fn, device)
    total = sum(by_kind.values())
    print(f"\n== {arch} {mode} blocks, {frames.shape[0]} frames {H}x{W} (grid {grid.tolist()}, {pixels.shape[0]} "
          f"patches): {ms:.2f} ms as run, {eager_ms:.2f} ms eager (medians of {reps}); kernels {total:.2f} ms, "
          f"{sum(k[1] for k in kernels)} launches")
    print_profile(by_kind, kernels, top)
    return dict(arch=arch, blocks=mode, frames=int(frames.shape[0]), size=[int(H), int(W)],
                patches=int(pixels.shape[0]),
                ms=ms, eager_ms=eager_ms, kernel_ms=total, kernel_ms_by_kind=by_kind,
                launches=sum(k[1] for k in kernels))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["qwen2-vl-2b", "qwen2.5-vl-7b"])
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--size", type=int, nargs="+", default=[448], help="H [W] of the frames")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=12, help="kernels listed per row")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    archs = ["tiny-qwen2_vl", "tiny-qwen2_5_vl"] if args.tiny else args.arch
    H, W = (args.size * 2)[:2]
    frames = synthetic_window(*((4, 56, 84) if args.tiny else (args.frames, H, W)))
    rows = []
    for arch in archs:
        for mode in MODES:
            rows.append(measure(arch, mode, frames, device, dtype, args.reps, args.top))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\narch            HF blocks ms  fast blocks ms  speed-up (as run)  speed-up (eager)")
    speedups = {}
    for arch in archs:
        hf, fast = (next(r for r in rows if r["arch"] == arch and r["blocks"] == m) for m in MODES)
        speedups[arch] = dict(as_run=hf["ms"] / fast["ms"], eager=hf["eager_ms"] / fast["eager_ms"])
        print(f"{arch:15s} {hf['ms']:12.2f} {fast['ms']:15.2f} {speedups[arch]['as_run']:17.2f}x "
              f"{speedups[arch]['eager']:16.2f}x")
    if args.json:
        import transformers
        args.json.write_text(json.dumps(dict(
            command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            torch=torch.__version__, transformers=transformers.__version__, dtype=str(dtype),
            rows=rows, speedup_fast_over_hf_blocks=speedups), indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
