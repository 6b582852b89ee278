#!/usr/bin/env bash
# Issue 38, one GPU, about 8 minutes: live capacity with the capture in threads against worker processes
# (live.capture_processes; the default from 16 streams on), 720p30 streams answered every 2 s, all other defaults.
# 48 streams with threads processed 0.9 frames/s a stream on a 16-CPU H200 host, every pipeline
# thread waiting for the interpreter lock (docs/performance.md); does capture in processes hold them?
# Alternates the two settings (processes first) so that the machine's drift lands on both.
# Needs PyAV and zarr importable (unpack their wheels into a folder on PYTHONPATH first).
#   bash benchmarks/gpu/live_capture.sh [PROCESSES] [STREAMS...]     (defaults: 4, then 48 32)
#   DEVICE=cpu EXTRA=--quick bash benchmarks/gpu/live_capture.sh 1 2  (a CPU smoke test of this script)
# Writes under $OUT (default ./out/live_capture): live_{N}_{threads,processes}.json and .log, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
PROCESSES=${1:-4}
shift || true
COUNTS=("${@:-48 32}")
source benchmarks/gpu/live_runs.sh
live_setup out/live_capture
for n in ${COUNTS[*]}; do
    echo "== $n streams, capture in $PROCESSES processes"; run "live_${n}_processes" --streams "$n" --capture-processes "$PROCESSES"
    echo "== $n streams, capture threads"; run "live_${n}_threads" --streams "$n" --capture-processes 0
done
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
print(f"{'run':<22} {'fps/stream':>10} {'drop%':>6} {'p95 ms':>8} {'first 10 s p95':>15} {'CPU cores':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("live_*.json")):
    for r in json.loads(path.read_text()).get("rows", []):
        print(f"{path.stem:<22} {r['fps_processed_per_stream_mean']:>10} {100 * r['drop_share']:>6.1f} "
              f"{r['answer_latency_p95_ms']:>8} {str(r.get('cold_latency_p95_ms')):>15} {str(r.get('cpu_cores_pipeline')):>9}")
PYEOF
