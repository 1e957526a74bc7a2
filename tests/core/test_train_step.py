"""The jitted train step on a tiny random model: invariances and guards."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.train_step import (
    CFG,
    accumulated_in_micro_batches,
    algorithm,
    as_jnp,
    assert_same_accumulation,
    make_config,
    make_groups,
    setup,
    step_fn,
)

from a3po_jax import model
from a3po_jax.core import advantages, logprobs, losses, objectives, optim, packing, prox
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch, group_advantages
from a3po_jax.core.objectives import dpo as dpo_objective
from a3po_jax.training import config as config_lib
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    ConfigError,
    RolloutSection,
    SystemSection,
    TrainConfig,
)


def test_batch_alignment():
    groups = make_groups(1, 2)
    b = build_batch(groups, advantage="grpo", length_bucket=16)
    r = groups[0].rollouts[0]
    p, n = len(r.prompt_tokens), len(r.completion_tokens)
    # Completion token j is the target at position p - 1 + j.
    np.testing.assert_array_equal(b.targets[0, p - 1 : p - 1 + n], r.completion_tokens)
    np.testing.assert_allclose(b.behav_logp[0, p - 1 : p - 1 + n], r.behav_logprobs)
    assert b.loss_mask[0].sum() == n
    assert b.tokens.shape[1] % 16 == 0


def test_train_step_runs_and_bumps_version():
    cfg = make_config(prox="a3po")
    state, _ = setup(cfg)
    batch = as_jnp(build_batch(make_groups(), advantage="grpo", length_bucket=16))
    new_state, metrics = step_fn(cfg)(state, batch, None)
    assert int(new_state.step) == 1
    assert np.isfinite(float(metrics["loss/total"]))
    assert float(metrics["step/skipped"]) == 0.0
    leaves_old = jax.tree.leaves(state.params)
    leaves_new = jax.tree.leaves(new_state.params)
    assert any(not np.allclose(a, b) for a, b in zip(leaves_old, leaves_new, strict=True))


MICRO_BATCH_CASES = {
    **{agg: dict(prox="a3po", aggregation=agg) for agg in losses.AGGREGATIONS},
    "recompute-kl-loss": dict(prox="recompute", kl_coef=0.1, kl_kind="k3"),
    "dpo": dict(loss="dpo"),
}


@pytest.mark.parametrize("case", list(MICRO_BATCH_CASES))
def test_micro_batched_grads_equal_full_batch(case):
    # Every loss term returns (sum, count) pairs and Stats, so 4 micro-batches reduce to the
    # full batch's loss, gradient and every metric; averaging per micro-batch would not.
    algo_kwargs = MICRO_BATCH_CASES[case]
    group_size = 2 if algo_kwargs.get("loss") == "dpo" else 4
    algo = algorithm(make_config(group_size, 16 // group_size, **algo_kwargs))
    params = model.init_params(CFG, jax.random.key(1))
    ref_params = model.init_params(CFG, jax.random.key(2))
    groups = make_groups(num_groups=16 // group_size, group_size=group_size, versions_from=2)
    b = build_batch(groups, advantage="grpo", length_bucket=16, dpo_pairs=group_size == 2)
    batch = as_jnp(b)

    assert_same_accumulation(*accumulated_in_micro_batches(algo, params, ref_params, batch, (1, 4)))


def test_recompute_equals_a3po_at_zero_staleness_with_one_minibatch():
    # With one optimizer step per batch the recomputed prox is the current weights'
    # log-prob, i.e. what A-3PO uses at d = 0: same update, one forward pass more.
    groups = make_groups(seed=2)
    for g in groups:
        for r in g.rollouts:
            r.versions[:] = 0
    batch = as_jnp(build_batch(groups, advantage="grpo", length_bucket=16))
    out = {}
    for rule in ("recompute", "a3po"):
        cfg = make_config(prox=rule)
        state, _ = setup(cfg)
        out[rule], metrics = step_fn(cfg)(state, batch, None)
    chex.assert_trees_all_close(out["recompute"].params, out["a3po"].params, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("prox_rule", ["behav", "recompute"])
def test_periodic_arrival_order_equals_sync_update(prox_rule):
    # Periodic Asynchrony: groups arrive in any order, gradients are accumulated per
    # arriving micro-batch, one optimizer step at the end = the sync update.
    cfg = make_config(prox=prox_rule)
    algo = algorithm(cfg)
    state, opt = setup(cfg)
    groups = make_groups(seed=3)
    full = as_jnp(build_batch(groups, advantage="grpo", length_bucket=32))
    sync_state, sync_metrics = step_fn(cfg)(jax.tree.map(jnp.copy, state), full, None)

    # Arrival order reversed; advantages are per group so each group batch stands alone.
    # Jitted as the trainer runs them (one compile each instead of op by op).
    fold = jax.jit(functools.partial(ts.fold_group, algo=algo))
    apply = jax.jit(
        functools.partial(ts.apply_accumulated, optimizer=opt, grad_clip=cfg.optim.grad_clip)
    )
    total = None
    for g in reversed(groups):
        part = as_jnp(build_batch([g], advantage="grpo", length_bucket=32))
        acc = fold(state.params, None, ts.split_micro_batches(part, 2), state.step)
        total = acc if total is None else optim.add_accumulated(total, acc)
    periodic_state, metrics = apply(state, total)
    chex.assert_trees_all_close(periodic_state.params, sync_state.params, rtol=1e-5, atol=1e-6)
    assert metrics.keys() == sync_metrics.keys()
    for key in metrics:
        np.testing.assert_allclose(metrics[key], sync_metrics[key], rtol=1e-4, err_msg=key)


def test_tokens_from_the_future_poison_the_step():
    # Staleness < 0 (a token newer than the trainer) is a bug upstream; under jit A-3PO turns
    # it into NaN so the step is skipped rather than trained on.
    cfg = make_config(prox="a3po")
    state, _ = setup(cfg)
    batch = as_jnp(build_batch(make_groups(versions_from=1), advantage="grpo", length_bucket=16))
    new_state, metrics = step_fn(cfg)(state, batch, None)
    assert float(metrics["step/skipped"]) == 1.0 and int(new_state.step) == 0


def test_non_finite_step_is_skipped():
    cfg = make_config(prox="behav")
    state, _ = setup(cfg)
    b = build_batch(make_groups(), advantage="grpo", length_bucket=16)
    b.behav_logp[0, b.loss_mask[0] > 0] = np.nan
    new_state, metrics = step_fn(cfg)(state, as_jnp(b), None)
    assert float(metrics["step/skipped"]) == 1.0
    assert int(new_state.step) == 0
    chex.assert_trees_all_equal(new_state.params, state.params)


def test_minibatches_count_versions():
    cfg = dataclasses.replace(make_config(prox="a3po", num_minibatches=2))
    state, _ = setup(cfg)
    batch = as_jnp(build_batch(make_groups(), advantage="grpo", length_bucket=16))
    new_state, metrics = step_fn(cfg)(state, batch, None)
    assert int(new_state.step) == 2
    # The second minibatch trains at version 1 on tokens of versions 0 and 1.
    assert float(metrics["staleness/max"]) == 1.0


@pytest.mark.parametrize("algo", [dict(loss="dpo"), dict(kl_coef=0.1, kl_kind="k3")])
def test_reference_losses_run(algo):
    cfg = make_config(2 if algo.get("loss") == "dpo" else 4, 4, **algo)
    state, _ = setup(cfg)
    groups = make_groups(group_size=cfg.rollout.group_size, seed=4)
    batch = build_batch(
        groups, advantage="grpo", length_bucket=16, dpo_pairs=algo.get("loss") == "dpo"
    )
    ref = jax.tree.map(jnp.copy, state.params)
    new_state, metrics = step_fn(cfg)(state, as_jnp(batch), ref)
    assert np.isfinite(float(metrics["loss/total"]))
    if algo.get("loss") == "dpo":
        # At the start policy == reference, so the DPO loss is log 2 on every counted pair.
        assert float(metrics["loss/total"]) == pytest.approx(np.log(2), rel=1e-4)
    else:
        assert float(metrics["kl/ref"]) == pytest.approx(0.0, abs=1e-6)


def test_train_step_traces_once_per_bucket_shape():
    cfg = make_config(prox="a3po")
    algo = algorithm(cfg)
    opt = step_builder.optimizer(cfg)

    @functools.partial(jax.jit, donate_argnums=(0,))
    @chex.assert_max_traces(n=1)
    def step(state, batch):
        return ts.train_step(state, batch, None, algo=algo, optimizer=opt, grad_clip=1.0)

    state, _ = setup(cfg)
    for seed in range(3):
        b = build_batch(make_groups(seed=seed), advantage="grpo", length_bucket=32, min_length=32)
        state, _ = step(state, as_jnp(b))
    assert int(state.step) == 3
    chex.clear_trace_counter()


# Shared-prompt packing changes the layout, not the math; the one-pass old policy (old =
# sg(current) with one optimizer step) equals a separate no-grad pass.
RECOMPUTE_LAYOUTS = {
    "plain": (False, {}),
    "packed": (True, {"packed_prompts": True}),
    "one_pass": (False, {"one_pass_old": True}),
    "packed_one_pass": (True, {"packed_prompts": True, "one_pass_old": True}),
}


@functools.cache
def recompute_step_in_layout(name):
    """One recompute step on fixed groups in a layout of `RECOMPUTE_LAYOUTS` (cached: every
    comparison reads the plain one)."""
    packed, layout = RECOMPUTE_LAYOUTS[name]
    groups = make_groups(seed=6)
    build = packing.pack_groups if packed else build_batch
    batch = as_jnp(build(groups, advantage="grpo", length_bucket=16))
    cfg = make_config(prox="recompute", batch=layout)
    state, _ = setup(cfg)
    return step_fn(cfg)(state, batch, None)


@pytest.mark.parametrize("name", ["packed", "one_pass", "packed_one_pass"])
def test_packed_and_one_pass_steps_equal_the_plain_recompute_step(name):
    plain, plain_metrics = recompute_step_in_layout("plain")
    state, metrics = recompute_step_in_layout(name)
    assert float(plain_metrics["step/skipped"]) == 0.0
    assert float(metrics["step/skipped"]) == 0.0
    chex.assert_trees_all_close(state.params, plain.params, rtol=1e-4, atol=1e-6)


def test_prox_equal_to_behav_is_plain_ppo():
    # prox = behav (the "behav" rule, and A-3PO where every token has d = 1, so α = 1) makes
    # the decoupled step plain PPO against the behaviour policy: the step's gradient equals
    # that of losses.ppo_clip_loss on the whole batch, written independently here.
    groups = make_groups(seed=7, versions_from=1)
    for g in groups:
        for r in g.rollouts:
            r.versions[:] = 1
    batch = as_jnp(build_batch(groups, advantage="grpo", length_bucket=16))
    params = model.init_params(CFG, jax.random.key(2))

    def ppo(p):
        logp, _ = logprobs.forward_logprobs(p, batch, model_config=CFG, temperature=1.0)
        loss, _ = losses.ppo_clip_loss(
            logp, batch["behav_logp"], batch["advantages"], batch["loss_mask"], clip_eps=0.2
        )
        return loss

    want = jax.jit(jax.grad(ppo))(params)
    for rule in ("behav", "a3po"):
        accumulate = jax.jit(
            functools.partial(
                ts.accumulate_grads,
                old_logp=None,
                ref_logp=None,
                algo=algorithm(make_config(prox=rule)),
            )
        )
        acc = accumulate(params, ts.split_micro_batches(batch, 2), version=jnp.int32(2))
        got = jax.tree.map(lambda g: g / acc.count, acc.grads)  # noqa: B023
        chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-7)


def test_metrics_cover_every_minibatch():
    # Two minibatches: rows 0-7 (minibatch 0) were sampled at version 0, rows 8-15 at
    # version 2, and the step starts at version 2. Minibatch 0 trains at v = 2 (d = 2),
    # minibatch 1 at v = 3 (d = 1). Reporting the last minibatch only (the old step) gave
    # staleness/max 1, half the tokens in loss/num_tokens and a mean staleness of 1.
    groups = make_groups(seed=8)
    for g in groups:
        for r in g.rollouts:
            r.versions[:] = 0 if g.group_id < 2 else 2
    b = build_batch(groups, advantage="grpo", length_bucket=16)
    cfg = make_config(prox="a3po", num_minibatches=2)
    state, _ = setup(cfg)
    state = state._replace(step=jnp.int32(2))
    new_state, metrics = step_fn(cfg)(state, as_jnp(b), None)
    assert int(new_state.step) == 4
    mask = b.loss_mask
    n0, n1 = mask[:8].sum(), mask[8:].sum()
    assert float(metrics["loss/num_tokens"]) == mask.sum()
    assert float(metrics["staleness/max"]) == 2.0
    np.testing.assert_allclose(metrics["staleness/mean"], (2 * n0 + 1 * n1) / (n0 + n1), rtol=1e-6)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("loss", "bogus_objective", objectives.names()),
        ("prox", "bogus", prox.PROX_RULES),
        ("advantage", "gae", advantages.ESTIMATORS),
        ("aggregation", "seq_sum", losses.AGGREGATIONS),
        ("kl_kind", "k4", losses.KL_KINDS),
        ("cap_mode", "clip", losses.CAP_MODES),
        ("a3po_zero_staleness", "never", prox.ZERO_STALENESS),
    ],
)
def test_unknown_algorithm_names_fail_when_the_config_is_built(field, value, allowed):
    # Each name is validated once, in the config, before any model or array exists; the
    # error names the field and lists what is allowed.
    with pytest.raises(ConfigError, match=f"algo.{field}={value!r}") as err:
        make_config(**{field: value})
    for name in allowed:
        assert name in str(err.value)


def test_algorithm_holds_the_chosen_functions():
    # What the differentiated function calls was picked at build time from the tables.
    for rule in ("recompute", "a3po", "behav"):
        algo = algorithm(make_config(prox=rule))
        assert algo.needs_old_pass == (rule == "recompute")
        assert algo.needs_reference is False and algo.kl_in_loss is None
        prox_fn = algo.loss_term.keywords["anchor"].fn  # the prox rule, bound once
        assert getattr(prox_fn, "func", prox_fn) is prox.PROX_RULES[rule].fn
    one_pass = algorithm(make_config(prox="recompute", batch={"one_pass_old": True}))
    assert one_pass.needs_old_pass is False
    dpo = algorithm(make_config(loss="dpo"))
    assert dpo.loss_term.func is dpo_objective.dpo_term
    assert dpo.needs_reference and not dpo.needs_old_pass
    assert dpo.objective.layout is objectives.PAIRS and dpo.plan.layout.pairs
    kl = algorithm(make_config(kl_coef=0.1))
    assert kl.needs_reference and kl.kl_in_loss is not None and kl.kl_in_reward is None
    shaped = algorithm(make_config(kl_coef=0.1, kl_in_reward=True))
    assert shaped.kl_in_loss is None and shaped.keeps_reference and not shaped.needs_reference


def test_config_choices_are_the_core_tables():
    # algo.loss is checked against the objectives' registry itself (see the test above).
    assert config_lib.PROX_MODES == tuple(prox.PROX_RULES)
    assert config_lib.ADVANTAGES == tuple(advantages.ESTIMATORS)
    assert config_lib.AGGREGATIONS == tuple(losses.AGGREGATORS)
    assert config_lib.KL_KINDS == tuple(losses.KL_ESTIMATORS)


def test_algorithm_and_plan_come_from_the_config():
    """The step reads the validated config's sections as they are: no settings value
    repeats their fields. Each value lands in the function or the plan that uses it."""
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4, temperature=0.7),
        algo=AlgoSection(prox="recompute", clip_eps_high=0.28, num_minibatches=2),
        system=SystemSection(batch=BatchSection(micro_batch_size=4, packed_prompts=True)),
    )
    algo = algorithm(cfg)
    assert algo.forward.func is packing.packed_token_logprobs
    assert algo.forward.keywords == {"model_config": CFG, "temperature": 0.7}
    assert algo.loss_term.keywords["clip_eps_high"] == 0.28
    assert algo.needs_old_pass and algo.model_config is CFG
    plan = algo.plan
    assert plan == cfg.batch_plan
    assert (plan.num_minibatches, plan.micro_batch_size, plan.packed) == (2, 4, True)
    # 16 sequences, 2 minibatches of 8, micro-batches of 4 (one group: one packed row).
    assert (plan.rows, plan.micro_batches, plan.leading_rows) == (16, 4, 4)
    assert plan.leading_rows_per_micro_batch == 1


def test_kl_in_reward_is_the_shaped_reward_and_its_advantages():
    # R_b - β Σ_t KL_bt with KL under the current and reference policies, then GRPO on the
    # shaped rewards; with the reference equal to the policy the rewards do not move.
    groups = make_groups(seed=9)
    b = build_batch(groups, advantage="grpo", length_bucket=16)
    batch, rewards = as_jnp(b), jnp.asarray(b.rewards)
    algo = algorithm(make_config(kl_coef=0.5, kl_kind="k1", kl_in_reward=True))
    params = model.init_params(CFG, jax.random.key(0))
    ref_params = model.init_params(CFG, jax.random.key(1))
    fn = jax.jit(functools.partial(ts.kl_in_reward, algo=algo))

    same_r, same_adv = fn(params, params, batch, rewards)
    np.testing.assert_allclose(same_r, b.rewards, atol=1e-6)
    np.testing.assert_allclose(same_adv, b.advantages, atol=1e-5)

    shaped, adv = fn(params, ref_params, batch, rewards)
    logp, _ = logprobs.forward_logprobs(params, batch, model_config=CFG, temperature=1.0)
    ref, _ = logprobs.forward_logprobs(ref_params, batch, model_config=CFG, temperature=1.0)
    kl_seq = np.sum(np.asarray(logp - ref) * b.loss_mask, axis=-1)  # k1 = logp - ref
    want = b.rewards - 0.5 * kl_seq
    np.testing.assert_allclose(shaped, want, rtol=1e-5, atol=1e-5)
    want_adv = group_advantages(want, 4, "grpo")[:, None] * b.loss_mask
    np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-5)
