#!/usr/bin/env bash
# The two small answer models, trained side by side on one 4-GPU host (data parallel, two GPUs each):
#   stage 4   arrcoc-synth-qa trained on from the shipped stage 3 (configs/qa_vlm_stage4.yaml; issue 37's
#             instrument), on the training renderers; never the held-out one
#   qwen3     a small Qwen3-VL from scratch (configs/qa_vlm_qwen3.yaml; issue 36's keep / drop of empty
#             frame groups and kept context 0 / 1 are measured with it)
# then scores stage 4 and the shipped stage 3 on 300 test clips of the training renderers and of the held-out
# renderer (python -m pipeline.training.qa_eval), and leaves in $OUT what a device call can bring back
# (at most 8 files of 16 MiB): logs.tgz (logs, histories, scores) and snaps.tgz.part_* (both snapshots,
# ~60 MiB in 15 MiB parts; join with `cat snaps.tgz.part_* | tar xz`).
#
# The device needs no scikit-image: the photo renderer's photographs come from a stand-in package in CARRY,
# which `benchmarks/gpu/train_arrcoc.sh --prepare` writes on a CPU machine that has scikit-image (carry
# runs/arrcoc_carry). A device call is at most 10 minutes: split the training over two calls on the same warm
# machine (the checkpoints stay in WORK):
#   benchmarks/gpu/train_answer_models.sh --limit-s 400            # first call: 400 s of training each
#   benchmarks/gpu/train_answer_models.sh --resume --limit-s 800   # second: on to 800 s (limits are totals)
# Options: --stage4-steps / --qwen3-steps (the LR schedules' lengths: ~2.1 and ~2 steps/s on two H200s;
# stage 4 on one H200: 0.84-0.93 steps/s, the 500-step schedule in 580 s of training over two calls),
# --workers N (data workers per process), --gpus-a 0,1 --gpus-b 2,3, --cpus-a 0-31 --cpus-b 32-63 (taskset),
# --only stage4|qwen3 (train that one alone, e.g. on a one-GPU machine: --only qwen3 --gpus-b 0 --cpus-b 0-15),
# --skip-eval, --smoke (a few steps of tiny data on the CPU: the check of this script's commands).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python}
CARRY=runs/arrcoc_carry
OUT_DIR=${OUT:-runs/answer_models}
WORK=${WORK:-/tmp/answer_models}
LIMIT_S=400 RESUME=() S4_STEPS=1700 Q3_STEPS=1600 WORKERS=14
GPUS_A=0,1 GPUS_B=2,3 CPUS_A=0-31 CPUS_B=32-63 EVAL=1 SMOKE=0 EVAL_CLIPS=300 ONLY=
while [ $# -gt 0 ]; do
  case "$1" in
    --limit-s) LIMIT_S=$2; shift ;;
    --resume) RESUME=(--resume) ;;
    --stage4-steps) S4_STEPS=$2; shift ;;
    --qwen3-steps) Q3_STEPS=$2; shift ;;
    --workers) WORKERS=$2; shift ;;
    --gpus-a) GPUS_A=$2; shift ;;
    --gpus-b) GPUS_B=$2; shift ;;
    --cpus-a) CPUS_A=$2; shift ;;
    --cpus-b) CPUS_B=$2; shift ;;
    --carry) CARRY=$2; shift ;;
    --out) OUT_DIR=$2; shift ;;
    --skip-eval) EVAL=0 ;;
    --only) ONLY=$2; shift ;;
    --smoke) SMOKE=1 ;;
    *) echo "error: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
case "$ONLY" in
  "") NAMES=(stage4 qwen3) ;;
  stage4|qwen3) NAMES=("$ONLY") ;;
  *) echo "error: --only takes stage4 or qwen3, not '$ONLY'" >&2; exit 2 ;;
esac
# stage 4's scores compare it with the shipped stage 3: they need stage 4
if [ "$ONLY" = qwen3 ]; then EVAL=0; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! "$PY" -c "import skimage.data" 2>/dev/null; then
  if [ ! -f "$CARRY/skimage/data/astronaut.png" ]; then
    echo "error: scikit-image is missing and $CARRY/skimage holds no photographs: run" \
         "benchmarks/gpu/train_arrcoc.sh --prepare where scikit-image is, and carry $CARRY" >&2
    exit 2
  fi
  export PYTHONPATH=$PYTHONPATH:$PWD/$CARRY
