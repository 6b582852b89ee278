#!/usr/bin/env bash
# ARR-COC trained for the renderers' distribution, then on the answers, on one GPU in about 7 minutes:
#   1. relevance      python -m pipeline train --config configs/train_renderers.yaml
#   2. answer loss    python -m pipeline train --config configs/train_renderers_vlm_qa.yaml (soft keep, frozen VLM)
#   3. outcome        python -m pipeline.training.outcome --config configs/train_outcome.yaml (hard selection,
#                     exact-match reward, GRPO)
#   4. compare        python -m pipeline.training.outcome --compare ...: exact-match accuracy on val clips of the
#                     training renderers, ARR-COC's hard selection at 10% with the shipped and each new weights
# each time-bounded, each starting from the previous one's weights, each exporting its weights and log to
# $OUT (8 files, a few hundred KiB each): arrcoc_{relevance,vlm_qa,outcome}.safetensors, compare.json, *.log.
# Load one with
#   --set runtime.model_weights=PATH   (e.g. benchmarks/bench_accuracy.py ... --set runtime.model_weights=PATH)
#
# The device needs no MiniLM and no scikit-image: every question's query vector comes from a table and the
# photo renderer's photographs from a copy, both in CARRY (default runs/arrcoc_carry, ~15 MiB), which
# `--prepare` writes here on a CPU machine that has both packages (about 2 minutes):
#   benchmarks/gpu/train_arrcoc.sh --prepare
# On the GPU machine (carry runs/arrcoc_carry):
#   benchmarks/gpu/train_arrcoc.sh [--vlm arrcoc-synth-qa|SNAPSHOT_DIR] [--out DIR]
#                                  [--relevance-s 90] [--vlm-qa-s 100] [--outcome-s 130] [--device cuda]
# --vlm names the frozen answer model of stages 2 and 3 (default: the shipped arrcoc-synth-qa; a directory:
# a retrained snapshot). Stage limits count from each stage's start, data drawing included; each stage
# also needs ~10-20 s to start (imports, CUDA, loading). --relevance-set / --vlm-qa-set / --outcome-set
# KEY=VALUE (repeatable) pass a config override to that stage (e.g. --outcome-set train.temperature=0.2).
# --smoke runs every stage for a few steps on tiny data (the CPU check of this script).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python}
CARRY=runs/arrcoc_carry
OUT_DIR=${OUT:-runs/arrcoc_gpu}
VLM=arrcoc-synth-qa
DEVICE=cuda
REL_S=90
VQA_S=100
OUT_S=130
VAL_CLIPS=96
WORKERS=12
PREPARE=0
SMOKE=0
REL_EXTRA=() VQA_EXTRA=() OUT_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) PREPARE=1 ;;
    --smoke) SMOKE=1 ;;
    --vlm) VLM=$2; shift ;;
    --out) OUT_DIR=$2; shift ;;
    --carry) CARRY=$2; shift ;;
    --device) DEVICE=$2; shift ;;
    --relevance-s) REL_S=$2; shift ;;
    --vlm-qa-s) VQA_S=$2; shift ;;
    --outcome-s) OUT_S=$2; shift ;;
    --workers) WORKERS=$2; shift ;;
    --relevance-set) REL_EXTRA+=(--set "$2"); shift ;;
    --vlm-qa-set) VQA_EXTRA+=(--set "$2"); shift ;;
    --outcome-set) OUT_EXTRA+=(--set "$2"); shift ;;
    *) echo "error: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ "$PREPARE" = 1 ]; then
  mkdir -p "$CARRY/skimage/data"
  "$PY" -m pipeline.training.query_table --out "$CARRY/query_table.safetensors"
  # a stand-in package holding only the photographs evaluation/draw.py reads (used where scikit-image is absent)
  src=$("$PY" -c "import pathlib, skimage.data; print(pathlib.Path(skimage.data.__file__).parent)")
  names=$("$PY" -c "from evaluation.draw import PHOTOS; print(' '.join(PHOTOS))")
  for n in $names; do cp "$src/$n" "$CARRY/skimage/data/$n"; done
  echo '"""The photographs of scikit-image that evaluation/draw.py reads, for machines without it."""' \
    > "$CARRY/skimage/__init__.py"
  : > "$CARRY/skimage/data/__init__.py"
  du -sh "$CARRY"
  exit 0
