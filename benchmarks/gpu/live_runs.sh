# Sourced by live_capture.sh and live_nvdec.sh (from the repository root): the run folder and one
# bench_live row.
#   live_setup DEFAULT_OUT     $OUT (default DEFAULT_OUT) made and made absolute, $PY, PYTHONPATH
#   run NAME ARGS...           bench_live (720p30, $LIVE_WARMUP_S s of warm-up, default 20, then 30 s
#                              measured, the first 10 s cold) with ARGS into $OUT/NAME.json and
#                              .log; prints the table's last lines. $RUN_LIMIT (170 s), $DEVICE
#                              (cuda) and $EXTRA (e.g. --quick) as the scripts document.
live_setup() {
    OUT="${OUT:-$1}"
    PY="${PYTHON:-python3}"
    mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}
run() {
    local name=$1; shift
    timeout "${RUN_LIMIT:-170}" "$PY" benchmarks/bench_live.py --device "${DEVICE:-cuda}" ${EXTRA:-} --soak 0 \
        --warmup "${LIVE_WARMUP_S:-20}" --seconds 30 --cold-seconds 10 "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    grep -v "INVALID INDEX" "$OUT/$name.log" | grep -v '^{' | tail -2
}
