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


def git_commit() -> str | None:
    """The checkout's short commit, "+dirty" when it has uncommitted changes; None outside git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) if head else None


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


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (None off Linux): busy leaves out idle and iowait."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    total = sum(fields[:8])                     # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total


def busy_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The machine's busy share of its CPU time between two cpu_times() samples (None: either is
    missing, or no time passed between them)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _gpu_utilization() -> list[float] | None:
    """Each GPU's utilization (% of the last sample period with a kernel running) from nvidia-smi,
    None where it cannot be read."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5)
        return [float(x) for x in out.stdout.split()] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class LoadSampler:
    """What a benchmark's run keeps busy, sampled in a background thread while entered: every
    `period` s the host CPUs' busy share since the last sample (all CPUs, 0-1) and each GPU's
    utilization (nvidia-smi, % of the period with a kernel running; absent without it).
    summary(start, end) reduces the samples taken in (start, end] (time.time()), e.g. a benchmark's
    steady window, to mean / p50 / max: whether the CPUs or the GPU bound that window."""

    def __init__(self, period: float = 0.5, gpu: bool = True) -> None:
        import threading

        self.period, self.gpu = period, gpu
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = cpu_times()
        while not self._stop.wait(self.period):
            now = cpu_times()
            sample: dict[str, Any] = {"t": time.time()}
            if (busy := busy_share(last, now)) is not None:
                sample["cpu_busy"] = busy
            last = now
            if self.gpu:
                util = _gpu_utilization()
                if util:
                    sample["gpu_util"] = sum(util) / len(util)
            self.samples.append(sample)

    def summary(self, start: float | None = None, end: float | None = None) -> dict[str, Any]:
        inside = [x for x in self.samples if (start is None or x["t"] > start) and (end is None or x["t"] <= end)]
        out: dict[str, Any] = {"samples": len(inside), "period_s": self.period}
        if start is not None and end is not None:
            out["window_s"] = round(end - start, 3)
        for key in ("cpu_busy", "gpu_util"):
            values = [x[key] for x in inside if key in x]
            if values:
                digits = 3 if key == "cpu_busy" else 1
                out[key] = {"mean": round(sum(values) / len(values), digits),
                            "p50": round(float(sorted(values)[len(values) // 2]), digits),
                            "max": round(max(values), digits)}
        return out


def cuda_kernels(prof) -> list:
    """A finished torch.profiler run's GPU kernels (its key_averages rows of device type CUDA),
    most time first. Only the kernels' own rows count: a CPU op's row holds the time of the kernels
    it launched as well, and summing every row would count those kernels twice. Kernels of every
    thread are there (CUPTI sees the whole process; the profiler's CPU ranges cover only its own
    thread)."""
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(rows, key=lambda e: -e.self_device_time_total)


def kernel_summary(prof, per: int, top: int = 20) -> dict[str, Any]:
    """A finished torch.profiler run -> GPU kernel time per unit of work (`per` units: videos,
    calls): in all, and the `top` kernels by time, in ms per unit."""
    kernels = cuda_kernels(prof)
    total_us = sum(e.self_device_time_total for e in kernels)
    return {"kernel_ms": round(total_us / per / 1e3, 2),
            "kernels": round(sum(e.count for e in kernels) / per),
            "top_kernels_ms": [[e.key[:90], round(e.self_device_time_total / per / 1e3, 3), round(e.count / per, 1)]
                               for e in kernels[:top]]}


def profiler_device(quick: bool) -> torch.device:
    """The device of a VLM profiler: the CPU for its --quick smoke run, else CUDA (one line and
    exit where there is none)."""
    import sys

    device = torch.device("cpu" if quick else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here (use --quick on CPU)")
    return device


def profiler_vlm(device: torch.device, quick: bool, overrides: list[str]):
    """A VLM profiler's model with these config overrides: tiny-random for --quick, else the
    random-weight Qwen2-VL-2B on `device`."""
    from pipeline.config import PipelineConfig
    from pipeline.configio import load_config

    cfg = load_config(PipelineConfig, None, overrides)
    if quick:
        from pipeline.vlm.loading import build_tiny_vlm
        return build_tiny_vlm("qwen2_vl", config=cfg.vlm)
    return random_qwen2_vl_2b(device, cfg.vlm)


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
