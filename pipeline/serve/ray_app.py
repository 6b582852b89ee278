"""The same app on Ray Serve (`python -m pipeline serve --ray local|auto|ADDRESS --replicas MIN:MAX
[--stream-groups N]`):

    HTTP ──▶ Ingress (1 replica)                     ──▶ VLMDeployment (MIN..MAX replicas, autoscaled)
             the FastAPI app of app.py, the front ends    one loaded VLM each (a GPU each where the cluster
             (runners.run / runners.live), live streams,  has them); `answer` is a @serve.batch method:
             uploads and the store                        requests from every client decoded together

The ingress is the app of a single-process server with RemoteVLM in place of LocalVLM: the answers
leave each request's graph the same way, and Ray Serve's router and batcher take them from there.
One ingress replica keeps live streams and uploads in one place; the store must be a path every
VLM-less ingress restart can reach again (a local path on one machine, or an fsspec URL).

With `--stream-groups N` the live streams leave the ingress: N StreamGroup deployments (a GPU
each, their own VLM) run them, the ingress places each new stream on the least-loaded group, and
the groups' VLMs answer the chat requests too, in place of the VLM deployment (ray_groups.py).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray import serve

from arr_coc._validate import ConfigError

from ..config import PipelineConfig
from ..core.setup import runtime_device
from .answering import context_length
from .options import ServeOptions

log = logging.getLogger(__name__)

APP_NAME = "arrcoc"


def parse_replicas(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' (1 <= MIN <= MAX) -> (MIN, MAX)."""
    try:
        low, _, high = text.partition(":")
        bounds = (int(low), int(high or low))
    except ValueError:
        raise ConfigError(f"--replicas must be N or MIN:MAX with integers 1 <= MIN <= MAX, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ConfigError(f"--replicas must be N or MIN:MAX with integers 1 <= MIN <= MAX, got {text!r}")
    return bounds


@serve.deployment
class VLMDeployment:
    """One loaded VLM per replica; `answer` batches the requests of every ingress call."""

    def __init__(self, cfg: PipelineConfig) -> None:
        from ..vlm.loading import load_answerer
        self.vlm = load_answerer(cfg, runtime_device(cfg))
        self.answer.set_max_batch_size(cfg.vlm.max_batch)
        self.answer.set_batch_wait_timeout_s(cfg.vlm.max_wait_s)
        self._lock = threading.Lock()      # the VLM's caches are not shared between threads

    def info(self) -> dict[str, Any]:
        from ..vlm.hf_forward import model_card
        v = self.vlm
        return {"name": v.name, "geometry": v.geometry, "config": v.config, "warning": v.warning,
                "context_length": context_length(v), "card": model_card(v)}

    def count_tokens(self, text: str) -> int:
        return len(self.vlm.tokenizer(text).input_ids)

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        return self.vlm.prefix_length(question, visual_tokens)

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.05)
    async def answer(self, requests: list[Any]) -> list[Any]:
        def run() -> list[Any]:
            with self._lock:
                return self.vlm.answer(requests)
        return await asyncio.get_running_loop().run_in_executor(None, run)


class RemoteVLM:
    """LocalVLM's interface over handles to VLM replicas (used from the ingress' threads): the VLM
    deployment's one handle (Ray Serve routes between its replicas), or the stream groups' (a
    request goes to the group with the fewest of this ingress's requests waiting)."""

    def __init__(self, handles: Any, max_in_flight: int = 64) -> None:
        self.handles = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        info = self.handles[0].info.remote().result()
        self.name, self.geometry = info["name"], info["geometry"]
        self.config, self.warning = info["config"], info["warning"]
        self.context = info["context_length"]
        self.card = info["card"]
        self._waiters = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="vlm-remote")
        self._waiting = [0] * len(self.handles)
        self._lock = threading.Lock()

    def submit(self, request: Any) -> Future:
        with self._lock:
            target = min(range(len(self.handles)), key=lambda i: (self._waiting[i], i))
            self._waiting[target] += 1
        response = self.handles[target].answer.remote(request)

        def wait() -> Any:
            try:
                return response.result()
            finally:
                with self._lock:
                    self._waiting[target] -= 1
        return self._waiters.submit(wait)

    def pending(self) -> int:
        return sum(self._waiting)

    def batch_sizes(self) -> list[int]:
        return []          # batches form in the VLM replicas: Ray Serve's own metrics show them

    def count_tokens(self, text: str) -> int:
        return self.handles[0].count_tokens.remote(text).result()

    def prefix_length(self, question: str, visual_tokens: int) -> int:
        return self.handles[0].prefix_length.remote(question, visual_tokens).result()

    def context_length(self) -> int | None:
        return self.context

    def close(self) -> None:
        self._waiters.shutdown(wait=False)


