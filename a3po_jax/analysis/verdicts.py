"""The reproduction report's verdict words, by its rule (docs/results.md, "Verdict words").

Analysis layer (host side, plain Python).

Two methods *separate* on a measure only when every seed of one lies beyond every seed of
the other; with fewer seeds than the rule asks, or with any overlap, the words are *not
separable*, and a higher mean is a higher mean only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_SEEDS = 3  # the report's least number of seeds a side for a verdict


def separation(a: Sequence[float], b: Sequence[float], *, min_seeds: int = MIN_SEEDS) -> str:
    """The verdict on per-seed figures ``a`` against ``b`` (higher is better):

    * ``"separates, higher"``: every seed of ``a`` lies above every seed of ``b``;
    * ``"separates, lower"``: every seed of ``a`` lies below every seed of ``b``;
    * ``"not separable"``: the seeds overlap (a tie counts as overlap);
    * ``"n seeds: no verdict"``: a side has fewer than ``min_seeds`` seeds (n the fewer).

    Raises ValueError for a non-finite figure or ``min_seeds`` < 1.
    """
    if min_seeds < 1:
        raise ValueError(f"separation: min_seeds must be >= 1, got {min_seeds}")
    for name, values in (("a", a), ("b", b)):
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise ValueError(f"separation: {name} holds non-finite figures {bad}")
    fewer = min(len(a), len(b))
    if fewer < min_seeds:
        return f"{fewer} seed{'' if fewer == 1 else 's'}: no verdict"
    if min(a) > max(b):
        return "separates, higher"
    if max(a) < min(b):
        return "separates, lower"
    return "not separable"
