"""Several groups per packed row (``system.batch.groups_per_row``) and the compact per-row head:
the mask never crosses groups, packed == unpacked values and gradients for 1, 2 and 4 groups
per row, the balancing order, one train step equal across layouts, micro-batches, config."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.factories import synthetic_groups
from helpers.packing import (
    TEMPERATURE,
    TINY,
    assert_trees_close,
    make_groups,
    make_rollout,
    masked_sum_grad,
    packed_fn,
    sharpened_params,
    unpacked_fn,
)

from a3po_jax import model
from a3po_jax.core import logprobs, optim, packing
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.core.types import RolloutGroup
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    ConfigError,
    RolloutSection,
    SystemSection,
    TrainConfig,
)


@pytest.fixture(scope="module")
def tiny_params():
    return sharpened_params(TINY)


@pytest.fixture(scope="module")
def groups():
    # 4 groups: a 1-token prompt, an empty response, prompts of 3-9 and responses of 1-12.
    return make_groups(num_groups=4)


def permuted_rows(values, order, group_size):
    """Rows of per-sample arrays of groups in ``order`` -> rows in the input order."""
    values = np.asarray(values)
    out = np.empty_like(values)
    for pos, gi in enumerate(order):
        out[gi * group_size : (gi + 1) * group_size] = values[
            pos * group_size : (pos + 1) * group_size
        ]
    return out


# ---------------------------------------------------------------------------------------------
# Layout, order and mask


def test_two_groups_in_one_row_hand_example():
    groups = [
        RolloutGroup(
            "p0", 0, [make_rollout(0, 0, [5, 6], [8]), make_rollout(0, 1, [5, 6], [9, 10])], 0
        ),
        RolloutGroup(
            "p1", 1, [make_rollout(1, 0, [7], [11, 12]), make_rollout(1, 1, [7], [13])], 0
        ),
    ]
    packed = packing.pack_groups(groups, length_bucket=4, groups_per_row=2, balance_rows=False)
    # [p0 | a | b | p1 | c | d | pad]: 11 tokens, L = 12.
    np.testing.assert_array_equal(packed.tokens, [[5, 6, 8, 9, 10, 7, 11, 12, 13, 0, 0, 0]])
    # Positions restart at 0 with each group, and after each group's prompt per response.
    np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 2, 3, 0, 1, 2, 1, 0, 0, 0]])
    np.testing.assert_array_equal(packed.response_id, [[0, 0, 1, 2, 2, 0, 1, 1, 2, -1, -1, -1]])
    np.testing.assert_array_equal(packed.group_slot, [[0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1]])
    # Compact list: group 0's tokens 8 | 9 10 then group 1's 11 12 | 13; token 0 of each
    # response from its own group's last prompt position (1 for group 0, 5 for group 1).
    np.testing.assert_array_equal(packed.row_pred_pos, [[1, 1, 3, 5, 6, 5, 0, 0]])
    np.testing.assert_array_equal(packed.row_targets, [[8, 9, 10, 11, 12, 13, 0, 0]])
    np.testing.assert_array_equal(packed.row_valid, [[1, 1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(packed.completion_offset, [0, 1, 3, 5])
    np.testing.assert_array_equal(packed.window_start, [1, 1, 0, 0])
    assert [(p.tolist(), c.tolist()) for p, c in packing.unpack_sequences(packed)] == [
        ([5, 6], [8]),
        ([5, 6], [9, 10]),
        ([7], [11, 12]),
        ([7], [13]),
    ]
    mask = np.asarray(
        packing.packed_attention_mask(
            jnp.asarray(packed.response_id), jnp.asarray(packed.group_slot)
        )
    )[0]
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # p0
            [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # a0
            [1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # b0: not a0
            [1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # p1: NOT group 0's prompt
            [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0],  # c0
            [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0],  # d0: p1 and itself
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # pad queries: the prompts (never read)
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("groups_per_row", [2, 4])
def test_attention_mask_never_crosses_groups(groups_per_row):
    groups = make_groups(num_groups=8, seed=4)
    packed = packing.pack_groups(groups, length_bucket=8, groups_per_row=groups_per_row)
    mask = np.asarray(
        packing.packed_attention_mask(
            jnp.asarray(packed.response_id), jnp.asarray(packed.group_slot)
        )
    )
    slot, rid = packed.group_slot, packed.response_id
    real_q = slot[:, :, None] != packing.PAD_ID
    same_group = slot[:, :, None] == slot[:, None, :]
    # Every real query sees only keys of its own group, and some real query of every group
    # sees a key (the check is not vacuous).
    assert not np.any(mask & real_q & ~same_group)
    assert np.all(mask.any(axis=2))  # every query, padding included, has a finite softmax
    # Within a group: another response's tokens are never visible.
    other_response = (rid[:, None, :] > 0) & (rid[:, :, None] != rid[:, None, :])
    assert not np.any(mask & real_q & other_response)
    assert packed.shape[0] == 8 // groups_per_row
    assert set(np.unique(slot[slot >= 0])) == set(range(groups_per_row))


def test_balanced_order():
    assert packing.balanced_group_order([10, 1, 9, 2], 2).tolist() == [0, 1, 2, 3]
    # 10 + 1 and 9 + 2: the longest pairs with the shortest.
    assert packing.balanced_group_order([10, 9, 2, 1], 2).tolist() == [0, 3, 1, 2]
    assert packing.balanced_group_order([3, 1, 2], 1).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="divide"):
        packing.balanced_group_order([1, 2, 3], 2)
    # Balancing shortens the packed row of a batch whose long groups come first.
    groups = synthetic_groups(
        4, 2, prompt_len=4, response_len=lambda rng, g, i: 30 if g < 2 else 2, vocab=64
    )
    kept = packing.pack_groups(groups, length_bucket=4, groups_per_row=2, balance_rows=False)
    balanced = packing.pack_groups(groups, length_bucket=4, groups_per_row=2)
    assert kept.group_order.tolist() == [0, 1, 2, 3]
    assert balanced.group_order.tolist() == [0, 2, 1, 3]
    assert balanced.shape[1] < kept.shape[1] and balanced.head_token_slots < kept.head_token_slots
    # The unpacked batch follows the packed order.
    assert balanced.batch.group_ids.tolist() == [0, 0, 2, 2, 1, 1, 3, 3]
    with pytest.raises(ValueError, match="groups_per_row"):
        packing.pack_groups(groups, length_bucket=4, groups_per_row=3)


# ---------------------------------------------------------------------------------------------
# Packed == unpacked, 1, 2 and 4 groups per row


@pytest.mark.parametrize("groups_per_row", [1, 2, 4])
def test_values_and_gradients_match_unpacked(groups, tiny_params, groups_per_row):
    packed = packing.pack_groups(groups, length_bucket=8, groups_per_row=groups_per_row)
    g = packed.group_size
    if groups_per_row == 2:
        assert packed.group_order.tolist() == [0, 2, 1, 3]  # the reordering is exercised
    unpacked = build_batch(groups, advantage="grpo", length_bucket=8)  # the input order
    logp, ent = packed_fn(TINY)(tiny_params, packed.arrays())
    ref_logp, ref_ent = unpacked_fn(TINY)(tiny_params, unpacked.arrays())
    logp = permuted_rows(logp, packed.group_order, g)
    ent = permuted_rows(ent, packed.group_order, g)
    mask = unpacked.loss_mask > 0
    np.testing.assert_allclose(logp[mask], np.asarray(ref_logp)[mask], atol=1e-5)
    np.testing.assert_allclose(ent[mask], np.asarray(ref_ent)[mask], atol=1e-5)
    assert np.abs(np.asarray(ref_logp)[mask]).min() > 1e-2  # off-by-one would show
    assert np.all(logp[~mask] == 0)
    # The gradient of Σ mask·logp is order-independent: equal to the unpacked one.
    g_packed = masked_sum_grad(packing.packed_token_logprobs, TINY)(tiny_params, packed.arrays())
    g_unpacked = masked_sum_grad(logprobs.forward_logprobs, TINY)(tiny_params, unpacked.arrays())
    assert_trees_close(g_packed, g_unpacked, rel=1e-5)
    # The head runs on fewer positions than the old [B, C] layout's B·round_up(max R).
    old_head = len(groups) * g * 16  # longest completion 12 -> bucket 8 -> 16
    assert packed.head_token_slots <= old_head


def test_dpo_pairs_two_groups_per_row(tiny_params):
    groups = [
        RolloutGroup(
            f"p{g}",
            g,
            [
                make_rollout(g, 0, [4, 5, 6 + g] * (g + 1), [7, 8] * (g + 1), reward=0.0),
                make_rollout(g, 1, [4, 5, 6 + g] * (g + 1), [9, 10, 11], reward=1.0),
            ],
            admitted_at_version=0,
        )
        for g in range(4)
    ]
    packed = packing.pack_groups(groups, length_bucket=4, dpo_pairs=True, groups_per_row=2)
    unpacked = build_batch(groups, advantage="grpo", length_bucket=4, dpo_pairs=True)
    # Chosen (reward 1) first in every pair, in the packed order too.
    assert packed.batch.rewards.tolist() == [1.0, 0.0] * 4
    np.testing.assert_array_equal(
        permuted_rows(packed.batch.pair_mask, packed.group_order, 2), unpacked.pair_mask
    )
    logp, _ = packed_fn(TINY)(tiny_params, packed.arrays())
    ref, _ = unpacked_fn(TINY)(tiny_params, unpacked.arrays())
    logp = permuted_rows(logp, packed.group_order, 2)
    mask = unpacked.loss_mask > 0
    np.testing.assert_allclose(logp[mask], np.asarray(ref)[mask], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# One train step


def step_config(**batch):
    return TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4, temperature=TEMPERATURE),
        algo=AlgoSection(prox="a3po"),
        system=SystemSection(batch=BatchSection(**{"packed_prompts": True, **batch})),
    )


@functools.cache
def jitted_step(packed, micro_batch_size=0, groups_per_row=1):
    cfg = step_config(
        packed_prompts=packed, micro_batch_size=micro_batch_size, groups_per_row=groups_per_row
    )
    algo = step_builder.algorithm(cfg, TINY)
    opt = step_builder.optimizer(cfg)
    step = jax.jit(functools.partial(ts.train_step, algo=algo, optimizer=opt, grad_clip=1.0))
    return step, opt


def one_step(arrays, packed, micro_batch_size=0, groups_per_row=1):
    step, opt = jitted_step(packed, micro_batch_size, groups_per_row)
    params = model.init_params(TINY, jax.random.key(0))
    state = optim.init_train_state(params, opt)._replace(step=jnp.asarray(2, jnp.int32))
    new, metrics = step(state, {k: jnp.asarray(v) for k, v in arrays.items()}, None)
    return new, metrics


@pytest.fixture(scope="module")
def step_groups():
    return synthetic_groups(
        4,
        4,
        prompt_len=(3, 12),
        response_len=(1, 11),
        vocab=TINY.vocab_size,
        versions=lambda g, i: i % 2,
        behav_range=(3.0, 6.0),
        admitted_at_version=1,
        seed=6,  # the balancing reorders these groups: [0, 3, 1, 2]
    )


def test_train_step_equal_across_groups_per_row(step_groups):
    results = {
        "unpacked": one_step(
            build_batch(step_groups, advantage="grpo", length_bucket=16).arrays(), False
        )
    }
    for gpr in (1, 2):
        packed = packing.pack_groups(step_groups, length_bucket=16, groups_per_row=gpr)
        if gpr == 2:
            assert packed.group_order.tolist() != [0, 1, 2, 3]  # the reordering is exercised
        results[gpr] = one_step(packed.arrays(), True, groups_per_row=gpr)
    base_state, base = results["unpacked"]
    assert abs(float(base["loss/total"])) > 1e-4 and float(base["optim/grad_norm"]) > 1e-4
    for name in (1, 2):
        state, metrics = results[name]
        assert float(metrics["step/skipped"]) == 0.0
        for key in ("loss/total", "optim/grad_norm", "policy/logp", "policy/entropy"):
            chex.assert_trees_all_close(metrics[key], base[key], rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state.params, base_state.params, rtol=1e-5, atol=1e-6)


def test_micro_batches_of_two_group_rows(step_groups):
    packed = packing.pack_groups(step_groups, length_bucket=16, groups_per_row=2)
    full_state, full = one_step(packed.arrays(), True, groups_per_row=2)
    # 8 sequences = one packed row of 2 groups x 4 samples per micro-batch: 2 micro-batches.
    micro_state, micro = one_step(packed.arrays(), True, micro_batch_size=8, groups_per_row=2)
    for key in ("loss/total", "optim/grad_norm"):
        chex.assert_trees_all_close(micro[key], full[key], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(micro_state.params, full_state.params, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Config


def test_groups_per_row_validation():
    assert step_config(groups_per_row=2).system.batch.groups_per_row == 2
    with pytest.raises(ConfigError, match="system.batch.groups_per_row"):
        BatchSection(groups_per_row=0)
    with pytest.raises(ConfigError, match="system.batch.packed_prompts"):
        TrainConfig(
            system=SystemSection(batch=BatchSection(packed_prompts=False, groups_per_row=2))
        )
    with pytest.raises(ConfigError, match="rollout.groups_per_step=4"):
        step_config(groups_per_row=3)
    with pytest.raises(ConfigError, match="algo.num_minibatches=4"):
        TrainConfig(
            rollout=RolloutSection(group_size=4, groups_per_step=4),
            algo=AlgoSection(num_minibatches=4, prox="a3po"),
            system=SystemSection(
                max_staleness=4, batch=BatchSection(packed_prompts=True, groups_per_row=2)
            ),
        )
    with pytest.raises(ConfigError, match="system.batch.micro_batch_size=4"):
        step_config(groups_per_row=2, micro_batch_size=4)
    # Periodic mode folds one group at a time: groups_per_row only has to divide the batch.
    periodic = TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4),
        system=SystemSection(
            mode="periodic",
            max_staleness=0,
            batch=BatchSection(packed_prompts=True, groups_per_row=2),
        ),
    )
    assert periodic.system.batch.groups_per_row == 2


# ---------------------------------------------------------------------------------------------
# Through the trainer


@pytest.mark.e2e
def test_trainer_two_groups_per_row_equals_one(tmp_path):
    """sync mode is deterministic given the seed: both runs train on the same 4 groups at
    step 1; with 2 groups per row the trainer reorders them (one minibatch) and the step's
    loss, gradient norm and metrics of the batch are those of 1 group per row."""
    from helpers.trainer_runs import make_cfg, run

    records = {}
    for gpr in (1, 2):
        cfg = make_cfg(tmp_path, f"gpr{gpr}", mode="sync", steps=1, prox="a3po")
        cfg = dataclasses.replace(
            cfg,
            rollout=dataclasses.replace(cfg.rollout, groups_per_step=4),
            system=dataclasses.replace(
                cfg.system, batch=BatchSection(packed_prompts=True, groups_per_row=gpr)
            ),
        )
        (records[gpr],) = run(cfg)
    one, two = records[1], records[2]
    assert two["step/skipped"] == 0 and float(one["optim/grad_norm"]) > 0
    for key in ("loss/total", "optim/grad_norm", "policy/logp", "optim/param_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    for key in ("reward/mean", "response/length_mean", "staleness/max"):
        assert two[key] == one[key], key
