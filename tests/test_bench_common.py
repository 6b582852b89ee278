"""benchmarks/common.py (the host description results record, where results go without --out) and
bench_live's own helpers."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import host_topology  # noqa: E402


def test_host_topology_names_cpus_and_numa_nodes():
    info = host_topology()
    assert info["cpus"] == os.cpu_count() and info["cpu"]
    if Path("/sys/devices/system/node/node0/cpulist").exists():              # Linux
        cpus = set()
        for text in info["numa_nodes"].values():                             # e.g. "0-15,32-47"
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                cpus |= set(range(int(lo), int(hi or lo) + 1))
        assert len(cpus) >= 1 and "node0" in info["numa_nodes"]
    assert all(isinstance(line, str) for line in info.get("nvidia_smi_topo", []))


ROOT = Path(__file__).resolve().parents[1]


def test_results_without_out_land_outside_the_repository():
    from benchmarks.common import scratch_result

    path = scratch_result("bench_x_cpu.json").resolve()
    assert path.name == "bench_x_cpu.json" and ROOT not in path.parents


def test_no_benchmark_defaults_to_the_committed_results():
    # the committed results change only when --out (or bench_serve's --save) names them
    import re

    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        text = script.read_text()
        for line in text.splitlines():
            if re.search(r'["\']results["\']\s*/|/ *"results" */|results/bench_', line) and "help=" not in line \
                    and not line.lstrip().startswith(("#", "python")) and 'add_argument("--save"' not in text:
                raise AssertionError(f"{script.name} builds a path into benchmarks/results by default: {line.strip()}")


def test_bench_live_refuses_a_soak_too_short_to_sample(capsys):
    from benchmarks import bench_live as bench
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--soak", "1"])
    assert e.value.code == 2 and "at least 2 seconds" in capsys.readouterr().err



def test_profile_batch_quick_times_every_phase(tmp_path):
    """profile_batch's CPU smoke run: its phase timers wrap functions that exist (a renamed one
    failed it at start-up on the GPU box), `vlm_vision` counts the kept encoder's tower too, and
    the question vector needs no MiniLM."""
    import json
    import subprocess
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "benchmarks/profile_batch.py", "--quick", "--settings", "vlm.encode=kept",
                    "--json", str(out)], cwd=root, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == ["stock", "arrcoc"]
    for row in rows:
        phases = row["phases_s_per_video"]
        assert {"open_video", "vlm_vision", "vlm_generate", "graph_run"} <= set(phases)
        assert phases["vlm_vision"] > 0 and phases["open_video"] > 0


def test_profile_answer_windows_quick_times_every_phase(tmp_path):
    """profile_answer_windows' CPU smoke run: its phase timers wrap VLM methods that exist, and
    both token settings are timed at each batch size."""
    import json
    import subprocess
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "aw.json"
    subprocess.run([sys.executable, "benchmarks/profile_answer_windows.py", "--quick", "--videos", "1", "2",
                    "--repeats", "1", "--json", str(out)], cwd=root, check=True, capture_output=True, timeout=300)
    calls = json.loads(out.read_text())["calls"]
    assert [(c["tokens"], c["videos"]) for c in calls] == [("arrcoc", 1), ("arrcoc", 2), ("stock", 1), ("stock", 2)]
    for c in calls:
        assert set(c["phases_ms"]) == {"vision", "window_prefix", "question_prefixes", "generate"}
        assert c["call_ms"] > 0 and all(v > 0 for v in c["phases_ms"].values())
    assert calls[0]["tokens_kept"] < calls[2]["tokens_kept"]                 # the keep map drops tokens


def test_profile_lm_step_quick_times_a_decode_step(tmp_path):
    """profile_lm_step's CPU smoke run: a started decoder of the VLM steps, and the row is written."""
    import json
    import subprocess
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, "benchmarks/profile_lm_step.py", "--quick", "--json", str(out)],
                   cwd=root, check=True, capture_output=True, timeout=300)
    steps = json.loads(out.read_text())["steps"]
    assert [(s["rows"], s["slots"]) for s in steps] == [(2, 64)] and steps[0]["step_ms"] > 0


