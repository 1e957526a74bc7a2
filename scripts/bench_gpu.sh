#!/usr/bin/env bash
# The training-step and generation benchmarks on one accelerator, in bfloat16, at SmolLM2-135M
# and Qwen2.5-1.5B shapes (random weights): issue 15's and issue 19's GPU figures.
#
#   bash scripts/bench_gpu.sh [OUT_DIR]          # default runs/bench_gpu
#
# Each benchmark writes its log (and the inference ones their JSON) to OUT_DIR and runs
# under its own time limit (BENCH_TIMEOUT_SCALE=2 doubles them), so one that fails or runs
# long leaves the others' figures. Run from the repository root with jax[cuda] installed
# (or any jax whose default backend is the accelerator).
set -uo pipefail
out=${1:-runs/bench_gpu}
scale=${BENCH_TIMEOUT_SCALE:-1}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1

python3 - <<'EOF' 2>&1 | tee "$out/versions.log"
import jax, flax, optax
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)
print("devices", jax.devices())
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null |
  tee -a "$out/versions.log"

bench() {  # NAME SECONDS COMMAND...
  local name=$1 limit=$(($2 * scale))
  shift 2
  echo "=== $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: rc $rc after $((SECONDS - start)) s"
}

bench train_smollm2 150 python3 scripts/bench_train_step.py --config smollm2 --dtype bfloat16 \
  --batch 64 --group-size 8 --prompt-len 256 --response-len 256 --repeats 5
bench train_qwen1p5b 150 python3 scripts/bench_train_step.py --config qwen2.5-1.5b \
  --dtype bfloat16 --batch 16 --group-size 8 --prompt-len 256 --response-len 256 --repeats 3
bench infer_smollm2 120 python3 scripts/bench_inference.py --model smollm2 --dtype bfloat16 \
  --batch-sizes 1,8,32 --no-hf --json "$out/infer_smollm2.json"
bench infer_qwen1p5b 110 python3 scripts/bench_inference.py --model qwen2.5-1.5b \
  --dtype bfloat16 --batch-sizes 1,8,32 --no-hf --no-profile --json "$out/infer_qwen1p5b.json"
bench dispatch 100 python3 scripts/bench_decode_dispatch.py --models smollm2,qwen2.5-1.5b \
  --dtype bfloat16
