#!/usr/bin/env bash
# The cost benchmarks on one GPU, at full size, one JSON per part, each part under a time limit:
#
#   clip_step.json      CLIP ViT-B/16 (built from a config, random weights, bf16 autocast): the library's default
#                       step (row-wise non-forgetting constraints, fused, gamma' 0.1) and the same with gamma' 0
#                       against a plain Trainer step on the same rows, with each variant's peak CUDA memory;
#                       b = 256 objective pairs, |B_c| = 5 constraints of |B_k| = 10 images (the paper's setting).
#                       Launched through `accelerate launch` with recipes/accelerate_configs/single_gpu.yaml.
#   clip_scaling.json   the default step's time as the number of constraints m goes 10, 100, 1000, 5000.
#   llm_step.json       the LLM recipe's step (recipes/configs/llm_non_forgetting_lora.yaml: LoRA r16 on all linear
#                       layers, 8 rows x 2 accumulation, 3 constraints of |B_k| = 8, gamma' 0, replay 0.5, two-split
#                       0.25 with the proxy indicator) on a 0.5B-class Llama-shaped model (Qwen2.5-0.5B's shape, bf16),
#                       constrained against unconstrained, beside replay of the same rows without the hinge, the
#                       default with the look-ahead (gamma' 0.1), the proxy on the gradient's own rows (one split) and
#                       the earlier default (8:all:0); peak memory.
#
#   OUT=benchmarks/results/gpu bash benchmarks/gpu_suite.sh
#
# QUICK=1 runs the SAME model sizes with small batches and few steps (and a small image bank), so a
# host-side loop per row or per image shows on a CPU too:
#   QUICK=1 DEVICE=cpu PART_LIMIT=1500 OUT=/tmp/suite bash benchmarks/gpu_suite.sh
# MODEL=tiny LLM_MODEL=tiny shrink the models (the test suite's check of the script itself).
# PARTS: which parts to run (default: all three, "clip_step clip_scaling llm_step").
# PART_LIMIT: seconds per part (default 100 on a GPU: the whole suite within 5 minutes); a part past it is
# stopped, reported as "timed out" and the suite exits 1. A part's JSON is written only when it finishes.
set -u -o pipefail
OUT=${OUT:-benchmarks/results/gpu}
MODEL=${MODEL:-clip-b16}
LLM_MODEL=${LLM_MODEL:-0.5b}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
PART_LIMIT=${PART_LIMIT:-100}
PARTS=${PARTS:-clip_step clip_scaling llm_step}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PREC=""; [ "$DEVICE" = cuda ] && PREC="--bf16"
if [ "${QUICK:-0}" = 1 ]; then
  SIZES="--batch 2 --per-step 2 --constraint-batch 1 --bank-size 8"
  OV="--steps 3 --warmup 1 --rounds 1 --op-steps 0"
  # m = 200, not 5000: before training the library checks every constraint on |B_k| rows (preflight), which at
  # m = 5000 is 5,000 ViT-B/16 image forwards, over 25 minutes on a CPU
  SC="--ms 10,200 --steps 3 --warmup 1 --rounds 1"
  LLM="--batch 1 --accumulation 2 --seq-len 32 --constraint-rows 16 --steps 3 --warmup 1 --rounds 1"
else
  SIZES="--batch 256 --per-step 5 --constraint-batch 10 --bank-size 256"
  OV="--steps 13 --warmup 3 --rounds 1 --op-steps 0"
  SC="--ms 10,100,1000,5000 --steps 7 --warmup 2 --rounds 1"
  LLM="--seq-len 256 --constraint-rows 64 --steps 12 --warmup 3 --rounds 1"
fi
COMMON="--device $DEVICE $PREC --workdir /tmp/hf_constrained_bench"
[ "$DEVICE" = cpu ] && COMMON="$COMMON --threads 1"
{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, transformers, accelerate as a; print('torch', torch.__version__, 'transformers',
    transformers.__version__, 'accelerate', a.__version__)"
} 2>&1 | tee "$OUT/env.txt"
LAUNCH="$PY"
[ "$DEVICE" = cuda ] && \
  LAUNCH="$PY -m accelerate.commands.launch --config_file recipes/accelerate_configs/single_gpu.yaml"
status=0
part() {  # part NAME COMMAND...: run under the time limit, report its wall time and outcome
  local name=$1; shift
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  local start=$SECONDS rc
  timeout --kill-after=10 "$PART_LIMIT" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    echo "$name: done in $((SECONDS - start)) s -> $OUT/$name.json"
  elif [ $rc = 124 ] || [ $rc = 137 ]; then
    echo "$name: TIMED OUT after $PART_LIMIT s (log: $OUT/$name.log)"; status=1
  else
    echo "$name: FAILED (exit $rc) after $((SECONDS - start)) s; last lines of $OUT/$name.log:"
    tail -n 20 "$OUT/$name.log"; status=1
  fi
}
part clip_step $LAUNCH benchmarks/step_overhead.py --model "$MODEL" $COMMON $SIZES $OV \
  --variants fused_gp0.1,fused_gp0 --out "$OUT/clip_step.json"
part clip_scaling $PY benchmarks/constraint_scaling.py --model "$MODEL" $COMMON $SIZES $SC \
  --out "$OUT/clip_scaling.json"
part llm_step $PY benchmarks/llm_step.py --model "$LLM_MODEL" $COMMON $LLM \
  --variants 8:all:0:replay0.5:split0.25,8:all:0:nopenalty:replay0.5,8:all:0.1:replay0.5:split0.25,8:all:0:replay0.5:proxy,8:all:0 \
  --out "$OUT/llm_step.json"
echo "suite: $([ $status = 0 ] && echo all parts done || echo SOME PARTS FAILED) in $SECONDS s"
exit $status
