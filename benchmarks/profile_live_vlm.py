"""One live answer batch through the VLM alone: the cost bench_live's "VLM call" column would have
with no capture, front-end or sink threads competing for the interpreter and the GPU.

bench_live (16 streams of 720p30, an answer every 2 s) reports each VLM call's wall time under load;
this times the same call on its own: B windows of 4 frames at 1280x720 (2 s at vlm.fps 2), each
keeping a random 25% of its cells (the live default retention), 16 answer tokens each (EOS off),
split into prepare (preprocess, vision tower, selection) and generate (prefill and decode). If
the call is much slower under load, the VLM thread is starved (the GIL), not the GPU.

    python3 benchmarks/profile_live_vlm.py --json benchmarks/results/profile_live_vlm_h100.json
    python3 benchmarks/profile_live_vlm.py --tiny                       # CPU smoke test
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import json
import statistics
import time

import numpy as np
import torch

from benchmarks.bench_vlm import build_vlm, sync, synthetic_window
from benchmarks.common import device_name
from pipeline.vlm_config import VLMConfig
from pipeline.runtime.requests import AnswerRequest


def requests(vlm, n: int, T: int, H: int, W: int, retention: float, seed: int = 0) -> list[AnswerRequest]:
    rng = np.random.default_rng(seed)
    gh, gw = vlm.geometry.grid(H, W)
    out = []
    for i in range(n):
        frames = synthetic_window(T, H, W)
        frames = np.roll(frames, 7 * i, axis=2)                              # each stream its own view
        keep = (rng.random((T, gh, gw)) < retention).astype(np.int64)
        out.append(AnswerRequest(f"s{i}", frames, keep, "what is moving, and where?", 0.0, T / vlm.config.fps))
    return out


def timed_phases(vlm, reqs, reps: int) -> dict:
    prepare, generate, total = [], [], []
    for _ in range(reps + 2):                                                # two warm-up rounds
        t0 = time.perf_counter()
        prefixes = vlm.prepare(reqs)
        sync(vlm.device)
        t1 = time.perf_counter()
        vlm.generate(prefixes)
        sync(vlm.device)
        t2 = time.perf_counter()
        vlm.answer(reqs)
        sync(vlm.device)
        t3 = time.perf_counter()
        prepare.append(t1 - t0), generate.append(t2 - t1), total.append(t3 - t2)
    med = lambda v: round(statistics.median(v[2:]) * 1e3, 2)                # noqa: E731
    return {"batch": len(reqs), "prepare_ms": med(prepare), "generate_ms": med(generate), "answer_ms": med(total),
            "tokens_kept_mean": round(float(np.mean([p.tokens_kept for p in vlm.prepare(reqs)])), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny random model, small frames")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--encode", choices=("all", "kept"), default="kept")
    ap.add_argument("--retention", type=float, default=0.25)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    T, H, W = (4, 72, 128) if args.tiny else (4, 720, 1280)
    cfg = VLMConfig(encode=args.encode, max_new_tokens=args.new_tokens, max_batch=max(args.batches),
                    dtype=str(dtype)[6:])
    vlm = build_vlm("tiny-qwen2_vl" if args.tiny else "qwen2-vl-2b", device, dtype, cfg)
    reqs = requests(vlm, max(args.batches), T, H, W, args.retention)
    rows = []
    with torch.no_grad():
        for b in args.batches:
            rows.append(timed_phases(vlm, reqs[:b], 1 if args.tiny else args.reps))
            print(json.dumps(rows[-1]), flush=True)
    result = {"command": " ".join(["python3 benchmarks/profile_live_vlm.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "card": device_name(device), "torch": torch.__version__, "window": [T, H, W], "encode": args.encode,
              "retention": args.retention, "new_tokens": args.new_tokens, "rows": rows}
    print(f"{'batch':>5} {'prepare ms':>10} {'generate ms':>11} {'answer ms':>9} {'tokens':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['prepare_ms']:>10.1f} {r['generate_ms']:>11.1f} {r['answer_ms']:>9.1f} "
              f"{r['tokens_kept_mean']:>6.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
