"""Temporary directories that hold Unix sockets (the shared VLM's, an MPS daemon's pipes)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def short_tempdir(prefix: str, max_len: int) -> Path:
    """A fresh temporary directory whose path is at most `max_len` characters: under TMPDIR, or
    under /tmp where TMPDIR is too deep (a Unix socket's path holds at most ~107 bytes)."""
    root = tempfile.mkdtemp(prefix=prefix)
    if len(root) > max_len:
        os.rmdir(root)
        root = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    return Path(root)
