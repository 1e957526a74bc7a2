"""A-3PO's proximal policy when several minibatches train on one generated batch.

The paper counts staleness d in training steps (arXiv 2512.06547: "the difference in training
steps between policies") and AReaL's ``loglinear`` rule reads the trainer's version once per
training step, before its minibatch loop, with the live policy's log-probs in each minibatch
(``areal/trainer/ppo/actor.py``). So for every minibatch of a step, d = the training steps
between the data and the step's start, and only ``sg(current)`` moves between minibatches.
``algo.a3po_staleness_unit=update`` keeps the rule that counted d in optimizer updates at
minibatch i.
"""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.factories import synthetic_groups

from a3po_jax import model
from a3po_jax.core import optim, prox
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.core.stats import finalize
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    ConfigError,
    RolloutSection,
    SystemSection,
    TrainConfig,
)

CFG = model.ModelConfig.tiny()


@pytest.mark.parametrize(
    "behind, k, steps",
    [(0, 2, 0), (1, 2, 1), (2, 2, 1), (3, 2, 2), (4, 2, 2), (8, 4, 2), (9, 4, 3), (5, 1, 5)],
)
def test_updates_behind_become_training_steps_rounded_up(behind, k, steps):
    got = prox.steps_behind(jnp.array([behind]), k)
    assert int(got[0]) == steps


def test_tokens_from_the_future_stay_negative_in_steps():
    # Negative staleness poisons the step (NaN prox); rounding must not turn -1 into 0.
    got = prox.steps_behind(jnp.array([-1, -3]), 2)
    assert (np.asarray(got) < 0).all()


def config(unit, k=2, zero="current", prox_rule="a3po"):
    return TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4),
        algo=AlgoSection(
            prox=prox_rule,
            num_minibatches=k,
            a3po_staleness_unit=unit,
            a3po_zero_staleness=zero,
        ),
        system=SystemSection(
            batch=BatchSection(packed_prompts=False)
        ),  # the padded rows build_batch lays out
    )


# One compiled program per (unit, zero): eagerly every primitive of the term compiles its own.
@functools.partial(jax.jit, static_argnames=("unit", "zero"))
def _loss_and_metrics(logp, mb, staleness, *, unit, zero):
    term = step_builder.algorithm(config(unit, zero=zero), CFG).loss_term
    loss, count, stats = term(logp, mb, staleness=staleness, old_logp=None, ref_logp=None)
    return loss / count, finalize(stats)


def one_token(unit, *, step_staleness, staleness, zero="current"):
    """The loss and metrics of minibatch 1's term on one token with logp - behav = 0.4,
    A = 1, ε = 0.2: `step_staleness` training steps behind the step's start, `staleness`
    optimizer updates behind minibatch 1."""
    logp, behav = jnp.array([[-1.0]]), jnp.array([[-1.4]])
    mb = {
        "behav_logp": behav,
        "advantages": jnp.array([[1.0]]),
        "loss_mask": jnp.array([[1.0]]),
        "step_staleness": jnp.array([[step_staleness]], jnp.int32),
    }
    staleness = jnp.array([[staleness]], jnp.int32)
    loss, metrics = _loss_and_metrics(logp, mb, staleness, unit=unit, zero=zero)
    return float(loss), metrics


def one_token_sums(unit):
    """Minibatch 1 of a 2-minibatch step starting at version 10, one token sampled at
    version 6: d = 5 optimizer updates at minibatch 1, 2 training steps at the step's
    start."""
    return one_token(unit, step_staleness=2, staleness=5)


def test_minibatch_i_interpolates_by_training_steps_of_the_step_start():
    # d = 2 steps: prox = ½·behav + ½·logp, so r = w = exp(0.2) = 1.2214 > 1.2: clipped,
    # ℓ = w · (-A · 1.2) = -1.2 · exp(0.2).
    loss, metrics = one_token_sums("step")
    assert loss == pytest.approx(-1.2 * math.exp(0.2), rel=1e-6)
    assert float(metrics["loss/clipfrac"]) == 1.0


def test_update_unit_keeps_the_rule_by_optimizer_updates_at_minibatch_i():
    # d = 5 updates: prox = ⅕·behav + ⅘·logp, r = exp(0.08) (inside the clip),
    # w = exp(0.32), ℓ = -r · w = -exp(0.4).
    loss, metrics = one_token_sums("update")
    assert loss == pytest.approx(-math.exp(0.4), rel=1e-6)
    assert float(metrics["loss/clipfrac"]) == 0.0


