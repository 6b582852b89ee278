"""The batch work on Ray Data: plan rows -> an actor pool (a GPU or a share of one, or one CPU slot,
and a loaded VLM + ARR-COC per actor) that decodes, allocates and answers each video -> per-video
outcomes.

Every GPU Ray sees (on this machine or across a cluster) gets `per_gpu` actors, each asking for
1/per_gpu of it: the one-GPU setting that answers the most (several processes per GPU, the local
path's `--processes N`) repeated on every GPU. Several actors on one GPU take turns on it unless
they are clients of an NVIDIA MPS daemon (core/mps.py): `actor_env` carries its variables to them
(a daemon that runs with the default pipe directory on each node needs none: every CUDA process
there joins it).

Each actor is a `batch.VideoAnswerer`, the same object the local path uses, so both paths write
identical stream groups; every actor writes its videos' groups straight into the shared store
(writers of different streams touch disjoint groups: see sinks/zarr_store.py). Ray Data streams the
plan with backpressure: each actor has at most `MAX_IN_FLIGHT` videos queued, so a slow actor never
hoards work and the driver never materialises results it has not consumed.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from arr_coc._validate import ConfigError
from sinks import store_location

from .batch import (IN_FLIGHT, BatchSummary, VideoAnswerer, VideoOutcome, _with_progress, check_count,
                    check_in_flight, report_outcome)
from ..config import PipelineConfig
from sources.msrvtt import Question, VideoWork

MAX_IN_FLIGHT = 2
CONNECT_TIMEOUT_S = 5.0   # a cluster address that does not answer a TCP connect in this long is unreachable
REPO = Path(__file__).resolve().parents[2]


def plan_rows(plan: list[VideoWork]) -> list[dict[str, Any]]:
    # questions travel as a JSON string: Arrow would turn nested lists of dicts into numpy object arrays
    return [{"video_id": w.video_id, "path": "" if w.path is None else str(w.path),
             "questions": json.dumps([asdict(q) for q in w.questions])} for w in plan]


def work_of(row: dict[str, Any]) -> VideoWork:
    questions = tuple(Question(**{**q, "references": tuple(q["references"])}) for q in json.loads(row["questions"]))
    return VideoWork(str(row["video_id"]), Path(row["path"]) if row["path"] else None, questions)


class AnswerActor:
    """One Ray actor: owns a device and a loaded model; answers a batch of videos per call
    (videos_per_task, default in_flight), `in_flight` of them in work at once (as the local path
    does). A call returns when its last video is done, so the call's last videos drain alone."""

    def __init__(self, cfg: PipelineConfig, out: str, stock: bool, vlm_factory: Callable | None = None,
                 in_flight: int = IN_FLIGHT, query_encoder: Callable | None = None) -> None:
        self.answerer = VideoAnswerer(cfg, out, stock=stock, vlm_factory=vlm_factory, query_encoder=query_encoder)
        self.in_flight = in_flight

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        outcomes = [o.to_row() for o in self.answerer.answer_all([work_of(r) for r in rows], self.in_flight)]
        return {k: [o[k] for o in outcomes] for k in outcomes[0]} if outcomes else {}


def connect(address: str) -> None:
    import ray

    if ray.is_initialized():
        return
    # local workers import the project from the checkout; a cluster must have it installed
    env = {"env_vars": {"PYTHONPATH": str(REPO)}}
    if address == "local":
        ray.init(include_dashboard=False, runtime_env=env, log_to_driver=False)
    else:
        # auto: RAY_ADDRESS when set (else the address file a local `ray start` left)
        _check_reachable(os.environ.get("RAY_ADDRESS", "") if address == "auto" else address, address)
        try:
            ray.init(address=address, runtime_env=env if address == "auto" else None, log_to_driver=False)
        except ConnectionError as e:
            reason = str(e).splitlines()[0]
            if reason.startswith("Could not find any running Ray instance"):
                reason = "no running Ray instance found (start one with `ray start --head`, or give its address)"
            raise ConfigError(f"cannot connect to the Ray cluster at --ray {address}: {reason}") from None


