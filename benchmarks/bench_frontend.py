"""Speed of the ARR-COC front end (texture + realize) per frame, on CPU or a CUDA GPU.

    python3 benchmarks/bench_frontend.py --device cuda            # 448 and 1024, batch 1 and 64
    python3 benchmarks/bench_frontend.py --device cpu --sizes 448
    python3 benchmarks/bench_frontend.py --quick                  # CI smoke run (tiny sizes)

Frames are a generated camera pan with a moving square (real motion for the flow), already on
the device as the pipeline hands them over: uint8 (B, H, W, 3) permuted to (B, 3, H, W). One
step is `model.extract(frames, last_frame, grid)` then `model.realize(texture, query, state)`,
with the stream state and last frame carried from batch to batch as pipeline/core/stages.py does.
On CUDA an extra row per size/batch adds the host->device upload from pinned memory.
The token grid is the VLM's merged-token grid with max_pixels = H * W (the VLM keeps the frame
at its own size): 448x448 -> 16x16, 1024x1024 -> 36x36.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import os
import platform
import shlex
import statistics
import time
import contextlib
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from arr_coc.model import ARRCOC
from benchmarks.common import device_name, scratch_result, write_result
from pipeline.core.frontend_graphs import FrontendGraphs, graphable
from pipeline.vlm.geometry import VLMGeometry
from sources.synthetic import Shot, render_clip

# The GPU targets: >= 5000 frames/s at 448x448 batched, <= 2 ms per frame at batch 1
# (the seeds budget ~10 ms per 1024x1024 frame; 2 ms beats it by 5x).
TARGET_BATCHED_FPS_448 = 5000.0
TARGET_LATENCY_MS_BATCH1 = 2.0
QUERY_DIM = 384


@dataclass
class Row:
    size: str
    grid: tuple[int, int]
    batch: int
    device: str
    upload: bool            # True: the timed step includes the pinned host->device copy
    graphs: bool            # True: steady-state batches replay CUDA graphs (the pipeline's default on GPU)
    compiled: bool
    repeats: int
    ms_per_batch: float     # median over repeats
    ms_per_batch_min: float
    ms_per_frame: float
    frames_per_s: float
    target: str | None      # which issue target applies to this row, if any
    target_met: bool | None  # None off CUDA: the targets are for the GPU


def motion_frames(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 (2n, H, W, 3): a camera pan with a square moving against it, played forward then
    backward so that cycling through it never jumps (a jump would be a scene cut every lap)."""
    clip = render_clip([Shot("pan", n, speed=2.0)], height=height, width=width, seed=seed).frames
    side = max(4, min(height, width) // 6)
    y0 = (height - side) // 2
    for t in range(n):
        x0 = (width // 10 + 6 * t) % max(1, width - side)
        clip[t, y0:y0 + side, x0:x0 + side] = (230, 40, 40)
    return np.concatenate([clip, clip[::-1]])


def parse_size(text: str) -> tuple[int, int]:
    try:
        if "x" in text:
            h, w = (int(v) for v in text.lower().split("x"))
        else:
            h = w = int(text)
    except ValueError:
        raise SystemExit(f"--sizes: bad size {text!r}; allowed: N (square) or HxW, e.g. 448 or 720x1280") from None
    if h < 28 or w < 28:
        raise SystemExit(f"--sizes: {text!r} is smaller than one 28 px VLM token")
    return h, w


def parse_ints(name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{name}: expected positive integers, got {text!r}")
    return values


class CompiledOrEager(nn.Module):
    """`torch.compile(module)`, falling back to eager for good at the first compile failure (which
    happens in a warm-up step), so --compile never loses a run; `failures` records why."""

    def __init__(self, module: nn.Module, name: str, failures: dict[str, str]) -> None:
        super().__init__()
        self.eager, self.compiled = module, torch.compile(module)
        self.stage_name, self.failures = name, failures

    def forward(self, *args, **kwargs):
        if self.stage_name not in self.failures:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # inductor raises many types; any of them means "run eager"
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                self.failures[self.stage_name] = f"{type(e).__name__}: {first}"[:300]
                print(f"# --compile: {self.stage_name} runs eager ({self.failures[self.stage_name]})", flush=True)
        return self.eager(*args, **kwargs)


def pool_size(batches: list[int]) -> int:
    """Frames in the cycled pool: even (forward + backward), a multiple of every batch size
    (each batch is a plain slice), and at least two of the largest batches (and 16 frames)."""
    lcm = int(np.lcm.reduce(batches))
    total = lcm * -(-max(2 * max(batches), 16) // lcm)
    return total if total % 2 == 0 else 2 * total


def make_timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Milliseconds one call of `step` takes: CUDA events on the GPU, perf_counter on the CPU."""
    if device.type == "cuda":
        def timed(step: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return timed

    def timed_cpu(step: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    return timed_cpu


def bench_one(model: ARRCOC, query: torch.Tensor, pool: torch.Tensor, grid: tuple[int, int], batch: int,
              device: torch.device, warmup: int, repeats: int, upload: bool, graphs: bool = False) -> list[float]:
    """Per-step milliseconds for `repeats` consecutive batches of one stream (after `warmup`).

    pool: (N, H, W, 3) uint8 frames, N a multiple of batch; on the device, or in pinned host
    memory when `upload` (then each step first copies its batch to the device, as TextureStage does).
    """
    laps = pool.shape[0] // batch
    stream = {"last": None, "state": None, "k": 0}
    # graphs=True: the pipeline's steady state, every batch after a stream's first replays the
    # texture and realize CUDA graphs (pipeline/core/frontend_graphs.py), on a side stream as the stages do
    frontend = FrontendGraphs(model, grid, query) if graphs else None
    side = torch.cuda.Stream(device) if graphs else None
    ones = torch.ones(batch, dtype=torch.bool, device=device)

    def step() -> None:
        k = stream["k"] % laps
        pixels = pool[k * batch:(k + 1) * batch]                          # (B, H, W, 3)
        if upload:
            pixels = pixels.to(device, non_blocking=True)
        frames = pixels.permute(0, 3, 1, 2)                               # (B, 3, H, W)
        if frontend is not None and graphable(stream["state"]):
            texture = frontend.extract(frames, stream["last"], side)
            _, stream["state"] = frontend.realize(texture, stream["state"], ones, side)
        else:
            texture = model.extract(frames, stream["last"], grid)
            _, stream["state"], _ = model.realize(texture, query, stream["state"])
        stream["last"] = frames[-1].clone()
        stream["k"] += 1

    timed = make_timer(device)
    with torch.inference_mode(), (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
        for _ in range(max(warmup, 2 if graphs else 0)):  # graphs: eager first batch, then capture
            timed(step)
        return [timed(step) for _ in range(repeats)]


def judge(size: tuple[int, int], batch: int, ms_per_frame: float, fps: float,
          device: torch.device) -> tuple[str | None, bool | None]:
    if batch == 1:
        target, met = f"<= {TARGET_LATENCY_MS_BATCH1:g} ms/frame at batch 1", ms_per_frame <= TARGET_LATENCY_MS_BATCH1
    elif size == (448, 448):
        target, met = f">= {TARGET_BATCHED_FPS_448:g} frames/s at 448x448 batched", fps >= TARGET_BATCHED_FPS_448
    else:
        return None, None
    return target, (met if device.type == "cuda" else None)


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but no CUDA GPU is available (use --device auto or cpu)")
    torch.manual_seed(0)
    model = ARRCOC(query_dim=QUERY_DIM).to(device).eval()
    fallbacks: dict[str, str] = {}
    if args.compile:
        # Compile the pieces, not `extract`/`realize` themselves: they take and return dataclasses
        # (Texture, StreamState) and the stream's first batch takes another branch.
        for name in ("texture", "knowing", "balancer", "realizer", "allocator"):
            setattr(model, name, CompiledOrEager(getattr(model, name), name, fallbacks))
    # A unit-norm query like the sentence encoder's; the benchmark needs no text model.
    query = torch.nn.functional.normalize(torch.randn(QUERY_DIM, generator=torch.Generator().manual_seed(1)), dim=0)
    query = query.to(device)
    rows: list[Row] = []
    for h, w in args.sizes:
        grid = VLMGeometry(max_pixels=h * w).grid(h, w)
        host = torch.from_numpy(motion_frames(pool_size(args.batches) // 2, h, w))  # (N, H, W, 3)
        on_device = host.to(device)
        pinned = host.pin_memory() if device.type == "cuda" else None
        modes = [(False, False)]  # (upload, graphs)
        if pinned is not None:
            modes = [(False, False), (False, True), (True, True)] if args.graphs else [(False, False), (True, False)]
        for batch in args.batches:
            for upload, graphs in modes:
                times = bench_one(model, query, pinned if upload else on_device, grid, batch, device,
                                  args.warmup, args.repeats, upload, graphs)
                ms = statistics.median(times)
                fps = batch / ms * 1e3
                target, met = judge((h, w), batch, ms / batch, fps, device) if not upload else (None, None)
                rows.append(Row(size=f"{h}x{w}", grid=grid, batch=batch, device=device.type, upload=upload,
                                graphs=graphs,
                                compiled=args.compile, repeats=args.repeats, ms_per_batch=round(ms, 4),
                                ms_per_batch_min=round(min(times), 4), ms_per_frame=round(ms / batch, 4),
                                frames_per_s=round(fps, 2), target=target, target_met=met))
                print_row(rows[-1], device_name(device))
        del on_device, pinned
    return {
        "benchmark": "bench_frontend",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        # other jobs on the machine skew CPU numbers; this says how busy it was when the run ended
        "load_avg_1m_5m_15m": [round(v, 2) for v in os.getloadavg()],
        "timing": ("CUDA events around each step, synchronized after it" if device.type == "cuda"
                   else "time.perf_counter around each step") + f"; {args.warmup} warm-up steps, median of "
                                                                f"{args.repeats}",
        "frames": "generated pan + moving square, uint8 (B, H, W, 3) permuted to (B, 3, H, W); "
                  "on the device unless upload=true (pinned host memory, copied inside the step)",
        "grid_rule": "VLMGeometry(max_pixels=H*W).grid(H, W)",
        "targets": {"cuda_batched_fps_448": TARGET_BATCHED_FPS_448,
                    "cuda_ms_per_frame_batch1": TARGET_LATENCY_MS_BATCH1},
        "compile_fallbacks": fallbacks,  # stage -> why it ran eager under --compile
        "rows": [asdict(r) for r in rows],
    }


HEADER = (f"{'size':>10} {'grid':>6} {'batch':>5} {'device':>6} {'upload':>6} {'graphs':>6} {'frames/s':>10} "
          f"{'ms/frame':>9} {'ms/batch':>9}  target met?")


def print_row(r: Row, name: str) -> None:
    if not getattr(print_row, "printed", False):
        print(f"# {name}, torch {torch.__version__}")
        print(HEADER)
        print_row.printed = True
    met = "-" if r.target is None else ("n/a (GPU target)" if r.target_met is None
                                        else ("yes" if r.target_met else "NO"))
    print(f"{r.size:>10} {r.grid[0]:>2}x{r.grid[1]:<3} {r.batch:>5} {r.device:>6} {str(r.upload).lower():>6} "
          f"{str(r.graphs).lower():>6} "
          f"{r.frames_per_s:>10.1f} {r.ms_per_frame:>9.3f} {r.ms_per_batch:>9.3f}  {met}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--sizes", default=None, help="comma-separated N or HxW (default 448,1024; --quick: 112,224)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,64; --quick: 1,4)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per row (default 50 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 10 on CUDA, 1 on CPU, 5 on CPU with --compile)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke run for CI")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's stages (off by default)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="on CUDA, skip the CUDA-graph rows (the pipeline's default steady state)")
    p.add_argument("--out", default=None,
                   help="JSON path (default: $TMPDIR/arrcoc-bench/bench_frontend_<device>.json; name "
                        "benchmarks/results/... to commit a result)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.sizes = [parse_size(s) for s in (args.sizes or ("112,224" if args.quick else "448,1024")).split(",")]
    args.batches = parse_ints("--batches", args.batches or ("1,4" if args.quick else "1,64"))
    args.repeats = args.repeats or (3 if args.quick else (50 if cuda else 5))
    if args.warmup is None:
        # --compile: the first batch of a stream, the next ones and each new shape all compile
        args.warmup = 10 if cuda else (5 if args.compile else 1)
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    result = run(args)
    out = Path(args.out or scratch_result(f"bench_frontend_{result['device']}.json"))
    write_result(result, out)


if __name__ == "__main__":
    main()
