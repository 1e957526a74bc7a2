"""The tiny model's train step as the core tests build it: synthetic groups that mix
staleness d and d + 1, a config with padded rows unless asked, and the jitted step."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax import model
from a3po_jax.core import optim
from a3po_jax.core import train_step as ts
from a3po_jax.core.algorithm import Algorithm
from a3po_jax.core.batching import build_batch
from a3po_jax.core.stats import finalize
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    RolloutSection,
    SystemSection,
    TrainConfig,
)
from helpers.factories import synthetic_groups

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


def staleness_batch(num_groups=4, group_size=4, seed=0, dpo=False):
    """The padded batch arrays (jnp) of synthetic groups whose samples are 0, 1 or 2
    versions old by position, with behaviour log-probs spread over [3.5, 5.5]: the batch
    the objective tests push through a step."""
    groups = synthetic_groups(
        num_groups,
        group_size,
        prompt_len=(3, 8),
        response_len=(2, 11),
        vocab=CFG.vocab_size,
        versions=lambda g, i: (g + i) % 3,
        behav_range=(3.5, 5.5),
        seed=seed,
    )
    b = build_batch(groups, advantage="grpo", length_bucket=16, dpo_pairs=dpo)
    return {k: jnp.asarray(v) for k, v in b.arrays().items()}


def make_config(group_size=4, groups=4, batch=None, **algo):
    """4 groups of 4 (DPO: pairs) unless told; ``batch`` holds BatchSection fields. The
    step takes the padded rows the tests build unless ``batch`` asks for packed ones."""
    if algo.get("loss") == "dpo" and group_size == 4:
        group_size, groups = 2, 2 * groups
    return TrainConfig(
        rollout=RolloutSection(group_size=group_size, groups_per_step=groups),
        algo=AlgoSection(**algo),
        system=SystemSection(batch=BatchSection(**{"packed_prompts": False, **(batch or {})})),
    )


def setup(cfg: TrainConfig, seed=0):
    params = model.init_params(CFG, jax.random.key(seed))
    opt = step_builder.optimizer(cfg)
    return optim.init_train_state(params, opt), opt


def algorithm(cfg: TrainConfig) -> Algorithm:
    return step_builder.algorithm(cfg, CFG)


def step_fn(cfg: TrainConfig):
    opt = step_builder.optimizer(cfg)
    return jax.jit(
        functools.partial(
            ts.train_step, algo=algorithm(cfg), optimizer=opt, grad_clip=cfg.optim.grad_clip
        )
    )


def as_jnp(batch):
    return {k: jnp.asarray(v) for k, v in batch.arrays().items()}


def accumulated_in_micro_batches(algo: Algorithm, params, ref_params, batch, splits, version=3):
    """The step's accumulated loss sums, gradients and stats over `batch` split into each of
    `splits` micro-batch counts (old and reference passes included), jitted once per split
    rather than run op by op."""

    @functools.partial(jax.jit, static_argnums=0)
    def accumulate(m, params, ref_params, batch):
        mbs = ts.split_micro_batches(batch, m)
        old, ref = ts.auxiliary_logprobs(params, ref_params, mbs, algo=algo)
        return ts.accumulate_grads(
            params, mbs, version=jnp.int32(version), old_logp=old, ref_logp=ref, algo=algo
        )

    return [accumulate(m, params, ref_params, batch) for m in splits]


def assert_same_accumulation(one, four) -> dict:
    """Two accumulations of one batch (whole, and in micro-batches) agree: loss sum, count,
    gradients and every metric reduced once from its sums (not a mean of means). Returns the
    whole batch's metrics."""
    np.testing.assert_allclose(one.loss_sum, four.loss_sum, rtol=1e-5)
    np.testing.assert_allclose(one.count, four.count)
    chex.assert_trees_all_close(one.grads, four.grads, rtol=2e-4, atol=1e-6)
    m1, m4 = finalize(one.stats), finalize(four.stats)
    assert m1.keys() == m4.keys()
    # atol: dpo's rewards are β times a difference of two float32 sums of log-probs (tens of
    # nats), whose rounding in two differently compiled programs reaches a few 1e-7.
    for key in m1:
        np.testing.assert_allclose(m1[key], m4[key], rtol=1e-5, atol=1e-6, err_msg=key)
    return m1