def test_profile_ttft_summarizes_a_trace(tmp_path):
    """profile_ttft.summarize: GPU busy time, host syncs and the idle gaps per profiled call; the
    --tiny run writes its summary."""
    from benchmarks.profile_ttft import main, summarize
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 100.0, "dur": 20.0},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 400.0, "dur": 80.0},           # after 280 us idle
        {"ph": "X", "cat": "kernel", "name": "silu", "ts": 500.0, "dur": 20.0},           # 20 us: not a gap
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 120.0, "dur": 5.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 5.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2.0, "dur": 5.0},
    ]
    got = summarize(events, calls=2)
    assert got["gpu_busy_ms"] == 0.11 and got["syncs"] == 0.5 and got["kernel_launches"] == 1.0
    assert got["gaps_ms"] == [(0.12, 280)]
    assert got["kernels_ms"][0] == ("gemm", 0.09)
    out = tmp_path / "ttft.json"
    assert main(["--tiny", "--reps", "2", "--json", str(out)]) == 0
    import json
    summary = json.loads(out.read_text())
    assert summary["arch"] == "tiny-qwen2_5_vl" and summary["ttft_ms"] > 0


def test_vlm_benchmarks_import_without_av_or_zarr():
    """The GPU machines have torch and transformers but neither av nor zarr: the VLM benchmarks
    (which decode no video and write no store) must start there without them. One process for all
    (an import of av or zarr fails wherever it comes from); each benchmark's failure is named."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    modules = ["benchmarks.bench_vlm", "benchmarks.profile_ttft", "benchmarks.profile_answer_windows",
               "benchmarks.profile_lm_step"]
    code = ("import importlib, sys, traceback\n"
            "sys.modules['av'] = None; sys.modules['zarr'] = None\n"
            "failed = []\n"
            f"for module in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(module)\n"
            "    except Exception:\n"
            "        failed.append(module + ': ' + traceback.format_exc().splitlines()[-1])\n"
            "sys.exit('\\n'.join(failed) or None)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _outcome(worker: str, finished_at: float, questions: int = 2):
    from pipeline.runners.batch import VideoOutcome
    return VideoOutcome(f"v{worker}{finished_at}", "done", questions=questions, finished_at=finished_at, worker=worker)


def test_side_by_side_processes_count_only_while_all_run():
    """bench_batch --processes: the rate counts the window where every process is past its warm-up
    and none has finished, not each process's own rate summed (which would count processes that did
    not overlap as if they had)."""
    from benchmarks.bench_batch import overlap_rates, steady_rates
    from pipeline.runners.batch import BatchSummary

    # two processes, one after the other: their own rates sum to 2 videos/s, but they never overlapped
    apart = BatchSummary("x", 6, 12, 10.0, [_outcome("a", t) for t in (0.0, 1.0, 2.0)] +
                         [_outcome("b", t) for t in (10.0, 11.0, 12.0)])
    assert steady_rates(apart, 2) == (2.0, 4.0)
    assert all(np.isnan(overlap_rates(apart, 2)))
    # side by side: a finishes at 0, 1, 2, 3; b at 0.5, 1.5, 2.5, 3.5; both steady from 0.5 to 3.0
    side = BatchSummary("x", 8, 16, 4.0, [_outcome("a", t) for t in (0.0, 1.0, 2.0, 3.0)] +
                        [_outcome("b", t) for t in (0.5, 1.5, 2.5, 3.5)])
    videos, questions = overlap_rates(side, 2)
    assert videos == pytest.approx(5 / 2.5) and questions == pytest.approx(10 / 2.5)
    assert overlap_rates(side, 2, warmup=2) == pytest.approx((3 / 1.5, 6 / 1.5))   # 2.0, 2.5, 3.0 in (1.5, 3.0]
    assert all(np.isnan(overlap_rates(side, 3)))                                  # a process without videos
    # the windows the load is read over: the overlap, and (one process, Ray) the steady spans together
    from benchmarks.bench_batch import steady_window
    assert steady_window(side, 2, overlap=True) == (0.5, 3.0) and steady_window(apart, 2, overlap=True) is None
    assert steady_window(apart, 2, overlap=False) == (0.0, 12.0) and steady_window(side, 3, overlap=False) is None


def test_load_sampler_reads_the_cpus_over_a_window():
    import time

    from benchmarks.common import LoadSampler

    with LoadSampler(period=0.05, gpu=False) as load:
        t0 = time.time()
        end = t0 + 0.6
        while time.time() < end:                     # keep a CPU busy
            sum(range(1000))
    assert len(load.samples) >= 5 and all("gpu_util" not in x for x in load.samples)
    whole = load.summary()
    assert whole["samples"] == len(load.samples) and "gpu_util" not in whole
    busy = whole["cpu_busy"]
    assert 0 < busy["mean"] <= busy["max"] <= 1 and 0 <= busy["p50"] <= 1
    later = load.summary(load.samples[2]["t"], None)             # samples after the third
    assert later["samples"] == len(load.samples) - 3
    assert load.summary(0.0, 1.0) == {"samples": 0, "period_s": 0.05, "window_s": 1.0}   # before any sample



def test_busy_share_between_two_cpu_samples():
    from benchmarks.common import busy_share

    assert busy_share((30, 100), (90, 200)) == pytest.approx(0.6)
    assert busy_share(None, (90, 200)) is None and busy_share((30, 100), None) is None
    assert busy_share((30, 100), (30, 100)) is None                # no time passed


def test_kernel_summary_counts_kernels_per_unit():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import kernel_summary

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(3).add_(1)
    # no CUDA here: no kernels, and every field present
    assert kernel_summary(prof, per=2) == {"kernel_ms": 0, "kernels": 0, "top_kernels_ms": []}


def test_bench_batch_fixture_with_unique_clips_is_its_own_shape(tmp_path):
    """bench_batch --unique-clips K: K clips rendered, the other videos reuse them; --data records
    the shape, so a fixture of another K is not reused."""
    from types import SimpleNamespace

    from benchmarks.bench_batch import fixture

    args = SimpleNamespace(videos=4, questions=1, seconds=0.2, size=[32, 48], quick=False, data=tmp_path / "fx",
                           unique_clips=2)
    root = fixture(args, tmp_path)
    clips = [(root / f"videos/all/video{7010 + i}.mp4").read_bytes() for i in range(4)]
    assert clips[2] == clips[0] and clips[3] == clips[1] and clips[0] != clips[1]
    assert fixture(args, tmp_path) == root                                   # same shape: reused
    with pytest.raises(SystemExit, match="another shape"):
        fixture(SimpleNamespace(**{**vars(args), "unique_clips": None}), tmp_path)


def test_bench_batch_reports_questions_per_s_and_scaling_by_gpu_count():
    from benchmarks.bench_batch import summarize

    def row(n, steady, overlap):
        return {"path": "ray", "workers": n, "tokens": "arrcoc", "steady_questions_per_s": steady,
                "overlap_questions_per_s": overlap}
    summary = summarize([row(1, 100.0, 90.0), row(2, 190.0, 180.0), row(4, 360.0, 324.0)], [1, 2, 4])
    assert summary["ray_questions_per_s_by_gpus"] == {"arrcoc": {"1": 100.0, "2": 190.0, "4": 360.0}}
    assert summary["ray_scaling_efficiency"] == {"arrcoc": {"1": 1.0, "2": 0.95, "4": 0.9}}
    assert summary["ray_scaling_efficiency_overlap"] == {"arrcoc": {"1": 1.0, "2": 1.0, "4": 0.9}}


def test_git_commit_names_the_checkout():
    import re

    from benchmarks.common import git_commit

    if not (Path(__file__).resolve().parents[1] / ".git").exists():
        pytest.skip("not a git checkout")
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", git_commit() or "")


def test_bench_live_spreads_streams_over_gpus_and_pools_their_rows():
    from benchmarks.bench_live import capacity, pool_rows, split_streams

    assert split_streams(5, 2) == [3, 2] and split_streams(32, 2) == [16, 16] and split_streams(1, 2) == [1, 0]

    def part(streams, latencies, fps_min, dropped):
        return {"streams": streams, "seconds": 20.0, "fps_processed_per_stream_mean": 30.0,
                "fps_processed_per_stream_min": fps_min, "fps_in_per_stream_mean": 30.0, "dropped": dropped,
                "answers": len(latencies), "answer_latencies_ms": latencies}
    row = pool_rows([part(2, [100.0] * 19 + [900.0], 29.9, 0), part(2, [200.0] * 20, 28.0, 12)], [2, 2])
    assert row["streams"] == 4 and row["answers"] == 40 and row["fps_processed_per_stream_min"] == 28.0
    assert row["answer_latency_p50_ms"] == row["answer_latency_p95_ms"] == 200.0     # pooled: 38 of 40 <= 200
    assert row["drop_share"] == round(12 / (4 * 30.0 * 20.0), 4)
    assert all("answer_latencies_ms" not in p for p in row["per_gpu"])
    rows = [{"streams": n, "answer_latency_p95_ms": p95, "fps_processed_per_stream_min": fps}
            for n, p95, fps in ((16, 400.0, 30.0), (24, 900.0, 29.9), (28, 800.0, 25.0), (32, 3000.0, 29.0))]
    assert capacity(rows, 1000.0, 30.0)["streams"] == 24            # 28 lost frames, 32 missed the p95
    assert capacity(rows, 300.0, 30.0)["streams"] is None


@pytest.mark.slow
def test_bench_live_over_two_fake_gpus_answers_on_both(tmp_path):
    """--gpus 2 on the CPU: two processes, one stream each; both answer and the rows pool."""
    import json
    import subprocess

    out = tmp_path / "live.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks/bench_live.py"), "--quick",
                    "--device", "cpu", "--gpus", "2", "--streams", "2", "--seconds", "6", "--warmup", "3",
                    "--out", str(out)], check=True, timeout=600, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["gpus"] == 2 and row["streams"] == 2 and row["streams_per_gpu"] == [1, 1]
    assert [p["streams"] for p in row["per_gpu"]] == [1, 1] and all(p["answers"] > 0 for p in row["per_gpu"])
    assert row["answers"] == sum(p["answers"] for p in row["per_gpu"]) and row["answer_latency_p95_ms"] > 0


def test_bench_live_children_run_on_the_gpus_this_process_sees():
    from benchmarks.bench_live import child_devices

    assert child_devices(2, None) == ["0", "1"]
    assert child_devices(2, "2,3") == ["2", "3"]                   # not GPUs 0 and 1 of the host
    assert child_devices(2, " 1, 3,0") == ["1", "3"]


def test_bench_live_keeps_the_counts_it_finished_when_a_later_one_fails(tmp_path, monkeypatch):
    """The results file is written after every stream count: a run cut short (a later count that
    never starts, a call's time limit) keeps the rows it measured, marked incomplete."""
    import json
    from types import SimpleNamespace

    from benchmarks import bench_live as bench

    class Server:
        def __init__(self, clip):
            self.closed = False

        def url(self, i):
            return f"http://127.0.0.1:1/stream{i}.ts"

        def close(self):
            self.closed = True

    def measure(urls, vlm, args, device, out):
        if len(urls) == 3:
            raise RuntimeError("the 3-stream run never started")
        return {"streams": len(urls), "answer_latency_p95_ms": 100.0, "fps_processed_per_stream_min": 15.0}

    monkeypatch.setattr(bench, "encode_clip", lambda path, *a, **k: path)
    monkeypatch.setattr(bench, "TSServer", Server)
    monkeypatch.setattr(bench, "TSServerProcess", Server)
    monkeypatch.setattr(bench, "build_vlm", lambda *a: SimpleNamespace(name="fake"))
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "live.json"
    with pytest.raises(RuntimeError, match="never started"):
        bench.main(["--quick", "--device", "cpu", "--streams", "1,2,3", "--soak", "0", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"] is False and [r["streams"] for r in result["rows"]] == [1, 2]
    assert result["capacity"]["streams"] == 2


def test_loopback_server_process_serves_the_clip_and_ends_with_close(tmp_path):
    """bench_live's default server: a process of its own that streams the clip to each client and
    exits when closed."""
    import av

    from benchmarks.loopback import TSServerProcess, encode_clip

    clip = encode_clip(tmp_path / "clip.ts", 160, 96, 10, seconds=1.0)
    with TSServerProcess(clip) as server:
        container = av.open(server.url(7), options={"analyzeduration": "200000"}, timeout=(10, 10))
        try:
            frames = [f for _, f in zip(range(5), container.decode(video=0))]
        finally:
            container.close()
        proc = server._proc
    assert [(f.width, f.height) for f in frames] == [(160, 96)] * 5
    assert proc.poll() is not None


def test_sampled_decode_bench_runs_and_reads_the_same_frames(tmp_path):
    """bench_sampled_decode's smoke run: a row per read, the same frames kept with and without
    NonrefSkip, some left undecoded, and the JSON where --out says."""
    import json

    from benchmarks import bench_sampled_decode

    out = tmp_path / "r.json"
    bench_sampled_decode.main(["--sizes", "144p", "--fps", "2", "--repeats", "1", "--workdir", str(tmp_path),
                               "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["read"] for r in rows] == ["yuv", "rgb"]
    assert all(r["kept"] == 20 and r["left_undecoded"] > 0 and r["full_cpu_ms"] > 0 for r in rows)
