"""Test support: walk a jaxpr and every nested one (jit, cond, scan, custom_vjp ...).

Used by the tests that check what a traced program holds: no [B, T, V] logits in the
chunked log-prob path, and how many model passes a step runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import jax


def equations(jaxpr) -> Iterator:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from equations(sub)


def largest_intermediate(jaxpr) -> int:
    """Elements of the largest value any equation (in any nested jaxpr) produces."""
    return max(
        (math.prod(getattr(v.aval, "shape", ())) for e in equations(jaxpr) for v in e.outvars),
        default=0,
    )


def count_primitive(jaxpr, name: str, *, length: int | None = None) -> int:
    """Occurrences of primitive `name`; with `length`, only those whose `length` parameter
    equals it (a scan over the layers, not the head's scan over token chunks)."""
    return sum(
        e.primitive.name == name and length in (None, e.params.get("length"))
        for e in equations(jaxpr)
    )
