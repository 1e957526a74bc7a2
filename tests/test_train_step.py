"""The jitted train step on a tiny random model: invariances and guards."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from factories import synthetic_groups

from a3po_jax import model
from a3po_jax.core import advantages, losses, prox
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch, group_advantages
from a3po_jax.training import config as config_lib
from a3po_jax.training import step_builder
from a3po_jax.training.config import AlgoSection, RolloutSection, TrainConfig

CFG = model.ModelConfig.tiny()


def make_groups(num_groups=4, group_size=4, seed=0, versions_from=0, vocab=None):
    """Synthetic complete groups with varied lengths and rewards; odd samples are one
    version older than `versions_from` (so a batch mixes staleness d and d + 1)."""
    return synthetic_groups(
        num_groups,
        group_size,
        prompt_len=(3, 8),
        response_len=(2, 11),
        vocab=vocab or CFG.vocab_size,
        versions=lambda g, i: max(0, versions_from - (i % 2)),
        behav_range=(3.0, 6.0),
        admitted_at_version=versions_from,
        seed=seed,
    )


def make_config(**algo):
    return TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4),
        algo=AlgoSection(**algo),
    )


def setup(cfg: TrainConfig, seed=0):
    params = model.init_params(CFG, jax.random.key(seed))
    opt = step_builder.optimizer(cfg)
    return ts.init_train_state(params, opt), opt


def algorithm(cfg: TrainConfig, **overrides) -> ts.Algorithm:
    return ts.build_algorithm(dataclasses.replace(step_builder.step_settings(cfg), **overrides))


def step_fn(cfg: TrainConfig, **overrides):
    opt = step_builder.optimizer(cfg)
    return jax.jit(
        functools.partial(
            ts.train_step,
            algo=algorithm(cfg, **overrides),
            model_config=CFG,
            optimizer=opt,
            grad_clip=cfg.optim.grad_clip,
        )
    )


def as_jnp(batch):
    return {k: jnp.asarray(v) for k, v in batch.arrays().items()}


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
    settings = dataclasses.replace(step_builder.step_settings(make_config()), **algo_kwargs)
    algo = ts.build_algorithm(settings)
    params = model.init_params(CFG, jax.random.key(1))
    ref_params = model.init_params(CFG, jax.random.key(2))
    groups = make_groups(num_groups=16 // group_size, group_size=group_size, versions_from=2)
    b = build_batch(groups, advantage="grpo", length_bucket=16, dpo_pairs=group_size == 2)
    batch = as_jnp(b)
    version = jnp.int32(3)

    def accumulate(m):
        mbs = ts.split_micro_batches(batch, m)
        old, ref = ts.auxiliary_logprobs(params, ref_params, mbs, algo=algo, model_config=CFG)
        return ts.accumulate_grads(
            params, mbs, version=version, old_logp=old, ref_logp=ref, algo=algo, model_config=CFG
        )

    one, four = accumulate(1), accumulate(4)
    np.testing.assert_allclose(one.loss_sum, four.loss_sum, rtol=1e-5)
    np.testing.assert_allclose(one.count, four.count)
    chex.assert_trees_all_close(one.grads, four.grads, rtol=2e-4, atol=1e-6)
    # Every metric, reduced once from its sums, is the full batch's (not a mean of means).
    m1, m4 = ts.finalize(one.stats), ts.finalize(four.stats)
    assert m1.keys() == m4.keys()
    # atol: dpo's rewards are β times a difference of two float32 sums of log-probs (tens of
    # nats), whose rounding in two differently compiled programs reaches a few 1e-7.
    for key in m1:
        np.testing.assert_allclose(m1[key], m4[key], rtol=1e-5, atol=1e-6, err_msg=key)


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
    total = None
    for g in reversed(groups):
        part = as_jnp(build_batch([g], advantage="grpo", length_bucket=32))
        acc = ts.fold_group(
            state.params,
            None,
            ts.split_micro_batches(part, 2),
            state.step,
            algo=algo,
            model_config=CFG,
        )
        total = acc if total is None else ts.add_accumulated(total, acc)
    periodic_state, metrics = ts.apply_accumulated(
        state, total, optimizer=opt, grad_clip=cfg.optim.grad_clip
    )
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
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=2 if algo.get("loss") == "dpo" else 4, groups_per_step=4),
        algo=AlgoSection(**algo),
    )
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
        return ts.train_step(
            state, batch, None, algo=algo, model_config=CFG, optimizer=opt, grad_clip=1.0
        )

    state, _ = setup(cfg)
    for seed in range(3):
        b = build_batch(make_groups(seed=seed), advantage="grpo", length_bucket=32, min_length=32)
        state, _ = step(state, as_jnp(b))
    assert int(state.step) == 3
    chex.clear_trace_counter()


def test_packed_and_one_pass_steps_equal_the_plain_recompute_step():
    # Shared-prompt packing changes the layout, not the math; the one-pass old policy
    # (old = sg(current) with one optimizer step) equals a separate no-grad pass.
    from a3po_jax.core.packing import pack_groups

    cfg = make_config(prox="recompute")
    groups = make_groups(seed=6)
    plain_batch = as_jnp(build_batch(groups, advantage="grpo", length_bucket=16))
    packed_arrays = {
        k: jnp.asarray(v)
        for k, v in pack_groups(groups, advantage="grpo", length_bucket=16).arrays().items()
    }
    results = {}
    for name, batch, overrides in (
        ("plain", plain_batch, {}),
        ("packed", packed_arrays, {"packed_prompts": True}),
        ("one_pass", plain_batch, {"one_pass_old": True}),
        ("packed_one_pass", packed_arrays, {"packed_prompts": True, "one_pass_old": True}),
    ):
        state, _ = setup(cfg)
        results[name], metrics = step_fn(cfg, **overrides)(state, batch, None)
        assert float(metrics["step/skipped"]) == 0.0
    for name in ("packed", "one_pass", "packed_one_pass"):
        chex.assert_trees_all_close(
            results[name].params, results["plain"].params, rtol=1e-4, atol=1e-6
        )


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
        logp, _ = ts.forward_logprobs(p, batch, model_config=CFG, temperature=1.0)
        loss, _ = losses.ppo_clip_loss(
            logp, batch["behav_logp"], batch["advantages"], batch["loss_mask"], clip_eps=0.2
        )
        return loss

    want = jax.grad(ppo)(params)
    for rule in ("behav", "a3po"):
        acc = ts.accumulate_grads(
            params,
            ts.split_micro_batches(batch, 2),
            version=jnp.int32(2),
            old_logp=None,
            ref_logp=None,
            algo=algorithm(make_config(prox=rule)),
            model_config=CFG,
        )
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
        ("loss", "reinforce", ts.LOSS_TERMS),
        ("prox", "bogus", prox.PROX_RULES),
        ("advantage", "gae", advantages.ESTIMATORS),
        ("aggregation", "seq_sum", losses.AGGREGATIONS),
        ("kl_kind", "k4", losses.KL_KINDS),
        ("cap_mode", "clip", losses.CAP_MODES),
        ("a3po_zero_staleness", "never", prox.ZERO_STALENESS),
    ],
)
def test_unknown_algorithm_names_fail_when_the_step_is_built(field, value, allowed):
    # The names are resolved against the tables once, before any array exists; the error
    # lists what is allowed.
    settings = dataclasses.replace(ts.StepSettings(), **{field: value})
    with pytest.raises(ValueError, match=repr(value)) as err:
        ts.build_algorithm(settings)
    for name in allowed:
        assert name in str(err.value)


def test_algorithm_holds_the_chosen_functions():
    # What the differentiated function calls was picked at build time from the tables.
    for rule in ("recompute", "a3po", "behav"):
        algo = algorithm(make_config(prox=rule))
        assert algo.needs_old_pass == (rule == "recompute")
        assert algo.needs_reference is False and algo.kl_in_loss is None
        prox_fn = algo.loss_term.keywords["prox_fn"]
        assert getattr(prox_fn, "func", prox_fn) is prox.PROX_RULES[rule].fn
    one_pass = algorithm(make_config(prox="recompute"), one_pass_old=True)
    assert one_pass.needs_old_pass is False
    dpo = ts.build_algorithm(ts.StepSettings(loss="dpo"))
    assert dpo.loss_term.func is ts.dpo_term and dpo.needs_reference and not dpo.needs_old_pass
    kl = algorithm(make_config(kl_coef=0.1))
    assert kl.needs_reference and kl.kl_in_loss is not None and kl.kl_in_reward is None
    shaped = algorithm(make_config(kl_coef=0.1, kl_in_reward=True))
    assert shaped.kl_in_loss is None and shaped.keeps_reference and not shaped.needs_reference


def test_config_choices_are_the_core_tables():
    assert config_lib.PROX_MODES == tuple(prox.PROX_RULES)
    assert config_lib.LOSSES == tuple(ts.LOSS_TERMS)
    assert config_lib.ADVANTAGES == tuple(advantages.ESTIMATORS)
    assert config_lib.AGGREGATIONS == tuple(losses.AGGREGATORS)
    assert config_lib.KL_KINDS == tuple(losses.KL_ESTIMATORS)


def test_step_settings_come_from_the_config_by_field_name():
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4, temperature=0.7),
        algo=AlgoSection(prox="recompute", clip_eps_high=0.28, num_minibatches=2),
        system=config_lib.SystemSection(micro_batch_size=4, packed_prompts=True),
    )
    s = step_builder.step_settings(cfg)
    assert (s.prox, s.clip_eps_high, s.num_minibatches) == ("recompute", 0.28, 2)
    assert (s.temperature, s.micro_batch_size, s.packed_prompts) == (0.7, 4, True)
    # A field with no home in the given sections is refused, naming it.
    with pytest.raises(TypeError, match="'temperature'"):
        step_builder._by_name({"algo": cfg.algo}, ["temperature"], "StepSettings")


def test_kl_in_reward_is_the_shaped_reward_and_its_advantages():
    # R_b - β Σ_t KL_bt with KL under the current and reference policies, then GRPO on the
    # shaped rewards; with the reference equal to the policy the rewards do not move.
    groups = make_groups(seed=9)
    b = build_batch(groups, advantage="grpo", length_bucket=16)
    batch, rewards = as_jnp(b), jnp.asarray(b.rewards)
    algo = algorithm(make_config(kl_coef=0.5, kl_kind="k1", kl_in_reward=True))
    params = model.init_params(CFG, jax.random.key(0))
    ref_params = model.init_params(CFG, jax.random.key(1))
    fn = jax.jit(functools.partial(ts.kl_in_reward, algo=algo, model_config=CFG, group_size=4))

    same_r, same_adv = fn(params, params, batch, rewards)
    np.testing.assert_allclose(same_r, b.rewards, atol=1e-6)
    np.testing.assert_allclose(same_adv, b.advantages, atol=1e-5)

    shaped, adv = fn(params, ref_params, batch, rewards)
    logp, _ = ts.forward_logprobs(params, batch, model_config=CFG, temperature=1.0)
    ref, _ = ts.forward_logprobs(ref_params, batch, model_config=CFG, temperature=1.0)
    kl_seq = np.sum(np.asarray(logp - ref) * b.loss_mask, axis=-1)  # k1 = logp - ref
    want = b.rewards - 0.5 * kl_seq
    np.testing.assert_allclose(shaped, want, rtol=1e-5, atol=1e-5)
    want_adv = group_advantages(want, 4, "grpo")[:, None] * b.loss_mask
    np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grad_clip", [0.0, 1.0, 1e-3])
def test_apply_grads_is_optax_clip_then_adamw(grad_clip):
    """The update (one scale for 1/count and the clip, a branch for the skip, norms as dot
    products) equals optax's own chain on the averaged gradient, and its metrics equal
    optax's norms."""
    params = model.init_params(CFG, jax.random.key(0))
    opt = ts.make_optimizer(learning_rate=1e-2, weight_decay=0.1)
    state = ts.TrainState(params=params, opt_state=opt.init(params), step=jnp.zeros((), jnp.int32))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    grad_sums = treedef.unflatten(
        [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )
    count = 7.0
    acc = ts.Accumulated(grad_sums, jnp.float32(3.0), jnp.float32(count), ts.Stats())
    new, stats = jax.jit(functools.partial(ts.apply_grads, optimizer=opt, grad_clip=grad_clip))(
        state, acc
    )
    grads = jax.tree.map(lambda g: g / count, grad_sums)
    ref_opt = optax.chain(optax.clip_by_global_norm(grad_clip), opt) if grad_clip else opt
    ref_state = ref_opt.init(params)
    updates, ref_new_state = ref_opt.update(grads, ref_state, params)
    chex.assert_trees_all_close(
        new.params, optax.apply_updates(params, updates), rtol=1e-5, atol=1e-7
    )
    # The moments and counts too (the clip's own state is empty).
    ref_adam_state = ref_new_state[1] if grad_clip else ref_new_state
    chex.assert_trees_all_close(new.opt_state, ref_adam_state, rtol=1e-5, atol=1e-7)
    assert int(new.step) == 1
    means = {k: float(v[0] / v[1]) for k, v in stats.means.items()}
    np.testing.assert_allclose(means["optim/grad_norm"], optax.tree.norm(grads), rtol=1e-5)
    np.testing.assert_allclose(means["optim/update_norm"], optax.tree.norm(updates), rtol=1e-5)
    np.testing.assert_allclose(means["optim/param_norm"], optax.tree.norm(new.params), rtol=1e-5)
    np.testing.assert_allclose(means["loss/total"], 3.0 / count, rtol=1e-6)
    assert float(stats.maxima["step/skipped"]) == 0.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: ts.make_optimizer(learning_rate=1e-2, warmup_steps=3, weight_decay=0.1),
        lambda: optax.sgd(optax.linear_schedule(0.1, 0.01, 5), momentum=0.9),
    ],
    ids=["adamw-warmup", "sgd-momentum-schedule"],
)
def test_update_leaf_by_leaf_equals_one_update_of_the_whole_tree(make):
    """Over three steps: the same params, optimizer state (moments, counts) and update norm
    as ``optimizer.update`` over the whole tree."""
    opt = make()
    params = model.init_params(CFG, jax.random.key(0))
    leaves, treedef = jax.tree.flatten(params)
    state, ref_state, ref_params = opt.init(params), opt.init(params), params
    fn = jax.jit(functools.partial(ts.update_leaf_by_leaf, opt))
    for step in range(3):
        keys = jax.random.split(jax.random.key(step + 1), len(leaves))
        grads = treedef.unflatten(
            [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
        )
        params, state, norm = fn(grads, state, params)
        updates, ref_state = opt.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state, ref_state, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(norm, optax.tree.norm(updates), rtol=1e-5)


def test_apply_grads_updates_an_optimizer_not_known_to_be_leafwise_over_the_whole_tree():
    """A plain optax chain with a global transform inside (its clip sees every leaf at
    once): apply_grads does not split it by leaf. Leaf by leaf it would clip each leaf on
    its own norm, and the second step's params would differ."""
    assert isinstance(ts.make_optimizer(learning_rate=1e-2), ts.LeafwiseOptimizer)
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    assert not isinstance(opt, ts.LeafwiseOptimizer)
    params = {"a": jnp.zeros((2,), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}
    state = ts.TrainState(params=params, opt_state=opt.init(params), step=jnp.zeros((), jnp.int32))
    ref_params, ref_state = params, opt.init(params)
    step = jax.jit(functools.partial(ts.apply_grads, optimizer=opt, grad_clip=0.0))
    grad_steps = (
        {"a": jnp.array([3.0, 4.0]), "b": jnp.array([1.0, 0.0])},
        {"a": jnp.array([0.1, 0.1]), "b": jnp.array([1.0, 0.0])},
    )
    for grads in grad_steps:
        state, stats = step(
            state, ts.Accumulated(grads, jnp.float32(0.0), jnp.float32(1.0), ts.Stats())
        )
        updates, ref_state = opt.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        np.testing.assert_allclose(
            float(stats.means["optim/update_norm"][0]), optax.tree.norm(updates), rtol=1e-5
        )
    chex.assert_trees_all_close(state.params, ref_params, rtol=1e-5, atol=1e-7)
    # Leaf by leaf, the same chain gives other params: the comparison above can fail.
    leafwise = params, opt.init(params)
    for grads in grad_steps:
        p, s, _ = ts.update_leaf_by_leaf(opt, grads, leafwise[1], leafwise[0])
        leafwise = p, s
    assert not np.allclose(leafwise[0]["b"], ref_params["b"], rtol=1e-3)


def test_update_leaf_by_leaf_holds_one_leafs_update_at_a_time():
    """XLA's own memory figure for the compiled update of eight 4 MiB leaves, params and
    state donated as the train step donates them: at most three leaves' worth of
    temporaries, where one ``optimizer.update`` over the tree with the norm of its updates
    holds every leaf's update (design §6)."""
    leaf_bytes = 4 * 2**20
    params = {f"w{i}": jnp.full((1024, 1024), 0.1 * i, jnp.float32) for i in range(8)}
    grads = jax.tree.map(lambda x: x + 1.0, params)
    opt = ts.make_optimizer(learning_rate=1e-2)
    state = opt.init(params)

    # Arguments in the outputs' order: jit pairs donated buffers with outputs in order.
    def leaf_by_leaf(params, state, grads):
        return ts.update_leaf_by_leaf(opt, grads, state, params)

    def whole_tree(params, state, grads):
        updates, new_state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, ts.tree_norm(updates)

    def temp_leaves(fn):
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        return analysis.temp_size_in_bytes / leaf_bytes

    leafwise, whole = temp_leaves(leaf_by_leaf), temp_leaves(whole_tree)
    print(f"temporaries in leaves: leaf by leaf {leafwise:.2f}, whole tree {whole:.2f}")
    assert leafwise <= 3.0, leafwise

    # And through apply_grads, which takes that path on a CPU only.
    if jax.default_backend() != "cpu":
        return
    train_state = ts.init_train_state(params, opt)
    acc = ts.Accumulated(grads, jnp.float32(1.0), jnp.float32(2.0), ts.Stats())
    step = jax.jit(
        functools.partial(ts.apply_grads, optimizer=opt, grad_clip=1.0), donate_argnums=(0,)
    )
    analysis = step.lower(train_state, acc).compile().memory_analysis()
    assert analysis.temp_size_in_bytes / leaf_bytes <= 3.0


def test_apply_grads_skips_a_non_finite_gradient_untouched():
    params = model.init_params(CFG, jax.random.key(0))
    opt = ts.make_optimizer(learning_rate=1e-2)
    state = ts.TrainState(params=params, opt_state=opt.init(params), step=jnp.zeros((), jnp.int32))
    grad_sums = jax.tree.map(jnp.ones_like, params)
    grad_sums["final_norm"]["scale"] = grad_sums["final_norm"]["scale"].at[0].set(jnp.inf)
    acc = ts.Accumulated(grad_sums, jnp.float32(1.0), jnp.float32(2.0), ts.Stats())
    new, stats = jax.jit(functools.partial(ts.apply_grads, optimizer=opt, grad_clip=1.0))(
        state, acc
    )
    chex.assert_trees_all_equal(new.params, params)
    chex.assert_trees_all_equal(new.opt_state, state.opt_state)
    assert int(new.step) == 0 and float(stats.maxima["step/skipped"]) == 1.0
    assert float(stats.means["optim/update_norm"][0]) == 0.0
