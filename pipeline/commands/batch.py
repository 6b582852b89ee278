"""`batch --dataset msrvtt --root DIR`: answer every question of a split, locally or on Ray.

`--processes N` runs the local path as N processes side by side (`--shard i/N` each, on one store):
on one GPU, several processes keep it busier than one, whose host side caps its rate
(docs/performance.md). The parent checks the options, starts them, shows their progress from the
store and prints one summary of all of them. With `--mps` they are clients of an NVIDIA MPS daemon
(pipeline/core/mps.py), so that their kernels run on the GPU at once rather than in turns; the
parent itself never initialises CUDA. With `--ray`, `--processes N` puts N actors on every GPU of
the cluster instead (runners/ray_batch.py); `--ray local --mps` makes them clients of one daemon here.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from arr_coc._validate import ConfigError

from ..api import Pipeline
from .common import EXIT_INTERRUPTED, EXIT_OK, load_run_config

POLL_S = 0.5                       # how often the parent looks at the store and its processes


def cmd_batch(args: Any) -> int:
    if args.overlay:
        raise ConfigError("--overlay renders one video; batch does not support it")
    if args.vlm_server is not None and (args.ray is not None or args.processes not in (None, 1)):
        raise ConfigError("--vlm-server is set by batch --processes for its shard processes")
    if args.shared_vlm and (args.processes is None or args.processes < 2):
        raise ConfigError("--shared-vlm shares one VLM between the processes of --processes N (N >= 2)")
    if args.mps and (args.processes is None or args.processes < 2):
        raise ConfigError("--mps runs the processes of --processes N (N >= 2) as clients of one MPS daemon")
    if args.mps and args.ray not in (None, "local"):
        raise ConfigError("--mps starts a daemon on this machine only; on a Ray cluster start "
                          "`nvidia-cuda-mps-control -d` on every GPU node instead (docs/deployment.md)")
    if args.processes is not None and args.processes < 1:
        raise ConfigError(f"--processes must be >= 1, got {args.processes}")
    if args.ray is not None and args.shared_vlm:
        raise ConfigError("--shared-vlm is for the local path's --processes; each Ray actor loads its own VLM")
    if args.ray is not None:
        return _on_ray(args)
    if args.processes is not None:
        if args.processes > 1:
            if args.shard is not None:
                raise ConfigError("--processes shards the split itself (--shard i/N each); drop --shard")
            return _side_by_side(args)
    pipe = Pipeline(config=load_run_config(args))
    summary = pipe.batch(args.root, dataset=args.dataset, split=args.split, task=args.task, videos=args.videos,
                         limit=args.limit, shard=args.shard, out=args.out, ray=args.ray, workers=args.workers,
                         in_flight=args.in_flight, videos_per_task=args.videos_per_task,
                         stock_tokens=args.stock_tokens, progress=args.progress, vlm_server=args.vlm_server,
                         overwrite=args.overwrite)
    row = summary.to_dict()
    if pipe.config.runtime.vlm.startswith("tiny-random"):
        row["notes"] = ["tiny-random is a built-in random model for smoke tests: its answers are meaningless"]
    print(json.dumps(row))
    return EXIT_OK


def _on_ray(args: Any) -> int:
    """The batch on Ray Data: --processes N actors on every GPU (1/N of it each), with --mps as
    clients of one MPS daemon on this machine (--ray local)."""
    from ..core.mps import check_cuda, mps_clients

    pipe = Pipeline(config=load_run_config(args))
    if args.mps:
        check_cuda(pipe.config.runtime.device)
    with mps_clients(args.mps) as mps:
        summary = pipe.batch(args.root, dataset=args.dataset, split=args.split, task=args.task, videos=args.videos,
                             limit=args.limit, shard=args.shard, out=args.out, ray=args.ray, workers=args.workers,
                             in_flight=args.in_flight, videos_per_task=args.videos_per_task,
                             stock_tokens=args.stock_tokens, progress=args.progress, overwrite=args.overwrite,
                             per_gpu=args.processes or 1, actor_env=None if mps is None else mps.env)
    row = summary.to_dict()
    if mps is not None:
        row["mps"] = mps.state
    print(json.dumps(row))
    return EXIT_OK


def _child_argv(argv: list[str], i: int, n: int, out: str, vlm_server: str | None = None) -> list[str]:
    """This command line for shard i of n: without --processes (and without --out / progress /
    shared-VLM / MPS / --overwrite flags, which the parent handles; vlm_server: the shared VLM's socket)."""
    drop_with_value = {"--processes", "--out", "--vlm-server"}
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop_with_value:
            skip = True
            continue
        if a.split("=", 1)[0] in drop_with_value or a in ("--progress", "--no-progress", "--shared-vlm", "--mps",
                                                          "--overwrite"):
            continue
        rest.append(a)
    server = [] if vlm_server is None else ["--vlm-server", vlm_server]
    return [sys.executable, "-m", "pipeline", *rest, "--shard", f"{i}/{n}", "--out", out, "--no-progress", *server]


def _side_by_side(args: Any) -> int:
    from sources.msrvtt import load_msrvtt

    from ..runners.batch import VideoAnswerer, default_out, make_plan

    from ..core.mps import check_cuda, mps_clients

    n = args.processes
    cfg = load_run_config(args)                            # a bad option fails here, once, before any start
    if args.mps:
        check_cuda(cfg.runtime.device)
    data = load_msrvtt(args.root, args.split, task=args.task, videos_dir=args.videos)
    plan = make_plan(data, limit=args.limit)
    out = args.out if args.out is not None else default_out(args.dataset, args.split)
    started = time.monotonic()
    # the packages beside this one (sources, sinks, arr_coc) importable from any directory, installed or not
    root = str(Path(__file__).resolve().parents[2])
    procs: list[subprocess.Popen] = []
    outputs: dict[int, str] = {}
    server = None
    # --mps: the daemon's variables in os.environ until every process has ended (the shared VLM's,
    # spawned, inherits them; then the daemon quits)
    with mps_clients(args.mps) as mps:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:                                                # Ctrl-C while starting them stops those started
            if args.shared_vlm:
                server = _start_vlm_server(cfg)
                env.update(server.address.to_env())
            # the settings check (or the fresh start) once, here, after the shared VLM loaded (a VLM
            # that cannot load leaves no store behind): the processes only resume
            VideoAnswerer.create_store(cfg, out, stock=args.stock_tokens, overwrite=args.overwrite)
            for i in range(n):
                argv = _child_argv(args.argv, i, n, str(out), None if server is None else server.address.path)
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env))
            _wait(procs, outputs, [w.video_id for w in plan], out, args.progress)
            batches = _server_batches(server) if all(p.returncode == 0 for p in procs) else None
        except KeyboardInterrupt:
            _stop(procs)
            raise
        finally:
            if server is not None:
                server.close()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        i, code = failed[0]
        print(f"error: process {i} of {n} (--shard {i}/{n}) exited with code {code}; the others were stopped, "
              f"the store keeps what they finished", file=sys.stderr)
        return code if code != EXIT_INTERRUPTED else EXIT_INTERRUPTED
    rows = [json.loads(outputs[i].strip().splitlines()[-1]) for i in range(n)]
    merged = merge_summaries(rows, time.monotonic() - started)
    if batches is not None:
        merged["shared_vlm"] = batches
    if mps is not None:
        merged["mps"] = mps.state
    print(json.dumps(merged))
    return EXIT_OK


