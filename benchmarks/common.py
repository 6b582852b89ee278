"""Helpers shared by the benchmark scripts (run as scripts: they put the repo root on sys.path)."""
from __future__ import annotations

import contextlib
import functools
import json
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

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


def host_topology() -> dict[str, Any]:
    """What a multi-GPU run shares on its host: CPU count, NUMA nodes and their CPUs, and the GPUs'
    interconnect and CPU/NUMA affinity as `nvidia-smi topo -m` prints it (absent where unavailable)."""
    import os
    import subprocess

    info: dict[str, Any] = {"cpus": os.cpu_count(), "cpu": cpu_name()}
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    if nodes:
        info["numa_nodes"] = {n.name: (n / "cpulist").read_text().strip() for n in nodes if (n / "cpulist").exists()}
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            info["nvidia_smi_topo"] = out.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def device_name(device: torch.device) -> str:
    """The GPU's name for CUDA devices, else the CPU model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def scratch_result(name: str) -> Path:
    """Where a benchmark writes its JSON when no --out is given: outside the repository (the
    committed results under benchmarks/results/ change only when --out names them)."""
    import tempfile

    return Path(tempfile.gettempdir()) / "arrcoc-bench" / name


def write_result(result: dict[str, Any], out: Path) -> None:
    """Write a benchmark's JSON result (creating its folder) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def fixed_query(question: str = "") -> torch.Tensor:
    """A (384,) unit vector in place of MiniLM's encoding of `question` (runners' query_embedding /
    query_encoder): the GPU machines lack the MiniLM wheel, and what a question says does not change
    the work a speed benchmark measures."""
    return torch.nn.functional.normalize(torch.ones(384), dim=0)


def kernel_summary(prof, per: int, top: int = 20) -> dict[str, Any]:
    """A finished torch.profiler run -> GPU kernel time per unit of work (`per` units: videos,
    calls): in all, and the `top` kernels by time, in ms per unit. Kernels of every thread count
    (CUPTI sees the whole process; the profiler's CPU ranges would cover only its own thread)."""
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    return {"kernel_ms": round(total_us / per / 1e3, 2),
            "kernels": round(sum(e.count for e in kernels) / per),
            "top_kernels_ms": [[e.key[:90], round(e.self_device_time_total / per / 1e3, 3), round(e.count / per, 1)]
                               for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]]}


def random_qwen2_vl_2b(device: torch.device, config: Any = None):
    """The Qwen2-VL-2B architecture with random weights (bf16 on CUDA), built on `device` with
    VLMConfig `config` (None: defaults). Random weights choose EOS at random, and where depends on
    the visual tokens: its EOS set is emptied, so every answer runs to vlm.max_new_tokens and the
    arms of a benchmark decode the same number of tokens."""
    from pipeline.vlm.builtin import arch_config, build_model, build_tokenizer
    from pipeline.vlm.loading import _wrap

    tokenizer = build_tokenizer("english")  # questions cost about as many tokens as with Qwen's vocabulary
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(arch_config("qwen2-vl-2b", tokenizer), device=device, dtype=dtype)
    vlm = _wrap(model, tokenizer, "qwen2_vl", "qwen2-vl-2b (random weights)", config, {}, None)
    vlm.eos_ids = torch.empty(0, dtype=torch.long, device=device)
    return vlm


class PhaseTimers:
    """Times calls of the functions `phases` names ({label: (owner, attribute)}) while installed():
    each call between two device syncs (the GPU work it queued counted in), seconds summed per
    label in `s`; after(label, args), if given, sees every timed call's arguments."""

    def __init__(self, device: torch.device, phases: dict[str, tuple[Any, str]],
                 after: Callable[[str, tuple], None] | None = None) -> None:
        self.device, self.phases, self.after = device, phases, after
        self.s: defaultdict[str, float] = defaultdict(float)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def installed(self):
        saved = {label: getattr(owner, attr) for label, (owner, attr) in self.phases.items()}
        try:
            for label, (owner, attr) in self.phases.items():
                setattr(owner, attr, self._timed(label, saved[label]))
            yield self
        finally:
            for label, (owner, attr) in self.phases.items():
                setattr(owner, attr, saved[label])

    def _timed(self, label: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.s[label] += time.perf_counter() - t0
                if self.after is not None:
                    self.after(label, args)
        return wrapper
