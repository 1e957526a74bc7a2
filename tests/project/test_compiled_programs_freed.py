"""What `conftest._free_compiled_programs` relies on: compiled programs hold memory mappings
until JAX's caches drop them (a suite that never drops them crashes inside XLA past
`vm.max_map_count`)."""

import gc
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers.mappings import MAX_MAPPINGS, mappings

PROGRAMS = 24  # compiled programs, each at least one mapping


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/maps")
def test_clearing_jax_caches_gives_compiled_programs_mappings_back():
    @jax.jit
    def f(x, k):
        return jnp.sin(x) * k

    before = mappings()
    for k in range(PROGRAMS):  # one program per shape
        f(jnp.ones((k + 1,)), 2.0).block_until_ready()
    grown = mappings()
    assert grown - before >= PROGRAMS, (before, grown)  # at least one mapping per program
    jax.clear_caches()
    gc.collect()
    assert mappings() < grown - 3 * PROGRAMS // 4
    assert MAX_MAPPINGS * 3 < 65530  # room for a file's worth above the threshold