def _server_batches(server: Any) -> dict | None:
    """How the shared VLM batched the processes' videos: calls and videos per call (None without one)."""
    if server is None:
        return None
    from ..vlm.remote import VLMProcessError

    try:
        sizes = server.counters().get("batch_sizes", [])
    except VLMProcessError:                                 # gone after the shards finished: no counts
        return None
    return {"calls": len(sizes), "videos_per_call": round(sum(sizes) / len(sizes), 2) if sizes else 0.0}


def _start_vlm_server(cfg: Any) -> Any:
    """The VLM runtime.vlm names, loaded once in a process of its own that every shard asks."""
    import functools

    from ..runners.batch import config_vlm
    from ..vlm.server import VLMServer

    if cfg.runtime.vlm == "none":
        raise ConfigError("batch answers questions, so it needs a VLM: pass --vlm ID|PATH|tiny-random")
    return VLMServer(functools.partial(config_vlm, cfg), max_batch=cfg.vlm.max_batch)


def _wait(procs: list[subprocess.Popen], outputs: dict[int, str], video_ids: list[str], out, progress) -> None:
    """Until every process has ended (or one failed: then the rest are stopped), with a progress bar
    of the plan's videos complete in the store."""
    import threading

    def read(i: int, p: subprocess.Popen) -> None:
        outputs[i] = p.stdout.read()
    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for r in readers:
        r.start()
    bar = None
    if sys.stderr.isatty() if progress is None else progress:
        from tqdm import tqdm
        bar = tqdm(total=len(video_ids), unit="video", desc=f"batch x {len(procs)}", dynamic_ncols=True,
                   file=sys.stderr)
    try:
        while True:
            codes = [p.poll() for p in procs]
            if bar is not None:
                bar.n = _complete(out, video_ids)
                bar.refresh()
            if any(c not in (None, 0) for c in codes):
                _stop(procs)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(POLL_S)
    finally:
        if bar is not None:
            bar.close()
    for r in readers:
        r.join()


