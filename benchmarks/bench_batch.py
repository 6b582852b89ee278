"""Batch benchmark: MSR-VTT-QA-shaped work (generated videos in the MSRVTT-QA layout, many questions
per video) through `pipeline batch`, local path and Ray Data, stock tokens vs ARR-COC retention.

Reports per setting videos/s and questions/s, both over the whole wall time (model loading
included) and steady-state (each worker from its first finished video, which carries its model
load, or its --warmup-videos N-th, to its last, summed over the workers), plus
the ARR-COC/stock speed-up and the Ray scaling efficiency qps(n GPUs) / (n * qps(1 GPU)), and
per run the mean wall seconds per video and each stage's busy seconds per video (decode, texture,
realize, vlm, sink): a stage whose busy time grows with the worker count marks what the workers share,
and the load of the host CPUs and the GPU over the steady window (`load`) and the run (`load_run`):
which of the two bounds it.
"Stock" is the same pipeline with every token sent to the VLM (`--stock-tokens`: the ARR-COC front
end still runs); the `vlm-only` path is the stock VLM alone (frames decoded at vlm.fps, no front
end, no store), the alternative a user without ARR-COC would run.
The VLM is the Qwen2-VL-2B architecture with random weights (nothing is downloaded; speed does not
depend on the weights); its answers are meaningless, and every one is vlm.max_new_tokens (8) long
(EOS is never chosen), so both arms decode the same tokens. The videos a worker has in flight share
its VLM, which answers the videos waiting for it together (up to vlm.max_batch; `--set
vlm.max_batch=1`: one video per call).

    python3 benchmarks/bench_batch.py --device cuda                    # 1..all GPUs of this machine
    python3 benchmarks/bench_batch.py --device cuda --gpus 1 2 4       # choose the GPU counts
    python3 benchmarks/bench_batch.py --quick                          # CPU smoke test (tiny-random)
    python3 benchmarks/bench_batch.py --paths local --processes 4 --mps   # 4 processes under one MPS daemon
    python3 benchmarks/bench_batch.py --paths ray --gpus 1 2 --per-gpu 6 --mps   # 6 actors on each GPU, MPS

On Ray, each GPU count n runs n x --per-gpu actors (1/per-gpu of a GPU each, as `batch --ray
--processes N`); the summary gives questions/s per GPU count and the scaling efficiency
qps(n) / (n * qps(1)), from each actor's steady rate summed and from the window in which every
actor is steady (`overlap`).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arr_coc._validate import ConfigError  # noqa: E402
from benchmarks.common import LoadSampler, fixed_query, git_commit, host_topology, random_qwen2_vl_2b  # noqa: E402
from pipeline.core.mps import mps_clients  # noqa: E402
from pipeline.runners.batch import IN_FLIGHT, BatchSummary, config_vlm, make_plan, run_batch  # noqa: E402
from pipeline.config import PipelineConfig  # noqa: E402
from pipeline.configio import load_config  # noqa: E402
from evaluation.fixtures import write_fixture  # noqa: E402
from sources.msrvtt import load_msrvtt  # noqa: E402


def qwen2_vl_2b_factory(device: torch.device):
    """Qwen2-VL-2B architecture, random bf16 weights, built on the actor's own device; every answer
    runs to vlm.max_new_tokens (benchmarks/common.py)."""
    return random_qwen2_vl_2b(device, BENCH_VLM)


BENCH_VLM = None  # set in main (VLMConfig of this run), read by the factory in every worker


def _steady_workers(s: BatchSummary, workers: int, warmup: int) -> dict[str, list] | None:
    """Each worker's (VideoOutcome.worker) finished videos by finish time, from its `warmup`-th
    on; None when a worker is missing or has no video after it (no steady state)."""
    by_worker: dict[str, list] = {}
    for o in s.outcomes:
        if o.status == "done":
            by_worker.setdefault(o.worker, []).append(o)
    if len(by_worker) != workers or any(len(o) < warmup + 1 for o in by_worker.values()):
        return None
    return {w: sorted(o, key=lambda o: o.finished_at)[warmup - 1:] for w, o in by_worker.items()}


def steady_rates(s: BatchSummary, workers: int, warmup: int = 1) -> tuple[float, float]:
    """videos/s and questions/s in steady state: per worker process (VideoOutcome.worker), from
    its `warmup`-th finished video (the first carries its model load, the first few most CUDA-graph
    captures) to its last, summed over the workers, so workers that start at different times (Ray
    actors load their models one after another) do not count each other's start-up. Idle gaps
    inside a worker's span still count."""
    steady = _steady_workers(s, workers, warmup)
    if steady is None:
        return float("nan"), float("nan")
    vps = qps = 0.0
    for outcomes in steady.values():
        span = outcomes[-1].finished_at - outcomes[0].finished_at
        vps += (len(outcomes) - 1) / span
        qps += sum(o.questions for o in outcomes[1:]) / span
    return vps, qps


