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
                           max_connections=args.max_connections, **_limits(args))
    if args.config is None and not any(o.startswith("decode.process=") for o in args.overrides):
        # many short clips at once: a decode process per request (spawn, shared memory) costs more
        # than it saves; each request's decoder is a thread of the server instead
        args.overrides = ["decode.process=false", *args.overrides]
    if args.stream_groups and not args.ray:
        raise ConfigError("--stream-groups places live streams on Ray Serve deployments: it needs --ray")
    cfg = load_run_config(args)
    if args.ray:
        from ..serve.ray_app import parse_replicas, serve_on_ray
        serve_on_ray(cfg, options, address=args.ray, replicas=parse_replicas(args.replicas),
                     stream_groups=args.stream_groups)
    else:
        from ..serve.server import serve_forever
        serve_forever(cfg, options)
    return EXIT_OK


def _limits(args: argparse.Namespace) -> dict:
    """The fetch policy, admission and retention options (docs/deploying.md)."""
    pinned = []
    for entry in args.media_resolve:
        host, sep, address = entry.partition("=")
        if not sep or not host or not address:
            raise ConfigError(f"--media-resolve {entry!r}: expected HOST=ADDRESS (e.g. media.internal=10.0.0.5)")
        pinned.append((host, address))
    return dict(allow_media_hosts=tuple(args.allow_media_hosts), allow_private_media=args.allow_private_media,
                media_hosts_only=args.media_hosts_only, media_resolve=tuple(pinned),
                max_concurrent_per_key=args.max_concurrent_per_key, max_streams_per_key=args.max_streams_per_key,
                request_timeout_s=args.request_timeout_s, retention_s=args.retention_s,
                max_storage_gb=args.max_storage_gb)