@serve.deployment
@serve.ingress()
class Ingress:
    """The HTTP app (app.create_app) over an Engine whose VLM is the VLM deployment."""

    async def __init__(self, vlm: Any, cfg: PipelineConfig, options: ServeOptions, groups: list[Any] = ()) -> None:
        from .engine import Engine

        # built off the replica's event loop: handle calls block there (.result()), as in request threads
        self.engine = await asyncio.get_running_loop().run_in_executor(
            None, lambda: Engine(cfg, options, RemoteVLM(list(groups) if groups else vlm)))
        if groups:                        # live streams run in the stream groups, placed from here
            from .ray_groups import GroupedStreams

            self.engine.streams = GroupedStreams(list(groups), self.engine.media, options)
            self.engine.metrics.live_streams = self.engine.streams.running

    def __serve_build_asgi_app__(self) -> Any:
        from .app import create_app

        return create_app(self.engine)


def build_app(cfg: PipelineConfig, options: ServeOptions, replicas: tuple[int, int], gpus: float,
              stream_groups: int = 0) -> Any:
    """The bound application: autoscaled VLM replicas (a GPU each when `gpus`) behind one ingress;
    or, with `stream_groups`, that many StreamGroup deployments (a GPU each when `gpus`) that run
    the live streams and answer every request."""
    from .ray_groups import StreamGroup

    if stream_groups:
        groups = [StreamGroup.options(name=f"StreamGroup{i}", num_replicas=1,
                                      ray_actor_options={"num_gpus": gpus, "num_cpus": 1}).bind(cfg, options)
                  for i in range(stream_groups)]
        return Ingress.options(num_replicas=1, ray_actor_options={"num_cpus": 1}).bind(None, cfg, options, groups)
    low, high = replicas
    batch = cfg.vlm.max_batch
    vlm = VLMDeployment.options(
        ray_actor_options={"num_gpus": gpus, "num_cpus": 1},
        max_ongoing_requests=4 * batch,
        autoscaling_config={"min_replicas": low, "initial_replicas": low, "max_replicas": high,
                            "target_ongoing_requests": batch},
    ).bind(cfg)
    return Ingress.options(num_replicas=1, ray_actor_options={"num_cpus": 1}).bind(vlm, cfg, options)


def start(cfg: PipelineConfig, options: ServeOptions, *, address: str, replicas: tuple[int, int],
          stream_groups: int = 0) -> None:
    """Connect to Ray, start Serve's HTTP proxy on options.host:port and deploy the app (returns
    once every replica is up)."""
    import ray

    from sinks import ZarrStore

    from ..configio import to_dict

    from ..runners.ray_batch import connect

    if cfg.runtime.vlm == "none":
        raise ConfigError("serve answers questions: name a VLM with --vlm")
    if stream_groups < 0:
        raise ConfigError(f"--stream-groups must be >= 0, got {stream_groups}")
    # the replicas do not share this process' working directory
    local = "://" not in options.store
    options = replace(options, store=str(Path(options.store).resolve()) if local else options.store,
                      uploads=options.upload_dir.resolve(),
                      allow_dirs=tuple(Path(d).resolve() for d in options.allow_dirs))
    connect(address)
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0 and cfg.runtime.device != "cpu"
    # the store made once, here: the ingress and the groups start at once and would race to create it
    ZarrStore.open(options.store, config=to_dict(cfg))
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(build_app(cfg, options, replicas, 1.0 if has_gpus else 0.0, stream_groups), name=APP_NAME,
              route_prefix="/")


def serve_on_ray(cfg: PipelineConfig, options: ServeOptions, *, address: str, replicas: tuple[int, int],
                 stream_groups: int = 0) -> None:
    """Deploy and keep serving until Ctrl-C / SIGTERM, then take the app down."""
    start(cfg, options, address=address, replicas=replicas, stream_groups=stream_groups)
    for signum in (signal.SIGINT, signal.SIGTERM):   # ray.init installed its own, which abort the process
        signal.signal(signum, _stop)
    log.info("serving %s on Ray Serve at http://%s:%s/ (VLM replicas %s..%s; %s; store %s)", cfg.runtime.vlm,
             options.host, options.port, replicas[0], replicas[1],
             f"{stream_groups} stream groups answer all (--replicas unused)" if stream_groups
             else "live streams in the ingress",
             options.store)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
    log.info("server stopped")


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
