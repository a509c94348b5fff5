#!/usr/bin/env bash
# The cost benchmarks on one GPU with a CLIP ViT-B/16-sized model in bf16 autocast
# (b = 256 objective pairs, |B_c| = 5 constraints of |B_k| = 10 pairs: the paper's CLIP setting).
# Step overhead runs through `accelerate launch` with recipes/accelerate_configs/single_gpu.yaml and
# also records each configuration's peak CUDA memory (torch.cuda.max_memory_allocated), so the memory
# comparison needs no separate run; then constraint scaling (m = 10 ... 5000).
#
#   OUT=benchmarks/results/gpu bash benchmarks/gpu_suite.sh
#
# Check it on CPU first with a tiny model:  QUICK=1 DEVICE=cpu MODEL=tiny bash benchmarks/gpu_suite.sh
set -u -o pipefail
OUT=${OUT:-benchmarks/results/gpu}
MODEL=${MODEL:-clip-b16}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PREC=""; [ "$DEVICE" = cuda ] && PREC="--bf16"
if [ "${QUICK:-0}" = 1 ]; then
  SIZES="--batch 16 --per-step 2 --constraint-batch 4"; OV="--steps 6 --warmup 2 --rounds 1"
  SC="--ms 10,100 --steps 5 --warmup 2 --rounds 1"
else
  SIZES="--batch 256 --per-step 5 --constraint-batch 10"; OV="--steps 13 --warmup 3 --rounds 1"
  SC="--ms 10,100,1000,5000 --steps 9 --warmup 3 --rounds 1"
fi
COMMON="--model $MODEL --device $DEVICE $PREC --workdir /tmp/hf_constrained_bench"
[ "$DEVICE" = cpu ] && COMMON="$COMMON --threads 1"
{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
} 2>&1 | tee "$OUT/env.txt"
status=0
LAUNCH="$PY"
[ "$DEVICE" = cuda ] && LAUNCH="$PY -m accelerate.commands.launch --config_file recipes/accelerate_configs/single_gpu.yaml"
$LAUNCH benchmarks/step_overhead.py $COMMON $SIZES $OV --out "$OUT/step_overhead.json" 2>&1 | grep -v "^\[transformers\]" | tail -n 70 || status=1
# the same with the constraints' rows in one datasets.Dataset (one column read per step)
$LAUNCH benchmarks/step_overhead.py $COMMON $SIZES $OV --constraint-data dataset --out "$OUT/step_overhead_dataset.json" 2>&1 | grep -v "^\[transformers\]" | tail -n 70 || status=1
$PY benchmarks/constraint_scaling.py $COMMON $SIZES $SC --out "$OUT/constraint_scaling.json" 2>&1 | grep -v "^\[transformers\]" | tail -n 40 || status=1
exit $status
