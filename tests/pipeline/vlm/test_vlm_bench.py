import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_vlm.py"


def load_bench():
    """benchmarks/bench_vlm.py as a module (a script, not in an installed package)."""
    spec = importlib.util.spec_from_file_location("bench_vlm", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_tiny_smoke(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--arch", "tiny-qwen2_5_vl", "--new-tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"command", "device", "torch", "transformers", "results"} <= set(report)
    rows = report["results"]
    assert [r["setting"] for r in rows] == ["stock, HF forward", "stock", "arr-coc 50%", "arr-coc 50%, kept",
                                            "arr-coc 25%", "arr-coc 25%, kept", "arr-coc 10%", "arr-coc 10%, kept"]
    assert [r["encode"] for r in rows] == ["all"] * 2 + ["all", "kept"] * 3
    # 4 frames of 112x112
    assert rows[0]["tokens_kept"] == rows[1]["tokens_kept"] == rows[0]["tokens_full"] == 2 * 4 * 4
    kept = [r["tokens_kept"] for r in rows[1::2]]
    assert kept[0] > kept[1] >= kept[2] >= kept[3] >= 1
    assert [r["tokens_kept"] for r in rows[2::2]] == [r["tokens_kept"] for r in rows[3::2]]   # same tokens either way
    # every cell through the tower with encode: all; with kept, the 2x2-cell windows holding a kept token
    assert all(r["vision_cells"] == 32 for r in rows[:3] + rows[4::2])
    assert all(r["tokens_kept"] <= r["vision_cells"] < 32 for r in rows[5::2])
    assert all(r["ttft_x_stock"] == rows[1]["ttft_ms"] / r["ttft_ms"] for r in rows)
    assert all(r["decode_tokens"] == 4 and r["prefill_ms"] > 0 and r["front_end_ms"] > 0 for r in rows)
    # speed-ups against both stock rows of the run
    assert rows[1]["prefill_x_stock"] == 1.0 and rows[0]["prefill_x_hf_stock"] == 1.0
    for r in rows:
        assert r["prefill_x_stock"] == rows[1]["prefill_ms"] / r["prefill_ms"]
        assert r["prefill_x_hf_stock"] == rows[0]["prefill_ms"] / r["prefill_ms"]
    assert "arr-coc 10%" in capsys.readouterr().out


def test_bench_hf_lm_has_one_stock_row(tmp_path):
    """--hf-lm: every setting through HF's forward already, so no separate HF stock row."""
    bench = load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--arch", "tiny-qwen2_vl", "--new-tokens", "2", "--retention", "0.5",
                       "--hf-lm", "--encode", "kept", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["fast_lm"] is False
    assert [r["setting"] for r in report["results"]] == ["stock", "arr-coc 50%, kept"]   # --encode kept: no "all" row
    assert all(r["prefill_x_hf_stock"] is None for r in report["results"])


def test_bench_kept_context_rows_encode_more_cells(tmp_path):
    """--kept-context 0 1: a kept row per radius, the ring's cells encoded on top of the kept ones."""
    bench = load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--arch", "tiny-qwen2_vl", "--new-tokens", "2", "--retention", "0.25",
                       "--encode", "kept", "--kept-context", "0", "1", "--out", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    plain, ring = rows["arr-coc 25%, kept"], rows["arr-coc 25%, kept, context 1"]
    assert plain["kept_context"] == 0 and ring["kept_context"] == 1 and rows["stock"]["kept_context"] is None
    assert ring["tokens_kept"] == plain["tokens_kept"] and ring["vision_cells"] > plain["vision_cells"]


def test_bench_pass2_rows_time_both_passes_through_answer(tmp_path):
    """--pass2: through VLM.answer, stock, single pass and pass 2 over candidate_factor times the
    candidates; pass 2 keeps about the single pass's budget, and the VLM's own setting is back after."""
    bench = load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--arch", "tiny-qwen2_vl", "--new-tokens", "2", "--retention", "0.25",
                       "--encode", "kept", "--pass2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["pass2"]
    assert [r["setting"] for r in rows] == ["stock, answer()", "arr-coc 25%, answer()",
                                            "arr-coc 25%, pass 2 of 75%, answer()"]
    stock, single, two = rows
    assert stock["tokens_kept"] == stock["tokens_full"] == 32 and stock["answer_ttft_x_stock"] == 1.0
    assert single["tokens_kept"] == 8                     # 4 of the 16 cells of each of the 2 frame pairs
    # pass 2 keeps a third of the 24 candidates: the same budget, chosen by the question's attention
    assert two["tokens_kept"] == 8 and two["passes"] == 1
    assert all(r["answer_ttft_ms"] > 0 and r["arch"] == "tiny-qwen2_vl" for r in rows)


def test_bench_qwen3_vl_through_the_fast_engine(tmp_path):
    """--arch tiny-qwen3_vl: the fast engine's rows (stock, each retention with the tower on every
    patch and on the kept cells) and the stock model through transformers' own Qwen3-VL forward."""
    bench = load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--arch", "tiny-qwen3_vl", "--new-tokens", "3", "--retention", "0.25",
                       "--out", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["stock, transformers forward", "stock, HF forward", "stock", "arr-coc 25%",
                          "arr-coc 25%, kept"]
    full = rows["stock"]["tokens_full"]
    assert full == rows["stock"]["tokens_kept"] == rows["stock, transformers forward"]["tokens_kept"] == 2 * 3 * 3
    kept = rows["arr-coc 25%, kept"]
    assert full > kept["tokens_kept"] == rows["arr-coc 25%"]["tokens_kept"] >= 1 and kept["vision_cells"] < full
    assert all(r["decode_tokens"] == 3 and r["ttft_ms"] > 0 for r in rows.values())
    forward = rows["stock, transformers forward"]["ttft_ms"]
    assert all(r["ttft_x_hf_forward"] == forward / r["ttft_ms"] for r in rows.values())


def test_qwen3_vl_arch_configs_are_the_published_sizes():
    """The benchmark's random-weight Qwen3-VL configs (no weights built: counted from the config)."""
    from pipeline.vlm import qwen3_vl
    from pipeline.vlm.builtin import build_tokenizer

    tok = build_tokenizer()
    big, small = (qwen3_vl.arch_config(a, tok) for a in ("qwen3-vl-8b", "qwen3-vl-2b"))
    for cfg, text, vision, deepstack, tie in ((big, (36, 4096, 12288), (27, 1152, 4096), [8, 16, 24], False),
                                              (small, (28, 2048, 6144), (24, 1024, 2048), [5, 11, 17], True)):
        t, v = cfg.text_config, cfg.vision_config
        assert (t.num_hidden_layers, t.hidden_size, t.intermediate_size) == text
        assert (v.depth, v.hidden_size, v.out_hidden_size) == vision and v.deepstack_visual_indexes == deepstack
        assert cfg.tie_word_embeddings is tie and t.num_key_value_heads == 8
        assert t.rope_parameters["mrope_interleaved"] and t.rope_parameters["mrope_section"] == [24, 20, 20]
