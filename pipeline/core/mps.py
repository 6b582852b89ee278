"""NVIDIA MPS for processes that share one GPU (`batch --processes N --mps`, bench_batch --mps).

Each CUDA process has its own context, and the GPU time-slices between contexts: the kernels of
N shard processes never run at once. Under an MPS control daemon the processes' work goes through
one MPS server and one context, so their kernels overlap (the gain: docs/performance.md).

`mps_daemon()` reuses a daemon that is already running (CUDA_MPS_PIPE_DIRECTORY's control pipe,
else the default /tmp/nvidia-mps/control) and starts nothing; else it starts a private one
(`nvidia-cuda-mps-control -d`) in a fresh temporary directory and, on the way out (also on an
error or Ctrl-C), tells it to quit, kills it if it does not, and removes the directory. It yields
the variables the GPU processes must inherit; `exported` puts them in os.environ for processes
spawned through multiprocessing. The process that starts the daemon must not initialise CUDA
under those variables: the driver connects a process to the daemon when it first initialises
CUDA, and a daemon told to quit waits for its clients.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from arr_coc._validate import ConfigError
from pipeline.runtime.sockets import short_tempdir

BINARY = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"     # where the driver looks without CUDA_MPS_PIPE_DIRECTORY
PID_FILE = "nvidia-cuda-mps-control.pid"
MAX_DIR = 60                             # the daemon's Unix sockets live in pipe/ (sun_path is 108 bytes)
START_S = 5.0                            # for the control pipe to appear
QUIT_S = 10.0                            # for `quit` to be taken, then again for the daemon to exit


@dataclass(frozen=True)
class MPS:
    """A running MPS control daemon: the variables its clients need and whether we started it."""
    env: dict[str, str]
    state: str                           # "started" (ours, quit on exit) or "existing" (left running)


@contextmanager
def mps_daemon() -> Iterator[MPS]:
    """An MPS control daemon for the processes started inside: the running one, else a private one
    that is gone again (daemon and directory) when the block ends, however it ends."""
    existing = running_pipe_dir()
    if existing is not None:
        yield MPS({PIPE_ENV: existing}, "existing")
        return
    binary = shutil.which(BINARY)
    if binary is None:
        raise ConfigError(f"--mps needs NVIDIA's {BINARY} on PATH (it ships with the driver); none was found, "
                          f"so run without --mps or install the driver's utilities")
    root = short_tempdir("arrcoc-mps-", MAX_DIR)
    env = {PIPE_ENV: str(root / "pipe"), LOG_ENV: str(root / "log")}
    for d in env.values():
        os.mkdir(d)
    try:
        _start(binary, env, root)
        yield MPS(env, "started")
    finally:
        with _uninterrupted():                             # a second Ctrl-C must not leave the daemon
            _stop(binary, env)
            shutil.rmtree(root, ignore_errors=True)


def running_pipe_dir() -> str | None:
    """The pipe directory of an MPS daemon already running for this environment, or None: its
    control pipe exists, and the daemon its pid file names (where it has one) is alive; a crashed
    daemon's leftover pipe does not count."""
    named = os.environ.get(PIPE_ENV)
    for d in ([named] if named else []) + [DEFAULT_PIPE_DIR]:
        if os.path.exists(os.path.join(d, "control")):
            pid = _pid(Path(d) / PID_FILE)
            if pid is None or _alive(pid):
                return d
    return None


@contextmanager
def exported(env: Mapping[str, str]) -> Iterator[None]:
    """`env` in os.environ while the block runs (processes spawned meanwhile inherit it), then
    os.environ as it was."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """SIGINT and SIGTERM ignored while the block runs (in the main thread; elsewhere they do not
    interrupt anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)   # None: not set from Python


def _start(binary: str, env: dict[str, str], root: Path) -> None:
    """`BINARY -d` with env; ConfigError (naming the daemon's last log line) if it fails or its
    control pipe does not appear within START_S."""
    control = Path(env[PIPE_ENV]) / "control"
    with open(root / "start.out", "wb") as out:         # a file, not a pipe the daemon could keep open
        try:
            code = subprocess.run([binary, "-d"], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=START_S,
                                  start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            code = None
    deadline = time.monotonic() + START_S
    while code == 0 and not control.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if code == 0 and control.exists():
        return
    what = (f"exited with code {code}" if code not in (0, None) else
            f"gave no control pipe within {START_S:g} s")
    raise ConfigError(f"--mps: {BINARY} -d {what}: {_last_line(root)}")


def _last_line(root: Path) -> str:
    """The daemon's own last log line (log/control.log), else its start output's; what to show."""
    for path in (root / "log" / "control.log", root / "start.out"):
        try:
            lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            continue
        if lines:
            return f"{path.name}: {lines[-1]}"
    return "it logged nothing"


def _stop(binary: str, env: dict[str, str]) -> None:
    """`quit` through the control pipe; a daemon still alive QUIT_S later is killed."""
    pid = _pid(Path(env[PIPE_ENV]) / PID_FILE)
    try:
        subprocess.run([binary], input=b"quit\n", env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=QUIT_S)
    except (subprocess.TimeoutExpired, OSError):
        pass
    if pid is None:
        return
    deadline = time.monotonic() + QUIT_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        if not _alive(pid):
            return
        try:
            os.kill(pid, sig)
        except OSError:
            return
        deadline = time.monotonic() + wait_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether process pid runs (a zombie, ended but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@contextmanager
def mps_clients(enabled: bool) -> Iterator[MPS | None]:
    """With `enabled`, mps_daemon() with its variables exported while the block runs: processes
    started inside (subprocess with os.environ, multiprocessing's spawn) are its clients. Without,
    None and nothing done."""
    if not enabled:
        yield None
        return
    with mps_daemon() as mps, exported(mps.env):
        yield mps


def check_cuda(device: str) -> None:
    """ConfigError unless runtime.device `device` resolves to a CUDA GPU (as resolve_device does:
    "auto" with a GPU, "cuda[:i]"). The GPUs are counted through NVML where it answers
    (torch.cuda.device_count), so this process does not initialise CUDA itself."""
    import torch

    device = str(device)
    if not (device == "auto" or device.startswith("cuda")):
        raise ConfigError(f"--mps shares one CUDA GPU between processes; runtime.device is {device} "
                          f"(use --device cuda, or drop --mps)")
    if torch.cuda.device_count() == 0:
        raise ConfigError(f"--mps shares one CUDA GPU between processes; runtime.device {device} has no CUDA GPU "
                          f"here (drop --mps)")
