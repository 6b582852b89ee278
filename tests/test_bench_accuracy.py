"""The accuracy benchmark end to end on CPU (tiny-random: its answers are meaningless, the plumbing is
not): every policy's row comes from batch + eval, the ARR-COC row is what `batch` + `eval` print, and
the token counts follow the retention. The script runs in this process (its start-up, as a script
and without PyAV or zarr, in test_ttft_window_runs_without_pyav_or_zarr)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_accuracy  # noqa: E402
from pipeline.commands.cli import main as cli  # noqa: E402


@pytest.fixture
def bench(capsys, monkeypatch):
    """bench(*args): `python benchmarks/bench_accuracy.py ARGS` run in this process from the repository
    root, as a CompletedProcess (returncode, stderr)."""
    monkeypatch.chdir(ROOT)

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = bench_accuracy.main(list(args))
        except SystemExit as e:                         # argparse's errors (2), or a message (1), as a script's
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        return subprocess.CompletedProcess(args, code, "", capsys.readouterr().err)
    return run


def test_quick_run_writes_rows_matching_batch_and_eval(tmp_path, bench):
    out = tmp_path / "acc.json"
    done = bench("--quick", "--root", str(tmp_path / "data"), "--policies", "stock,evs,arrcoc", "--retentions", "0.25",
                 "--limit", "2", "--ttft", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {(r["policy"], r["retention"]): r for r in result["rows"]}
    assert set(rows) == {("stock", 1.0), ("evs", 0.25), ("arrcoc", 0.25)}
    assert rows["evs", 0.25]["mean_tokens_kept"] < 0.4 * rows["stock", 1.0]["mean_tokens_kept"]
    assert all(r["answered"] == result["questions"] > 0 for r in rows.values())   # every question of the plan
    assert {r["policy"] for r in result["ttft"]} == {"stock", "evs", "arrcoc"}

    # the CLI's batch + eval at the same retention give the ARR-COC row's numbers
    store, report = tmp_path / "cli.zarr", tmp_path / "eval.json"
    assert cli(["batch", "--dataset", "msrvtt", "--root", str(tmp_path / "data"), "--limit", "2",
                "--vlm", "tiny-random", "--device", "cpu", "--set", "decode.fps=2",
                "--set", "model.attending.retention=0.25", "--out", str(store), "--no-progress"]) == 0
    assert cli(["eval", str(store), "--dataset", "msrvtt", "--root", str(tmp_path / "data"),
                "--report", str(report)]) == 0
    scored = json.loads(report.read_text())
    assert scored["accuracy"] == rows["arrcoc", 0.25]["accuracy"]
    assert scored["tokens"]["mean_kept_per_video"] == rows["arrcoc", 0.25]["mean_tokens_kept"]


def test_variants_pass2_kept_and_tempering_calibrated_on_val(tmp_path, bench):
    """The variant rows run through their own VLM settings: pass 2 and kept encoding at each retention,
    tempering once, with a threshold calibrated on the val split and every pass's tokens counted."""
    out = tmp_path / "acc.json"
    done = bench("--quick", "--root", str(tmp_path / "data"),
                 "--policies", "arrcoc", "--retentions", "0.25", "--limit", "1",
                 "--variants", "pass2,kept,tempering", "--ladder", "0.05,0.25",
                 "--val-root", str(tmp_path / "val"), "--val-make", "2", "--ttft", "--out", str(out),
                 "--escalate", "0.3", "--hold-share",
                 "--arrcoc-weights", "arr_coc/weights/synth-qa.safetensors")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {(r["policy"], r["retention"]): r for r in result["rows"]}
    assert set(rows) == {("arrcoc", 0.25), ("arrcoc+pass2", 0.25), ("arrcoc+kept", 0.25), ("arrcoc+tempering", 0.25),
                         ("arrcoc+finetuned", 0.25)}
    assert result["variants"]["finetuned"] == ["runtime.model_weights=arr_coc/weights/synth-qa.safetensors"]
    assert result["variants"]["pass2"] == ["vlm.pass2=attention"]
    assert "vlm.tempering.ladder=[0.05,0.25]" in result["variants"]["tempering"]
    calibration = result["tempering_calibration"]
    assert calibration["split"] == "val" and calibration["answers"] > 0 and 0.0 <= calibration["threshold"] <= 1.0
    assert f"vlm.tempering.threshold={calibration['threshold']:g}" in result["variants"]["tempering"]
    assert "vlm.tempering.escalate=0.3" in result["variants"]["tempering"]     # --hold-share
    tempering = rows["arrcoc+tempering", 0.25]
    assert 1.0 <= tempering["mean_passes"] <= 2.0
    assert tempering["mean_tokens_spent"] >= tempering["mean_tokens_kept"]
    # pass 2 keeps the budget among 3x as many candidates: about as many tokens as pass 1 alone
    assert rows["arrcoc+pass2", 0.25]["mean_tokens_kept"] <= 1.5 * rows["arrcoc", 0.25]["mean_tokens_kept"] + 4
    assert {r["policy"] for r in result["ttft"]} == {"arrcoc", "arrcoc+pass2", "arrcoc+kept", "arrcoc+tempering",
                                                     "arrcoc+finetuned"}


def test_hold_share_needs_escalate(tmp_path, bench):
    done = bench("--quick", "--root", str(tmp_path / "data"),
                 "--variants", "tempering", "--threshold", "0.5", "--hold-share")
    assert done.returncode == 2 and "--hold-share holds the --escalate share" in done.stderr
    assert not (tmp_path / "data").exists()