fi
mkdir -p "$OUT_DIR" "$WORK"
LOGS=$WORK/logs; mkdir -p "$LOGS"

EXTRA=() DEVICE=cuda
if [ "$SMOKE" = 1 ]; then
  EXTRA=(--set train.clips_per_step=4 --set train.warmup_steps=1 --set val.clips=4 --set val.periodic_clips=0
         --set train.device=cpu --set drop.curriculum_steps=1)
  S4_STEPS=2 Q3_STEPS=2 WORKERS=1 DEVICE=cpu EVAL_CLIPS=2
fi

train() {   # name, config, steps, gpus, cpus
  local name=$1 config=$2 steps=$3 gpus=$4 cpus=$5
  local procs; procs=$(awk -F, '{print NF}' <<< "$gpus")
  local launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$procs")
  if [ "$SMOKE" = 1 ]; then launch=("$PY"); fi
  CUDA_VISIBLE_DEVICES=$gpus taskset -c "$cpus" "${launch[@]}" -m pipeline.training.qa_vlm --config "$config" \
    --out-dir "$WORK/$name" "${RESUME[@]}" --set train.steps="$steps" --set train.time_limit_s="$LIMIT_S" \
    --set train.workers="$WORKERS" "${EXTRA[@]}" > "$LOGS/train_$name.log" 2>&1
}
if [ "$SMOKE" = 1 ]; then CPUS_A=0-$(($(nproc) - 1)) CPUS_B=$CPUS_A; fi
t0=$SECONDS
status=0
pids=()
if [[ " ${NAMES[*]} " == *" stage4 "* ]]; then
  train stage4 configs/qa_vlm_stage4.yaml "$S4_STEPS" "$GPUS_A" "$CPUS_A" & pids+=($!)
fi
if [[ " ${NAMES[*]} " == *" qwen3 "* ]]; then
  train qwen3 configs/qa_vlm_qwen3.yaml "$Q3_STEPS" "$GPUS_B" "$CPUS_B" & pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "== training: $((SECONDS - t0)) s (exit $status)"
for name in "${NAMES[@]}"; do
  echo "== $name"; grep -v "^qa_vlm\|INVALID INDEX" "$LOGS/train_$name.log" | tail -n 6 | cut -c1-400
done

if [ "$EVAL" = 1 ]; then
  IFS=, read -r -a ga <<< "$GPUS_A"; IFS=, read -r -a gb <<< "$GPUS_B"
  score() {   # gpu, snapshot, name, qa_eval flags
    local gpu=$1 snap=$2 name=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu "$PY" -m pipeline.training.qa_eval "$snap" --clips "$EVAL_CLIPS" --device "$DEVICE" \
      "$@" --out "$LOGS/eval_$name.json" > "$LOGS/eval_$name.log" 2>&1 || echo "qa_eval $name failed" >&2
  }
  score "${ga[0]}" "$WORK/stage4/snapshot" stage4_in & score "${ga[1]:-${ga[0]}}" "$WORK/stage4/snapshot" stage4_held --held-out &
  score "${gb[0]}" arrcoc-synth-qa stage3_in & score "${gb[1]:-${gb[0]}}" arrcoc-synth-qa stage3_held --held-out &
  wait
  for name in stage4_in stage4_held stage3_in stage3_held; do
    echo "== $name"; "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps(d)[:600])" \
      "$LOGS/eval_$name.json" 2>/dev/null || tail -n 3 "$LOGS/eval_$name.log"
  done
fi

for name in "${NAMES[@]}"; do cp "$WORK/$name/history.json" "$LOGS/history_$name.json" 2>/dev/null || true; done
rm -rf "$WORK/snaps" && mkdir -p "$WORK/snaps"
for name in "${NAMES[@]}"; do
  [ -d "$WORK/$name/snapshot" ] && cp -r "$WORK/$name/snapshot" "$WORK/snaps/$name"
done
tar czf "$WORK/snaps.tgz" -C "$WORK" snaps
rm -f "$OUT_DIR"/snaps.tgz.part_*
split -b 15M "$WORK/snaps.tgz" "$OUT_DIR/snaps.tgz.part_"
tar czf "$OUT_DIR/logs.tgz" -C "$LOGS" .
ls -la "$OUT_DIR"
exit $status
