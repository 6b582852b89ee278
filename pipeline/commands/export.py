"""`export STORE [--stream ID] --format jsonl|csv [--out FILE]`: a store's answers and scene changes as rows."""
from __future__ import annotations

import argparse

from .common import EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from sinks.export import export_store

    export_store(args.store, args.out, format=args.format, stream_id=args.stream)
    return EXIT_OK
