"""Shared by the pipeline tests: a fake NVIDIA MPS control binary for the tests of `--mps`
(pipeline/core/mps.py), on CPU; VLMs that generate nothing (silent_vlms); a temporary directory of a
test's own (own_tempdir)."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.core import mps

FAKE_MPS = """#!/bin/sh
# nvidia-cuda-mps-control as the tests see it: -d records its environment, starts a "daemon" (a
# sleep) and makes the control pipe and the pid file; `quit` on stdin stops it and records that.
if [ "$1" = "-d" ]; then
    env | grep '^CUDA_MPS_' | sort > "{record}/start.env"
    echo "[fake] control daemon starting" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
    {on_start}
    sleep 300 </dev/null >/dev/null 2>&1 &
    echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    {make_control}
    exit 0
fi
read command
echo "$command" >> "{record}/commands"
if [ "$command" = "quit" ] && [ "{quits}" = "yes" ]; then
    kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
    rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
fi
"""


@dataclass
class FakeMPS:
    record: Path                         # start.env (the -d run's CUDA_MPS_* variables), commands (stdin lines)

    def start_env(self) -> dict[str, str]:
        text = (self.record / "start.env").read_text()
        return dict(line.split("=", 1) for line in text.splitlines())

    def commands(self) -> list[str]:
        path = self.record / "commands"
        return path.read_text().split() if path.exists() else []


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """fake_mps(fails=False, control=True, quits=True) -> FakeMPS: the only nvidia-cuda-mps-control
    on PATH; no MPS daemon counts as running (CUDA_MPS_PIPE_DIRECTORY unset, the default pipe
    directory moved to an empty place). fails: -d logs a line and exits 1; control: -d makes the
    control pipe; quits: `quit` stops the daemon."""
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.delenv(mps.LOG_ENV, raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-default-mps"))

    def make(fails: bool = False, control: bool = True, quits: bool = True) -> FakeMPS:
        bin_dir, record = tmp_path / "fake-bin", tmp_path / "fake-record"
        bin_dir.mkdir()
        record.mkdir()
        on_start = ('echo "[fake] cannot open the GPU: operation not permitted" >> '
                    '"$CUDA_MPS_LOG_DIRECTORY/control.log"'
                    "; exit 1") if fails else ":"
        script = bin_dir / mps.BINARY
        script.write_text(FAKE_MPS.format(record=record, on_start=on_start, quits="yes" if quits else "no",
                                          make_control='mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"' if control else ":"))
        script.chmod(0o755)
        monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))
        return FakeMPS(record)
    return make


@pytest.fixture
def own_tempdir(monkeypatch):
    """A short, empty directory of this test's own as tempfile's directory and TMPDIR (so also its
    subprocesses'): what the test finds there afterwards (a shared VLM's socket directory, MPS pipes
    left behind) is its own doing, whatever other tests run alongside (`pytest -n`)."""
    path = tempfile.mkdtemp(prefix="t", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", path)
    monkeypatch.setenv("TMPDIR", path)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def silent_vlms():
    """`with silent_vlms():` every VLM loaded inside generates nothing (what the shipped model did
    on real footage): the answers' other fields are the VLM's own."""
    import contextlib
    import dataclasses

    import pipeline.vlm.loading as loading

    def silent(load):
        def load_silent(*args, **kwargs):
            vlm = load(*args, **kwargs)
            answer = vlm.answer
            vlm.answer = lambda requests, *a, **k: [dataclasses.replace(r, text="") for r in answer(requests, *a, **k)]
            return vlm
        return load_silent

    @contextlib.contextmanager
    def silenced():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loading, "load_vlm", silent(loading.load_vlm))   # load_answerer's
            yield
    return silenced
