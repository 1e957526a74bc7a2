"""Shared-prompt packing: layout, mask, packed == unpacked log-probs and gradients, one pass."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jaxpr_inspect import count_primitive
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
from a3po_jax.core import logprobs, packing
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.core.types import RolloutGroup


@pytest.fixture(scope="module")
def tiny_params():
    return sharpened_params(TINY)


@pytest.fixture(scope="module")
def groups():
    return make_groups()


# ---------------------------------------------------------------------------------------------
# Layout and mask on a hand-made group


def hand_group():
    # Prompt [5 6 7]; responses [8 9] and [10 11 12]: packed length 8, bucket 3 -> L = 9.
    return [
        RolloutGroup(
            "p0",
            0,
            [
                make_rollout(0, 0, [5, 6, 7], [8, 9], 1.0),
                make_rollout(0, 1, [5, 6, 7], [10, 11, 12]),
            ],
            admitted_at_version=0,
        )
    ]


def test_pack_layout_hand_example():
    packed = packing.pack_groups(hand_group(), length_bucket=3)
    np.testing.assert_array_equal(packed.tokens, [[5, 6, 7, 8, 9, 10, 11, 12, 0]])
    # Both responses restart at position P = 3: each sees the positions of its own row.
    np.testing.assert_array_equal(packed.positions, [[0, 1, 2, 3, 4, 3, 4, 5, 0]])
    np.testing.assert_array_equal(packed.response_id, [[0, 0, 0, 1, 1, 2, 2, 2, -1]])
    np.testing.assert_array_equal(packed.group_slot, [[0, 0, 0, 0, 0, 0, 0, 0, -1]])
    np.testing.assert_array_equal(packed.prompt_len, [3])
    np.testing.assert_array_equal(packed.response_start, [3, 5])
    # The row's completion tokens in one compact list (K = 5 rounded up to the bucket 3):
    # token 0 of BOTH responses is predicted from the last prompt position 2; token j > 0
    # from the previous token of the same response (response 2's token 1 from position 5,
    # not from position 4, which is response 1's last token).
    np.testing.assert_array_equal(packed.row_pred_pos, [[2, 3, 2, 5, 6, 0]])
    np.testing.assert_array_equal(packed.row_targets, [[8, 9, 10, 11, 12, 0]])
    np.testing.assert_array_equal(packed.row_valid, [[1, 1, 1, 1, 1, 0]])
    # Sample b's tokens start at completion_offset[b] of the list; its unpacked window at P-1.
    np.testing.assert_array_equal(packed.completion_offset, [0, 2])
    np.testing.assert_array_equal(packed.window_start, [2, 2])
    np.testing.assert_array_equal(packed.group_order, [0])
    assert packed.head_token_slots == 6
    # The unpacked batch is build_batch's, so the loss inputs are shared by construction.
    ref = build_batch(hand_group(), advantage="grpo", length_bucket=3)
    for key, value in ref.arrays().items():
        if key in packed.arrays():
            np.testing.assert_array_equal(packed.arrays()[key], value, err_msg=key)
    assert packed.packed_token_slots == 9 and ref.tokens.size == 12
    sequences = packing.unpack_sequences(packed)
    assert [(p.tolist(), c.tolist()) for p, c in sequences] == [
        ([5, 6, 7], [8, 9]),
        ([5, 6, 7], [10, 11, 12]),
    ]


def test_attention_mask_hand_example():
    packed = packing.pack_groups(hand_group(), length_bucket=3)
    mask = np.asarray(packing.packed_attention_mask(jnp.asarray(packed.response_id)))[0]
    # Rows are queries, columns keys: p p p a a b b b pad.
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 0],  # p0: causal prompt
            [1, 1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0],  # a0: prompt + itself
            [1, 1, 1, 1, 1, 0, 0, 0, 0],  # a1
            [1, 1, 1, 0, 0, 1, 0, 0, 0],  # b0: prompt + itself, NOT a0 / a1
            [1, 1, 1, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],  # pad query: the prompt only (never read)
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)


def test_response_cannot_see_another_response(tiny_params):
    """Changing response 1's tokens leaves response 2's log-probs bit-identical, and
    changing the prompt changes them (so the check can fail)."""
    arrays = packing.pack_groups(hand_group(), length_bucket=3).arrays()
    f = packed_fn(TINY)
    base, _ = f(tiny_params, arrays)
    other = dict(arrays, packed_tokens=arrays["packed_tokens"].copy())
    other["packed_tokens"][0, 3:5] = [40, 41]  # response 1
    changed, _ = f(tiny_params, other)
    np.testing.assert_array_equal(np.asarray(changed)[1], np.asarray(base)[1])
    assert not np.allclose(np.asarray(changed)[0, 3], np.asarray(base)[0, 3])
    prompt_changed = dict(arrays, packed_tokens=arrays["packed_tokens"].copy())
    prompt_changed["packed_tokens"][0, 1] = 50
    moved, _ = f(tiny_params, prompt_changed)
    assert np.abs(np.asarray(moved)[1] - np.asarray(base)[1]).max() > 1e-3


def test_pack_groups_rejects_bad_groups():
    g = hand_group()[0]
    different = RolloutGroup(
        "p0", 0, [g.rollouts[0], make_rollout(0, 1, [5, 6, 8], [10])], admitted_at_version=0
    )
    with pytest.raises(ValueError, match="different prompt"):
        packing.pack_groups([different], length_bucket=4)
    empty = RolloutGroup(
        "p0", 0, [make_rollout(0, 0, [], [8]), make_rollout(0, 1, [], [9])], admitted_at_version=0
    )
    with pytest.raises(ValueError, match="empty prompt"):
        packing.pack_groups([empty], length_bucket=4)
    with pytest.raises(ValueError, match="length_bucket"):
        packing.pack_groups(hand_group(), length_bucket=0)


# ---------------------------------------------------------------------------------------------
# Packed == unpacked on the tiny model


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_logprobs_match_unpacked(groups, tie_embeddings):
    config = model.ModelConfig.tiny(tie_embeddings=tie_embeddings)
    params = sharpened_params(config, seed=1)
    packed = packing.pack_groups(groups, length_bucket=8)
    unpacked = build_batch(groups, advantage="grpo", length_bucket=8)
    assert packed.shape[1] < unpacked.shape[1] * packed.group_size  # it did pack
    logp, ent = packed_fn(config)(params, packed.arrays())
    ref_logp, ref_ent = unpacked_fn(config)(params, unpacked.arrays())
    mask = unpacked.loss_mask > 0
    assert logp.shape == ref_logp.shape == unpacked.shape
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(ref_logp)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[mask], np.asarray(ref_ent)[mask], atol=1e-5)
    # Log-probs of ~-5 and entropies of ~3 nats: an off-by-one gather misses by far more.
    assert np.abs(np.asarray(ref_logp)[mask]).min() > 1e-2
    # Outside the completion windows the packed layout holds 0 (never read by the loss).
    assert np.all(np.asarray(logp)[~mask] == 0) and np.all(np.asarray(ent)[~mask] == 0)


def test_gradients_match_unpacked(groups, tiny_params):
    packed = packing.pack_groups(groups, length_bucket=8)
    unpacked = build_batch(groups, advantage="grpo", length_bucket=8)
    g_packed = masked_sum_grad(packing.packed_token_logprobs, TINY)(tiny_params, packed.arrays())
    g_unpacked = masked_sum_grad(logprobs.forward_logprobs, TINY)(tiny_params, unpacked.arrays())
    assert_trees_close(g_packed, g_unpacked, rel=1e-5)


def test_micro_batches_of_packed_rows(groups, tiny_params):
    """split_micro_batches (the trainer's split) keeps each group's rows together."""
    arrays = packing.pack_groups(groups, length_bucket=8).arrays()
    full, _ = packed_fn(TINY)(tiny_params, arrays)
    micro = ts.split_micro_batches(arrays, len(groups))  # one group per micro-batch
    g = len(groups[0].rollouts)
    for m in range(len(groups)):
        part, _ = packed_fn(TINY)(tiny_params, jax.tree.map(lambda x: x[m], micro))  # noqa: B023
        np.testing.assert_allclose(part, np.asarray(full)[m * g : (m + 1) * g], atol=1e-5)


def test_dpo_pair_order_follows_build_batch(tiny_params):
    # Sample 1 has the higher reward, so build_batch puts it first: packing must too.
    groups = [
        RolloutGroup(
            f"p{g}",
            g,
            [
                make_rollout(g, 0, [4, 5, 6 + g], [7, 8], reward=0.0),
                make_rollout(g, 1, [4, 5, 6 + g], [9, 10, 11], reward=1.0),
            ],
            admitted_at_version=0,
        )
        for g in range(2)
    ]
    packed = packing.pack_groups(groups, length_bucket=4, dpo_pairs=True)
    unpacked = build_batch(groups, advantage="grpo", length_bucket=4, dpo_pairs=True)
    np.testing.assert_array_equal(packed.row_targets[0, :5], [9, 10, 11, 7, 8])
    logp, _ = packed_fn(TINY)(tiny_params, packed.arrays())
    ref, _ = unpacked_fn(TINY)(tiny_params, unpacked.arrays())
    mask = unpacked.loss_mask > 0
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(ref)[mask], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# One pass: policy, old, reference


def test_one_pass_reference_and_old(groups, tiny_params):
    ref_params = sharpened_params(TINY, seed=7)
    arrays = packing.pack_groups(groups, length_bucket=8).arrays()
    unpacked = build_batch(groups, advantage="grpo", length_bucket=8).arrays()
    mask = unpacked["loss_mask"] > 0

    def one_pass(p, r, b):
        return packing.policy_old_ref_logprobs(
            p, b, model_config=TINY, temperature=TEMPERATURE, ref_params=r, old_is_current=True
        )

    out = jax.jit(one_pass)(tiny_params, ref_params, arrays)
    # Reference from the one pass == a separate reference forward, packed and unpacked.
    separate_ref, _ = packed_fn(TINY)(ref_params, arrays)
    # Two differently compiled programs (one pass for policy and reference, and the
    # reference alone) agree to rounding, not bit for bit on every CPU; a policy/reference
    # mix-up is off by > 0.1 (checked below).
    np.testing.assert_allclose(out.ref_logp, separate_ref, atol=1e-6, rtol=1e-6)
    unpacked_ref, _ = unpacked_fn(TINY)(ref_params, unpacked)
    np.testing.assert_allclose(
        np.asarray(out.ref_logp)[mask], np.asarray(unpacked_ref)[mask], atol=1e-5
    )
    # The two policies really differ, so equality above is not a policy/reference mix-up.
    assert np.abs(np.asarray(out.logp - out.ref_logp)[mask]).max() > 0.1
    np.testing.assert_array_equal(out.old_logp, out.logp)

    # old and ref are detached: only the current log-probs carry gradient.
    def detached(p):
        o = one_pass(p, ref_params, arrays)
        return jnp.sum((o.old_logp + o.ref_logp) * arrays["loss_mask"])

    grads = jax.jit(jax.grad(detached))(tiny_params)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


def test_one_pass_runs_no_forward_for_old(groups, tiny_params):
    """Forward passes traced: policy + reference = 2 with old = current (none for old);
    3 when old needs its own weights. Counted twice: calls of `forward` while tracing, and
    layer-stack scans (one `scan` over the layers per model pass) in the jaxpr."""
    arrays = packing.pack_groups(groups, length_bucket=8).arrays()
    calls = []

    def counting_forward(p, b, **kw):
        calls.append(1)
        return packing.packed_token_logprobs(p, b, **kw)

    def passes(**kw):
        calls.clear()
        fn = functools.partial(
            packing.policy_old_ref_logprobs,
            model_config=TINY,
            temperature=TEMPERATURE,
            forward=counting_forward,
            **kw,
        )
        jaxpr = jax.make_jaxpr(lambda p, b: fn(p, b))(tiny_params, arrays)
        return len(calls), count_primitive(jaxpr.jaxpr, "scan", length=TINY.n_layers)

    assert passes() == (1, 1)
    assert passes(old_is_current=True) == (1, 1)
    assert passes(ref_params=tiny_params, old_is_current=True) == (2, 2)
    assert passes(ref_params=tiny_params, old_params=tiny_params) == (3, 3)
    with pytest.raises(ValueError, match="not both"):
        passes(old_is_current=True, old_params=tiny_params)


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (real weights)


@pytest.mark.e2e  # the real SmolLM2-135M checkpoint, loaded from its file
def test_smollm2_packed_matches_unpacked():
    assets = pytest.importorskip("a3po_jax.model.assets")
    try:
        config, params, _ = assets.load_smollm2()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, config.vocab_size, size=7)
    group = RolloutGroup(
        "p0",
        0,
        [
            make_rollout(0, 0, prompt, rng.integers(3, config.vocab_size, size=5), 1.0),
            make_rollout(0, 1, prompt, rng.integers(3, config.vocab_size, size=3), 0.0),
        ],
        admitted_at_version=0,
    )
    packed = packing.pack_groups([group], length_bucket=8)
    unpacked = build_batch([group], advantage="grpo", length_bucket=8)
    mask = unpacked.loss_mask > 0
    logp, ent = packed_fn(config)(params, packed.arrays())
    ref_logp, ref_ent = unpacked_fn(config)(params, unpacked.arrays())
    # Random tokens give log-probs near -20; through 30 float32 layers the unpacked path
    # alone moves by ~6e-5 (3e-6 relative) when only its padding changes (bucket 8 -> 32),
    # so the check is relative: 1e-5, a few times that floor.
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    close(np.asarray(logp)[mask], np.asarray(ref_logp)[mask])
    close(np.asarray(ent)[mask], np.asarray(ref_ent)[mask])
    g_packed = masked_sum_grad(packing.packed_token_logprobs, config)(params, packed.arrays())
    g_unpacked = masked_sum_grad(logprobs.forward_logprobs, config)(params, unpacked.arrays())
    assert_trees_close(g_packed, g_unpacked, rel=1e-5)
