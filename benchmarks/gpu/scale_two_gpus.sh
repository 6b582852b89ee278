#!/usr/bin/env bash
# Issue 38 on a 2-GPU machine, about 9 minutes: the CUDA warm-start test; live capacity on GPU 0
# alone (32 and 48 streams of 720p30, defaults, cold first 10 s and steady) and on both GPUs
# (bench_live --gpus 2: one process per GPU, streams placed least-loaded); batch on Ray Data with
# 1 and 2 GPU actors. Needs PyAV and zarr importable, and Ray (ray[data]) for the last step.
#   bash benchmarks/gpu/scale_two_gpus.sh          (from the repository root; $OUT: where results go)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-out/scale_two_gpus}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
status=0
CUDA_VISIBLE_DEVICES=0 timeout 90 "$PY" -m pytest -m cuda -q -p no:cacheprovider \
    tests/pipeline/runners/test_warm_start.py > "$OUT/pytest_warm_start.log" 2>&1 || status=1
tail -1 "$OUT/pytest_warm_start.log"
live() {  # name, seconds allowed, then bench_live arguments
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$PY" benchmarks/bench_live.py --device cuda --soak 0 --warmup 20 --seconds 30 \
        --cold-seconds 10 "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
    grep -v '^{' "$OUT/$name.log" | tail -3
}
CUDA_VISIBLE_DEVICES=0 live live32_gpu0 110 --streams 32
CUDA_VISIBLE_DEVICES=0 live live48_gpu0 120 --streams 48
live live64_gpus2 130 --streams 64 --gpus 2
# where an NVDEC live stream stops: Python's stacks of every thread after 30 s
timeout -s ABRT 30 "$PY" -X faulthandler benchmarks/bench_live.py --device cuda --streams 1 --decoder nvdec \
    --soak 0 --warmup 2 --seconds 5 --out "$OUT/nvdec1.json" > "$OUT/nvdec1.log" 2>&1 || status=1
timeout 150 "$PY" benchmarks/bench_batch.py --device cuda --paths ray --tokens arrcoc --gpus 1 2 --videos 96 \
    --set decode.fps=2 --json "$OUT/bench_batch_ray.json" > "$OUT/bench_batch_ray.log" 2>&1 || status=1
tail -8 "$OUT/bench_batch_ray.log"
exit $status
