#!/usr/bin/env bash
# The test suite on a GPU. By default it runs on the CPU (tests/conftest.py), which is what
# CI runs; this script puts it on the accelerator, in parts, each under its own time limit,
# so that a short lease still brings back the parts that finished.
#
#   bash scripts/test_gpu.sh [OUT_DIR] [PART ...]     # default runs/test_gpu, all parts
#
# Parts:
#   fast     the quick tier (docs/development.md)
#   slow     the whole runs, soaks, benchmarks and multi-device tests
#   replay   tests/training/test_replay.py twice: as is, and with
#            XLA_FLAGS=--xla_gpu_deterministic_ops=true
#            (XLA:GPU's atomic scatter-adds can make a replay miss its recording)
#
# Needs a python3 (or $PYTHON) whose jax sees the GPU (pip install -e '.[cuda,test]'), and
# runs pytest-xdist workers when it is installed ($WORKERS, default 8). Float32 matmuls are
# kept at full precision, as on a CPU: XLA:GPU's default would be TF32. BENCH_TIMEOUT_SCALE=2
# doubles the limits; PYTEST_ARGS adds arguments to every part (e.g. PYTEST_ARGS="-k replay").
# Each part's log and JUnit XML go to OUT_DIR; the last lines printed
# are one summary line per part.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/test_gpu}
shift $(($# > 0 ? 1 : 0))
parts=${*:-fast slow replay}
scale=${BENCH_TIMEOUT_SCALE:-1}
py=${PYTHON:-python3}
mkdir -p "$out"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} JAX_DEFAULT_MATMUL_PRECISION=highest
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)

"$py" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$out/versions.log"
workers=()
if "$py" -c "import xdist" 2>/dev/null; then workers=(-n "${WORKERS:-8}"); fi

summary=()
part() {  # NAME SECONDS PYTEST_ARGS...
  local name=$1 limit=$(($2 * scale))
  shift 2
  echo "=== $name (limit ${limit} s): pytest $*"
  local start=$SECONDS
  timeout "$limit" "$py" -m pytest -q -p no:cacheprovider "${workers[@]}" --timeout=300 \
    --junitxml="$out/$name.xml" "$@" ${PYTEST_ARGS:-} >"$out/$name.log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR)" "$out/$name.log" | cut -c1-160
  summary+=("$name: rc $rc after $((SECONDS - start)) s: $(tail -n 1 "$out/$name.log")")
}

for p in $parts; do
  case $p in
    fast) part fast 480 -m "not (e2e or multidevice or soak or bench or docs)" ;;
    slow) part slow 600 -m "e2e or multidevice or soak or bench" ;;
    replay)
      part replay 300 tests/training/test_replay.py
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_deterministic_ops=true" \
        part replay_deterministic 300 tests/training/test_replay.py
      ;;
    *) echo "unknown part $p (fast, slow, replay)" >&2; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
