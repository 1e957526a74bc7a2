"""The suite's tiers as a pytest plugin (registered by tests/conftest.py): the folder
markers, and the time budget of a unit test. docs/development.md describes both."""

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# Folders whose every test carries the folder's marker (the others set theirs in the file).
FOLDER_MARKERS = {"e2e": "e2e", "docs": "docs", "bench": "bench"}
# Tests under these markers may take longer than the unit budget.
LONG_MARKERS = frozenset({"e2e", "soak", "bench", "multidevice"})
# What the quick tier leaves out: the long markers and the docs checks.
QUICK_DESELECT = "not (e2e or multidevice or soak or bench or docs)"
DEFAULT_BUDGET_S = 10.0

_SETUP_S = pytest.StashKey[float]()


def unit_budget_s() -> float:
    """Seconds one unit test (its own set-up plus its body) may take: A3PO_TEST_BUDGET_S
    scales it for a slower machine, and 0 turns the check off."""
    return float(os.environ.get("A3PO_TEST_BUDGET_S", DEFAULT_BUDGET_S))


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            parts = Path(item.fspath).resolve().relative_to(TESTS).parts
        except ValueError:  # a test outside tests/ (pytester's own)
            continue
        marker = FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None
        if marker:
            item.add_marker(getattr(pytest.mark, marker))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fails a passing unit test whose set-up and body took longer than the budget: a test
    that needs more belongs under one of `LONG_MARKERS`."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item.stash[_SETUP_S] = report.duration
    budget = unit_budget_s()
    if report.when != "call" or not report.passed or budget <= 0:
        return
    if LONG_MARKERS & {m.name for m in item.iter_markers()}:
        return
    took = item.stash.get(_SETUP_S, 0.0) + report.duration
    if took > budget:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {took:.1f} s (set-up and body), over the unit-test budget of "
            f"{budget:g} s (A3PO_TEST_BUDGET_S): make it cheaper, or mark it one of "
            f"{', '.join(sorted(LONG_MARKERS))} (docs/development.md)"
        )
