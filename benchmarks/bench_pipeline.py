"""Whole-pipeline speed vs raw decode speed of the same file and decoder (`--vlm none`).

    python3 benchmarks/bench_pipeline.py --device cuda                   # 480p, 720p, 1080p; pyav, decord
    python3 benchmarks/bench_pipeline.py --device cpu --sizes 480p --decoders pyav
    python3 benchmarks/bench_pipeline.py --quick                         # CI smoke run (240p, 48 frames)
    python3 benchmarks/bench_pipeline.py --device cuda --decoders pyav,nvdec --sizes 720p,1080p \
        --videos 720p=v720.mp4,1080p=v1080.mp4                          # GPU decode vs CPU decode

Test videos are generated (a smooth texture panning 2 px per frame with a square moving across
it, H.264 via sources.synthetic.write_video) and cached in --workdir. For each size and decoder:
  raw decode   iterate open_video(path, decoder=...) and touch every frame: exactly the
               pipeline's source, so the difference is what the graph adds;
  pipeline     pipeline.runners.run.run_video(path, question, out, cfg) with runtime.vlm=none; its
               frames/s is RunResult.frames / RunResult.wall_s.
  no-RGB       (PyAV) decoding that stops at the decoder's YUV frames: what the pipeline's worker
               does on a GPU run, where the conversion to RGB happens on the device; (nvdec) PyAV's
               packets through NVDEC (sources/nvdec.py's PacketFeed), NV12 frames before the
               conversion to RGB (which the source runs nvdec.CONVERT_BATCH frames at a time).
CPU time: resource.getrusage of this process and its waited-for children (the decode worker
processes), user + system, over each timed run, per frame decoded: what a decoder costs the host
(nvdec's is the point: its frames cost the GPU's decoders, not the CPU's cores).
Both clocks start after the file is opened: run_video's wall_s covers only graph.run (decode ->
texture -> realize -> sink, store close included); opening the video and the store, encoding the
query and building the model come before it and are reported apart as setup_s. The sentence
encoder is loaded once up front and each (size, decoder) gets an untimed short warm-up run.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package is not pip-installed on the GPU box

import argparse
import os
import platform
import resource
import subprocess
import shlex
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from benchmarks.common import cpu_name, device_name, scratch_result, write_result
from pipeline.core.query import QueryEncoderError
from pipeline.core.setup import encode_query, resolve_device
from pipeline.runners.run import run_video
from sources import open_video
from sources.synthetic import smooth_texture, write_video
from sources.video import DECODERS

# The GPU target: the graph adds almost nothing, decode is the bound.
TARGET_RATIO = 0.9
SIZES = {"144p": (144, 256), "240p": (240, 426), "480p": (480, 854), "720p": (720, 1280), "1080p": (1080, 1920)}
QUESTION = "where is the red square going?"
PAN_PX = 2  # camera pan per frame, in pixels


class PanningFrames:
    """uint8 (T, H, W, 3) frames made one at a time: a smooth texture panning PAN_PX per frame
    and a red square crossing it. write_video reads frames[i] one by one, so 300 frames of
    1080p (1.8 GB as one array) never sit in memory."""

    def __init__(self, frames: int, height: int, width: int, seed: int = 0) -> None:
        self.shape = (frames, height, width, 3)
        # a coarse texture upsampled once; each frame is a window of it (cheap at 1080p)
        self.canvas = smooth_texture(np.random.default_rng(seed), height, width + PAN_PX * frames, cells=8)
        self.side = max(8, min(height, width) // 6)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, t: int) -> np.ndarray:
        _, h, w, _ = self.shape
        frame = self.canvas[:, PAN_PX * t:PAN_PX * t + w].copy()         # (H, W, 3)
        x0 = (w // 10 + 4 * PAN_PX * t) % (w - self.side)
        y0 = (h - self.side) // 2
        frame[y0:y0 + self.side, x0:x0 + self.side] = (230, 40, 40)
        return frame


def test_video(workdir: Path, name: str, height: int, width: int, frames: int) -> Path:
    """The cached test video for this size and length (generated and encoded on first use)."""
    path = workdir / f"pan_{name}_{width}x{height}_{frames}f.mp4"
    if not path.is_file():
        t0 = time.perf_counter()
        tmp = path.with_suffix(".part.mp4")
        write_video(tmp, PanningFrames(frames, height, width), fps=25)  # type: ignore[arg-type]
        tmp.rename(path)
        print(f"# generated {path.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def cpu_s() -> float:
    """User + system CPU seconds of this process and its waited-for children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def raw_decode(path: Path, decoder: str) -> tuple[int, float, float]:
    """(frames, seconds, CPU seconds) to iterate the source and touch every frame, after the open.
    A GPU-decoded frame is finished when the source hands it over (sources/nvdec.py): reading a byte
    of it would add a device-to-host sync per frame that the pipeline never makes."""
    with open_video(path, decoder=decoder) as video:
        t0, c0 = time.perf_counter(), cpu_s()
        frames, touched = 0, 0
        for frame in video:
            if not frame.on_device:
                touched += int(frame.rgb[-1, -1, 0])  # read the last byte: the frame is really there
            frames += 1
        return frames, time.perf_counter() - t0, cpu_s() - c0