def overlap_rates(s: BatchSummary, workers: int, warmup: int = 1) -> tuple[float, float]:
    """videos/s and questions/s of workers running side by side (local_processes), counted only
    while every one is in steady state: from the latest of their `warmup`-th finished videos to the
    earliest of their last ones, every video finished in that window over its length. Summing each
    worker's own rate (steady_rates) would count workers that did not overlap as if they had."""
    window = steady_window(s, workers, warmup, overlap=True)
    if window is None:
        return float("nan"), float("nan")
    start, end = window
    inside = [o for o in s.outcomes if o.status == "done" and start < o.finished_at <= end]
    if not inside:
        return float("nan"), float("nan")
    return len(inside) / (end - start), sum(o.questions for o in inside) / (end - start)


def steady_window(s: BatchSummary, workers: int, warmup: int = 1, *, overlap: bool) -> tuple[float, float] | None:
    """(start, end), time.time(), of the steady state, from each worker's `warmup`-th finished
    video to its last: overlap, the window overlap_rates counts (every worker in it: the latest
    start to the earliest end); else the spans steady_rates counts, all together (the earliest
    start to the latest end). None where there is none."""
    steady = _steady_workers(s, workers, warmup)
    if steady is None:
        return None
    starts = [o[0].finished_at for o in steady.values()]
    ends = [o[-1].finished_at for o in steady.values()]
    start, end = (max(starts), min(ends)) if overlap else (min(starts), max(ends))
    return (start, end) if end > start else None


def one_run(plan, cfg, *, path: str, workers: int, stock: bool, factory, scratch: Path, in_flight: int,
            videos_per_task: int | None = None, warmup: int = 1, shared_vlm: bool = False, mps: bool = False,
            per_gpu: int = 1) -> dict:
    """One setting timed: `workers` processes on the local path, or `workers` GPUs (x per_gpu
    actors) on Ray."""
    out = scratch / f"{path}_{workers}_{'stock' if stock else 'arrcoc'}.zarr"
    shutil.rmtree(out, ignore_errors=True)
    made = []                                                                # the local path's VLM, for its counters
    server_stats: dict = {}
    mps_state = None
    # the host CPUs' and the GPU's load, sampled through the run and read over its steady window
    with LoadSampler(gpu=torch.cuda.is_available()) as load:
        if path == "local" and workers > 1:
            with mps_clients(mps) as daemon:       # as `batch --processes N --mps`: the processes are its clients
                mps_state = None if daemon is None else daemon.state
                s = local_processes(plan, out, cfg, stock=stock, factory=factory, in_flight=in_flight,
                                    processes=workers, shared_vlm=shared_vlm, server_stats=server_stats)
        elif path == "local":
            local_factory = None if factory is None else (lambda device: made.append(factory(device)) or made[-1])
            s = run_batch(plan, out, cfg, stock=stock, progress=False, vlm_factory=local_factory,
                          in_flight=in_flight, query_encoder=fixed_query)
        else:
            from pipeline.runners.ray_batch import run_ray_batch
            # the actors start after Ray did: the daemon's variables go to them (`batch --ray local --mps`)
            with mps_clients(mps and per_gpu > 1) as daemon:
                mps_state = None if daemon is None else daemon.state
                s = run_ray_batch(plan, out, cfg, address="local", stock=stock, workers=workers * per_gpu,
                                  progress=False, vlm_factory=factory, in_flight=in_flight,
                                  videos_per_task=videos_per_task, query_encoder=fixed_query, per_gpu=per_gpu,
                                  actor_env=None if daemon is None else daemon.env)
    row = s.to_dict()
    actors = workers * per_gpu if path == "ray" else workers
    side_by_side = path == "local" and workers > 1
    rates = overlap_rates if side_by_side else steady_rates
    vps, qps = rates(s, actors, warmup)
    _, overlap_qps = overlap_rates(s, actors, warmup)
    window = steady_window(s, actors, warmup, overlap=side_by_side)
    shutil.rmtree(out, ignore_errors=True)
    return {"path": path, "workers": workers, "actors": actors, "per_gpu": per_gpu if path == "ray" else None,
            "in_flight": in_flight, "tokens": "stock" if stock else "arrcoc",
            "videos_per_s": row["videos_per_s"], "questions_per_s": row["questions_per_s"],
            "steady_videos_per_s": round(vps, 4), "steady_questions_per_s": round(qps, 4),
            # every worker steady at once (the local processes' headline; a check on Ray's summed rates)
            "overlap_questions_per_s": round(overlap_qps, 4),
            "tokens_kept_per_video": row["tokens_kept_per_video"],
            "tokens_full_per_video": row["tokens_full_per_video"],
            "done": row["done"], "wall_s": row["wall_s"], "backend": row["backend"],
            "seconds_per_video": row["seconds_per_video"], "stage_busy_per_video_s": row["stage_busy_per_video_s"],
            "videos_per_vlm_call": row["videos_per_vlm_call"],
            # decoders made and CUDA graphs captured during the run (each capture a few hundred ms)
            "vlm_counters": dict(made[0].counters) if made else None,
            # --shared-vlm: one VLM process for every worker, and the batches it answered
            "shared_vlm": server_stats or None,
            # --mps: the processes ran under an MPS daemon started for the run, or one already running
            "mps": mps_state,
            # the host CPUs' busy share (0-1, all CPUs) and the GPU's utilization (%), mean / p50 /
            # max of 0.5 s samples: over the steady window (None without one), and over the run
            "load": load.summary(*window) if window is not None else None,
            "load_run": load.summary()}


