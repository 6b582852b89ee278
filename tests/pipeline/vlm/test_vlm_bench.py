import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_vlm.py"


def test_bench_tiny_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_vlm", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--arch", "tiny-qwen2_5_vl", "--new-tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"command", "device", "torch", "transformers", "results"} <= set(report)
    rows = report["results"]
    assert [r["setting"] for r in rows] == ["stock", "arr-coc 50%", "arr-coc 25%", "arr-coc 10%"]
    assert rows[0]["tokens_kept"] == rows[0]["tokens_full"] == 2 * 4 * 4     # 4 frames of 112x112
    kept = [r["tokens_kept"] for r in rows]
    assert kept[0] > kept[1] >= kept[2] >= kept[3] >= 1
    assert all(r["decode_tokens"] == 4 and r["prefill_ms"] > 0 and r["front_end_ms"] > 0 for r in rows)
    assert "arr-coc 10%" in capsys.readouterr().out
