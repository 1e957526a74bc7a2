"""The training modes as schedules (a3po_jax/training/schedules/, docs/design.md §4): the
registry, each mode's rules, the wrappers, and the recipe "Adding a mode" trained through
the command line from a module outside the package."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.processes import train_tiny

from a3po_jax.training import schedules
from a3po_jax.training.config import ConfigError, SystemSection, TrainConfig, staleness_bound
from a3po_jax.training.schedules import base
from a3po_jax.training.schedules.lockstep import Lockstep
from a3po_jax.training.schedules.one_step_off import OneStepOff
from a3po_jax.training.schedules.periodic import Periodic
from a3po_jax.training.schedules.replay import Replayed
from a3po_jax.training.schedules.sync import Sync

ROOT = Path(__file__).resolve().parents[2]


# The recipe's module, as docs/design.md shows it ("Adding a mode"); read from the page, so
# that the page and the test cannot drift apart.
def _recipe_module() -> str:
    page = (ROOT / "docs" / "design.md").read_text()
    section = page[page.index("### Adding a mode") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)] + "\n"


RECIPE = _recipe_module()


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, restored after the test (registrations are global)."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))


def test_the_built_in_modes_in_design_order():
    assert schedules.names() == ("sync", "periodic", "one_step_off", "async")
    for name in schedules.names():
        assert schedules.get(name).name == name


@pytest.mark.parametrize(
    "mode,eta,k,expected",
    [
        ("sync", 5, 1, 0),
        ("sync", 5, 4, 3),
        ("periodic", 0, 2, 1),
        ("one_step_off", 5, 1, 1),
        ("one_step_off", 5, 4, 7),
        ("async", 3, 1, 3),
        ("async", 8, 4, 8),
    ],
)
def test_each_modes_staleness_bound(mode, eta, k, expected):
    """η in optimizer versions, by hand: k - 1 for sync and periodic, 2k - 1 one step off,
    max_staleness for async (design §4)."""
    assert staleness_bound(mode, eta, k) == expected


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match=r"system.max_staleness=2 with algo.num_minibatches=4"):
        staleness_bound("async", 2, 4)
    with pytest.raises(ConfigError, match="system.mode='periodic' is strictly on-policy"):
        SystemSection(mode="periodic", max_staleness=1)
    with pytest.raises(ConfigError, match="not with system.mode='periodic'"):
        SystemSection(mode="periodic", max_staleness=0, lockstep_decode_steps=2)
    with pytest.raises(ConfigError, match=r"system.mode='nope' is not one of sync, periodic"):
        SystemSection(mode="nope")


def test_only_async_updates_in_flight():
    for mode in ("sync", "one_step_off"):
        assert (
            SystemSection(mode=mode, update_policy="in_flight").effective_update_policy == "drain"
        )
    assert SystemSection(mode="async").effective_update_policy == "in_flight"
    assert SystemSection(mode="async", update_policy="drain").effective_update_policy == "drain"


def test_a_second_class_under_a_registered_name_is_refused(scratch_registry):
    with pytest.raises(ValueError, match="mode 'sync' is already registered by"):

        @schedules.register("sync")
        class Other(schedules.Schedule):
            pass


def fake_run(**system):
    hosts = SimpleNamespace(rollout_timeout_s=1.0)
    cfg = SimpleNamespace(system=SimpleNamespace(hosts=hosts, **system))
    return SimpleNamespace(cfg=cfg, workers=None, host=None, batch_groups=2)


def test_the_wrappers_change_what_they_say_and_keep_the_rest():
    """Lockstep holds groups, settles every group in flight and keeps the heap; a replay
    holds nothing; both stop one-step-off's wait for a producer (none runs behind)."""
    run = fake_run()
    inner = OneStepOff(run)
    assert inner.holds_groups and inner.producer_behind
    assert inner.settle_older_than(7) == 7 and inner.releases_replaced_weights
    locked = Lockstep(inner, decode_steps=3)
    assert locked.name == "one_step_off" and locked.holds_groups
    assert locked.settle_older_than(7) is None and not locked.releases_replaced_weights
    assert not inner.producer_behind
    timings: dict[str, float] = {}
    locked.before_push(3, timings)  # no producer: nothing to wait for, and the time says so
    assert timings["time/one_step_off_wait_s"] < 1.0

    replayed = Replayed(Sync(run))
    assert replayed.name == "sync" and not replayed.holds_groups
    assert replayed.settle_older_than(4) == 4 and replayed.releases_replaced_weights
    assert Replayed(OneStepOff(run)).holds_groups is False


def test_only_periodic_is_single_process_and_refuses_lockstep():
    for name in schedules.names():
        cls = schedules.get(name)
        assert (cls.single_process_only is not None) == (cls is Periodic)
        assert cls.drives_in_lockstep == (cls is not Periodic)


def test_the_trainer_never_asks_which_mode_it_runs():
    """No mode string, no isinstance and no getattr in the loop (the schedule answers)."""
    source = (ROOT / "a3po_jax" / "training" / "trainer.py").read_text()
    tree = ast.parse(source)
    calls = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert not calls & {"isinstance", "getattr", "hasattr"}
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not strings & {"sync", "periodic", "one_step_off", "async"}
    assert ".mode" not in source


def test_the_recipes_module_registers_its_mode_when_named(tmp_path, monkeypatch, scratch_registry):
    (tmp_path / "two_step_off.py").write_text(RECIPE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "two_step_off" not in schedules.names()
    try:
        cfg = TrainConfig(system=SystemSection(mode="two_step_off"))
        assert schedules.get("two_step_off").__module__ == "two_step_off"
    finally:
        sys.modules.pop("two_step_off", None)
    assert cfg.staleness_bound == 2 and cfg.system.effective_update_policy == "drain"


@pytest.mark.e2e
def test_a_new_mode_module_trains_through_the_cli(tmp_path):
    """The recipe: write one module that registers ``two_step_off``, put it on the Python
    path, and select it with ``system.mode=two_step_off``; nothing in the package changes."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "two_step_off.py").write_text(RECIPE)
    run_dir = tmp_path / "run"
    records = train_tiny(
        run_dir, "system.mode=two_step_off", "steps=4", "checkpoint_every=0", plugins=plugins
    )
    assert len(records) == 4
    assert all(record["staleness/max"] <= 2 for record in records)  # η = 3k - 1, k = 1
    assert all(record["step/skipped"] == 0 for record in records)
    assert json.loads((run_dir / "config.json").read_text())["system"]["mode"] == "two_step_off"
