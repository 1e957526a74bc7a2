"""The step book's reading of which side waited: the trainer's wait and the host's serving
time, as shares of each step, from the step's own record."""

from types import SimpleNamespace

import pytest

from a3po_jax.training.step_book import StepBook


def book() -> StepBook:
    cfg = SimpleNamespace(rollout=SimpleNamespace(groups_per_step=2))
    return StepBook(cfg, workers=None)


def test_wait_and_host_busy_are_shares_of_the_step():
    b = book()
    # The first record: the host's busy seconds so far have no earlier figure to subtract.
    first = b.demand({"time/step_s": 2.0, "time/wait_rollouts_s": 0.5, "host/busy_s": 10.0})
    assert first == {"time/wait_frac": 0.25}
    second = b.demand({"time/step_s": 2.0, "time/wait_rollouts_s": 0.0, "host/busy_s": 11.5})
    assert second == pytest.approx({"time/wait_frac": 0.0, "host/busy_frac": 0.75})


def test_a_replay_or_an_empty_step_has_no_host_share():
    b = book()
    assert b.demand({"time/step_s": 1.0, "time/wait_rollouts_s": 0.0}) == {"time/wait_frac": 0.0}
    assert b.demand({"time/wait_rollouts_s": 1.0}) == {}  # no step time: nothing to share
