"""What the kept-cells vision tower costs per padded size: one captured graph (kept_graph.KeptGraph)
per cell count, replayed and timed with CUDA events, and the mergers' share (the final merger and
the DeepStack mergers run eagerly on as many rows, timed the same way). Tells how much a finer
cell bucket or mergers over the kept rows only would save.

    python3 benchmarks/profile_kept_tower.py --arch qwen3-vl-2b qwen3-vl-8b        # GPU
    python3 benchmarks/profile_kept_tower.py --tiny                                # CPU smoke test (eager)

Random bf16 weights, blank pixels (the tower's cost depends on its shapes only), 16 blocks (frame
pairs of 32 frames at 448x448). --json writes the rows.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import functools
import json
import statistics

import torch

from benchmarks.bench_vlm import build_vlm
from pipeline.vlm import qwen3_vl
from pipeline.vlm.kept_graph import KeptGraph, blank_call, pow2_at_least
from pipeline.vlm_config import VLMConfig

CELLS = (320, 384, 448, 512, 576, 608, 640, 672, 704, 736)


def event_ms(fn, device: torch.device, reps: int) -> float:
    """Median ms of fn() over reps calls (CUDA events on a GPU, the wall clock otherwise)."""
    import time
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_all(modules, x: torch.Tensor) -> list[torch.Tensor]:
    return [m(x) for m in modules]


@torch.no_grad()
def curve(arch: str, device: torch.device, dtype: torch.dtype, cells_list, blocks: int, frame: int,
          reps: int) -> list[dict]:
    vlm = build_vlm(arch, device, dtype, VLMConfig(dtype=str(dtype)[6:], max_pixels=frame * frame, encode="kept"))
    visual = vlm.kept_encoder.visual
    g = vlm.geometry
    units = g.merge_size ** 2
    gh = gw = frame // (g.patch_size * g.merge_size)
    features = visual.patch_embed.proj.weight[0].numel()
    capture = device.type == "cuda"
    pool = torch.cuda.graph_pool_handle() if capture else None
    mergers = [visual.merger] + (list(visual.deepstack_merger_list) if qwen3_vl.has_deepstack(visual) else [])
    width = visual.blocks[0].norm1.weight.numel() if hasattr(visual.blocks[0], "norm1") else None
    rows = []
    for cells in cells_list:
        longest = pow2_at_least(min(cells, -(-cells // blocks) * 2, gh * gw) * units, 64)
        key = (cells, blocks, longest, 0)
        call = blank_call(key, features, dtype, device, units, (gh * g.merge_size, gw * g.merge_size), None,
                          qwen3_vl.has_deepstack(visual))
        graph = KeptGraph(visual, key, dtype, 1, pool, call, capture_graph=capture)
        tower = event_ms(functools.partial(graph, call, filled=True), device, reps)
        merge = float("nan")
        if width is not None:
            hidden = torch.randn(cells * units, width, dtype=dtype, device=device)
            merge = event_ms(functools.partial(run_all, mergers, hidden), device, reps)
        rows.append(dict(arch=arch, cells=cells, blocks=blocks, longest=longest, tower_ms=tower,
                         mergers_ms=merge, mergers=len(mergers)))
        print(f"{arch:>14} cells {cells:5d}: tower {tower:7.3f} ms, {len(mergers)} mergers eager {merge:7.3f} ms",
              flush=True)
        del graph
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["qwen3-vl-2b", "qwen3-vl-8b"])
    ap.add_argument("--cells", type=int, nargs="+", default=list(CELLS))
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny random Qwen3-VL, eager")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_kept_tower: no CUDA GPU here; use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.tiny else torch.bfloat16
    archs = ["tiny-qwen3_vl"] if args.tiny else args.arch
    cells = [32, 64] if args.tiny else args.cells
    frame = 112 if args.tiny else 448
    rows = [r for arch in archs for r in curve(arch, device, dtype, cells, 2 if args.tiny else args.blocks,
                                                frame, 2 if args.tiny else args.reps)]
    if args.json:
        args.json.write_text(json.dumps({
            "command": "profile_kept_tower.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
