"""pipeline/core/mps.py against a fake nvidia-cuda-mps-control (tests/pipeline/conftest.py): a
private daemon is started, handed to the block and gone afterwards however the block ends; a
running one is reused and left alone; every way it can fail is one ConfigError line."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from arr_coc._validate import ConfigError
from pipeline.core import mps

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))           # benchmarks/


def gone(pid_file: Path, pid: int) -> bool:
    return not pid_file.exists() and not mps._alive(pid)


def test_a_private_daemon_serves_the_block_and_quits_after(fake_mps):
    fake = fake_mps()
    with mps.mps_daemon() as daemon:
        assert daemon.state == "started"
        pipe, log = Path(daemon.env[mps.PIPE_ENV]), Path(daemon.env[mps.LOG_ENV])
        assert (pipe / "control").exists() and log.is_dir() and pipe.parent == log.parent
        assert fake.start_env() == daemon.env                       # the daemon was started in these
        pid = int((pipe / mps.PID_FILE).read_text())
        assert mps._alive(pid) and fake.commands() == []
    assert fake.commands() == ["quit"]
    assert not mps._alive(pid) and not pipe.parent.exists()


@pytest.mark.parametrize("error", [RuntimeError("the batch failed"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_the_daemon_quits_when_the_block_fails(fake_mps, error):
    fake = fake_mps()
    with pytest.raises(type(error)):
        with mps.mps_daemon() as daemon:
            root = Path(daemon.env[mps.PIPE_ENV]).parent
            pid = int((root / "pipe" / mps.PID_FILE).read_text())
            raise error
    assert fake.commands() == ["quit"] and not mps._alive(pid) and not root.exists()


def test_a_daemon_that_does_not_quit_is_killed(fake_mps, monkeypatch):
    fake = fake_mps(quits=False)
    monkeypatch.setattr(mps, "QUIT_S", 0.2)
    with mps.mps_daemon() as daemon:
        root = Path(daemon.env[mps.PIPE_ENV]).parent
        pid = int((root / "pipe" / mps.PID_FILE).read_text())
    assert fake.commands() == ["quit"] and not mps._alive(pid) and not root.exists()


def test_a_running_daemon_is_reused_and_left_running(fake_mps, tmp_path, monkeypatch):
    fake = fake_mps()
    pipe = tmp_path / "theirs"
    pipe.mkdir()
    os.mkfifo(pipe / "control")
    monkeypatch.setenv(mps.PIPE_ENV, str(pipe))
    with mps.mps_daemon() as daemon:
        assert (daemon.state, daemon.env) == ("existing", {mps.PIPE_ENV: str(pipe)})
    assert (pipe / "control").exists() and fake.commands() == [] and not (fake.record / "start.env").exists()


def test_a_crashed_daemons_leftover_pipe_is_not_a_daemon(fake_mps, tmp_path, monkeypatch):
    """A control pipe whose pid file names a process that has ended: a private daemon is started."""
    fake = fake_mps()
    pipe = tmp_path / "crashed"
    pipe.mkdir()
    os.mkfifo(pipe / "control")
    gone = subprocess.Popen(["true"])
    gone.wait()
    (pipe / mps.PID_FILE).write_text(f"{gone.pid}\n")
    monkeypatch.setenv(mps.PIPE_ENV, str(pipe))
    with mps.mps_daemon() as daemon:
        assert daemon.state == "started" and daemon.env[mps.PIPE_ENV] != str(pipe)
    assert fake.commands() == ["quit"]
    (pipe / mps.PID_FILE).write_text(f"{os.getpid()}\n")                  # a live pid: that daemon is used
    with mps.mps_daemon() as daemon:
        assert daemon.state == "existing"


def test_the_default_daemon_is_reused_over_a_stale_variable(fake_mps, tmp_path, monkeypatch):
    """CUDA_MPS_PIPE_DIRECTORY names no daemon, /tmp/nvidia-mps has one: the processes are sent there."""
    fake = fake_mps()
    default = tmp_path / "nvidia-mps"
    default.mkdir()
    os.mkfifo(default / "control")
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(default))
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path / "stale"))
    with mps.mps_daemon() as daemon:
        assert (daemon.state, daemon.env) == ("existing", {mps.PIPE_ENV: str(default)})
    assert fake.commands() == []


def test_no_binary_is_one_clear_line(tmp_path, monkeypatch, own_tempdir):
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="--mps needs NVIDIA's nvidia-cuda-mps-control on PATH "
                                          r"\(it ships with the driver\)") as e:
        with mps.mps_daemon():
            pytest.fail("no daemon to run under")
    assert "\n" not in str(e.value)
    assert list(own_tempdir.glob("arrcoc-mps-*")) == []             # no pipe directory left behind


def test_a_daemon_that_fails_to_start_names_its_log_line(fake_mps, own_tempdir):
    fake = fake_mps(fails=True)
    with pytest.raises(ConfigError) as e:
        with mps.mps_daemon():
            pytest.fail("no daemon to run under")
    assert str(e.value) == ("--mps: nvidia-cuda-mps-control -d exited with code 1: control.log: "
                            "[fake] cannot open the GPU: operation not permitted")
    assert list(own_tempdir.glob("arrcoc-mps-*")) == []             # no pipe directory left behind
    assert fake.commands() == ["quit"]                                # told to quit all the same


def test_a_daemon_without_a_control_pipe_is_an_error_and_is_stopped(fake_mps, monkeypatch):
    fake = fake_mps(control=False, quits=False)
    monkeypatch.setattr(mps, "START_S", 0.3)
    monkeypatch.setattr(mps, "QUIT_S", 0.2)
    pids = []
    real_stop = mps._stop

    def stop(binary, env):
        pids.append(int((Path(env[mps.PIPE_ENV]) / mps.PID_FILE).read_text()))
        real_stop(binary, env)
    monkeypatch.setattr(mps, "_stop", stop)
    with pytest.raises(ConfigError, match=r"^--mps: nvidia-cuda-mps-control -d gave no control pipe within 0.3 s: "
                                          r"control.log: \[fake\] control daemon starting$"):
        with mps.mps_daemon():
            pytest.fail("no daemon to run under")
    assert len(pids) == 1 and not mps._alive(pids[0]) and fake.commands() == ["quit"]


def test_a_long_tmpdir_moves_the_pipes_to_tmp(fake_mps, tmp_path, monkeypatch):
    fake_mps()
    long = tmp_path / ("d" * 80)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    with mps.mps_daemon() as daemon:
        pipe = daemon.env[mps.PIPE_ENV]
        assert pipe.startswith("/tmp/arrcoc-mps-") and len(pipe) <= mps.MAX_DIR + len("/pipe")
    assert not list(long.iterdir())


def test_exported_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("ARRCOC_TEST_KEPT", "before")
    monkeypatch.delenv("ARRCOC_TEST_NEW", raising=False)
    with mps.exported({"ARRCOC_TEST_KEPT": "during", "ARRCOC_TEST_NEW": "during"}):
        assert os.environ["ARRCOC_TEST_KEPT"] == os.environ["ARRCOC_TEST_NEW"] == "during"
    assert os.environ["ARRCOC_TEST_KEPT"] == "before" and "ARRCOC_TEST_NEW" not in os.environ


def test_mps_clients_exports_the_daemon_only_when_asked(fake_mps):
    fake = fake_mps()
    with mps.mps_clients(False) as none:
        assert none is None and mps.PIPE_ENV not in os.environ
    assert not (fake.record / "start.env").exists()
    with mps.mps_clients(True) as daemon:
        assert {k: os.environ[k] for k in daemon.env} == daemon.env
    assert mps.PIPE_ENV not in os.environ and mps.LOG_ENV not in os.environ and fake.commands() == ["quit"]


@pytest.mark.parametrize("device, gpus, message", [
    ("cpu", 1, "--mps shares one CUDA GPU between processes; runtime.device is cpu (use --device cuda, or drop --mps)"),
    ("auto", 0, "--mps shares one CUDA GPU between processes; runtime.device auto has no CUDA GPU here (drop --mps)"),
    ("cuda", 0, "--mps shares one CUDA GPU between processes; runtime.device cuda has no CUDA GPU here (drop --mps)"),
    ("auto", 1, None), ("cuda:0", 1, None),
])
def test_check_cuda(monkeypatch, device, gpus, message):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if message is None:
        mps.check_cuda(device)
    else:
        with pytest.raises(ConfigError) as e:
            mps.check_cuda(device)
        assert str(e.value) == message


@pytest.mark.parametrize("asked", [True, False], ids=["mps", "time-sliced"])
def test_bench_batch_runs_its_processes_under_the_same_daemon(fake_mps, monkeypatch, tmp_path, asked):
    """bench_batch --mps: its side-by-side processes start under mps_clients (the code batch --mps
    runs), and each run records whether a daemon was started."""
    from benchmarks import bench_batch
    from pipeline.runners.batch import BatchSummary

    fake = fake_mps()
    seen = []

    def local_processes(plan, out, cfg, **kw):
        seen.append(os.environ.get(mps.PIPE_ENV))
        return BatchSummary(out, 0, 0, 1.0, [])
    monkeypatch.setattr(bench_batch, "local_processes", local_processes)
    row = bench_batch.one_run([], None, path="local", workers=2, stock=True, factory=None, scratch=tmp_path,
                              in_flight=1, mps=asked)
    if asked:
        assert row["mps"] == "started" and seen == [fake.start_env()[mps.PIPE_ENV]]
        assert fake.commands() == ["quit"]
    else:
        assert row["mps"] is None and seen == [None] and not (fake.record / "start.env").exists()
    assert mps.PIPE_ENV not in os.environ