def pipeline_config(device: str, decoder: str, max_frames: int | None = None) -> PipelineConfig:
    overrides = [f"runtime.device={device}", f"decode.decoder={decoder}", "runtime.vlm=none"]
    if max_frames is not None:
        overrides.append(f"decode.max_frames={max_frames}")
    return load_config(PipelineConfig, None, overrides)


QUERY: torch.Tensor | None = None  # set in main(): the question's embedding, computed once


def run_pipeline(path: Path, out: Path, cfg: PipelineConfig) -> tuple[Any, float, float]:
    """(RunResult, seconds of the whole run_video, CPU seconds of it, decode workers included)."""
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), cpu_s()
    result = run_video(path, QUESTION, out, cfg, progress=False, query_embedding=QUERY)
    return result, time.perf_counter() - t0, cpu_s() - c0


@dataclass
class Row:
    size: str
    height: int
    width: int
    grid: tuple[int, int]
    decoder: str
    device: str
    frames: int
    decode_fps: float           # median over repeats
    pipeline_fps: float         # median over repeats, RunResult.frames / RunResult.wall_s
    ratio: float                # pipeline_fps / decode_fps
    decode_no_rgb_fps: float | None  # PyAV: decoding without the conversion to RGB; nvdec: NV12 frames
    ratio_no_rgb: float | None  # pipeline_fps / decode_no_rgb_fps
    decode_cpu_ms_per_frame: float     # median over repeats: CPU time of the raw decode per frame
    pipeline_cpu_ms_per_frame: float   # of the whole run_video (setup included), decode workers included
    setup_s: float              # run_video's time outside wall_s (open, store, query, model)
    target_met: bool | None     # ratio >= TARGET_RATIO; None off CUDA (the target is for the GPU)
    decode_s: list[float] = field(default_factory=list)
    pipeline_wall_s: list[float] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)  # RunResult.metrics of the median run
    # the median run's decode stage alone (its frames over its own wall time) and the rest of the
    # graph's wall time: start-up, the last frames' trip through texture / realize / sink, the store's
    # close. A fixed cost per run, so short videos show a lower pipeline / raw ratio than long ones
    decode_stage_fps: float | None = None
    outside_decode_s: float | None = None


def raw_decode_planes(path: Path, decoder: str) -> tuple[int, float]:
    """(frames, seconds) to decode and touch each frame's planes, with no conversion to RGB: the
    decoder's own bound, which the pipeline's YUV hand-over can approach. PyAV: its YUV frames;
    nvdec: NVDEC's NV12 frames of PyAV's packets (on the GPU; synchronized once at the end)."""
    if decoder == "nvdec":
        import av

        from sources import nvdec

        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            feed = nvdec.PacketFeed(str(path), stream)   # PyAV's packets to NVDEC, as the source feeds them
            try:
                t0, frames = time.perf_counter(), 0
                for packet in container.demux(stream):
                    frames += len(feed.decode(packet))
                torch.cuda.synchronize()
                return frames, time.perf_counter() - t0
            finally:
                feed.close()
    with open_video(path, decoder="pyav") as video:
        t0 = time.perf_counter()
        frames, touched = 0, 0
        for _, _, frame in video.decoded_frames():
            touched += memoryview(frame.planes[0])[-1]
            frames += 1
        return frames, time.perf_counter() - t0


