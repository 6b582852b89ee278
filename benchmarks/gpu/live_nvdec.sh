#!/usr/bin/env bash
# Issue 38, one GPU, about 7 minutes: live streams decoded by NVDEC against PyAV's default (capture in
# worker processes), 720p30 streams answered every 2 s, all other defaults. With each stream's thread
# converting its frames one by one, 32 NVDEC streams ran at 6.2 frames/s each on a 16-CPU H200 host,
# the capture threads holding the interpreter 97% of the time (docs/performance.md); live NVDEC frames
# now wait as NV12 and are converted a batch at a time when taken. Alternates the decoders per count
# (NVDEC first) so that the machine's drift lands on both.
# Needs PyAV, zarr and PyNvVideoCodec importable (unpack their wheels into a folder on PYTHONPATH first).
#   bash benchmarks/gpu/live_nvdec.sh [STREAMS...]                       (default: 32 48)
#   DEVICE=cpu EXTRA=--quick DECODERS=pyav bash benchmarks/gpu/live_nvdec.sh 2   (a CPU smoke test)
# Writes under $OUT (default ./out/live_nvdec): live_{N}_{nvdec,pyav}.json and .log, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
COUNTS=("${@:-32 48}")
source benchmarks/gpu/live_runs.sh
live_setup out/live_nvdec
LIVE_WARMUP_S=${LIVE_WARMUP_S:-15}
for n in ${COUNTS[*]}; do
    for decoder in ${DECODERS:-nvdec pyav}; do
        echo "== $n streams, decoder $decoder"; run "live_${n}_${decoder}" --streams "$n" --decoder "$decoder"
    done
done
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
print(f"{'run':<18} {'fps/stream':>10} {'in':>6} {'drop%':>6} {'p95 ms':>8} {'first 10 s p95':>15} {'VLM call p50':>12} "
      f"{'CPU cores':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("live_*.json")):
    for r in json.loads(path.read_text()).get("rows", []):
        print(f"{path.stem:<18} {r['fps_processed_per_stream_mean']:>10} {r['fps_in_per_stream_mean']:>6} "
              f"{100 * r['drop_share']:>6.1f} {r['answer_latency_p95_ms']:>8} {str(r.get('cold_latency_p95_ms')):>15} "
              f"{str(r.get('vlm_call_p50_ms')):>12} {str(r.get('cpu_cores_pipeline')):>9}")
PYEOF