def _shard(plan, out: Path, cfg, stock: bool, factory, in_flight: int, vlm_server=None) -> BatchSummary:
    """One process of local_processes: its share of the plan through the local path."""
    global BENCH_VLM
    BENCH_VLM = cfg.vlm                       # a spawned process has not run main()
    return run_batch(plan, out, cfg, stock=stock, progress=False, vlm_factory=factory, in_flight=in_flight,
                     query_encoder=fixed_query, vlm_server=vlm_server)


def _server_vlm(cfg, factory):
    """The shared VLM process's model: the benchmark's factory on runtime.device, or runtime.vlm's."""
    global BENCH_VLM
    BENCH_VLM = cfg.vlm
    if factory is None:
        return config_vlm(cfg)
    from pipeline.core.setup import runtime_device
    return factory(runtime_device(cfg))


def local_processes(plan, out: Path, cfg, *, stock: bool, factory, in_flight: int, processes: int,
                    shared_vlm: bool = False, server_stats: dict | None = None) -> BatchSummary:
    """The local path in `processes` processes at once on this machine's GPU (`pipeline batch
    --shard i/n` run n times side by side): each loads its own models (with shared_vlm, all but
    the VLM: one VLM process answers every process's videos, as `batch --processes` does) and
    answers every n-th video into its own store. One process's front end (decoding, texture, the
    store; Python's lock) tops out below what the GPU can answer; several feed it together. -> the
    processes' outcomes in one summary; server_stats gets the shared VLM's batch sizes."""
    import functools
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from pipeline.vlm.server import VLMServer

    start = time.perf_counter()
    server = VLMServer(functools.partial(_server_vlm, cfg, factory),
                       max_batch=cfg.vlm.max_batch) if shared_vlm else None
    try:
        with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_shard, plan[i::processes], out.with_name(f"{out.stem}_p{i}.zarr"), cfg, stock,
                                   factory, in_flight, None if server is None else server.address)
                       for i in range(processes)]
            parts = [f.result() for f in futures]
        if server is not None and server_stats is not None:
            counters = server.counters()
            sizes, answer_s, queued_s = (counters.get(k, []) for k in ("batch_sizes", "answer_s", "queued_s"))
            server_stats.update({
                "batches": len(sizes), "videos_per_batch": round(float(np.mean(sizes)), 2) if sizes else 0.0,
                "batch_size_counts": dict(sorted((int(k), int(v)) for k, v in zip(*np.unique(sizes,
                                                                                             return_counts=True)))),
                # the VLM process's time: its calls (busy_s over the run's wall time says how loaded it was)
                "call_ms_p50": round(1e3 * float(np.median(answer_s)), 1) if answer_s else None,
                "busy_s": round(float(np.sum(answer_s)), 2),
                "queued_ms_p50": round(1e3 * float(np.median(queued_s)), 1) if queued_s else None,
                "vlm_counters": counters.get("vlm")})
    finally:
        if server is not None:
            server.close()
    for i in range(processes):
        shutil.rmtree(out.with_name(f"{out.stem}_p{i}.zarr"), ignore_errors=True)
    return BatchSummary(out, len(plan), sum(p.questions for p in parts), time.perf_counter() - start,
                        [o for p in parts for o in p.outcomes], vlm_calls=[n for p in parts for n in p.vlm_calls])


