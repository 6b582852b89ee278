"""What the server is allowed to do and how much: typed, validated in __post_init__ (one line each)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from arr_coc._validate import ConfigError, check_int, check_range

API_KEY_ENV = "ARRCOC_API_KEY"
MB = 1 << 20


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    allow_dirs: tuple[Path, ...] = ()      # file:// inputs only inside these (real paths, symlinks resolved)
    api_key: str | None = None             # every /v1 route then needs `Authorization: Bearer <key>`
    store: str = "serve.zarr"              # every request's homunculus: stream id = request id
    uploads: Path | None = None            # where POST /v1/files keeps uploads (default: beside the store)
    max_upload_mb: float = 512.0           # POST /v1/files and data: URLs
    max_fetch_mb: float = 512.0            # http(s):// videos fetched for a request
    fetch_timeout_s: float = 30.0
    live_window_s: float = 4.0             # rtsp:// in a chat request: answered over this much live video
    max_concurrent: int = 8                # requests whose front ends run at once (the rest queue)
    max_streams: int = 8                   # live streams over HTTP at once
    stream_events: int = 1024              # events kept per live stream for followers that join late
    model_id: str = field(default="")      # what /v1/models lists (default: the VLM's name)
    api_keys: tuple[str, ...] = ()         # more keys (--api-key repeated): each sees only what it made
    max_question_chars: int = 8192         # longer questions are refused (413) before they are tokenized
    header_timeout_s: float = 10.0         # a connection whose request head is not in by then is closed
    max_connections: int = 1024            # open connections; at the cap the oldest one still sending its head goes

    def __post_init__(self) -> None:
        if self.host.startswith("[") and self.host.endswith("]"):      # [::1]: the URL form of an IPv6 address
            object.__setattr__(self, "host", self.host[1:-1])
        check_int("--port", self.port)
        check_range("--port", self.port, 0, 65535)
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if self.api_keys and (self.api_key is None or not all(k.strip() for k in self.api_keys)
                              or len(set(self.keys)) != len(self.keys)):
            raise ConfigError("each --api-key must be non-empty and different from the others")
        check_range("--header-timeout-s", self.header_timeout_s, 0.0, 3600.0, lo_open=True)
        for name in ("max_upload_mb", "max_fetch_mb", "fetch_timeout_s", "live_window_s"):
            check_range(f"--{name.replace('_', '-')}", getattr(self, name), 0.0, None, lo_open=True)
        for name in ("max_concurrent", "max_streams", "stream_events", "max_question_chars", "max_connections"):
            check_int(f"--{name.replace('_', '-')}", getattr(self, name))
            check_range(f"--{name.replace('_', '-')}", getattr(self, name), 1, 100_000)
        for d in self.allow_dirs:
            if not Path(d).is_dir():
                raise ConfigError(f"--allow-dir {d}: not a directory")
        if not is_loopback(self.host) and self.api_key is None:
            raise ConfigError(f"refusing to serve on {self.host} without an API key: anyone who can reach it "
                              f"could read files and spend the GPU; pass --api-key KEY or set {API_KEY_ENV} "
                              f"(or bind 127.0.0.1)")

    @property
    def keys(self) -> tuple[str, ...]:
        """Every API key the server takes (none: no authentication)."""
        return () if self.api_key is None else (self.api_key, *self.api_keys)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def upload_dir(self) -> Path:
        if self.uploads is not None:
            return Path(self.uploads)
        return Path(f"{self.store.rstrip('/')}.uploads") if "://" not in self.store else Path("serve.uploads")

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * MB)

    @property
    def max_fetch_bytes(self) -> int:
        return int(self.max_fetch_mb * MB)


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else the ARRCOC_API_KEY environment variable, else None."""
    return flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; anything else (0.0.0.0, a LAN address, a name) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
