"""Start the server: load the VLM once, build the engine and the app, run uvicorn (in the foreground
for `python -m pipeline serve`, or in a thread for tests and benchmarks)."""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from arr_coc._validate import ConfigError

from ..config import PipelineConfig
from ..core.setup import runtime_device
from .answering import LocalVLM
from .engine import Engine
from .options import ServeOptions

log = logging.getLogger(__name__)


def build_engine(cfg: PipelineConfig, options: ServeOptions) -> Engine:
    """The VLM named by runtime.vlm behind one batcher, the ARR-COC model, the store and the uploads."""
    if cfg.runtime.vlm == "none":
        raise ConfigError("serve answers questions: name a VLM with --vlm: arrcoc-synth-qa (shipped, offline; "
                          "generated scenes only), a Hugging Face id such as Qwen/Qwen2-VL-2B-Instruct, a local "
                          "snapshot, or tiny-random for smoke tests")
    from ..core.warmup import warm_up_any
    from ..vlm.loading import load_answerer
    device = runtime_device(cfg)
    vlm = load_answerer(cfg, device)
    if device.type == "cuda" and cfg.vlm.cuda_graphs:   # the graphs answers replay, before the first request
        warm_up_any(vlm, cfg, window_frames=round(options.live_window_s * cfg.vlm.fps) + 1)
    service = LocalVLM(vlm)
    try:
        return Engine(cfg, options, service)
    except BaseException:
        service.close()
        raise


def create_server(app: Any, host: str, port: int, options: ServeOptions | None = None) -> Any:
    """uvicorn over `app`, with the connection limits of `options` (connections.py)."""
    import uvicorn

    from .connections import uvicorn_limits

    if options is None:     # the app's own (create_app keeps its engine in app.state)
        engine = getattr(getattr(app, "state", None), "engine", None)
        options = engine.options if engine is not None else None
    limits = uvicorn_limits(options.header_timeout_s, options.max_connections) if options else {}
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, **limits)
    return uvicorn.Server(config)


def listen(options: ServeOptions) -> socket.socket:
    """The server's listening socket, or ConfigError naming the address and why not (in use, not an
    address of this machine): one line, exit 2, instead of uvicorn's log and exit 3."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(options.host, options.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ConfigError(f"cannot listen on {options.url}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {options.url}: {e.strerror or e}") from None
    return sock


def serve_forever(cfg: PipelineConfig, options: ServeOptions) -> None:
    """Serve until Ctrl-C / SIGTERM (a normal stop: open live streams end, the store stays valid)."""
    from .app import create_app

    sock = listen(options)       # before the model loads: a taken port is one line, at once
    try:
        engine = build_engine(cfg, options)
    except BaseException:
        sock.close()
        raise
    if engine.service.warning:
        log.warning("%s", engine.service.warning)
    server = create_server(create_app(engine), options.host, options.port, options)
    url = replace(options, port=sock.getsockname()[1]).url      # --port 0: the port it got
    log.info("serving %s on %s (store %s; file:// inside %s; API key %s)", engine.model_id, url, options.store,
             ", ".join(map(str, options.allow_dirs)) or "nothing", "required" if options.api_key else "off")
    try:
        server.run(sockets=[sock])      # uvicorn shuts down gracefully on Ctrl-C / SIGTERM, then re-raises the signal
    except KeyboardInterrupt:
        pass
    log.info("server stopped")


class BackgroundServer:
    """uvicorn in a thread on loopback (tests, benchmarks): `url` once started; stop() shuts it down."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = create_server(app, host, port)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30.0)
