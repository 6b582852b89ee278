#!/usr/bin/env bash
# Dense Qwen3-VL on the fast engine, on one GPU (H100/H200), in about 4 minutes:
#   1. the CUDA tests of the Qwen3-VL engine (graphs, static cache, kept-tower graphs), then the
#      other CUDA tests of tests/pipeline/vlm as a regression check (less two modules that import
#      av / zarr at collection and hold no CUDA test);
#   2. bench_vlm for qwen3-vl-8b and qwen3-vl-2b (random weights of the real configs, bf16): 32 frames
#      of 448x448, ARR-COC at 10% (vision tower on every patch, and on the kept cells only) against
#      stock (100%) through the same engine and stock through transformers' own forward; TTFT, peak
#      memory, decode tokens/s.
# Writes under $OUT (default ./out/qwen3_fast): pytest logs, bench JSON per architecture, a summary.
#   bash benchmarks/gpu/qwen3_fast.sh           (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-out/qwen3_fast}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee "$OUT/versions.txt"

status=0
timeout 150 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/pipeline/vlm/test_qwen3_fast.py \
    > "$OUT/pytest_qwen3_cuda.log" 2>&1 || status=1
tail -5 "$OUT/pytest_qwen3_cuda.log"
timeout 150 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/pipeline/vlm --deselect tests/pipeline/vlm/test_qwen3_fast.py \
    --ignore tests/pipeline/vlm/test_qwen3_modes.py --ignore tests/pipeline/vlm/test_vlm_hub_offline.py \
    > "$OUT/pytest_vlm_cuda.log" 2>&1 || status=1
tail -5 "$OUT/pytest_vlm_cuda.log"

for arch in qwen3-vl-8b qwen3-vl-2b; do
    timeout 300 "$PY" benchmarks/bench_vlm.py --arch "$arch" --frames 32 --size 448 --retention 0.1 \
        --encode both --new-tokens 64 --reps 3 --out "$OUT/bench_vlm_$arch.json" \
        > "$OUT/bench_vlm_$arch.log" 2>&1 || status=1
    tail -12 "$OUT/bench_vlm_$arch.log"
done

"$PY" - "$OUT" <<'PYEOF' > "$OUT/summary.txt" 2>&1 || status=1
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("bench_vlm_*.json")):
    report = json.loads(path.read_text())
    print(report["device"], "torch", report["torch"], "transformers", report["transformers"])
    for r in report["results"]:
        x_fwd = r.get("ttft_x_hf_forward")
        print(f'{r["arch"]:12} {r["setting"]:30} kept {r["tokens_kept"]:5}/{r["tokens_full"]:5} '
              f'ttft {r["ttft_ms"]:8.1f} ms  x stock {r["ttft_x_stock"]:5.2f}  '
              f'x transformers {"-" if x_fwd is None else f"{x_fwd:5.2f}"}  decode {r["decode_tok_s"]:6.1f} tok/s  '
              f'peak {r["peak_mem_gib"]:6.2f} GiB')
PYEOF
cat "$OUT/summary.txt"
exit $status
