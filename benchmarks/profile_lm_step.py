"""One LM decode step of the VLM (a StaticDecoder step, replayed as a CUDA graph): its time by
batch rows and cache length, and the kernels it is made of.

    python3 benchmarks/profile_lm_step.py --json out.json          # GPU: random-weight Qwen2-VL-2B
    python3 benchmarks/profile_lm_step.py --quick                  # CPU smoke test (tiny-random)

Why: every answer token of every question costs one such step, whatever the visual tokens, so in
batch mode (16 questions of 8 tokens a video) the steps are the largest cost ARR-COC's token
selection does not shrink. Per (rows, cache slots) it prints the step's milliseconds (CUDA events
around --repeats replays, after warm-up) and the kernels of one replay grouped by name: count and
microseconds each, most time first.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import cuda_kernels, profiler_device, profiler_vlm  # noqa: E402


def ready_decoder(vlm, rows: int, length: int, prefix_len: int):
    """The VLM's (rows, length) decoder, started at slot prefix_len (its step captured on CUDA)."""
    decoder = vlm.pool._decoder(rows, length, steps=True)
    decoder.start(torch.full((rows,), prefix_len, dtype=torch.long, device=vlm.device),
                  [(0, 0)] * rows, prefix_len)
    return decoder


def step_ms(vlm, decoder, repeats: int) -> float:
    token = torch.full((decoder.rows,), 7, dtype=torch.long, device=vlm.device)
    for _ in range(3):
        decoder.step(token)
    if vlm.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            decoder.step(token)
        return 1e3 * (time.perf_counter() - t0) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        decoder.step(token)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def step_kernels(vlm, decoder, replays: int = 5, top: int = 25) -> dict:
    """Kernels of one replay, grouped by name: [name, count, us each, us in all] per step."""
    from torch.profiler import ProfilerActivity, profile
    token = torch.full((decoder.rows,), 7, dtype=torch.long, device=vlm.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            decoder.step(token)
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof)
    total = sum(e.self_device_time_total for e in kernels) / replays
    return {"kernel_us": round(total, 1), "kernels": round(sum(e.count for e in kernels) / replays),
            "by_name": [[e.key[:100], round(e.count / replays, 1), round(e.self_device_time_total / max(e.count, 1), 2),
                         round(e.self_device_time_total / replays, 1)] for e in kernels[:top]]}


@torch.no_grad()                     # as VLM.generate: no autograd graph recorded into the captured step
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128], help="decoder rows (answers decoded at once)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1280], help="cache slots")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (e.g. vlm.fast_lm=false), repeatable")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny-random, one small shape")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    device = profiler_device(args.quick)
    if args.quick:
        args.rows, args.lengths, args.repeats = [2], [64], 3
    vlm = profiler_vlm(device, args.quick, args.overrides)
    rows = []
    print(f"{'rows':>5} {'slots':>6} {'step ms':>8} {'kernel us':>9} {'kernels':>7}")
    for length in args.lengths:
        for r in args.rows:
            decoder = ready_decoder(vlm, r, length, prefix_len=min(length // 2, 128))
            row = {"rows": r, "slots": length, "step_ms": round(step_ms(vlm, decoder, args.repeats), 3)}
            if device.type == "cuda":
                row.update(step_kernels(vlm, decoder))
            rows.append(row)
            print(f"{r:>5} {length:>6} {row['step_ms']:>8} {row.get('kernel_us', '-'):>9} {row.get('kernels', '-'):>7}",
                  flush=True)
            vlm.pool._decoders.clear()                                             # the next shape's room
    for row in rows[:1] + rows[-1:]:
        for name, count, each, total in row.get("by_name", []):
            print(f"  rows {row['rows']} slots {row['slots']}: {total:8.1f} us  {count:6.1f} x {each:7.2f} us  {name}")
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "vlm": "tiny-random" if args.quick else "qwen2-vl-2b (random bf16)", "overrides": args.overrides,
              "steps": rows, "command": " ".join(["python3"] + sys.argv)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
