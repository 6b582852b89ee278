"""What the server is allowed to do and how much: typed, validated in __post_init__ (one line each)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from arr_coc._validate import ConfigError, check_int, check_range

if TYPE_CHECKING:
    from .fetch_policy import FetchPolicy

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
    max_concurrent: int = 8                # requests doing work at once; beyond: 429 (admission.py)
    max_streams: int = 8                   # live streams over HTTP at once
    stream_events: int = 1024              # events kept per live stream for followers that join late
    model_id: str = field(default="")      # what /v1/models lists (default: the VLM's name)
    api_keys: tuple[str, ...] = ()         # more keys (--api-key repeated): each sees only what it made
    max_question_chars: int = 8192         # longer questions are refused (413) before they are tokenized
    header_timeout_s: float = 10.0         # a connection whose request head is not in by then is closed
    max_connections: int = 1024            # open connections; at the cap the oldest one still sending its head goes
    # outbound fetches (fetch_policy.py): hosts that may resolve anywhere, private addresses for all
    allow_media_hosts: tuple[str, ...] = ()
    allow_private_media: bool = False
    media_hosts_only: bool = False         # refuse every host not in allow_media_hosts
    media_resolve: tuple[tuple[str, str], ...] = ()   # HOST -> ADDRESS instead of DNS (still checked)
    max_redirects: int = 5
    # admission (admission.py) and retention (retention.py)
    max_concurrent_per_key: int | None = None   # default: max_concurrent
    max_streams_per_key: int | None = None      # default: max_streams
    request_timeout_s: float = 600.0
    retention_s: float = 6 * 3600.0
    max_storage_gb: float = 20.0
    # sets of captured front-end graphs kept, shared by requests and live streams of one shape
    max_frontend_graphs: int | None = None   # default: max_concurrent + max_streams (one per run at once)

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
        for name in ("request_timeout_s", "retention_s", "max_storage_gb"):
            check_range(f"--{name.replace('_', '-')}", getattr(self, name), 0.0, None, lo_open=True)
        for name in ("max_concurrent_per_key", "max_streams_per_key", "max_frontend_graphs"):
            if getattr(self, name) is not None:
                check_int(f"--{name.replace('_', '-')}", getattr(self, name))
                check_range(f"--{name.replace('_', '-')}", getattr(self, name), 1, 100_000)
        if self.max_storage_gb * 1024 < max(self.max_upload_mb, self.max_fetch_mb):
            raise ConfigError(f"--max-storage-gb={self.max_storage_gb:g} cannot hold one upload or fetch "
                              f"(--max-upload-mb {self.max_upload_mb:g}, --max-fetch-mb {self.max_fetch_mb:g})")
        _ = self.fetch_policy    # built for its own checks: --media-resolve addresses, --max-redirects
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
    def frontend_graph_sets(self) -> int:
        """The front-end graph pool's bound (max_frontend_graphs, by default one set per run that can
        be at work at once: requests and live streams)."""
        return self.max_frontend_graphs or self.max_concurrent + self.max_streams

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
    def fetch_policy(self) -> "FetchPolicy":
        from .fetch_policy import FetchPolicy

        return FetchPolicy(allow_hosts=self.allow_media_hosts, allow_private=self.allow_private_media,
                           hosts_only=self.media_hosts_only, max_redirects=self.max_redirects,
                           pinned=self.media_resolve)

    @property
    def per_key(self) -> tuple[int, int]:
        """(requests, live streams) one API key may run at once."""
        return (self.max_concurrent_per_key or self.max_concurrent, self.max_streams_per_key or self.max_streams)

    @property
    def max_storage_bytes(self) -> int:
        return int(self.max_storage_gb * (1 << 30))

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