def test_ttft_window_runs_without_pyav_or_zarr(tmp_path, bench):
    """--save-ttft-window writes the window --ttft times; --ttft-only --ttft-window times it with
    neither PyAV nor zarr importable (a GPU machine carrying the shipped model but no wheels)."""
    window = tmp_path / "w.npz"
    done = bench("--quick", "--root", str(tmp_path / "data"),
                 "--policies", "stock", "--limit", "1", "--ttft-only", "--save-ttft-window", str(window))
    assert done.returncode == 0, done.stderr[-2000:]
    blocked = ("import runpy, sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('av', 'zarr', 'numcodecs', 'decord'):\n"
               "            raise ImportError('blocked ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "sys.argv = sys.argv[1:]\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = tmp_path / "ttft.json"
    done = subprocess.run([sys.executable, "-c", blocked, "benchmarks/bench_accuracy.py", "--vlm", "tiny-random",
                           "--device", "cpu", "--policies", "stock,arrcoc", "--retentions", "0.25", "--ttft-only",
                           "--ttft-window", str(window), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {r["policy"] for r in json.loads(out.read_text())["ttft"]} == {"stock", "arrcoc"}
    (tmp_path / "bad.npz").write_bytes(b"not a window")
    bad = bench("--vlm", "tiny-random", "--device", "cpu",
                "--ttft-only", "--ttft-window", str(tmp_path / "bad.npz"))
    assert bad.returncode != 0 and "not a window file" in bad.stderr and "Traceback" not in bad.stderr


def test_renderer_split_adds_the_named_object_measures(tmp_path, bench):
    """--renderer writes that renderer's clips; every row splits accuracy by whether a question names
    one object, ARR-COC's rows add the named object's share of the tokens; --held-out is the held-out
    renderer's test split and takes no other renderer."""
    out = tmp_path / "acc.json"
    done = bench("--quick", "--root", str(tmp_path / "data"),
                 "--renderer", "photo", "--policies", "stock,arrcoc", "--retentions", "0.25",
                 "--limit", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["renderer"] == "photo"
    records = json.loads((tmp_path / "data" / "test_qa.json").read_text())
    assert {r["renderer"] for r in records} == {"photo"}
    for row in result["rows"]:
        split = row["names_one_object"]
        assert split["one_object"]["questions"] + split["other"]["questions"] == row["answered"]
    arrcoc = next(r for r in result["rows"] if r["policy"] == "arrcoc")
    assert 0 <= arrcoc["named_object_share"]["token_share"] <= 1 and arrcoc["named_object_share"]["questions"] > 0
    assert "named_object_share" not in result["rows"][0]
    bad = bench("--quick", "--root", str(tmp_path / "x"),
                "--held-out", "--renderer", "photo")
    assert bad.returncode == 2 and "--held-out is --renderer" in bad.stderr and not (tmp_path / "x").exists()
    bad = bench("--quick", "--root", str(tmp_path / "x"),
                "--renderer", "photo,styled")
    assert bad.returncode == 2 and "evaluate it alone" in bad.stderr and not (tmp_path / "x").exists()


def test_in_distribution_split_draws_every_training_renderer(tmp_path, bench):
    from evaluation.renderers import training_renderers
    done = bench("--quick", "--root", str(tmp_path / "data"),
                 "--make", "3", "--renderer", "in-distribution", "--policies", "stock", "--limit", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads((tmp_path / "data" / "test_qa.json").read_text())
    assert {r["renderer"] for r in records} == set(training_renderers())


def test_a_variant_setting_out_of_range_fails_before_any_row(tmp_path, bench):
    done = bench("--quick", "--root", str(tmp_path / "data"),
                 "--variants", "pass2", "--retentions", "1,0.1")
    assert done.returncode == 2 and "variant pass2 at retention 1" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


def test_empty_frame_group_variants_on_a_qwen3_vl(tmp_path, bench):
    """keep vs drop (vlm.empty_frame_groups) at kept context 1 and 0: four ARR-COC rows of one Qwen3-VL."""
    out = tmp_path / "acc.json"
    done = bench("--root", str(tmp_path / "data"), "--make", "2", "--limit", "1", "--vlm", "tiny-random-qwen3_vl",
                 "--device", "cpu", "--policies", "arrcoc", "--retentions", "0.1", "--variants", "kept,drop,kept-drop",
                 "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {r["policy"] for r in result["rows"]} == {"arrcoc", "arrcoc+kept", "arrcoc+drop", "arrcoc+kept-drop"}
    assert result["variants"]["drop"] == ["vlm.empty_frame_groups=drop"]
    assert result["variants"]["kept-drop"] == ["vlm.encode=kept", "vlm.kept_context=0", "vlm.empty_frame_groups=drop"]
    assert all(r["mean_tokens_kept"] > 0 for r in result["rows"])


def test_held_out_validation_clips_come_from_the_training_renderers_and_say_so(tmp_path, monkeypatch, capsys):
    """Tempering's validation split for a held-out run is drawn by the training renderers (the
    held-out one is never tuned on), and the progress line names those, not the held-out one."""
    import evaluation.renderers as renderers
    from benchmarks.bench_accuracy import ensure_split

    calls = []
    def write(root, split, count, names, evaluation, progress):
        calls.append((split, names, evaluation))
    monkeypatch.setattr(renderers, "write_renderer_split", write)
    ensure_split(tmp_path / "val", 3, "val", renderers.HELD_OUT)
    ensure_split(tmp_path / "test", 3, "test", renderers.HELD_OUT)
    assert calls == [("val", renderers.training_renderers(), False), ("test", (renderers.HELD_OUT,), True)]
    err = capsys.readouterr().err
    assert f"val clips ({','.join(renderers.training_renderers())})" in err
    assert f"test clips ({renderers.HELD_OUT})" in err
    assert f"val clips ({renderers.HELD_OUT})" not in err
