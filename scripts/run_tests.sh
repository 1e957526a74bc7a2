#!/usr/bin/env bash
# Set up (if needed) and run the tests (docs/development.md):
#   bash scripts/run_tests.sh            # the whole suite: what CI runs (.ci/run)
#   bash scripts/run_tests.sh --quick    # the quick tier: every unit test, no whole runs
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh --quick tests/core`.
# A3PO_TEST_WORKERS sets the pytest-xdist workers (default: the cores, at most 4; 0 runs
# in this process); A3PO_TEST_COMPILE_CACHE=off turns the on-disk compilation cache off.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi

start=$(date +%s)
bash scripts/setup.sh --test
echo "[setup] took $(($(date +%s) - start)) s"

.venv/bin/python -m ruff check a3po_jax tests scripts experiments
marks=()
if [ "$quick" = 1 ]; then
  # tests/helpers/tiers.py's QUICK_DESELECT (a test holds them equal); no docs build. The
  # folders whose every test is deselected are not even imported.
  marks=(-m "not (e2e or multidevice or soak or bench or docs or matrix)")
  marks+=(--ignore=tests/e2e --ignore=tests/docs --ignore=tests/bench)
else
  # The documentation site (mkdocs.yml) with warnings as errors: a broken link or anchor, an
  # API entry that no longer resolves or a docstring naming a missing function fails here.
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  echo "[docs] mkdocs build --strict"
  .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
fi

cores=$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)))')
workers="${A3PO_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
parallel=()
if [ "$workers" -gt 0 ]; then parallel=(-n "$workers" --dist worksteal); fi

# --durations: the slowest tests, printed at the end, so that CI shows where its minutes go.
start=$(date +%s)
status=0
.venv/bin/python -m pytest -q --timeout=1200 --durations=25 "${parallel[@]}" "${marks[@]}" "$@" ||
  status=$?
echo "[tests] pytest took $(($(date +%s) - start)) s with ${workers} workers"
exit "$status"