def vlm_only_run(plan, cfg, *, factory) -> dict:
    """The stock VLM alone, the real alternative to the pipeline: each video decoded at the VLM's
    frame rate (vlm.fps) and all its questions answered over every visual token, with no ARR-COC
    front end and no store; one video at a time. Steady rates leave out the first video."""
    import time

    from pipeline.core.setup import runtime_device
    from pipeline.vlm.loading import load_answerer
    from sources import open_video

    device = runtime_device(cfg)
    t0 = time.perf_counter()
    vlm = load_answerer(cfg, device) if factory is None else factory(device)
    done, questions, tokens = [], 0, 0
    for work in plan:
        with open_video(work.path, fps=cfg.vlm.fps) as video:
            frames = np.stack([f.rgb for f in video])                       # (T, H, W, 3)
        results = vlm.answer_questions(frames, None, [q.question for q in work.questions])
        done.append((time.perf_counter(), len(results)))
        questions += len(results)
        tokens = results[0].tokens_full if results else tokens
    wall = time.perf_counter() - t0
    span = done[-1][0] - done[0][0] if len(done) > 1 else float("nan")
    return {"path": "vlm-only", "workers": 1, "in_flight": 1, "tokens": "stock",
            "videos_per_s": round(len(done) / wall, 4), "questions_per_s": round(questions / wall, 4),
            "steady_videos_per_s": round((len(done) - 1) / span, 4),
            "steady_questions_per_s": round(sum(n for _, n in done[1:]) / span, 4),
            "tokens_kept_per_video": float(tokens), "tokens_full_per_video": float(tokens),
            "done": len(done), "wall_s": round(wall, 3), "backend": "stock VLM alone (no ARR-COC front end)",
            "vlm_counters": dict(getattr(vlm, "counters", {}))}


