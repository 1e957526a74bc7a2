"""The jitted train step on a tiny random model: invariances and guards."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from a3po_jax import model
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.core.types import Rollout, RolloutGroup
from a3po_jax.training.config import AlgoSection, RolloutSection, TrainConfig

CFG = model.ModelConfig.tiny()


def make_groups(num_groups=4, group_size=4, seed=0, versions_from=0, vocab=None):
    """Synthetic complete groups with varied lengths, rewards and versions."""
    rng = np.random.default_rng(seed)
    vocab = vocab or CFG.vocab_size
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(3, vocab, size=rng.integers(3, 9))
        rollouts = []
        for i in range(group_size):
            n = int(rng.integers(2, 12))
            rollouts.append(
                Rollout(
                    prompt_id=f"p{g}",
                    group_id=g,
                    sample_index=i,
                    prompt_tokens=prompt,
                    completion_tokens=rng.integers(3, vocab, size=n),
                    behav_logprobs=-rng.uniform(3.0, 6.0, size=n),
                    versions=np.full(n, max(0, versions_from - (i % 2))),
                    finish_reason="stop",
                    reward=float(rng.integers(0, 2)),
                )
            )
        groups.append(RolloutGroup(f"p{g}", g, rollouts, admitted_at_version=versions_from))
    return groups


def make_config(**algo):
    return TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4),
        algo=AlgoSection(**algo),
    )


def setup(cfg: TrainConfig, seed=0):
    params = model.init_params(CFG, jax.random.key(seed))
    opt = ts.make_optimizer(cfg)
    return ts.init_train_state(params, opt), opt


def step_fn(cfg: TrainConfig, **overrides):
    settings = dataclasses.replace(ts.StepSettings.from_config(cfg), **overrides)
    opt = ts.make_optimizer(cfg)
    return jax.jit(
        functools.partial(
            ts.train_step,
            settings=settings,
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


def test_micro_batched_grads_equal_full_batch():
    cfg = make_config(prox="a3po")
    settings = ts.StepSettings.from_config(cfg)
    params = model.init_params(CFG, jax.random.key(1))
    batch = as_jnp(build_batch(make_groups(versions_from=2), advantage="grpo", length_bucket=16))
    version = jnp.int32(3)

    def grads(m):
        g, loss, sums = ts.accumulate_grads(
            params,
            ts.split_micro_batches(batch, m),
            version=version,
            prox_logp=None,
            ref_logp=None,
            settings=settings,
            model_config=CFG,
        )
        return g, loss, sums

    g1, l1, s1 = grads(1)
    g4, l4, s4 = grads(4)
    np.testing.assert_allclose(l1, l4, rtol=1e-5)
    chex.assert_trees_all_close(g1, g4, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(s1["staleness/max"], s4["staleness/max"])
    np.testing.assert_allclose(s1["is/weight_max"], s4["is/weight_max"], rtol=1e-5)


def test_recompute_equals_a3po_at_zero_staleness_with_one_minibatch():
    # With one optimizer step per batch the recomputed prox is the current weights'
    # log-prob, i.e. what A-3PO uses at d = 0: same update, one forward pass more.
    groups = make_groups(seed=2)
    for g in groups:
        for r in g.rollouts:
            r.versions[:] = 0
    batch = as_jnp(build_batch(groups, advantage="grpo", length_bucket=16))
    out = {}
    for prox in ("recompute", "a3po"):
        cfg = make_config(prox=prox)
        state, _ = setup(cfg)
        out[prox], metrics = step_fn(cfg)(state, batch, None)
    chex.assert_trees_all_close(out["recompute"].params, out["a3po"].params, rtol=1e-5, atol=1e-7)


def test_periodic_arrival_order_equals_sync_update():
    # Periodic Asynchrony: groups arrive in any order, gradients are accumulated per
    # arriving micro-batch, one optimizer step at the end = the sync update.
    cfg = make_config(prox="behav")
    settings = ts.StepSettings.from_config(cfg)
    state, opt = setup(cfg)
    groups = make_groups(seed=3)
    full = as_jnp(build_batch(groups, advantage="grpo", length_bucket=32))
    sync_state, _ = step_fn(cfg)(state, full, None)

    # Arrival order reversed; advantages are per group so each group batch stands alone.
    g_total, l_total, denom = None, 0.0, 0.0
    for g in reversed(groups):
        part = as_jnp(build_batch([g], advantage="grpo", length_bucket=32))
        g_sum, l_sum, _ = ts.accumulate_grads(
            state.params,
            ts.split_micro_batches(part, 1),
            version=state.step,
            prox_logp=None,
            ref_logp=None,
            settings=settings,
            model_config=CFG,
        )
        g_total = g_sum if g_total is None else jax.tree.map(jnp.add, g_total, g_sum)
        l_total += l_sum
        denom += ts.global_denominator(part, settings)
    periodic_state, _ = ts.apply_grads(
        state, g_total, denom, optimizer=opt, grad_clip=cfg.optim.grad_clip, loss_sum=l_total
    )
    chex.assert_trees_all_close(periodic_state.params, sync_state.params, rtol=1e-5, atol=1e-6)


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
    settings = ts.StepSettings.from_config(cfg)
    opt = ts.make_optimizer(cfg)

    @functools.partial(jax.jit, donate_argnums=(0,))
    @chex.assert_max_traces(n=1)
    def step(state, batch):
        return ts.train_step(
            state, batch, None, settings=settings, model_config=CFG, optimizer=opt, grad_clip=1.0
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
        ("packed", packed_arrays, {"packed": True}),
        ("one_pass", plain_batch, {"one_pass_old": True}),
        ("packed_one_pass", packed_arrays, {"packed": True, "one_pass_old": True}),
    ):
        state, _ = setup(cfg)
        results[name], metrics = step_fn(cfg, **overrides)(state, batch, None)
        assert float(metrics["step/skipped"]) == 0.0
    for name in ("packed", "one_pass", "packed_one_pass"):
        chex.assert_trees_all_close(
            results[name].params, results["plain"].params, rtol=1e-4, atol=1e-6
        )
