"""The suite's own shape (docs/development.md): tests live in their layer's folder, no test
file imports another, every marker is registered, and the unit-test budget fails a slow
unmarked test but not a marked one."""

import ast
import json
import tomllib

from helpers.paths import REPO, TESTS
from helpers.tiers import QUICK_DESELECT, WHOLE_ONLY_MARKERS

pytest_plugins = ["pytester"]

LAYERS = {"core", "model", "parallel", "inference", "rollout", "tasks", "training"}
LAYERS |= {"analysis", "cli"}
OTHER_FOLDERS = {"e2e", "docs", "bench", "project", "helpers", "data", "__pycache__"}


def test_test_files_live_in_folders_that_mirror_the_package():
    assert not list(TESTS.glob("test_*.py")), "test files go in their layer's folder"
    packages = {p.name for p in (REPO / "a3po_jax").iterdir() if (p / "__init__.py").exists()}
    assert LAYERS == packages, "tests/ mirrors a3po_jax/: a layer folder per package"
    folders = {p.name for p in TESTS.iterdir() if p.is_dir()}
    assert folders <= LAYERS | OTHER_FOLDERS, folders - LAYERS - OTHER_FOLDERS
    for layer in LAYERS:
        assert list((TESTS / layer).glob("test_*.py")), f"tests/{layer}/ has no tests"


def test_no_test_file_imports_another():
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")} | {"conftest"}
    offenders = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[-1] in test_modules:
                    offenders.append(f"{path.relative_to(TESTS)} imports {name}")
    assert not offenders, "shared code goes in tests/helpers/: " + "; ".join(offenders)


def test_markers_are_strict_and_every_tier_marker_is_registered():
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in ini["addopts"].split()
    registered = {m.split(":")[0] for m in ini["markers"]}
    assert registered == WHOLE_ONLY_MARKERS
    for marker in registered:
        assert marker in QUICK_DESELECT
    # The quick tier's command deselects exactly these.
    assert f'-m "{QUICK_DESELECT}"' in (REPO / "scripts" / "run_tests.sh").read_text()


BODY = """
import time
import pytest

def test_unmarked_slow():
    time.sleep(0.8)

@pytest.mark.e2e
def test_marked_slow():
    time.sleep(0.8)

@pytest.mark.docs
def test_docs_slow():
    time.sleep(0.8)

def test_unmarked_fast():
    pass
"""


def test_the_budget_fails_a_slow_unit_test_and_spares_a_marked_one(pytester, monkeypatch):
    pytester.makepyfile(test_budget=BODY)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: whole runs\n    docs: pages\n")
    # 0.8 s is over the budget's 1.5x grace; an empty test keeps 0.75 s of headroom, for a
    # collection in this worker's large heap or a busy machine (a 0.3 s budget was not).
    monkeypatch.setenv("A3PO_TEST_BUDGET_S", "0.5")
    result = pytester.runpytest_inprocess("-p", "helpers.tiers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked_slow took *over the unit-test budget of 0.5 s*"])
    monkeypatch.setenv("A3PO_TEST_BUDGET_S", "0")
    result = pytester.runpytest_inprocess("-p", "helpers.tiers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


def test_a_unit_test_within_the_grace_is_listed_not_failed(pytester, monkeypatch):
    """Between the budget and 1.5 times it, a passing test stays passed and is named at the
    end; one machine times a test differently from another."""
    pytester.makepyfile(test_grace="import time\n\ndef test_a_bit_slow():\n    time.sleep(0.5)\n")
    monkeypatch.setenv("A3PO_TEST_BUDGET_S", "0.4")  # grace up to 0.6 s
    result = pytester.runpytest_inprocess("-p", "helpers.tiers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*over the unit-test budget, within its 1.5x grace*", "*test_a_bit_slow took *"]
    )
    monkeypatch.setenv("A3PO_TEST_BUDGET_S", "0")  # the budget read for this test itself


MATRIX_KEPT = """
import pytest

@pytest.mark.parametrize("case", ["plain", pytest.param("combined", marks=pytest.mark.matrix)])
def test_kept(case):
    pass
"""
MATRIX_ALL = """
import pytest

@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.matrix) for c in "ab"])
def test_all_moved(case):
    pass
"""


def test_a_matrix_moves_further_cases_and_never_a_whole_test(pytester):
    """The quick tier deselects a `matrix` case and keeps its test's other cases; a test
    whose every case is marked is refused by name, since the quick tier would lose it."""
    pytester.makeini("[pytest]\nmarkers =\n    matrix: further cases\n")
    args = ("-p", "helpers.tiers", "-p", "no:cacheprovider", "-m", QUICK_DESELECT)
    pytester.makepyfile(test_matrix=MATRIX_KEPT)
    result = pytester.runpytest_inprocess(*args, "-v")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_kept[[]plain[]] PASSED*"])
    pytester.makepyfile(test_matrix=MATRIX_KEPT + MATRIX_ALL)
    result = pytester.runpytest_inprocess(*args)
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*every case of test_matrix.py::test_all_moved is marked matrix*"])


COMPILES = """
import time

import jax
import jax.numpy as jnp
import numpy as np

# A shape no earlier run compiled: a persistent-cache hit would compile nothing.
N = 1000 + time.time_ns() % 100_000


def test_eager():
    x = np.ones((N, 3), np.float32)  # no program: numpy's array is put as it is
    (jnp.exp(x) * 3.0 + x).block_until_ready()


def test_jitted():
    x = np.ones((N, 5), np.float32)
    jax.jit(lambda x: jnp.exp(x) * 3.0 + x)(x).block_until_ready()
"""


def test_the_compile_report_counts_each_tests_programs(pytester, monkeypatch, tmp_path):
    """A3PO_TEST_COMPILE_REPORT writes one line per test: eager JAX compiles a program per
    primitive (exp, multiply, add), one jit compiles one; the summary totals them by file."""
    from helpers.compile_report import summary

    pytester.makepyfile(test_compiles=COMPILES)
    report = tmp_path / "compiles.jsonl"
    monkeypatch.setenv("A3PO_TEST_COMPILE_REPORT", str(report))
    result = pytester.runpytest_inprocess("-p", "helpers.compile_report", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    records = {r["test"]: r for r in map(json.loads, report.read_text().splitlines())}
    assert set(records) == {"test_compiles.py::test_eager", "test_compiles.py::test_jitted"}
    assert records["test_compiles.py::test_eager"]["programs"] >= 3
    assert records["test_compiles.py::test_jitted"]["programs"] == 1
    for r in records.values():
        assert 0 < r["compile_s"] and 0 < r["lower_s"] and 0 < r["wall_s"]
    table = summary(report).splitlines()
    assert table[2].startswith("| test_compiles.py | 2 | ")