def _check_reachable(address: str, given: str | None = None) -> None:
    """Fail at once, naming the address (and `given`, the --ray value it came from), when nothing
    answers a TCP connect to it: ray.init would otherwise retry an unreachable head node for minutes.
    Addresses it cannot parse go to Ray as they are."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        reason = f"no answer in {CONNECT_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        where = address if given in (None, address) else f"{given} ({address}, from RAY_ADDRESS)"
        raise ConfigError(f"cannot connect to the Ray cluster at --ray {where}: {reason}") from None


def actor_count(gpus: int, use_gpu: bool, per_gpu: int, workers: int | None, tasks: int) -> int:
    """Actors in the pool: `workers`, else per_gpu on every GPU (one on CPU); never more than the
    plan's actor calls (an actor with no call to run would still load a model), never none."""
    size = workers or (gpus * per_gpu if use_gpu else 1)
    return max(1, min(size, tasks))


def run_ray_batch(plan: list[VideoWork], out: str | Path, cfg: PipelineConfig, *, address: str = "auto",
                  stock: bool = False, workers: int | None = None, progress: bool | None = None,
                  vlm_factory: Callable | None = None, in_flight: int = IN_FLIGHT,
                  videos_per_task: int | None = None, query_encoder: Callable | None = None,
                  per_gpu: int = 1, actor_env: dict[str, str] | None = None) -> BatchSummary:
    """The plan on Ray Data: per_gpu actors on every GPU of the cluster, each holding 1/per_gpu of
    one (or `workers` actors in all; one CPU actor when cfg asks for cpu), each call answering
    videos_per_task videos (default in_flight). actor_env: variables the actors start with (an MPS
    daemon's). query_encoder: question -> (384,) instead of MiniLM, built into each actor
    (runners/batch.py: VideoAnswerer)."""
    import ray

    out = store_location(out)
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    check_count("--processes (actors per GPU)", per_gpu)
    check_in_flight(in_flight)
    per_task = in_flight if videos_per_task is None else videos_per_task
    check_count("--videos-per-task", per_task)
    connect(address)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and gpus > 0)
    if cfg.runtime.device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda was asked for, but the Ray cluster has no GPUs")
    tasks = -(-len(plan) // per_task)
    size = actor_count(gpus, use_gpu, per_gpu, workers, tasks)
    # Ray counts GPU shares in units of 1e-4: 1/3 rounds down, so three actors still fit one GPU
    share = int(1e4 / per_gpu) / 1e4 if use_gpu else 0
    env = {"runtime_env": {"env_vars": dict(actor_env)}} if actor_env else {}
    # the driver creates the store once, so actors never race to create its root
    VideoAnswerer.create_store(cfg, out, stock=stock)
    start = time.perf_counter()
    outcomes: list[VideoOutcome] = []
    if plan:
        ds = ray.data.from_items(plan_rows(plan), override_num_blocks=tasks)
        ds = ds.map_batches(AnswerActor, batch_size=per_task,
                            fn_constructor_kwargs=dict(cfg=cfg, out=str(out), stock=stock, vlm_factory=vlm_factory,
                                                       in_flight=in_flight, query_encoder=query_encoder),
                            compute=ray.data.ActorPoolStrategy(size=size, max_tasks_in_flight_per_actor=MAX_IN_FLIGHT),
                            num_gpus=share, num_cpus=1, **env)
        rows = (VideoOutcome(**{k: v.item() if hasattr(v, "item") else v for k, v in row.items()})
                for row in ds.iter_rows())
        for outcome in _with_progress(rows, len(plan), progress):
            outcomes.append(outcome)
            report_outcome(outcome)
    kind = ("GPU" if per_gpu == 1 else f"1/{per_gpu}-GPU") if use_gpu else "CPU"
    return BatchSummary(out, len(plan), sum(len(w.questions) for w in plan), time.perf_counter() - start, outcomes,
                        backend=f"ray ({size} {kind} actor{'s' if size > 1 else ''})")
