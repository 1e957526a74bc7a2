"""`RolloutSource` (a3po_jax/rollout/source.py): the workers and a replay both implement it,
with the same signatures, so the trainer and its schedules are written once for both."""

from __future__ import annotations

import inspect

import pytest

from a3po_jax.rollout.source import RolloutSource
from a3po_jax.rollout.workers import RolloutWorkers
from a3po_jax.training.recording import ReplaySource

MEMBERS = [name for name in vars(RolloutSource) if not name.startswith("_")]


def test_the_protocol_names_what_the_trainer_calls():
    assert {"get_batch", "consumed", "discard", "state", "restore"} <= set(MEMBERS)
    assert "queue" in RolloutSource.__annotations__  # an attribute of the workers


@pytest.mark.parametrize("source", [RolloutWorkers, ReplaySource])
@pytest.mark.parametrize("name", MEMBERS)
def test_both_sources_implement_every_member(source, name):
    assert hasattr(source, name), f"{source.__name__} has no {name}"
    want = getattr(RolloutSource, name)
    have = getattr(source, name)
    wanted = inspect.signature(want).parameters
    given = inspect.signature(have).parameters
    for param in wanted.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        assert param.name in given or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in given.values()
        ), f"{source.__name__}.{name} takes no {param.name}"