def _complete(out, video_ids: list[str]) -> int:
    from sinks import ZarrStore

    try:
        store = ZarrStore.open(out, mode="r")
        present = set(store.stream_ids())
        return sum(vid in present and store.is_complete(vid) for vid in video_ids)
    except Exception:                                       # not written yet, or mid-write: next poll
        return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ctrl-C for every process still running (each closes its store writes cleanly), then wait."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def merge_summaries(rows: list[dict], wall_s: float) -> dict:
    """One batch summary of the shard processes' own: counts summed, rates over the parent's wall
    time, per-video means weighted by the videos each process did; `shards` keeps each one's."""
    counts = ("videos", "questions", "done", "skipped_complete", "missing", "failed", "damaged", "answered")
    merged: dict[str, Any] = {"out": rows[0]["out"], "backend": f"local x {len(rows)} processes"}
    merged.update({k: sum(r[k] for r in rows) for k in counts})
    done = merged["done"]
    merged["wall_s"] = round(wall_s, 3)
    merged["videos_per_s"] = round(done / wall_s, 4) if wall_s > 0 else 0.0
    merged["questions_per_s"] = round(merged["answered"] / wall_s, 4) if wall_s > 0 else 0.0

    def mean(key: str, digits: int) -> float:
        return round(sum(r[key] * r["done"] for r in rows) / done, digits) if done else 0.0
    merged["tokens_kept_per_video"] = mean("tokens_kept_per_video", 1)
    merged["tokens_full_per_video"] = mean("tokens_full_per_video", 1)
    merged["seconds_per_video"] = mean("seconds_per_video", 4)
    stages = sorted({s for r in rows for s in r.get("stage_busy_per_video_s", {})})
    merged["stage_busy_per_video_s"] = {
        s: round(sum(r["stage_busy_per_video_s"].get(s, 0.0) * r["done"] for r in rows) / done, 4) if done else 0.0
        for s in stages}
    calls = sum(r.get("vlm_calls", 0) for r in rows)
    merged["vlm_calls"] = calls
    merged["videos_per_vlm_call"] = round(sum(r["videos_per_vlm_call"] * r["vlm_calls"] for r in rows
                                              if r.get("vlm_calls")) / calls, 2) if calls else None
    merged["processes"] = len(rows)
    merged["shards"] = rows
    notes = [note for r in rows for note in r.get("notes", [])]
    if notes:
        merged["notes"] = sorted(set(notes))
    return merged
