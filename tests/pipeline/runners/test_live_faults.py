"""`live` under the faults of issue 41: an answer period that means nothing (`--every 1e-20`, NaN,
infinity, shorter than a frame), --duration with a tiny valid period, and what `complete` says
of a file cut short by --duration and of a stream with an outage (the stream attrs `stopped_by`
and `outage_s`). The reconnect backoff under a flapping server is in tests/sources/test_live_source.py."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from pipeline.commands.cli import main
from pipeline.config import PipelineConfig, RuntimeConfig
from pipeline.core.live_stages import LiveOptions
from pipeline.runners.live import run_live
from sinks import read_stream, validate_store
from sources import StreamInterruptedWarning
from sources.live import LiveConfig, parse_source
from sources.synthetic import Shot, render_clip, write_video

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import http_ts_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
UNTRAINED = ["--set", "runtime.model_weights=none"]   # the live plumbing, not trained relevance


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """10 s at 25 fps: longer than every --duration below."""
    d = tmp_path_factory.mktemp("faults")
    return write_video(d / "ten.mp4", render_clip([Shot("moving_object", 250, speed=1.0)], height=96, width=128,
                                                    seed=7).frames, fps=25)


def start_live(clip: Path, out: Path, *args: str) -> subprocess.Popen:
    """`python -m pipeline live CLIP --realtime` with the tiny VLM on the CPU, in a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "pipeline", "live", str(clip), "--realtime", "--query", "q",
                             "--vlm", "tiny-random", "--device", "cpu", "--out", str(out), *UNTRAINED, *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def ended_within(proc: subprocess.Popen, seconds: float, what: str) -> str:
    """The process's stderr once it ended; the test fails (the process killed) if it runs longer."""
    try:
        return proc.communicate(timeout=seconds)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{what} was still running after {seconds} s")


