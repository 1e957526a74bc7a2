"""The report's verdict rule: separate only when every seed lies beyond every other seed."""

import pytest

from a3po_jax.analysis.verdicts import separation


def test_every_seed_beyond_every_other_separates():
    assert separation([0.5, 0.6, 0.7], [0.1, 0.2, 0.49]) == "separates, higher"
    assert separation([0.1, 0.2, 0.49], [0.5, 0.6, 0.7]) == "separates, lower"


def test_one_overlapping_seed_or_a_tie_is_not_separable():
    # The means differ by 0.4, but one seed of each side crosses: no verdict word.
    assert separation([0.9, 0.9, 0.3], [0.1, 0.1, 0.4]) == "not separable"
    assert separation([0.5, 0.6, 0.7], [0.1, 0.2, 0.5]) == "not separable"


def test_too_few_seeds_give_no_verdict():
    assert separation([0.9, 0.8], [0.1, 0.2, 0.3]) == "2 seeds: no verdict"
    assert separation([0.9], [0.1, 0.2, 0.3]) == "1 seed: no verdict"
    assert separation([0.9], [0.1], min_seeds=1) == "separates, higher"


def test_bad_figures_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        separation([0.1, float("nan"), 0.2], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="min_seeds"):
        separation([0.1], [0.2], min_seeds=0)
