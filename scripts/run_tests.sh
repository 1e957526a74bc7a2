#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow end-to-end tests included.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -m "not slow"` for a quick run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m ruff check a3po_jax tests scripts experiments
# --durations: the slowest tests, printed at the end, so that CI shows where its minutes go.
exec .venv/bin/python -m pytest -q --timeout=1200 --durations=25 "$@"
