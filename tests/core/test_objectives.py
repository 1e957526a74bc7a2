"""The objectives: one registry, one road from the maths to the public loss, and the
newcomer's recipe (one module registers a new objective; ``algo.loss=<name>`` trains it)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.processes import train_tiny
from helpers.train_step import staleness_batch

from a3po_jax import model
from a3po_jax.core import losses, objectives, prox
from a3po_jax.core.objectives import registry
from a3po_jax.core.stats import finalize
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    ConfigError,
    RolloutSection,
    SystemSection,
    TrainConfig,
    apply_overrides,
    config_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]
CFG = model.ModelConfig.tiny()
UNPACKED = SystemSection(
    batch=BatchSection(packed_prompts=False)
)  # the padded rows build_batch lays out


# The recipe's module, as docs/losses.md shows it ("Adding an objective"): plain REINFORCE
# with a group-mean baseline, written as a user would, outside the package. Read from the
# page, so that the page and the test cannot drift apart.
def _recipe_module() -> str:
    page = (ROOT / "docs" / "losses.md").read_text()
    section = page[page.index("### Adding an objective") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)] + "\n"


REINFORCE = _recipe_module()


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, restored after the test (registrations are global)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


# --------------------------------------------------------------------------------------
# The registry.
# --------------------------------------------------------------------------------------


def test_the_built_in_objectives_are_registered():
    assert {"ppo", "dpo"} <= set(objectives.names())
    ppo, dpo = objectives.get("ppo"), objectives.get("dpo")
    assert not ppo.needs_reference and ppo.layout is objectives.ROWS
    assert dpo.needs_reference and dpo.layout is objectives.PAIRS
    assert dpo.layout.group_size == 2


def test_a_duplicate_name_is_refused_naming_the_owner_and_the_choices(scratch_registry):
    with pytest.raises(ValueError, match="'ppo' is already registered by") as err:

        @objectives.register("ppo")
        def another_ppo(cfg):
            raise AssertionError("never built")

    assert "a3po_jax.core.objectives.ppo.ppo" in str(err.value)
    assert "registered: dpo, gspo, icepop, m2po, ppo" in str(err.value)
    assert objectives.get("ppo").origin == "a3po_jax.core.objectives.ppo.ppo"  # unchanged
    # The same function again (its module imported a second time) is not a conflict.
    objectives.register("ppo")(objectives.get("ppo").make)


def test_an_objectives_settings_must_be_a_frozen_dataclass(scratch_registry):
    # The config holds every objective's settings in its frozen algo section.
    with pytest.raises(TypeError, match="settings of objective 'x' must be a frozen dataclass"):
        objectives.register("x", settings=dict)
    assert "x" not in objectives.names()


def test_an_unknown_name_is_refused_naming_the_choices(scratch_registry):
    known = "dpo, gspo, icepop, m2po, ppo"
    with pytest.raises(ValueError, match=f"objective='no_such_loss' is not one of {known}"):
        objectives.get("no_such_loss")
    # The config says which field it was, and refuses before anything loads.
    with pytest.raises(ConfigError, match=f"algo.loss='no_such_loss' is not one of {known}"):
        AlgoSection(loss="no_such_loss")


def test_a_module_named_by_the_loss_is_imported_and_registers_it(
    tmp_path, monkeypatch, scratch_registry
):
    (tmp_path / "reinforce.py").write_text(REINFORCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "reinforce" not in objectives.names() and "reinforce" not in sys.modules
    try:
        cfg = apply_overrides(
            TrainConfig(),
            ["algo.loss=reinforce", "algo.advantage=drgrpo", "algo.reinforce.max_advantage=2"],
        )
        assert objectives.get("reinforce").make.__module__ == "reinforce"
        algo = step_builder.algorithm(cfg, CFG)
        # Its setting is a config field like any other: saved, loaded, checked by name.
        assert cfg.algo.reinforce.max_advantage == 2.0
        saved = json.loads(json.dumps(cfg.to_dict()))
        assert saved["algo"]["reinforce"] == {"max_advantage": 2.0}
        assert config_from_dict(saved) == cfg
        with pytest.raises(ConfigError, match="algo.reinforce.max_advantage must be >= 0"):
            apply_overrides(cfg, ["algo.reinforce.max_advantage=-1"])
        with pytest.raises(ConfigError, match="unknown config field 'algo.reinforce.cap'"):
            apply_overrides(cfg, ["algo.reinforce.cap=1"])
    finally:
        sys.modules.pop("reinforce", None)  # the next import registers it afresh
    assert algo.loss_term.func.__name__ == "reinforce_term"
    assert algo.loss_term.keywords == {"max_advantage": 2.0}
    assert not algo.needs_reference and not algo.needs_old_pass


def test_an_import_error_inside_an_objective_module_is_not_hidden(
    tmp_path, monkeypatch, scratch_registry
):
    (tmp_path / "broken_objective.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency"):
        objectives.get("broken_objective")


# --------------------------------------------------------------------------------------
# One road: the public loss is the step's term over the whole batch, finalized.
# --------------------------------------------------------------------------------------


def test_decoupled_ppo_loss_is_the_steps_term_finalized():
    cfg = TrainConfig(
        algo=AlgoSection(prox="a3po", behav_weight_cap=1.2, cap_mode="truncate", dual_clip=3.0),
        system=UNPACKED,
    )
    algo = step_builder.algorithm(cfg, CFG)
    batch = staleness_batch(4, 4)
    mask = batch["loss_mask"]

    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def term_and_public_loss(params, batch):
        logp, _ = algo.forward(params, batch)
        mask = batch["loss_mask"]
        staleness = jnp.where(mask > 0, 2 - batch["versions"], 0).astype(jnp.int32)
        term = algo.loss_term(logp, batch, staleness=staleness, old_logp=None, ref_logp=None)
        public = losses.decoupled_ppo_loss(
            logp,
            prox.a3po_prox_logp(logp, batch["behav_logp"], staleness),
            batch["behav_logp"],
            batch["advantages"],
            mask,
            clip_eps=0.2,
            dual_clip=3.0,
            behav_weight_cap=1.2,
            cap_mode="truncate",
            staleness=staleness,
        )
        return term, public, finalize(term[2])

    (loss_sum, count, _), (loss, metrics), want = term_and_public_loss(
        model.init_params(CFG, jax.random.key(0)), batch
    )
    np.testing.assert_allclose(loss, loss_sum / count, rtol=1e-6)
    assert float(want["is/capped_frac"]) > 0  # the cap is exercised
    assert set(metrics) == set(want) | {"loss/num_tokens"}
    for key, value in want.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=key)
    assert float(metrics["loss/num_tokens"]) == float(jnp.sum(mask))


def test_online_dpo_loss_is_the_steps_term_finalized():
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=2, groups_per_step=8),
        algo=AlgoSection(loss="dpo", settings={"dpo": {"kind": "ipo"}}),
        system=UNPACKED,
    )
    algo = step_builder.algorithm(cfg, CFG)
    batch = staleness_batch(8, 2, dpo=True, seed=1)

    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def term_and_public_loss(params, ref_params, batch):
        logp, _ = algo.forward(params, batch)
        ref, _ = algo.forward(ref_params, batch)
        mask = batch["loss_mask"]
        term = algo.loss_term(
            logp, batch, staleness=jnp.zeros_like(mask, jnp.int32), old_logp=None, ref_logp=ref
        )
        seq, ref_seq = losses.sequence_logprobs(logp, mask), losses.sequence_logprobs(ref, mask)
        public = losses.online_dpo_loss(
            seq[0::2],
            seq[1::2],
            ref_seq[0::2],
            ref_seq[1::2],
            beta=0.1,
            kind="ipo",
            mask=batch["pair_mask"][0::2],
        )
        return term, public, finalize(term[2])

    (loss_sum, count, _), (loss, metrics), want = term_and_public_loss(
        model.init_params(CFG, jax.random.key(0)), model.init_params(CFG, jax.random.key(1)), batch
    )
    assert 0 < float(count) < 8  # some pairs tie and do not count
    np.testing.assert_allclose(loss, loss_sum / count, rtol=1e-6)
    assert metrics.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=key)


# --------------------------------------------------------------------------------------
# The newcomer's recipe, for real: one module, trained through the CLI.
# --------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_new_objective_module_trains_through_the_cli(tmp_path):
    """The recipe: write one module that registers ``reinforce``, put it on the Python path,
    and select it with ``algo.loss=reinforce``; nothing in the package changes."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "reinforce.py").write_text(REINFORCE)
    run_dir = tmp_path / "run"
    records = train_tiny(
        run_dir,
        "algo.loss=reinforce",
        "algo.advantage=drgrpo",
        "algo.reinforce.max_advantage=2",
        "system.mode=sync",
        "steps=2",
        "checkpoint_every=0",
        plugins=plugins,
    )
    assert len(records) == 2
    for record in records:
        assert math.isfinite(record["loss/total"]) and record["step/skipped"] == 0
        assert "reinforce/advantage" in record  # the new objective's own metric
        assert "loss/clipfrac" not in record  # and not PPO's
    assert records[0]["optim/grad_norm"] > 0
    saved = json.loads((run_dir / "config.json").read_text())["algo"]
    assert saved["loss"] == "reinforce" and saved["reinforce"] == {"max_advantage": 2.0}
