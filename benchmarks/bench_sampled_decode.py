"""CPU cost of reading a video at a target fps, with the non-reference frames the sampler will not
keep left undecoded (sources/sampling.py, NonrefSkip) against decoding every frame.

    python3 benchmarks/bench_sampled_decode.py                       # 240p and 720p, fps 1, 2, 5
    python3 benchmarks/bench_sampled_decode.py --sizes 240p --fps 2 --repeats 3 --out RESULT.json

Clips are generated (sources.synthetic.write_video: libx264, crf 18, its default GOP and B-frames,
30 fps, 10 s: MSR-VTT's shape) and cached in --workdir. Each row times, on this process's CPU clock
(time.process_time: the decoder's threads included), two reads of one clip through open_video
alternated `repeats` times: the decode worker's read (decoded_frames: YUV frames, what `batch` and
`run` hand to the GPU) and the read to RGB (iterating the source). "full" switches NonrefSkip off.
Both reads return the same frames (tests/sources/test_sampling.py); the JSON says how many frames
each decoder call left undecoded.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import shlex
import statistics
import tempfile
import time

from benchmarks.bench_pipeline import SIZES, PanningFrames
from benchmarks.common import cpu_name, git_commit, scratch_result, write_result
from sources import open_video
from sources import video as video_module
from sources.synthetic import write_video

SECONDS, FPS_IN = 10, 30


def clip(workdir: Path, name: str, height: int, width: int) -> Path:
    path = workdir / f"sampled_{name}_{width}x{height}.mp4"
    if not path.is_file():
        write_video(path, PanningFrames(SECONDS * FPS_IN, height, width), fps=FPS_IN)  # type: ignore[arg-type]
    return path


def timed_read(path: Path, fps: float, full: bool, yuv: bool, threads: int) -> tuple[float, int, int]:
    """(CPU seconds, frames kept, frames left undecoded) of one read."""
    codecs = video_module.NONREF_CODECS
    if full:
        video_module.NONREF_CODECS = ()
    try:
        c0 = time.process_time()
        with open_video(path, decoder="pyav", fps=fps, threads=threads) as video:
            kept = sum(1 for _ in (video.decoded_frames() if yuv else video))
            skipped = 0 if video._nonref is None else video._nonref.skipped
        return time.process_time() - c0, kept, skipped
    finally:
        video_module.NONREF_CODECS = codecs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="240p,720p")
    p.add_argument("--fps", default="1,2,5", help="target fps values (comma-separated)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="FFmpeg threads per read (the decode workers': 1)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="JSON path (default: $TMPDIR/arrcoc-bench/bench_sampled_decode.json)")
    args = p.parse_args(argv)
    try:
        sizes = [(s.strip(), SIZES[s.strip()]) for s in args.sizes.split(",")]
        rates = [float(f) for f in args.fps.split(",")]
    except (KeyError, ValueError) as e:
        raise SystemExit(f"--sizes must name {', '.join(SIZES)}; --fps numbers ({e})") from None
    if args.repeats < 1 or args.threads < 0 or any(f <= 0 for f in rates):
        raise SystemExit("--repeats >= 1, --threads >= 0 and --fps > 0 please")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_sampled_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"# {cpu_name()}, {SECONDS} s clips at {FPS_IN} fps, {args.threads} FFmpeg thread(s), "
          f"median of {args.repeats}")
    print(f"{'size':>6} {'fps':>5} {'read':>5} {'kept':>5} {'undecoded':>9} {'full ms':>8} {'skip ms':>8} {'saved':>6}")
    rows = []
    for name, (h, w) in sizes:
        path = clip(workdir, name, h, w)
        for fps in rates:
            for yuv in (True, False):
                full, skip, counts = [], [], None
                for _ in range(args.repeats):   # alternated: both see the same clocks and page cache
                    full.append(timed_read(path, fps, True, yuv, args.threads)[0])
                    seconds, kept, skipped = timed_read(path, fps, False, yuv, args.threads)
                    skip.append(seconds)
                    counts = kept, skipped
                f_ms, s_ms = 1e3 * statistics.median(full), 1e3 * statistics.median(skip)
                row = {"size": name, "height": h, "width": w, "fps": fps, "read": "yuv" if yuv else "rgb",
                       "frames_in": SECONDS * FPS_IN, "kept": counts[0], "left_undecoded": counts[1],
                       "full_cpu_ms": round(f_ms, 2), "skip_cpu_ms": round(s_ms, 2),
                       "saved_share": round(1 - s_ms / f_ms, 3)}
                rows.append(row)
                print(f"{name:>6} {fps:>5g} {row['read']:>5} {counts[0]:>5} {counts[1]:>9} {f_ms:>8.1f} {s_ms:>8.1f} "
                      f"{row['saved_share']:>6.1%}", flush=True)
    result = {"benchmark": "bench_sampled_decode", "command": shlex.join([Path(sys.executable).name, *sys.argv]),
              "commit": git_commit(), "cpu_name": cpu_name(), "threads": args.threads, "repeats": args.repeats,
              "clips": f"generated, libx264 crf 18 (sources.synthetic.write_video), {SECONDS} s at {FPS_IN} fps",
              "timing": "time.process_time around open_video + reading every kept frame (the open included)",
              "rows": rows}
    write_result(result, Path(args.out or scratch_result("bench_sampled_decode.json")))


if __name__ == "__main__":
    main()
