"""CUDA helpers shared by the front end and the VLM: the device choice, host -> device copies that
do not stall, reading several device tensors back at once, graph capture, and the ledger of graph
shapes and captures (LEDGER). CPU-safe: on a machine without CUDA all but capture run.
"""
from __future__ import annotations

import collections
import gc
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from arr_coc._validate import ConfigError
from sources import nvdec

# While a thread captures a CUDA graph, page-locked host allocations in other threads fail (torch's
# caching host allocator queries its blocks' events; seen in live mode as "operation not
# permitted when stream is capturing" / "invalid argument" in pin_memory while the VLM captured its
# decode step). Captures and those allocations take this lock: captures are rare (one per shape),
# the allocations short. So do (un)registering host memory and device-wide syncs (a sync waits on
# the capturing stream, which invalidates its capture); the hot paths sync streams or events only.
# NVDEC's decoder calls take it too: one lock, owned by sources (which may not import pipeline)
CAPTURE_LOCK = nvdec.CAPTURE_LOCK


@dataclass(frozen=True)
class LedgerEntry:
    """One event of the graph ledger. kind "shape": a graph cache was asked for a shape it holds no
    graph for (recorded on every device, so a CPU run sees the shapes a GPU run would capture);
    "capture": a CUDA graph was captured (seconds: how long, warm-up runs included); "mark": a
    point in a run (the first frame taken)."""

    t: float                       # time.monotonic()
    kind: Literal["shape", "capture", "mark"]
    label: str                     # what and which shape, e.g. "prefill rows=4 len=256 L=192"
    seconds: float = 0.0


class GraphLedger:
    """Every graph shape asked for without a graph and every capture of this process, with the time:
    what benchmarks and tests read to tell a warm start from a cold one (a "shape" or "capture"
    after the first frame means warm-up missed a shape). Bounded (the newest `limit` entries) and
    thread-safe; recording is one append under a lock."""

    def __init__(self, limit: int = 4096) -> None:
        self._entries: collections.deque[LedgerEntry] = collections.deque(maxlen=limit)
        self._lock = threading.Lock()

    def record(self, kind: Literal["shape", "capture", "mark"], label: str, seconds: float = 0.0) -> float:
        with self._lock:       # the time is read under the lock, so the entries stay in time order
            t = time.monotonic()
            self._entries.append(LedgerEntry(t, kind, label, seconds))
        return t

    def shape(self, label: str) -> None:
        """A graph cache met a shape it has no graph for: on CUDA a capture follows; elsewhere the
        shape runs eagerly, but counts all the same (coverage tests run on the CPU)."""
        self.record("shape", label)

    def mark(self, label: str) -> float:
        return self.record("mark", label)

    def entries(self, since: float | None = None, kind: str | None = None) -> list[LedgerEntry]:
        """The entries (of `kind`) at or after time.monotonic() `since`, oldest first."""
        with self._lock:
            out = list(self._entries)
        return [e for e in out if (since is None or e.t >= since) and (kind is None or e.kind == kind)]

    def first_mark(self, label: str, since: float | None = None) -> float | None:
        """The time of the first mark `label` at or after `since`, None if none."""
        return next((e.t for e in self.entries(since, "mark") if e.label == label), None)


LEDGER = GraphLedger()
FIRST_FRAME = "first frame"      # the mark a live run records when its capture stage takes its first frame


def resolve_device(name: str | torch.device) -> torch.device:
    """"auto" -> cuda when a GPU is there, else cpu; "cuda" without a GPU is a ConfigError."""
    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} was asked for, but no CUDA GPU is available (use --device auto or cpu)")
    return torch.device(name)


CU_CTX_SCHED_MASK, CU_CTX_SCHED_BLOCKING_SYNC = 0x07, 0x04


def set_cuda_wait(mode: str, device: torch.device) -> bool:
    """How this process's threads wait for the GPU (runtime.cuda_wait), set on every visible GPU's
    primary context before the first CUDA call uses it. "block": a waiting thread sleeps on a
    sync primitive until the GPU is done. "auto" (CUDA's default) spins the thread on its core
    while the process has fewer CUDA contexts than the host has CPUs: with several processes on
    one GPU (batch --processes), each spinning VLM and stage thread takes a core from the decoders.
    -> whether blocking waits are set. A driver that refuses is one warning, not an error."""
    if mode == "auto" or device.type != "cuda":
        return False
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        warnings.warn(f"runtime.cuda_wait={mode}: the CUDA driver library was not found ({e}); "
                      "threads wait for the GPU as CUDA chooses", RuntimeWarning, stacklevel=2)
        return False
    count, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    failed = cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(count))
    for ordinal in range(count.value if not failed else 0):
        dev = ctypes.c_int()
        failed = (cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
                  or cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)))
        if not failed and flags.value & CU_CTX_SCHED_MASK != CU_CTX_SCHED_BLOCKING_SYNC:
            failed = cuda.cuDevicePrimaryCtxSetFlags_v2(
                dev, (flags.value & ~CU_CTX_SCHED_MASK) | CU_CTX_SCHED_BLOCKING_SYNC)
        if failed:
            break
    if failed:
        warnings.warn(f"runtime.cuda_wait={mode}: the CUDA driver refused it (error {failed}); threads "
                      "wait for the GPU as CUDA chooses", RuntimeWarning, stacklevel=2)
        return False
    return True


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list, an array, a CPU tensor) -> a device tensor, queued like a kernel: from
    page-locked memory the copy does not wait for the GPU, where a copy from pageable memory waits
    for all the work queued before it (a sync the VLM thread would pay once per question)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda" or host.device.type != "cpu" or host.is_pinned():
        return host.to(device, non_blocking=True)
    with CAPTURE_LOCK.shared():  # a page-locked allocation: not while another thread captures
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_uint8(shape: tuple[int, ...], pin: bool) -> torch.Tensor:
    """An empty uint8 host tensor, page-locked when `pin` (not while another thread captures)."""
    with CAPTURE_LOCK.shared() if pin else nullcontext():
        return torch.empty(shape, dtype=torch.uint8, pin_memory=pin)


