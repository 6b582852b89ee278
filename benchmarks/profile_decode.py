"""Where a GPU pipeline run spends its decode budget: each layer of the file path alone.

    python3 benchmarks/profile_decode.py --sizes 720p,1080p --frames 1200                    # PyAV
    python3 benchmarks/profile_decode.py --decoder decord --sizes 480p,720p,1080p --repeats 5
    python3 benchmarks/profile_decode.py --quick                # CPU smoke run: 240p, 48 frames

Per size, frames/s (median of --repeats, interleaved) of the same generated H.264 video as
bench_pipeline, decoded by --decoder:
  raw          open_video -> RGB frames in this thread (bench_pipeline's baseline)
  planes       (PyAV) decoding only, no conversion to RGB (the decoder's own bound)
  worker_rgb   ProcessSource handing over RGB, batches released at once (no consumer work)
  worker_yuv   (PyAV) ProcessSource handing over YUV planes (what GPU runs without a VLM use)
  stage        (CUDA) DecodeStage: worker + page-locked DMA to the GPU (+ YUV->RGB there)
  pipeline     (CUDA) run_video with --vlm none (RunResult.frames / wall_s)
and each layer's ratio to raw. A layer much slower than the one before it is where the time
goes. Layers that do not apply to the decoder, or need CUDA where there is none, print "-".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import statistics
import tempfile
import time
from typing import Callable

import torch

import benchmarks.bench_pipeline as bp
from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from pipeline.core.items import RunStatus
from pipeline.core.stages import DecodeStage
from sources.process import ProcessSource
from sources.video import DECODERS


def worker(path: Path, yuv: bool, batch: int, decoder: str = "pyav") -> float:
    with ProcessSource(path, batch_size=batch, slots=6, device_color=yuv, decoder=decoder) as src:
        src.wait_ready()
        t0, n = time.perf_counter(), 0
        for b in src.batches():
            n += len(b.indices)
            src.release(b)
        return n / (time.perf_counter() - t0)


def stage(path: Path, batch: int, decoder: str = "pyav") -> float:
    with ProcessSource(path, batch_size=batch, slots=6, device_color=True, decoder=decoder) as src:
        decode = DecodeStage(src, batch, pin=True, status=RunStatus(), device=torch.device("cuda"))
        try:
            src.wait_ready()
            t0, n, last = time.perf_counter(), 0, None
            for last in decode.produce():
                n += last.frames_count
            last.ready.synchronize()
            return n / (time.perf_counter() - t0)
        finally:
            decode.close()


def layers(path: Path, decoder: str, batch: int, cuda: bool, cfg: PipelineConfig,
           workdir: Path) -> dict[str, Callable[[], float]]:
    """The layers that apply to this decoder and machine, each a function returning frames/s."""
    def raw() -> float:
        n, s, _ = bp.raw_decode(path, decoder)
        return n / s

    def planes() -> float:
        n, s = bp.raw_decode_planes(path, "pyav")
        return n / s

    def pipeline() -> float:
        result, _, _ = bp.run_pipeline(path, workdir / "out.zarr", cfg)
        return result.frames / result.wall_s

    out: dict[str, Callable[[], float]] = {"raw": raw}
    if decoder == "pyav":
        out["planes"] = planes
    out["worker_rgb"] = lambda: worker(path, False, batch, decoder)
    if decoder == "pyav":
        out["worker_yuv"] = lambda: worker(path, True, batch, decoder)
    if cuda:
        out["stage"] = lambda: stage(path, batch, decoder)
        out["pipeline"] = pipeline
    return out


COLUMNS = ("raw", "planes", "worker_rgb", "worker_yuv", "stage", "pipeline")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="720p", help=f"comma-separated, of: {', '.join(bp.SIZES)}")
    p.add_argument("--frames", type=int, default=1200)
    # the layers run the decode worker process, which nvdec does not use (bench_pipeline measures it)
    p.add_argument("--decoder", default="pyav", choices=[d for d in DECODERS if d != "nvdec"])
    p.add_argument("--repeats", type=int, default=1, help="runs of each layer (interleaved); medians")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workdir", default=None, help="where test videos are cached (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="smoke run: 240p, 48 frames, 1 repeat")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.frames, args.repeats = "240p", 48, 1
    if args.frames < 1 or args.repeats < 1:
        raise SystemExit(f"--frames and --repeats must be >= 1, got {args.frames} and {args.repeats}")
    sizes = [s.strip() for s in args.sizes.split(",")]
    for name in sizes:
        if name not in bp.SIZES:
            raise SystemExit(f"--sizes: unknown size {name!r}; allowed: {', '.join(bp.SIZES)}")
    cuda = torch.cuda.is_available()
    bp.QUERY = torch.nn.functional.normalize(torch.randn(384, generator=torch.Generator().manual_seed(0)), dim=0)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="profile_decode_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(PipelineConfig, None, ["runtime.device=cuda", "runtime.vlm=none",
                                             f"decode.decoder={args.decoder}",
                                             f"runtime.batch_size={args.batch_size}"])
    paths = {name: bp.test_video(workdir, name, *bp.SIZES[name], args.frames) for name in sizes}
    where = torch.cuda.get_device_name() if cuda else "no CUDA: stage and pipeline skipped"
    print(f"# {where}; {args.decoder}, {args.frames} frames, batch {args.batch_size}, "
          f"median of {args.repeats}; frames/s (ratio to raw)")
    print(f"{'size':>6} " + " ".join(f"{c:>16}" for c in COLUMNS))
    for name in sizes:
        path = paths[name]
        worker(path, args.decoder == "pyav", args.batch_size, args.decoder)  # warm-up: page cache, libraries
        if cuda:
            bp.run_pipeline(path, workdir / "out.zarr", cfg)  # warm-up: kernels for this size
        runs = layers(path, args.decoder, args.batch_size, cuda, cfg, workdir)
        fps: dict[str, list[float]] = {c: [] for c in runs}
        for _ in range(args.repeats):  # interleaved, so every layer sees the same page cache and clocks
            for c, run in runs.items():
                fps[c].append(run())
        row = {c: statistics.median(v) for c, v in fps.items()}
        cells = [f"{row[c]:.0f} ({row[c] / row['raw']:.2f})" if c in row else "-" for c in COLUMNS]
        print(f"{name:>6} " + " ".join(f"{cell:>16}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
