"""Helpers shared by the benchmark scripts (run as scripts: they put the repo root on sys.path)."""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name for CUDA devices, else the CPU model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def write_result(result: dict[str, Any], out: Path) -> None:
    """Write a benchmark's JSON result (creating its folder) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
