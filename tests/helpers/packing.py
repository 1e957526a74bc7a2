"""Packed-versus-unpacked fixtures shared by the packing tests: groups with ragged lengths,
sharpened weights, and the two log-prob paths jitted once per model config."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax import model
from a3po_jax.core import logprobs, packing
from a3po_jax.core.types import Rollout
from helpers.factories import synthetic_groups

TINY = model.ModelConfig.tiny()
TEMPERATURE = 0.7


def make_rollout(group, index, prompt, completion, reward=0.0):
    n = len(completion)
    return Rollout(
        prompt_id=f"p{group}",
        group_id=group,
        sample_index=index,
        prompt_tokens=np.asarray(prompt),
        completion_tokens=np.asarray(completion, np.int32),
        behav_logprobs=-np.linspace(1.0, 2.0, n),
        versions=np.zeros(n, np.int32),
        finish_reason="stop",
        reward=reward,
    )


def make_groups(num_groups=3, group_size=4, seed=0, vocab=TINY.vocab_size):
    """Groups with varied prompt and response lengths: a 1-token prompt, an empty
    response and a response longer than any other sample's whole row are all in."""
    return synthetic_groups(
        num_groups,
        group_size,
        prompt_len=lambda rng, g: 1 if g == 0 else int(rng.integers(3, 10)),
        response_len=lambda rng, g, i: 0 if (g, i) == (1, 2) else int(rng.integers(1, 13)),
        vocab=vocab,
        behav_range=(1.0, 2.0),
        seed=seed,
    )


def sharpened_params(config, seed=0, scale=4.0):
    """Random weights scaled up so attention is far from uniform: a token that leaks into a
    position it must not see then moves that position's log-probs visibly."""
    params = model.init_params(config, jax.random.key(seed))
    return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params)


@functools.cache
def packed_fn(config, temperature=TEMPERATURE):
    return jax.jit(
        lambda p, b: packing.packed_token_logprobs(
            p, b, model_config=config, temperature=temperature
        )
    )


@functools.cache
def unpacked_fn(config, temperature=TEMPERATURE):
    return jax.jit(
        lambda p, b: logprobs.forward_logprobs(p, b, model_config=config, temperature=temperature)
    )


def masked_sum_grad(forward, config):
    """Gradient of Σ loss_mask·logp, the simplest loss that reads every completion log-prob."""

    def loss(p, b):
        logp, _ = forward(p, b, model_config=config, temperature=TEMPERATURE)
        return jnp.sum(logp * b["loss_mask"])

    return jax.jit(jax.grad(loss))


def assert_trees_close(actual, expected, rel):
    """Per leaf: max |a - e| <= rel · max |e| (gradients span orders of magnitude across
    leaves, so one absolute tolerance would be loose on the small ones)."""
    for (path, a), (_, e) in zip(
        jax.tree_util.tree_leaves_with_path(actual),
        jax.tree_util.tree_leaves_with_path(expected),
        strict=True,
    ):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, model.tree_path_str(path)
        scale = float(np.abs(e).max())
        assert scale > 0, f"{model.tree_path_str(path)}: zero reference gradient tests nothing"
        err = float(np.abs(a - e).max())
        assert err <= rel * scale, f"{model.tree_path_str(path)}: max err {err} vs scale {scale}"