fi

TABLE=$CARRY/query_table.safetensors
if [ ! -f "$TABLE" ]; then
  echo "error: no query table at $TABLE: run $0 --prepare on a machine with MiniLM, and carry $CARRY" >&2
  exit 2
fi
if ! "$PY" -c "import skimage.data" 2>/dev/null; then
  if [ ! -f "$CARRY/skimage/data/astronaut.png" ]; then
    echo "error: scikit-image is missing and $CARRY/skimage holds no photographs: run $0 --prepare" >&2
    exit 2
  fi
  export PYTHONPATH=$PYTHONPATH:$PWD/$CARRY
fi
mkdir -p "$OUT_DIR"
WORK=runs/arrcoc_gpu_work
rm -rf "$WORK"

# tiny data and a few steps: the CPU check of this script's commands
REL_SMOKE=() VQA_SMOKE=() OUT_SMOKE=()
if [ "$SMOKE" = 1 ]; then
  REL_SMOKE=(--set data.render_clips=6 --set data.val_scenes=2 --set data.hard_scenes=4 --set data.clips=2
             --set "stages=[{name: grounding, epochs: 1}, {name: temporal, epochs: 1, batch_size: 1}, {name: hard, epochs: 1}]")
  VQA_SMOKE=(--set data.qa_clips=2 --set data.val_scenes=2 --set "stages=[{name: vlm_qa, epochs: 1, batch_size: 2}]")
  OUT_SMOKE=(--set data.clips=2 --set data.val_clips=1 --set train.steps=2 --set train.clips_per_step=1
             --set train.samples=2 --set train.log_every=1)
  VAL_CLIPS=2
fi

stage() {   # name, then the command; its stderr (progress) goes to the terminal and to $OUT_DIR/name.log
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" >&2
  "$@" 2> >(tee "$OUT_DIR/$name.log" >&2)
  echo "== $name done in $((SECONDS - t0)) s" >&2
}

stage relevance "$PY" -m pipeline train --config configs/train_renderers.yaml \
  --set device="$DEVICE" --set queries="$TABLE" --set data.workers="$WORKERS" --set time_limit_s="$REL_S" \
  --set out_dir="$WORK/relevance" "${REL_SMOKE[@]}" "${REL_EXTRA[@]}" --export "$OUT_DIR/arrcoc_relevance.safetensors"

stage vlm_qa "$PY" -m pipeline train --config configs/train_renderers_vlm_qa.yaml \
  --set device="$DEVICE" --set vlm="$VLM" --set queries="$TABLE" --set data.workers="$WORKERS" \
  --set init="$OUT_DIR/arrcoc_relevance.safetensors" --set time_limit_s="$VQA_S" \
  --set out_dir="$WORK/vlm_qa" "${VQA_SMOKE[@]}" "${VQA_EXTRA[@]}" --export "$OUT_DIR/arrcoc_vlm_qa.safetensors"

stage outcome "$PY" -m pipeline.training.outcome --config configs/train_outcome.yaml \
  --set device="$DEVICE" --set vlm="$VLM" --set queries="$TABLE" --set data.workers="$WORKERS" \
  --set init="$OUT_DIR/arrcoc_vlm_qa.safetensors" --set train.time_limit_s="$OUT_S" \
  --set out_dir="$WORK/outcome" "${OUT_SMOKE[@]}" "${OUT_EXTRA[@]}" --export "$OUT_DIR/arrcoc_outcome.safetensors"

W=$OUT_DIR/arrcoc
stage compare "$PY" -m pipeline.training.outcome --config configs/train_outcome.yaml \
  --set device="$DEVICE" --set vlm="$VLM" --set queries="$TABLE" --set data.workers="$WORKERS" \
  --set data.val_clips="$VAL_CLIPS" --set out_dir="$WORK/compare" \
  --compare "default,synth-qa,${W}_relevance.safetensors,${W}_vlm_qa.safetensors,${W}_outcome.safetensors" \
  > "$OUT_DIR/compare.json"
cat "$OUT_DIR/compare.json"
ls -la "$OUT_DIR" >&2
