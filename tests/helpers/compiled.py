"""A function run as one compiled program in the tests (docs/development.md, "What makes
the suite fit"): eagerly every primitive compiles a program of its own."""

import functools

import jax


def jitted(fn, **static):
    """``fn`` with the keyword arguments ``static`` bound, jitted: one program per input
    shape, kept for the process (the same ``fn`` and ``static`` give the same function)."""
    return _jitted(fn, tuple(sorted(static.items())))


@functools.cache
def _jitted(fn, static):
    return jax.jit(functools.partial(fn, **dict(static)))
