#!/usr/bin/env bash
# Live capacity of two trees in one device call: bench_live (32 streams of 720p30, PyAV, answered every
# 2 s, defaults) at BASE and at the working tree, alternated (base, head, base, head) so that the host's
# drift lands on both. For a regression hunt: 32 streams held p95 590 ms at 83eba63 on a 1-GPU H200 and
# 3.6-4.2 s at eb84f9e / a7e17e7 on the same kind of machine (docs/performance.md); is it the host or
# a change?
# Needs PyAV and zarr importable (unpack their wheels into a folder on PYTHONPATH first) and the
# repository's history (BASE is checked out from it with git archive; the device's copy of .git is the
# one from the session's start, which holds every earlier commit).
#   bash benchmarks/gpu/live_ab.sh [BASE] [STREAMS] [ROUNDS]     (defaults 83eba63 32 2; ~9 min)
# RUN_LIMIT (seconds, default 240) bounds each run: a run took ~130 s on one H200 machine and more
# than 170 s on another (bench_live's stamped progress lines in the logs say where the time went).
# Writes under $OUT (default ./out/live_ab): live_{base,head}_N.json, summary.txt, logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:-83eba63} STREAMS=${2:-32} ROUNDS=${3:-2}
OUT="${OUT:-out/live_ab}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
OLD=$(mktemp -d /tmp/live_ab_base.XXXX)
if ! git archive "$BASE" | tar -x -C "$OLD"; then
  echo "error: cannot check out $BASE from this repository's history" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
run() {   # tree, name
  local tree=$1 name=$2
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "${RUN_LIMIT:-240}" "$PY" benchmarks/bench_live.py --device cuda \
      --soak 0 --warmup 20 --seconds 30 --cold-seconds 10 --streams "$STREAMS" --out "$OUT/$name.json") \
      > "$OUT/$name.log" 2>&1
  grep -v "INVALID INDEX" "$OUT/$name.log" | grep -v '^{' | tail -2
}
for i in $(seq "$ROUNDS"); do
  echo "== base $BASE, round $i"; run "$OLD" "live_base_$i"
  echo "== head, round $i"; run "$PWD" "live_head_$i"
done
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':<14} {'p95 ms':>8} {'cold p95':>9} {'drop%':>6} {'VLM call p50':>13} {'windows/call':>13}")
for f in sorted(out.glob("live_*.json")):
    r = json.loads(f.read_text())["rows"][0]
    print(f"{f.stem:<14} {r['answer_latency_p95_ms']:>8.0f} {r.get('cold_latency_p95_ms') or 0:>9.0f} "
          f"{100 * r['drop_share']:>6.1f} {r['vlm_call_p50_ms']:>13.1f} {r['batch_size_mean']:>13.1f}")
PYEOF
rm -rf "$OLD"
# a device call returns at most 8 files: the logs go back as one archive
(cd "$OUT" && tar czf logs.tgz live_*.log && rm -f live_*.log)
