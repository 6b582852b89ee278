"""Where a GPU pipeline run spends its decode budget: each layer of the file path alone.

    python3 benchmarks/profile_decode.py --sizes 720p,1080p --frames 1200     # needs CUDA

Per size, frames/s of (PyAV, the same generated H.264 video as bench_pipeline):
  raw          open_video -> RGB frames in this thread (bench_pipeline's baseline)
  planes       PyAV decoding only, no conversion to RGB (the decoder's own bound)
  worker_rgb   ProcessSource handing over RGB, batches released at once (no consumer work)
  worker_yuv   ProcessSource handing over YUV planes (what GPU runs without a VLM use)
  stage        DecodeStage: worker + page-locked DMA to the GPU + YUV->RGB there
  pipeline     run_video with --vlm none (RunResult.frames / wall_s)
A layer much slower than the one before it is where the time goes.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import tempfile
import time

import torch

import benchmarks.bench_pipeline as bp
from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from pipeline.stages import DecodeStage, RunStatus
from sources.process import ProcessSource


def worker(path: Path, yuv: bool, batch: int) -> float:
    with ProcessSource(path, batch_size=batch, slots=6, device_color=yuv) as src:
        src.wait_ready()
        t0, n = time.perf_counter(), 0
        for b in src.batches():
            n += len(b.indices)
            src.release(b)
        return n / (time.perf_counter() - t0)


def stage(path: Path, batch: int) -> float:
    with ProcessSource(path, batch_size=batch, slots=6, device_color=True) as src:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="720p", help=f"comma-separated, of: {', '.join(bp.SIZES)}")
    p.add_argument("--frames", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workdir", default=None, help="where test videos are cached (default: a temp dir)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode: needs a CUDA GPU (the device path is what it profiles)")
    bp.QUERY = torch.nn.functional.normalize(torch.randn(384, generator=torch.Generator().manual_seed(0)), dim=0)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="profile_decode_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(PipelineConfig, None, ["runtime.device=cuda", "runtime.vlm=none",
                                             f"runtime.batch_size={args.batch_size}"])
    cols = ("raw", "planes", "worker_rgb", "worker_yuv", "stage", "pipeline")
    print(f"# {torch.cuda.get_device_name()}, {args.frames} frames, batch {args.batch_size}; frames/s")
    print(f"{'size':>6} " + " ".join(f"{c:>10}" for c in cols))
    for name in (s.strip() for s in args.sizes.split(",")):
        if name not in bp.SIZES:
            raise SystemExit(f"--sizes: unknown size {name!r}; allowed: {', '.join(bp.SIZES)}")
        path = bp.test_video(workdir, name, *bp.SIZES[name], args.frames)
        worker(path, True, args.batch_size)  # warm-up: page cache, decoder libraries
        n, s = bp.raw_decode(path, "pyav")
        row = {"raw": n / s}
        n, s = bp.raw_decode_planes(path)
        row["planes"] = n / s
        row["worker_rgb"] = worker(path, False, args.batch_size)
        row["worker_yuv"] = worker(path, True, args.batch_size)
        row["stage"] = stage(path, args.batch_size)
        bp.run_pipeline(path, workdir / "out.zarr", cfg)  # warm-up
        result, _ = bp.run_pipeline(path, workdir / "out.zarr", cfg)
        row["pipeline"] = result.frames / result.wall_s
        print(f"{name:>6} " + " ".join(f"{row[c]:>10.0f}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
