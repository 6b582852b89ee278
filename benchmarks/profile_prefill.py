"""Where a prefill's GPU time goes: the LM prefill of one window at several prefix lengths, timed
eagerly (median of --reps) and profiled (CUDA kernel time summed by kind: GEMM, attention, norm,
rotary, elementwise, other), so a short pruned prefill can be compared with the stock one kernel by kind.

    python3 benchmarks/profile_prefill.py --arch qwen2.5-vl-7b --lengths 4130 450 512   # GPU
    python3 benchmarks/profile_prefill.py --tiny                                         # CPU smoke test

Random bf16 weights, embeddings drawn at random and positions 0..L-1: a prefill's cost depends on
its shapes only.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import re
from collections import defaultdict

import torch

from benchmarks.bench_vlm import build_vlm, sync, timed
from pipeline.vlm_config import VLMConfig

KINDS = [("gemm", r"gemm|gemv|cutlass|sm90_xmma|ampere_|nvjet|cublas"), ("attention", r"flash|fmha|attention|softmax"),
         ("norm", r"rsqrt|norm|mean|pow"), ("rotary", r"cat|neg|slice|index"), ("elementwise",
                                                                                r"elementwise|vectorized|silu|mul|add|copy")]


def kind(name: str) -> str:
    low = name.lower()
    for label, pattern in KINDS:
        if re.search(pattern, low):
            return label
    return "other"


def profile(fn, device) -> tuple[dict, list]:
    fn()
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync(device)
    by_kind, kernels = defaultdict(float), []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) if device.type == "cuda" else 0
        if device.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA and t > 0:
            by_kind[kind(e.key)] += t / 1e3
            kernels.append((t / 1e3, e.count, e.key))
    return dict(by_kind), sorted(kernels, reverse=True)


def print_profile(by_kind: dict, kernels: list, top: int) -> None:
    """profile()'s kernel time by kind (ms and share), then its `top` kernels."""
    total = sum(by_kind.values())
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:12s} {v:8.2f} ms  {100 * v / max(total, 1e-9):5.1f}%")
    for t, n, name in kernels[:top]:
        print(f"    {t:8.2f} ms  x{n:<4d} {name[:110]}")


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2.5-vl-7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4130, 450, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--graph", action="store_true", help="replay each prefill as a CUDA graph (as generate() does)")
    ap.add_argument("--hf-lm", action="store_true", help="the LM's layers through HF's own forward")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    arch = "tiny-qwen2_5_vl" if args.tiny else args.arch
    vlm = build_vlm(arch, device, dtype, VLMConfig(dtype=str(dtype)[6:], graph_prefill_max_tokens=0,
                                                     fast_lm=not args.hf_lm))
    D = vlm.lm.embed_tokens.embedding_dim
    for L in args.lengths:
        embeds = torch.randn(1, L, D, device=device, dtype=dtype) * 0.02
        positions = torch.arange(L, device=device).expand(3, 1, L)
        decoder = vlm.pool._decoder(1, -(-(L + 8) // 256) * 256, steps=False)
        pool = vlm.pool.graph_pool() if args.graph and device.type == "cuda" else None
        def fn(decoder=decoder, embeds=embeds, positions=positions, pool=pool):
            return decoder.prefill(embeds, positions, [0], pool=pool)
        ms = timed(fn, device, args.reps)[0] * 1e3
        by_kind, kernels = profile(fn, device)
        total = sum(by_kind.values())
        print(f"\n== {arch} L={L}{' graph' if pool is not None else ''}{' hf-lm' if args.hf_lm else ''}: {ms:.2f} ms "
              f"wall (median of {args.reps}); kernels {total:.2f} ms, "
              f"{sum(k[1] for k in kernels)} launches")
        print_profile(by_kind, kernels, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