def live_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["live", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def summary(err: str) -> dict:
    return json.loads(next(line for line in err.splitlines() if line.startswith('{"summary"')))["summary"]


class TestAnswerPeriod:
    def test_a_tiny_every_is_refused_at_once_by_a_real_process(self, tmp_path, clip):
        """It used to run on (655 s here) at 100 % CPU, deaf to --duration and to SIGTERM."""
        out = tmp_path / "o.zarr"
        started = time.monotonic()
        proc = start_live(clip, out, "--every", "1e-20", "--duration", "8")
        err = ended_within(proc, 90, "`live --every 1e-20 --duration 8`")
        assert proc.returncode == 2, err
        assert err.strip().splitlines() == ["error: --every=1e-20 s is out of range: an answer period is at least "
                                            "0.001 s (one frame at 1000 fps) and at most 86400 s (a day)"]
        assert time.monotonic() - started < 60 and not out.exists()

    @pytest.mark.parametrize("every, message", [
        ("nan", "--every must be a finite number of seconds, got nan"),
        ("inf", "--every must be a finite number of seconds, got inf"),
        ("1e308", "--every=1e+308 s is out of range"),
        ("0", "--every=0.0 s is out of range"),
    ])
    @pytest.mark.parametrize("command", ["live", "run"])
    def test_periods_that_mean_nothing_are_one_line(self, capsys, tmp_path, clip, every, message, command):
        extra = ["--realtime"] if command == "live" else []
        code = main([command, str(clip), *extra, "--query", "q", "--every", every, "--out", str(tmp_path / "o.zarr")])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: {message}"), err
        assert not (tmp_path / "o.zarr").exists()

    def test_a_period_shorter_than_a_frame_names_the_source(self, capsys, tmp_path, clip):
        code, _, err = live_cli(capsys, str(clip), "--realtime", "--query", "q", "--every", "0.01", "--vlm",
                                "tiny-random", "--device", "cpu", "--out", str(tmp_path / "o.zarr"), *UNTRAINED)
        assert code == 2, err
        assert err.strip() == (f"error: {clip}: --every=0.01 s is out of range: an answer period is at least 0.04 s "
                               f"(one frame at 25 fps) and at most 86400 s (a day)")
        assert not (tmp_path / "o.zarr").exists()

    def test_one_frame_periods_stop_at_the_duration(self, capsys, tmp_path, clip):
        """The shortest valid period (one frame) answers as often as the VLM can and stops at
        --duration; the file it cut short is not complete (stopped_by: duration)."""
        store = tmp_path / "o.zarr"
        started = time.monotonic()
        code, out, err = live_cli(capsys, str(clip), "--realtime", "--query", "q", "--every", "0.04", "--duration", "3",
                                  "--vlm", "tiny-random", "--device", "cpu", "--out", str(store), *UNTRAINED)
        assert code == 0, err
        assert summary(err)["wall_s"] < 3 + 5 and time.monotonic() - started < 120
        assert len(out.splitlines()) >= 1                            # answers, as JSON lines
        data = read_stream(store, "ten")
        assert validate_store(store) == [] and 0 < data["pts"][-1] < 5
        assert data["attrs"]["complete"] is False and data["attrs"]["stopped_by"] == "duration"
        assert summary(err)["complete"] is False and summary(err)["streams"]["ten"]["stopped_by"] == "duration"


def cfg() -> PipelineConfig:
    return PipelineConfig(runtime=RuntimeConfig(device="cpu", batch_size=4, model_weights="none"))


class TestComplete:
    """`complete` of a live stream: the store holds all of it. A file: played to its last frame. A
    camera or network stream (no last frame): ran until the run was ended as asked, here by
    --duration. Never with an outage in it; `stopped_by` and `outage_s` say what happened."""

    def test_a_file_played_to_its_end_is_complete(self, tmp_path):
        short = write_video(tmp_path / "short.mp4", render_clip([Shot("pan", 25, speed=1.0)], height=96, width=128,
                                                                 seed=2).frames, fps=25)
        result = run_live([str(short)], "q", tmp_path / "o.zarr", cfg(), live=LiveConfig(realtime=True),
                          options=LiveOptions(duration_s=30), status_out=io.StringIO())
        attrs = read_stream(tmp_path / "o.zarr", "short")["attrs"]
        assert result.complete and attrs["complete"] is True
        assert attrs["stopped_by"] == "end" and attrs["outage_s"] == 0

    def test_a_stream_up_until_the_duration_is_complete(self, tmp_path):
        with http_ts_server(tmp_path) as server:
            result = run_live([server.url()], "q", tmp_path / "o.zarr", cfg(), live=LiveConfig(read_timeout_s=2.0),
                              options=LiveOptions(duration_s=2.0), status_out=io.StringIO())
        attrs = read_stream(tmp_path / "o.zarr", result.stream_ids[0])["attrs"]
        assert result.complete and attrs["complete"] is True and attrs["stopped_by"] == "duration"
        assert attrs.get("gap_count", 0) == 0 and attrs["outage_s"] == 0

    def test_a_stream_down_for_most_of_its_run_is_not_complete(self, tmp_path):
        """The server goes away once the first frames are stored, in a 5 s run: the gap is stored and
        `complete` is false (it was true with a stream down 31 of its 40 s)."""
        fast = LiveConfig(open_timeout_s=1.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.2)

        def close_after_frames(graph) -> None:
            sink = graph.stages[-1]

            def watch():
                deadline = time.monotonic() + 30
                while sink.frames_written == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
                server.close()
            threading.Thread(target=watch, daemon=True).start()
        with http_ts_server(tmp_path) as server, warnings.catch_warnings():
            warnings.simplefilter("ignore", StreamInterruptedWarning)
            result = run_live([server.url()], "q", tmp_path / "o.zarr", cfg(), live=fast, on_graph=close_after_frames,
                              options=LiveOptions(duration_s=5.0), status_out=io.StringIO())
        data = read_stream(tmp_path / "o.zarr", result.stream_ids[0])
        attrs = data["attrs"]
        assert validate_store(tmp_path / "o.zarr") == [] and len(data["pts"]) > 0
        assert not result.complete and attrs["complete"] is False
        assert attrs["stopped_by"] == "duration" and attrs["gap_count"] == 1
        gap = data["gaps"]
        # the server closed at the first stored frames, the run lasted 5 s
        assert attrs["outage_s"] == pytest.approx(gap["end_wall"][0] - gap["start_wall"][0], abs=0.01)
        assert attrs["outage_s"] >= 2.5, attrs["outage_s"]

    def test_a_source_that_gave_up_says_so(self, tmp_path, capsys):
        """--max-reconnects through the CLI: the source gives up, exit 1 with one error line,
        stopped_by: gave_up."""
        from live_servers import FlappingServer

        with FlappingServer(tmp_path) as server:
            code, _, err = live_cli(capsys, server.url(), "--query", "q", "--max-reconnects", "3", "--duration", "30",
                                    "--timeout", "1", "--device", "cpu", "--out", str(tmp_path / "o.zarr"), *UNTRAINED)
            gets = len(server.gets)
        assert code == 1, err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "gave up after 3 failed reconnect attempts (--max-reconnects 3)" in errors[0]
        assert gets == 4 and summary(err)["wall_s"] < 20
        attrs = read_stream(tmp_path / "o.zarr", parse_source(server.url()).stream_id)["attrs"]
        assert attrs["complete"] is False and attrs["stopped_by"] == "gave_up"


def test_sigterm_still_ends_a_one_frame_period_run(tmp_path, clip):
    """--every at one frame and no --duration: SIGTERM ends it, exit 130, a valid store."""
    out = tmp_path / "o.zarr"
    proc = start_live(clip, out, "--every", "0.04")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()            # the first answer: the VLM stage is answering
        if line.startswith("{"):
            break
    proc.send_signal(signal.SIGTERM)
    err = ended_within(proc, 60, "the run after SIGTERM")
    assert proc.returncode == 130, err
    assert validate_store(out) == [] and read_stream(out, "ten")["attrs"]["stopped_by"] == "interrupt"
