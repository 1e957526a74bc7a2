#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow end-to-end tests included.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -m "not slow"` for a quick run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m ruff check a3po_jax tests scripts experiments
# The documentation site (mkdocs.yml) with warnings as errors: a broken link or anchor, an
# API entry that no longer resolves or a docstring naming a missing function fails here.
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
echo "[docs] mkdocs build --strict"
.venv/bin/mkdocs build --strict --quiet --site-dir "$site"
# --durations: the slowest tests, printed at the end, so that CI shows where its minutes go.
.venv/bin/python -m pytest -q --timeout=1200 --durations=25 "$@"
