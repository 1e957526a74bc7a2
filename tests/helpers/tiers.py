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
# The further cases of a parametrized test whose every ingredient has a quick-tier case of
# its own (packing with minibatches, where packing and minibatches each have one).
MATRIX = "matrix"
# What the quick tier leaves out: the long markers, the docs checks and the matrix cases.
# The budget guards the quick tier, so it spares every one of these.
WHOLE_ONLY_MARKERS = LONG_MARKERS | {"docs", MATRIX}
QUICK_DESELECT = "not (e2e or multidevice or soak or bench or docs or matrix)"
DEFAULT_BUDGET_S = 10.0
# A unit test between the budget and GRACE times it is listed at the end, not failed: two
# machines (or two loads of one) time the same test differently.
GRACE = 1.5

_SETUP_S = pytest.StashKey[float]()


def unit_budget_s() -> float:
    """Seconds one unit test (its own set-up plus its body) may take: A3PO_TEST_BUDGET_S
    scales it for a slower machine, and 0 turns the check off."""
    return float(os.environ.get("A3PO_TEST_BUDGET_S", DEFAULT_BUDGET_S))


def pytest_collection_modifyitems(config, items):
    _check_matrix_cases(items)
    for item in items:
        try:
            parts = Path(item.fspath).resolve().relative_to(TESTS).parts
        except ValueError:  # a test outside tests/ (pytester's own)
            continue
        marker = FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None
        if marker:
            item.add_marker(getattr(pytest.mark, marker))


def _check_matrix_cases(items) -> None:
    """Refuses a test whose every case is marked `matrix`: the marker moves a matrix's
    further cases to the whole suite, and the quick tier keeps at least one of each test."""
    quick: dict[str, bool] = {}
    for item in items:
        name = f"{item.nodeid.split('::')[0]}::{getattr(item, 'originalname', item.name)}"
        quick[name] = quick.get(name, False) or item.get_closest_marker(MATRIX) is None
    whole = sorted(name for name, kept in quick.items() if not kept)
    if whole:
        raise pytest.UsageError(
            f"every case of {', '.join(whole)} is marked {MATRIX}: leave one in the quick "
            "tier, or mark the test with the tier it needs (docs/development.md)"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fails a passing quick-tier test whose set-up and body took longer than `GRACE` times
    the budget, and lists one over the budget alone: a test that needs more belongs under
    one of `LONG_MARKERS`."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item.stash[_SETUP_S] = report.duration
    budget = unit_budget_s()
    if report.when != "call" or not report.passed or budget <= 0:
        return
    if WHOLE_ONLY_MARKERS & {m.name for m in item.iter_markers()}:
        return
    took = item.stash.get(_SETUP_S, 0.0) + report.duration
    if took <= budget:
        return
    verdict = (
        f"{item.nodeid} took {took:.1f} s (set-up and body), over the unit-test budget of "
        f"{budget:g} s (A3PO_TEST_BUDGET_S): make it cheaper, or mark it one of "
        f"{', '.join(sorted(LONG_MARKERS))} (docs/development.md)"
    )
    if took > GRACE * budget:
        report.outcome = "failed"
        report.longrepr = verdict
    else:  # carried to the controller (xdist) as a report section
        report.sections.append(("unit-test budget", verdict))


def pytest_terminal_summary(terminalreporter):
    """Lists the passing unit tests that went over the budget but not over its grace."""
    over = [
        text
        for report in terminalreporter.stats.get("passed", [])
        for name, text in report.sections
        if name == "unit-test budget"
    ]
    if over:
        terminalreporter.section(f"over the unit-test budget, within its {GRACE:g}x grace")
        for line in over:
            terminalreporter.line(line)
