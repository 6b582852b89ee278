"""`serve`: the HTTP API and the viewer page, in this process or deployed on Ray Serve."""
from __future__ import annotations

import argparse
from pathlib import Path

from arr_coc._validate import ConfigError

from .common import EXIT_OK, load_run_config


SERVE_EXTRA = (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("python-multipart", "python_multipart"))


def check_serve_extra() -> None:
    """One line naming the `serve` extra when its packages are missing (before any model loads)."""
    import importlib.util

    missing = [package for package, module in SERVE_EXTRA if importlib.util.find_spec(module) is None
               and not (module == "python_multipart" and importlib.util.find_spec("multipart") is not None)]
    if missing:
        raise ConfigError(f"serve needs the serve extra ({', '.join(missing)} not installed): "
                          "pip install 'arr-coc-video[serve]' (in a checkout: pip install -e '.[serve]')")


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serve.options import ServeOptions, resolve_api_key

    check_serve_extra()
    if args.overlay:
        raise ConfigError("--overlay is not supported by `serve` (the page at / draws the homunculus)")
    keys = args.api_key or [None]
    options = ServeOptions(host=args.host, port=args.port, allow_dirs=tuple(Path(d) for d in args.allow_dirs),
                           api_key=resolve_api_key(keys[0]), api_keys=tuple(keys[1:]), store=args.out or "serve.zarr",
                           uploads=Path(args.uploads) if args.uploads else None, max_upload_mb=args.max_upload_mb,
                           max_fetch_mb=args.max_fetch_mb, live_window_s=args.live_window,
                           max_concurrent=args.max_concurrent, max_streams=args.max_streams,
                           max_question_chars=args.max_question_chars, header_timeout_s=args.header_timeout_s,
                           max_connections=args.max_connections)
    if args.config is None and not any(o.startswith("decode.process=") for o in args.overrides):
        # many short clips at once: a decode process per request (spawn, shared memory) costs more
        # than it saves; each request's decoder is a thread of the server instead
        args.overrides = ["decode.process=false", *args.overrides]
    cfg = load_run_config(args)
    if args.ray:
        from ..serve.ray_app import parse_replicas, serve_on_ray
        serve_on_ray(cfg, options, address=args.ray, replicas=parse_replicas(args.replicas))
    else:
        from ..serve.server import serve_forever
        serve_forever(cfg, options)
    return EXIT_OK