def stack_host(arrays: Sequence[np.ndarray], pin: bool) -> torch.Tensor:
    """Same-shaped uint8 arrays -> one (n, ...) uint8 host tensor, written straight into pinned
    memory when `pin` (no second copy into page-locked memory before an upload)."""
    out = host_uint8((len(arrays), *arrays[0].shape), pin)
    np.stack(arrays, out=out.numpy())
    return out


def stack_device(tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Same-shaped device tensors (frames the GPU decoded) -> one (n, ...) tensor on their device,
    stacked on `stream` (None: the current one). Each input is marked as used there, so that the
    caching allocator does not hand its memory to another stream before the copy ran. CPU tensors
    are stacked as they are."""
    if not tensors[0].is_cuda:
        return torch.stack(list(tensors))
    stream = torch.cuda.current_stream(tensors[0].device) if stream is None else stream
    with torch.cuda.stream(stream):
        for t in tensors:
            t.record_stream(stream)
        return torch.stack(list(tensors))


def window_frames(arrays: Sequence[np.ndarray | torch.Tensor], pin: bool) -> np.ndarray | torch.Tensor:
    """An answer window's (T, H, W, 3) frames for an AnswerRequest: stacked straight into pinned
    memory when `pin` (see pins_frames), else a numpy array. Frames the GPU decoded stay there for
    an in-process VLM on a GPU (`pin`), and come to the host for any other."""
    if isinstance(arrays[0], torch.Tensor):
        stacked = stack_device(arrays)
        return stacked if pin and stacked.is_cuda else stacked.cpu().numpy()
    return stack_host(arrays, True) if pin else np.stack(arrays)


def pins_frames(vlm: Any) -> bool:
    """Whether answer windows go to `vlm` in page-locked memory: an in-process VLM on a GPU then
    uploads a window without first copying it into page-locked memory itself (to_device). A VLM
    in a process of its own (vlm/remote.py) has no device here and gets pageable arrays, pickled."""
    device = getattr(vlm, "device", None)
    return isinstance(device, torch.device) and device.type == "cuda"


def device_of(values) -> torch.device:
    """Where values are: a tensor's device; anything else (numpy, lists) is on the host."""
    return values.device if isinstance(values, torch.Tensor) else torch.device("cpu")


def upload(arrays: list, device: torch.device) -> list[torch.Tensor]:
    """Integer host arrays -> int64 device tensors (views of one buffer) with one queued copy."""
    flat = np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays]) if arrays else np.zeros(0, np.int64)
    return list(to_device(flat, device).split([int(np.size(a)) for a in arrays]))


def read_back(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Tensors of one dtype -> host numpy copies; those on a device read back together: one host
    read (one sync on a GPU, waiting for the work queued before it) however many there are, none
    when all are on the host already."""
    on_device = [t for t in tensors if t.device.type != "cpu"]
    read: list[np.ndarray] = []
    if on_device:
        flat = torch.cat([t.reshape(-1) for t in on_device]).cpu().numpy()
        cuts = np.cumsum([t.numel() for t in on_device])[:-1]
        read = [part.reshape(t.shape) for part, t in zip(np.split(flat, cuts), on_device)]
    device_parts = iter(read)
    return [next(device_parts) if t.device.type != "cpu" else t.numpy().copy() for t in tensors]


def capture(fn: Callable[[], Any], stream: torch.cuda.Stream, pool: Any = None,
            warmup: int = 2, label: str = "graph") -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run fn() `warmup` times on `stream` (kernels get chosen and workspaces allocated before
    capture), then capture it there -> (graph, fn's outputs: the buffers each replay overwrites).
    The stream first waits for the current stream's work, and the current stream for the capture.
    thread_local: other threads (the stages, the VLM) keep launching work on their own streams
    while this one captures; CAPTURE_LOCK: but none allocates page-locked memory meanwhile.
    Python's cyclic collector is off during the capture: run in this thread, it could free a
    graph held in a reference cycle, and destroying a graph is not permitted while capturing.
    label: what and which shape, for LEDGER (with the time the capture took)."""
    started = time.perf_counter()
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK, no_cyclic_gc(), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                            capture_error_mode="thread_local"):
            outputs = fn()
    current.wait_stream(stream)
    LEDGER.record("capture", label, time.perf_counter() - started)
    return graph, outputs


@contextmanager
def no_cyclic_gc():
    """Python's automatic cyclic garbage collection off inside (process-wide; callers hold
    CAPTURE_LOCK, so no two captures toggle it at once), back on after if it was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
