"""Where the front end's time goes on a GPU: texture vs realize, eager vs CUDA-graph replay.

    python3 benchmarks/profile_frontend.py --device cuda [--size 448] [--batches 1,16,64]

Prints, per batch size: host-side launch time and GPU time of `extract` and of `realize` (eager),
and the time of one CUDA-graph replay of both (the launch-overhead-free floor). Notes for the
optimisation work, not a benchmark of record (that is bench_frontend.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from arr_coc.model import ARRCOC  # noqa: E402
from arr_coc.realizing import StreamState  # noqa: E402
from pipeline.vlm.geometry import VLMGeometry  # noqa: E402


def gpu_ms(fn, repeats: int = 20) -> tuple[float, float]:
    """(median host ms to launch, median GPU ms) of fn()."""
    host, gpu = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    host.sort()
    gpu.sort()
    return host[len(host) // 2], gpu[len(gpu) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--kernels", type=int, default=0, help="also list the N costliest GPU kernels at batch 1")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = ARRCOC().to(device).eval()
    query = torch.nn.functional.normalize(torch.randn(384, device=device), dim=0)
    size = args.size
    grid = VLMGeometry(max_pixels=size * size).grid(size, size)
    print(f"# {torch.cuda.get_device_name(device)}  torch {torch.__version__}  {size}x{size} grid {grid}")
    print(f"{'batch':>5} {'extract host/gpu ms':>20} {'realize host/gpu ms':>20} {'graph replay ms':>16} "
          f"{'graph fps':>10}")
    for b in (int(x) for x in args.batches.split(",")):
        frames = torch.randint(0, 255, (b, 3, size, size), dtype=torch.uint8, device=device)
        last = torch.randint(0, 255, (3, size, size), dtype=torch.uint8, device=device)
        with torch.inference_mode():
            texture = model.extract(frames, last, grid)
            _, state, _ = model.realize(texture, query, StreamState())
            ex = gpu_ms(lambda frames=frames, last=last: model.extract(frames, last, grid))
            re = gpu_ms(lambda texture=texture, state=state: model.realize(texture, query, state))
            graph_ms = float("nan")
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        model.realize(model.extract(frames, last, grid), query, state)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    model.realize(model.extract(frames, last, grid), query, state)
                _, graph_ms = gpu_ms(g.replay)
            except Exception as e:  # report why capture failed, keep the eager numbers
                print(f"# batch {b}: graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        print(f"{b:>5} {ex[0]:>9.2f}/{ex[1]:<9.2f} {re[0]:>9.2f}/{re[1]:<9.2f} {graph_ms:>16.3f} "
              f"{b / graph_ms * 1e3 if graph_ms == graph_ms else float('nan'):>10.0f}")
    if args.kernels:
        top_kernels(model, query, size, grid, device, args.kernels)


def top_kernels(model, query, size: int, grid, device, n: int) -> None:
    """The costliest GPU kernels of one eager batch-1 step (the same kernels a graph replays)."""
    from torch.profiler import ProfilerActivity, profile
    frames = torch.randint(0, 255, (1, 3, size, size), dtype=torch.uint8, device=device)
    last = torch.randint(0, 255, (3, size, size), dtype=torch.uint8, device=device)
    with torch.inference_mode():
        _, state, _ = model.realize(model.extract(frames, last, grid), query, StreamState())
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.realize(model.extract(frames, last, grid), query, state)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"# {sum(e.count for e in events)} kernels, {total / 1e3:.3f} ms GPU in all")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:n]:
        print(f"{e.self_device_time_total / 1e3:8.3f} ms {e.count:5d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
