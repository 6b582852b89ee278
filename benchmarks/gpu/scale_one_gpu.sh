#!/usr/bin/env bash
# Issue 38 on one GPU (H100/H200), about 8 minutes: the CUDA tests of NVDEC decode and warm start,
# then live capacity (720p30 streams answered every 2 s, defaults, cold first 10 s and steady state in
# each run) with PyAV and with NVDEC decode, and the pipeline against raw decode for both decoders.
# Needs PyAV, zarr and PyNvVideoCodec importable (on a bare device box: unpack their wheels into a
# folder on PYTHONPATH first). Writes under $OUT (default ./out/scale_one_gpu).
#   bash benchmarks/gpu/scale_one_gpu.sh          (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-out/scale_one_gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
status=0
"$PY" -c "from sources import open_video; v = open_video('.whl/v720.mp4', decoder='nvdec'); f = [(x.index, round(x.pts_s, 3), tuple(x.rgb.shape)) for x in v]; print('nvdec probe:', len(f), f[:2], f[-1:])" 2>&1 | grep -v "INVALID INDEX" | tail -3
timeout 200 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/pipeline/runners/test_warm_start.py \
    tests/pipeline/runtime/test_cuda_helpers.py tests/pipeline/vlm/test_kept_warm_keys.py \
    tests/pipeline/vlm/test_kept_vision.py tests/sources/test_nvdec.py tests/pipeline/core/test_gpu_frames.py \
    tests/pipeline/commands/test_cli_nvdec.py > "$OUT/pytest_cuda.log" 2>&1 || status=1
grep -v "INVALID INDEX" "$OUT/pytest_cuda.log" | tail -4
live() {  # name, then bench_live arguments
    local name=$1; shift
    timeout 170 "$PY" benchmarks/bench_live.py --device cuda --soak 0 --warmup 20 --seconds 30 --cold-seconds 10 \
        "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
    grep -v "INVALID INDEX" "$OUT/$name.log" | grep -v '^{' | tail -3
}
live live32_pyav --streams 32
live live32_nvdec --streams 32 --decoder nvdec
live live48_nvdec --streams 48 --decoder nvdec
timeout 150 "$PY" benchmarks/bench_pipeline.py --device cuda --sizes 720p,1080p --decoders pyav,nvdec --frames 600 \
    --repeats 3 --out "$OUT/bench_pipeline.json" > "$OUT/bench_pipeline.log" 2>&1 || status=1
grep -v "INVALID INDEX" "$OUT/bench_pipeline.log" | tail -6
exit $status
