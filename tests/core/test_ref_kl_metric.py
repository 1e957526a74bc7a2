"""algo.track_ref_kl: KL(π_θ ‖ π_init) as a metric (kl/ref_k3), the loss and update unchanged."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.factories import synthetic_groups

from a3po_jax import model
from a3po_jax.core import optim
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
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
UNPACKED = SystemSection(
    batch=BatchSection(packed_prompts=False)
)  # the padded rows build_batch lays out


def make_config(group_size=4, **algo) -> TrainConfig:
    return TrainConfig(
        rollout=RolloutSection(group_size=group_size, groups_per_step=4),
        algo=AlgoSection(**algo),
        system=UNPACKED,
    )


def make_batch(group_size=4, dpo=False, seed=3):
    groups = synthetic_groups(
        4,
        group_size,
        prompt_len=(3, 8),
        response_len=(2, 11),
        vocab=CFG.vocab_size,
        behav_range=(3.0, 6.0),
        seed=seed,
    )
    b = build_batch(groups, advantage="grpo", length_bucket=16, dpo_pairs=dpo)
    return {k: jnp.asarray(v) for k, v in b.arrays().items()}


def run_step(cfg: TrainConfig, params, batch, ref):
    opt = step_builder.optimizer(cfg)
    fn = jax.jit(
        functools.partial(
            ts.train_step,
            algo=step_builder.algorithm(cfg, CFG),
            optimizer=opt,
            grad_clip=cfg.optim.grad_clip,
        )
    )
    return fn(optim.init_train_state(params, opt), batch, ref)


def test_off_by_default_and_the_algorithm_keeps_a_reference_when_on():
    off = step_builder.algorithm(make_config(prox="recompute"), CFG)
    assert off.kl_metric is None and not off.needs_reference and not off.keeps_reference
    on = step_builder.algorithm(make_config(prox="recompute", track_ref_kl=True), CFG)
    # The trainer creates ref_params exactly when keeps_reference is set.
    assert on.kl_metric is not None and on.needs_reference and on.keeps_reference
    assert on.kl_in_loss is None and on.kl_coef == 0.0


def test_config_rejects_a_non_bool():
    with pytest.raises(ConfigError, match="algo.track_ref_kl"):
        AlgoSection(track_ref_kl="yes")


@pytest.mark.parametrize(
    "algo, group_size",
    [(dict(prox="recompute", num_minibatches=2), 4), (dict(loss="dpo", prox="behav"), 2)],
    ids=["ppo-recompute-2-minibatches", "dpo"],
)
def test_update_equals_the_run_without_it(algo, group_size):
    # The metric reads the reference pass and adds nothing to the loss: the new params and
    # every other metric are those of the same step without it. DPO already has a reference
    # pass (the initial policy), so there only the metric is new.
    params = model.init_params(CFG, jax.random.key(0))
    batch = make_batch(group_size, dpo=algo.get("loss") == "dpo")
    ref = jax.tree.map(jnp.copy, params)
    base_ref = ref if algo.get("loss") == "dpo" else None
    base, base_metrics = run_step(make_config(group_size, **algo), params, batch, base_ref)
    tracked, metrics = run_step(
        make_config(group_size, track_ref_kl=True, **algo), params, batch, ref
    )
    chex.assert_trees_all_close(tracked.params, base.params, rtol=1e-5, atol=1e-7)
    assert "kl/ref_k3" not in base_metrics
    assert set(metrics) == set(base_metrics) | {"kl/ref_k3"}
    for key, value in base_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    kl = float(metrics["kl/ref_k3"])
    if algo.get("num_minibatches", 1) == 2:
        # Minibatch 0 trains at the reference (KL 0), minibatch 1 one update away (KL > 0).
        assert kl > 1e-8
    else:
        assert kl == pytest.approx(0.0, abs=1e-6)


def test_value_is_the_masked_k3_mean_against_the_given_reference():
    # Golden: k3 = exp(x) - x - 1 with x = ref - logp, averaged over the trained tokens,
    # computed here from the two policies' log-probs on the batch.
    cfg = make_config(prox="recompute", track_ref_kl=True)
    params = model.init_params(CFG, jax.random.key(0))
    ref = model.init_params(CFG, jax.random.key(1))  # a different "initial" policy
    batch = make_batch()
    _, metrics = run_step(cfg, params, batch, ref)
    algo = step_builder.algorithm(cfg, CFG)
    logp, _ = algo.forward(params, batch)
    ref_logp, _ = algo.forward(ref, batch)
    x = np.asarray(ref_logp, np.float64) - np.asarray(logp, np.float64)
    mask = np.asarray(batch["loss_mask"], np.float64)
    want = np.sum((np.exp(x) - x - 1) * mask) / np.sum(mask)
    assert want > 0.01  # two random policies differ
    np.testing.assert_allclose(float(metrics["kl/ref_k3"]), want, rtol=1e-4)


def test_the_algorithm_reads_the_field():
    cfg = dataclasses.replace(make_config(), algo=AlgoSection(track_ref_kl=True))
    assert step_builder.algorithm(cfg, CFG).kl_metric is not None