def bench(path: Path, name: str, size: tuple[int, int], decoder: str, device: torch.device, repeats: int,
          workdir: Path) -> Row:
    cfg = pipeline_config(device.type, decoder)
    out = workdir / f"out_{name}_{decoder}.zarr"
    # warm-up: decoder libraries, allocator, kernels for this frame size; not timed
    run_pipeline(path, out, pipeline_config(device.type, decoder, max_frames=2 * cfg.runtime.batch_size))
    decodes, planes, runs = [], [], []
    for _ in range(repeats):  # interleaved so all see the same page cache and clocks
        decodes.append(raw_decode(path, decoder))
        if decoder in ("pyav", "nvdec"):
            planes.append(raw_decode_planes(path, decoder))
        runs.append(run_pipeline(path, out, cfg))
    shutil.rmtree(out, ignore_errors=True)
    frames = decodes[0][0]
    for result, _, _ in runs:
        if result.frames != frames or not result.complete:
            raise SystemExit(f"{path.name} ({decoder}): the pipeline wrote {result.frames} frames "
                             f"(complete={result.complete}), raw decode gave {frames}")
    decode_fps = statistics.median(n / s for n, s, _ in decodes)
    planes_fps = statistics.median(n / s for n, s in planes) if planes else None
    by_fps = sorted(runs, key=lambda r: r[0].fps)
    median_run, outer, _ = by_fps[len(by_fps) // 2]
    pipeline_fps = median_run.fps
    ratio = pipeline_fps / decode_fps
    stage = next((m for m in median_run.metrics if m.get("stage") == "decode" and m.get("fps")), None)
    stage_fps = None if stage is None else float(stage["fps"])
    return Row(size=name, height=size[0], width=size[1], grid=median_run.grid, decoder=decoder, device=device.type,
               frames=frames, decode_fps=round(decode_fps, 2), pipeline_fps=round(pipeline_fps, 2),
               ratio=round(ratio, 3),
               decode_no_rgb_fps=None if planes_fps is None else round(planes_fps, 2),
               ratio_no_rgb=None if planes_fps is None else round(pipeline_fps / planes_fps, 3),
               decode_cpu_ms_per_frame=round(1e3 * statistics.median(c / n for n, _, c in decodes), 3),
               pipeline_cpu_ms_per_frame=round(1e3 * statistics.median(c / r.frames for r, _, c in runs), 3),
               setup_s=round(outer - median_run.wall_s, 3),
               decode_stage_fps=None if stage_fps is None else round(stage_fps, 2),
               outside_decode_s=None if stage_fps is None else round(median_run.wall_s - frames / stage_fps, 4),
               target_met=(ratio >= TARGET_RATIO) if device.type == "cuda" else None,
               decode_s=[round(s, 4) for _, s, _ in decodes],
               pipeline_wall_s=[round(r.wall_s, 4) for r, _, _ in runs], stages=median_run.metrics)


def parse_size(text: str) -> tuple[str, tuple[int, int]]:
    if text in SIZES:
        return text, SIZES[text]
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--sizes: bad size {text!r}; allowed: {', '.join(SIZES)} or HxW (even numbers)") from None
    if h < 16 or w < 16 or h % 2 or w % 2:
        raise SystemExit(f"--sizes: {text!r} must be even and at least 16x16 (H.264 yuv420p)")
    return text, (h, w)


def versions() -> dict[str, str]:
    import av
    import zarr
    out = {"python": platform.python_version(), "torch": torch.__version__, "av": av.__version__,
           "zarr": zarr.__version__, "numpy": np.__version__}
    try:
        import decord
        out["decord"] = decord.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version
        out["PyNvVideoCodec"] = version("PyNvVideoCodec")
    except Exception:  # not installed (PackageNotFoundError)
        pass
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_videos(text: str | None, sizes: dict[str, tuple[int, int]]) -> dict[str, Path]:
    """--videos SIZE=PATH,...: files to use for those sizes instead of generated ones."""
    out: dict[str, Path] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, path = item.partition("=")
        if name.strip() not in sizes or not path or not Path(path).is_file():
            raise SystemExit(f"--videos: {item!r} must be SIZE=PATH with SIZE one of --sizes "
                             f"({', '.join(sizes)}) and PATH an existing file")
        out[name.strip()] = Path(path)
    return out


def _nvdec_batch() -> int:
    from sources import nvdec
    return nvdec.CONVERT_BATCH


def print_row(r: Row) -> None:
    busy = " ".join(f"{s['stage']}={s['busy']:.2f}" for s in r.stages)
    met = "n/a (GPU target)" if r.target_met is None else ("yes" if r.target_met else "NO")
    no_rgb = "-" if r.decode_no_rgb_fps is None else f"{r.decode_no_rgb_fps:.1f}"
    outside = "-" if r.outside_decode_s is None else f"{r.outside_decode_s:.3f}"
    print(f"{r.size:>7} {r.grid[0]:>2}x{r.grid[1]:<3} {r.decoder:>7} {r.device:>6} {r.frames:>6} {r.decode_fps:>10.1f} "
          f"{no_rgb:>10} {r.pipeline_fps:>12.1f} {r.ratio:>6.3f} {r.decode_cpu_ms_per_frame:>10.2f} "
          f"{r.pipeline_cpu_ms_per_frame:>10.2f} {r.setup_s:>7.2f} {outside:>9}  {met:<16} {busy}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--sizes", default=None, help=f"comma-separated {', '.join(SIZES)} or HxW (default 480p,720p,1080p)")
    p.add_argument("--decoders", default="pyav,decord", help="comma-separated, of: " + ", ".join(DECODERS))
    p.add_argument("--frames", type=int, default=None, help="frames per test video (default 300; --quick: 48)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs of each (median; default 3 on CUDA, 1 on CPU)")
    p.add_argument("--workdir", default=None, help="where test videos are cached (default: a temp dir, removed after)")
    p.add_argument("--quick", action="store_true", help="240p, 48 frames: a smoke run for CI")
    p.add_argument("--videos", default=None, metavar="SIZE=PATH,...",
                   help="use these files for those sizes (e.g. 720p=v720.mp4) instead of generated videos; "
                        "--frames does not apply to them")
    p.add_argument("--out", default=None,
                   help="JSON path (default: $TMPDIR/arrcoc-bench/bench_pipeline_<device>.json; name "
                        "benchmarks/results/... to commit a result)")
    args = p.parse_args(argv)

    device = resolve_device(args.device)
    sizes = [parse_size(s.strip()) for s in (args.sizes or ("240p" if args.quick else "480p,720p,1080p")).split(",")]
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    for d in decoders:
        if d not in DECODERS:
            raise SystemExit(f"--decoders: unknown decoder {d!r}; allowed: {', '.join(DECODERS)}")
    if "nvdec" in decoders:
        from sources.nvdec import NvdecUnavailable, check_available
        try:
            check_available("--decoders nvdec")
        except NvdecUnavailable as e:
            raise SystemExit(str(e)) from None
    given = parse_videos(args.videos, dict(sizes))
    frames = args.frames or (48 if args.quick else 300)
    repeats = args.repeats or (3 if device.type == "cuda" else 1)
    if frames < 2 or repeats < 1:
        raise SystemExit(f"--frames must be >= 2 and --repeats >= 1, got {frames} and {repeats}")

    global QUERY
    try:  # the real sentence encoder when its wheel is installed; speed does not depend on the values
        QUERY = encode_query(QUESTION, device)
    except QueryEncoderError as e:
        print(f"# {e}: using a fixed random unit query embedding instead")
        QUERY = torch.nn.functional.normalize(torch.randn(384, generator=torch.Generator().manual_seed(0)), dim=0)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    workdir.mkdir(parents=True, exist_ok=True)
    name = device_name(device)
    print(f"# {name}, CPU: {cpu_name()}, torch {torch.__version__}, {frames} frames per video, median of {repeats}")
    print(f"{'size':>7} {'grid':>6} {'decoder':>7} {'device':>6} {'frames':>6} {'decode fps':>10} {'no-RGB fps':>10} "
          f"{'pipeline fps':>12} {'ratio':>6} {'dec cpu ms':>10} {'run cpu ms':>10} {'setup_s':>7} {'outside_s':>9}  "
          f"{'>= 0.9x?':<16} "
          f"busy share per stage")
    rows: list[Row] = []
    try:
        for size_name, (h, w) in sizes:
            path = given.get(size_name) or test_video(workdir, size_name, h, w, frames)
            for decoder in decoders:
                rows.append(bench(path, size_name, (h, w), decoder, device, repeats, workdir))
                print_row(rows[-1])
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "benchmark": "bench_pipeline",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "device": device.type,
        "device_name": name,
        "cpu_name": cpu_name(),
        "cpu_count": os.cpu_count(),
        # other jobs on the machine skew CPU numbers; this says how busy it was when the run ended
        "load_avg_1m_5m_15m": [round(v, 2) for v in os.getloadavg()],
        "versions": versions(),
        "config": "PipelineConfig() defaults + runtime.device, decode.decoder, runtime.vlm=none"
                  + (f"; nvdec: PyAV demux, NV12 -> RGB {_nvdec_batch()} frames per conversion"
                     if "nvdec" in decoders else ""),
        "video": f"generated H.264 (libx264 crf 18 veryfast, yuv420p, 25 fps), {frames} frames, pan + moving square"
                 + "".join(f"; {k}: {v.name}" for k, v in given.items()),
        "cpu_time": "getrusage(RUSAGE_SELF) + getrusage(RUSAGE_CHILDREN), user + system, per frame: raw decode "
                    "over its iteration; pipeline over the whole run_video (setup and decode workers included)",
        "timing": ("decode: perf_counter around iterating open_video (after the open); pipeline: RunResult.wall_s "
                   f"(graph.run only; setup_s is the rest of run_video); median of {repeats}, after one warm-up run; "
                   "outside_decode_s: the median run's wall_s less its frames over the decode stage's own fps "
                   "(start-up, the last batch's trip through the later stages, the store's close)"),
        "busy": "share of the run's wall time each stage spent in its own code (host time: "
                "on CUDA, kernel launches are asynchronous, so GPU stages look idle)",
        "target": {"cuda_pipeline_over_decode": TARGET_RATIO},
        "rows": [asdict(r) for r in rows],
    }
    out = Path(args.out or scratch_result(f"bench_pipeline_{device.type}.json"))
    write_result(result, out)


if __name__ == "__main__":
    main()
