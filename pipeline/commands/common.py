"""What every command shares: exit codes and the run configuration from the command line."""
from __future__ import annotations

import argparse

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A bad command line (one line)."""


def load_run_config(args: argparse.Namespace):
    from ..config import PipelineConfig, validate_every
    from ..configio import load_config

    if getattr(args, "every", None) is not None:   # named as the user wrote it, not runtime.every_s
        validate_every(args.every, name="--every")
    overrides = list(args.overrides)
    for flag, key in (("device", "runtime.device"), ("decoder", "decode.decoder"), ("vlm", "runtime.vlm"),
                      ("every", "runtime.every_s")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(PipelineConfig, args.config, overrides)
