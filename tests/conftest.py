"""Shared test set-up: CPU only, float32, quiet TensorFlow, one on-disk compilation cache,
tiers by folder and marker, a time budget for unit tests, compiled programs freed in time.

The tiers and budgets are described in docs/development.md."""

import gc
import os
import sys
from pathlib import Path

import pytest
from helpers.codegen import CHEAP_CODEGEN
from helpers.mappings import MAX_MAPPINGS, mappings

# Tiers by folder and marker, the unit-test time budget, and the per-test compile report
# (A3PO_TEST_COMPILE_REPORT).
pytest_plugins = ["helpers.tiers", "helpers.compile_report"]

TESTS = Path(__file__).resolve().parent

# Tests run on the CPU whatever the machine has: results must not depend on an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# glibc's own mmap threshold: fixed by a trainer's heap trimmer, it stays for the rest of a
# worker's life and slows every later compile there (training/heap.py).
os.environ.setdefault("A3PO_MMAP_LARGE_BLOCKS", "0")

# The runs' end-of-run reports without their plots (matplotlib's import and four figures in
# each of the suite's CLI runs); tests/analysis/test_run_report.py draws them.
os.environ.setdefault("A3PO_REPORT_PLOTS", "0")

# Cheaper CPU code generation (helpers/codegen.py). Where XLA_FLAGS is set already (a
# user's, or a multi-device child's), it is left as it is.
os.environ.setdefault("XLA_FLAGS", CHEAP_CODEGEN)

# JAX's persistent compilation cache, keyed as JAX keys it (program, flags, devices, jax
# version): tests, xdist workers and the runs they start in subprocesses compile the same
# programs again and again, and a hit loads the executable instead. Environment variables,
# so every child process inherits them. A3PO_TEST_COMPILE_CACHE=off turns it off.
if os.environ.get("A3PO_TEST_COMPILE_CACHE", "") != "off":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR",
        os.environ.get("A3PO_TEST_COMPILE_CACHE") or str(TESTS.parent / ".cache" / "jax-tests"),
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
else:  # off for the runs too: their system.run.compile_cache_dir would land in the home dir
    os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After a test file, drops JAX's compiled programs once the process holds more than
    `MAX_MAPPINGS` mappings (after every file where they cannot be counted): programs
    shared between files are kept until then, which saves their compiles."""
    yield
    if "jax" not in sys.modules:  # never the first to import jax (XLA_FLAGS may not be set)
        return
    count = mappings()
    if count is None or count > MAX_MAPPINGS:
        sys.modules["jax"].clear_caches()
        gc.collect()


@pytest.fixture
def flat_system_names(monkeypatch):
    """For a test of the flat system names' deprecation path (``inference_hosts`` directly on
    ``system``): each is announced again, and `_no_flat_system_names` lets the test read them."""
    from a3po_jax.training import config_values

    monkeypatch.setattr(config_values, "RENAMED_READ", set())


@pytest.fixture(autouse=True)
def _no_flat_system_names(request):
    """Fails a test that reads a flat system name unless it asks for `flat_system_names`.
    Each test starts with no renamed spelling announced, so whichever test reads one fails,
    not only the first in its process to do so."""
    module = sys.modules.get("a3po_jax.training.config_values")
    saved = None
    if module is not None:
        saved, module.RENAMED_READ = module.RENAMED_READ, set()
    yield
    module = sys.modules.get("a3po_jax.training.config_values")
    if module is None:
        return
    read = sorted(name for name in module.RENAMED_READ if name.startswith("system."))
    if saved is not None:
        module.RENAMED_READ = saved | module.RENAMED_READ
    if read and "flat_system_names" not in request.fixturenames:
        pytest.fail(f"flat system name(s) {read} read: write system.<section>.<field>")