def test_the_unit_is_checked_by_name():
    with pytest.raises(ConfigError, match="algo.a3po_staleness_unit"):
        AlgoSection(a3po_staleness_unit="batch")


def groups_at_version(version, seed=3):
    groups = synthetic_groups(
        4,
        4,
        prompt_len=(3, 8),
        response_len=(2, 11),
        vocab=CFG.vocab_size,
        versions=lambda g, i: version,
        behav_range=(3.0, 6.0),
        admitted_at_version=version,
        seed=seed,
    )
    return build_batch(groups, advantage="grpo", length_bucket=16)


def train(cfg, batch, start_version):
    params = model.init_params(CFG, jax.random.key(0))
    opt = step_builder.optimizer(cfg)
    state = optim.init_train_state(params, opt)._replace(step=jnp.int32(start_version))
    algo = step_builder.algorithm(cfg, CFG)
    step = jax.jit(lambda s, b: ts.train_step(s, b, None, algo=algo, optimizer=opt, grad_clip=1.0))
    arrays = {k: jnp.asarray(v) for k, v in batch.arrays().items()}
    return step(state, arrays)


@functools.cache
def one_step_old(unit, prox_rule="a3po"):
    """The parameters after a 2-minibatch step starting at version 2 on data sampled at
    version 0 (cached: the tests below compare the same three steps)."""
    state, _ = train(config(unit, prox_rule=prox_rule), groups_at_version(0), 2)
    return state.params


# one compiled program: eagerly each leaf shape compiles its own subtract, abs and max
@jax.jit
def _largest_differences(a, b):
    return jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)), a, b)


def largest_difference(a, b):
    return max(float(x) for x in jax.tree.leaves(_largest_differences(a, b)))


def test_one_step_old_data_anchors_every_minibatch_at_behav():
    # Data sampled at version 0, the step starts at version 2 with k = 2: one training step
    # behind in both minibatches, so α = 1 and A-3PO is PPO against behav in each of them.
    naive, by_step = one_step_old("step", prox_rule="behav"), one_step_old("step")
    chex.assert_trees_all_close(by_step, naive, rtol=1e-5, atol=1e-7)


def test_the_update_unit_moves_minibatch_1_away_from_behav():
    # Minibatch 1 trains 3 optimizer updates after the data: the update unit gives α = ½
    # there, then ⅓. Adam's first update moves each weight by about the learning rate
    # whatever the loss, so a different second minibatch shows at the scale of that update,
    # not the rounding's.
    naive, by_step = one_step_old("step", prox_rule="behav"), one_step_old("step")
    moved = largest_difference(one_step_old("update"), naive)
    assert moved > 1e-6
    assert moved > 100 * largest_difference(by_step, naive)


def test_one_minibatch_makes_the_two_units_the_same_step():
    batch = groups_at_version(1)
    one, m1 = train(dataclasses.replace(config("step", k=1)), batch, 3)
    two, m2 = train(dataclasses.replace(config("update", k=1)), batch, 3)
    chex.assert_trees_all_close(one.params, two.params, rtol=1e-6, atol=1e-7)
    assert float(m1["loss/total"]) == pytest.approx(float(m2["loss/total"]), rel=1e-6)


def sync_minibatch_1(unit, zero="current"):
    """Minibatch 1 of a 2-minibatch step in sync mode: the token was sampled by the step's
    starting weights (0 training steps, 1 optimizer update behind), and the first update
    moved the policy since."""
    return one_token(unit, step_staleness=0, staleness=1, zero=zero)


def test_sync_minibatches_in_steps_have_no_trust_region():
    # d = 0 steps: α = 0, prox = sg(logp), so r = 1 and the clip never fires however far
    # the first update moved the policy; the weight π_prox/π_behav = exp(0.4) is applied
    # in full: ℓ = -exp(0.4) (docs/losses.md, "A-3PO with several minibatches").
    loss, metrics = sync_minibatch_1("step")
    assert loss == pytest.approx(-math.exp(0.4), rel=1e-6)
    assert float(metrics["loss/clipfrac"]) == 0.0


@pytest.mark.parametrize("unit, zero", [("update", "current"), ("step", "behav")])
def test_sync_minibatches_keep_the_clip_in_updates_or_with_behav_at_zero(unit, zero):
    # d = 1 update (α = 1), or AReaL's α = 1 at d = 0: prox = behav, r = exp(0.4) > 1.2,
    # clipped: ℓ = -1.2, as PPO against the sampling policy.
    loss, metrics = sync_minibatch_1(unit, zero)
    assert loss == pytest.approx(-1.2, rel=1e-6)
    assert float(metrics["loss/clipfrac"]) == 1.0
