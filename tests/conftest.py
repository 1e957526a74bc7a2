"""Shared test set-up: CPU only, float32, quiet TensorFlow, compiled programs freed per file."""

import gc
import os
import sys

import pytest

# Tests run on the CPU whatever the machine has: results must not depend on an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops JAX's compiled programs after each test file.

    Every XLA:CPU executable keeps about three memory mappings (code, constants, data) for as
    long as a jit cache holds it. The whole suite in one process compiles thousands, and past
    the kernel's limit on mappings per process (`vm.max_map_count`, 65530 by default) the next
    compile crashes the interpreter inside XLA. Clearing the caches per file keeps the count
    at one file's worth; a file that shares programs between its tests still shares them.
    """
    yield
    if "jax" in sys.modules:  # never the first to import jax (XLA_FLAGS may not be set yet)
        sys.modules["jax"].clear_caches()
        gc.collect()
