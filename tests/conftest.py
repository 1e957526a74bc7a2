"""Shared test set-up: CPU only, float32, quiet TensorFlow, compiled programs freed in time."""

import gc
import os
import sys

import pytest

# Tests run on the CPU whatever the machine has: results must not depend on an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Every XLA:CPU executable keeps about three memory mappings (code, constants, data) for as
# long as a jit cache holds it. The whole suite in one process compiles thousands, and past
# the kernel's limit on mappings per process (`vm.max_map_count`, 65530 by default) the next
# compile crashes the interpreter inside XLA. One test file adds up to ~15 000.
MAX_MAPPINGS = 20_000


def _mappings() -> int | None:
    """This process's memory mappings, or None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After a test file, drops JAX's compiled programs once the process holds more than
    `MAX_MAPPINGS` mappings (after every file where they cannot be counted): programs
    shared between files are kept until then, which saves their compiles."""
    yield
    if "jax" not in sys.modules:  # never the first to import jax (XLA_FLAGS may not be set)
        return
    count = _mappings()
    if count is None or count > MAX_MAPPINGS:
        sys.modules["jax"].clear_caches()
        gc.collect()