def main() -> None:
    global BENCH_VLM
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny-random VLM, 3 small videos")
    ap.add_argument("--gpus", type=int, nargs="*", help="Ray actor counts to time (default 1, 2, 4 up to #GPUs)")
    ap.add_argument("--videos", type=int, default=32)
    ap.add_argument("--questions", type=int, default=16, help="per video (MSRVTT-QA test averages ~24)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--size", type=int, nargs=2, default=[240, 320], metavar=("H", "W"), help="MSR-VTT is 320x240")
    ap.add_argument("--retention", type=float, default=0.25)
    ap.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="videos in work at once per worker")
    ap.add_argument("--videos-per-task", type=int, default=None,
                    help="Ray: videos per actor call (default: --in-flight)")
    ap.add_argument("--paths", default="local,ray,vlm-only",
                    help="comma-separated: local, ray, vlm-only (the stock VLM alone, no ARR-COC front end; "
                         "default all three)")
    ap.add_argument("--tokens", default="stock,arrcoc", help="comma-separated: stock, arrcoc (default both)")
    ap.add_argument("--no-ray", action="store_true", help="time the local path only (where Ray is not installed)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run (repeatable), e.g. decode.fps=2")
    ap.add_argument("--processes", type=int, default=1, metavar="N",
                    help="the local path in N processes sharing this machine's GPU, each with its own models "
                         "and every N-th video (default 1)")
    ap.add_argument("--shared-vlm", action="store_true",
                    help="with --processes: one VLM process answers every process's videos (as `batch "
                         "--processes N --shared-vlm` does) instead of a VLM in each")
    ap.add_argument("--per-gpu", type=int, default=1, metavar="N",
                    help="Ray: N actors on each GPU, 1/N of it each (as `batch --ray --processes N`; default 1)")
    ap.add_argument("--mps", action="store_true",
                    help="with --processes or --per-gpu N >= 2: run them as clients of an NVIDIA MPS daemon (as "
                         "`batch --mps`: the one running, else one started for each run and stopped after it)")
    ap.add_argument("--warmup-videos", type=int, default=1, metavar="N",
                    help="steady rates count from each worker's N-th finished video on (default 1: the first "
                         "carries the model load; more leave out the first CUDA-graph captures too)")
    ap.add_argument("--data", type=Path, metavar="DIR",
                    help="keep the generated clips here and reuse them in later runs of the same shape "
                         "(default: a temporary directory)")
    ap.add_argument("--unique-clips", type=int, metavar="K",
                    help="render only K distinct clips; the other videos reuse them under their own names "
                         "and questions (longer runs without the rendering time; default: every clip distinct)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.device, args.videos, args.questions, args.seconds, args.size = "cpu", 3, 3, 1.0, [64, 96]
    if args.processes < 1:
        sys.exit(f"--processes must be >= 1, got {args.processes}")
    if args.unique_clips is not None and not 1 <= args.unique_clips <= args.videos:
        sys.exit(f"--unique-clips must be between 1 and --videos ({args.videos}), got {args.unique_clips}")
    if args.shared_vlm and args.processes < 2:
        sys.exit("--shared-vlm shares one VLM between --processes N >= 2")
    if args.per_gpu < 1:
        sys.exit(f"--per-gpu must be >= 1, got {args.per_gpu}")
    if args.mps and (max(args.processes, args.per_gpu) < 2 or args.device != "cuda" or args.quick):
        sys.exit("--mps shares one CUDA GPU between --processes N >= 2 or --per-gpu N >= 2 (--device cuda)")
    if args.warmup_videos < 1:
        sys.exit(f"--warmup-videos must be >= 1, got {args.warmup_videos}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA GPU here (use --quick on CPU)")
    n_gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    paths, tokens = args.paths.split(","), args.tokens.split(",")
    if args.no_ray:
        paths = [p for p in paths if p != "ray"]
    counts = [] if "ray" not in paths else (args.gpus or [n for n in (1, 2, 4, 8) if n <= n_gpus])
    overrides = [f"runtime.device={args.device}", f"model.attending.retention={args.retention}",
                 "vlm.max_new_tokens=8" if not args.quick else "vlm.max_new_tokens=2", "vlm.fps=2.0"]
    if args.quick:
        overrides.append("runtime.vlm=tiny-random")
        factory = None
    else:
        overrides.append("runtime.vlm=qwen2-vl-2b-random")  # a label in the store; the factory builds it
        factory = qwen2_vl_2b_factory
    overrides += args.overrides
    cfg = load_config(PipelineConfig, None, overrides)
    BENCH_VLM = cfg.vlm
    scratch = Path(tempfile.mkdtemp(prefix="bench_batch_"))
    try:
        plan = make_plan(load_msrvtt(fixture(args, scratch)))
        if counts:
            import ray
            ray.init(include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": 2} if args.quick else {}))
        rows = []
        for stock in [t == "stock" for t in ("stock", "arrcoc") if t in tokens]:
            if "local" in paths:
                rows.append(one_run(plan, cfg, path="local", workers=args.processes, stock=stock, factory=factory,
                                    scratch=scratch, in_flight=args.in_flight, warmup=args.warmup_videos,
                                    shared_vlm=args.shared_vlm, mps=args.mps))
                print(json.dumps(rows[-1]), flush=True)
            for n in counts:
                rows.append(one_run(plan, cfg, path="ray", workers=n, stock=stock, factory=factory, scratch=scratch,
                                    in_flight=args.in_flight, videos_per_task=args.videos_per_task,
                                    warmup=args.warmup_videos, mps=args.mps, per_gpu=args.per_gpu))
                print(json.dumps(rows[-1]), flush=True)
        if counts:
            ray.shutdown()
        if "vlm-only" in paths:
            rows.append(vlm_only_run(plan, cfg, factory=factory))
            print(json.dumps(rows[-1]), flush=True)
    except ConfigError as e:                    # --mps without the driver's daemon, or one that did not start
        sys.exit(str(e))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    result = {"device": card, "card": card, "gpus_here": torch.cuda.device_count() if args.device == "cuda" else 0,
              "commit": git_commit(), "per_gpu": args.per_gpu,
              "torch": torch.__version__, "vlm": "tiny-random" if args.quick else "qwen2-vl-2b (random bf16)",
              "videos": args.videos, "unique_clips": args.unique_clips or args.videos,
              "questions_per_video": args.questions, "seconds": args.seconds,
              "size": args.size, "retention": args.retention, "warmup_videos": args.warmup_videos,
              "shared_vlm": args.shared_vlm, "mps": args.mps, "overrides": args.overrides,
              "videos_per_task": args.videos_per_task, "runs": rows,
              "summary": summarize(rows, counts, args.processes), "command": " ".join(["python3"] + sys.argv),
              "host": host_topology()}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def fixture(args, scratch: Path) -> Path:
    """The generated MSR-VTT-shaped split: written into scratch, or kept in --data and reused by
    later runs with the same shape (writing 288 clips takes ~100 s of one core; --unique-clips K
    writes K and lets the other videos reuse them)."""
    shape = {"videos": args.videos, "questions_per_video": args.questions, "seconds": args.seconds,
             "height": args.size[0], "width": args.size[1], "fps": 30 if not args.quick else 10}
    if args.unique_clips is not None and args.unique_clips < args.videos:
        shape["unique"] = args.unique_clips                                  # recorded: another shape
    root = scratch / "msrvtt" if args.data is None else args.data
    marker = root / "bench_batch_fixture.json"
    if args.data is not None and marker.exists():
        if json.loads(marker.read_text()) == shape:
            return root
        sys.exit(f"--data {root}: it holds a fixture of another shape ({marker.read_text().strip()}); "
                 f"use another directory")
    write_fixture(root, **shape, progress=True)
    marker.write_text(json.dumps(shape))
    return root


def summarize(rows: list[dict], counts: list[int], processes: int = 1) -> dict:
    get = lambda path, n, tok: next((r for r in rows if (r["path"], r["workers"], r["tokens"]) == (path, n, tok)),  # noqa: E731
                                    None)
    out = {"speedup_questions_per_s_arrcoc_over_stock": {}, "ray_scaling_efficiency": {},
           "ray_questions_per_s_by_gpus": {}, "ray_scaling_efficiency_overlap": {}}
    for path, n in [("local", processes)] + [("ray", n) for n in counts]:
        s, a = get(path, n, "stock"), get(path, n, "arrcoc")
        if s is None or a is None:
            continue
        out["speedup_questions_per_s_arrcoc_over_stock"][f"{path}_{n}"] = round(
            a["steady_questions_per_s"] / s["steady_questions_per_s"], 3) if s["steady_questions_per_s"] else None
    alone, local = get("vlm-only", 1, "stock"), get("local", processes, "arrcoc")
    if alone is not None and local is not None and alone["steady_questions_per_s"]:
        out["speedup_questions_per_s_arrcoc_over_stock_vlm_alone"] = round(
            local["steady_questions_per_s"] / alone["steady_questions_per_s"], 3)
    for tok in ("stock", "arrcoc") if counts else ():
        if get("ray", counts[0], tok) is None:
            continue
        done = [n for n in counts if get("ray", n, tok) is not None]
        out["ray_questions_per_s_by_gpus"][tok] = {str(n): get("ray", n, tok)["steady_questions_per_s"] for n in done}
        for key, rate in (("ray_scaling_efficiency", "steady_questions_per_s"),
                          ("ray_scaling_efficiency_overlap", "overlap_questions_per_s")):
            one = get("ray", counts[0], tok)[rate] / counts[0]
            out[key][tok] = {str(n): round(get("ray", n, tok)[rate] / (n * one), 3) if one else None for n in done}
    return out


if __name__ == "__main__":
    main()
