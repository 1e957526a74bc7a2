"""The training step's log-probs come from `chunked_token_logprobs` (no [B, T, V] logits),
and the step makes the same update as the full-logits path it replaced (issue 15).

`logprobs.forward_logprobs` and `packing.packed_token_logprobs` compute their log-probs as
`chunked_token_logprobs(model.hidden_states(...)[0] (packed: the completion positions'
states), model.lm_head_kernel(params, config), targets, temperature=...)`; the
no-full-vocabulary test checks that, the equality test that the update did not change.

The full-logits path is kept here as the reference: `model.apply` logits divided by the
temperature, then `losses.token_logprobs` / `losses.entropy`, for plain and packed batches.
On fixed rollouts both steps must give the same loss, gradient norm and updated
parameters, with the policy, old-policy (prox="recompute") and reference passes, tied and
untied heads, and a temperature != 1 (where a missing or doubled 1/T would show).
"""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import pytest
from helpers.factories import synthetic_groups
from helpers.jaxpr_inspect import largest_intermediate

from a3po_jax import model
from a3po_jax.core import losses, optim, packing
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.core.logprobs import DEFAULT_CHUNK_SIZE
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    RolloutSection,
    SystemSection,
    TrainConfig,
)


def full_logits_forward(params, batch, *, model_config, temperature):
    """The old `logprobs.forward_logprobs`: [B, T, V] float32 logits materialised."""
    logits, _ = model.apply(
        params,
        batch["tokens"],
        batch["positions"],
        config=model_config,
        segment_ids=batch["segment_ids"],
    )
    logits = logits / temperature
    return losses.token_logprobs(logits, batch["targets"]), losses.entropy(logits)


def full_logits_packed_forward(params, packed, *, model_config, temperature):
    """The old `packing.packed_token_logprobs`: [N, K, V] logits at the rows' completion
    positions."""
    row_pred_pos = jnp.asarray(packed["row_pred_pos"])
    t = packed["loss_mask"].shape[1]
    hidden = packing.packed_hidden(params, packed, model_config=model_config)  # [N, L, D]
    h = jnp.take_along_axis(hidden, row_pred_pos[:, :, None], axis=1)  # [N, K, D]
    head = model.lm_head_kernel(params, model_config)
    logits = jnp.einsum("nkd,dv->nkv", h, head) / temperature
    logp_k = losses.token_logprobs(logits, packed["row_targets"])
    ent_k = losses.entropy(logits)
    to_rows = functools.partial(
        packing.row_completions_to_rows,
        window_start=jnp.asarray(packed["window_start"]),
        completion_offset=jnp.asarray(packed["completion_offset"]),
        response_len=jnp.asarray(packed["response_len"]),
        length=t,
    )
    return to_rows(logp_k), to_rows(ent_k)


CASES = {
    # name: (algo section fields, packed, tie_embeddings, temperature)
    "recompute_tied_T0.7": (dict(prox="recompute"), False, True, 0.7),
    "a3po_untied_T1.3_packed": (dict(prox="a3po"), True, False, 1.3),
    "recompute_kl_reference_untied": (dict(prox="recompute", kl_coef=0.1), False, False, 0.7),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_equals_the_full_logits_step(case):
    algo_fields, packed, tie, temperature = CASES[case]
    mcfg = model.ModelConfig.tiny(tie_embeddings=tie)
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4, temperature=temperature),
        algo=AlgoSection(**algo_fields),
        system=SystemSection(batch=BatchSection(packed_prompts=packed)),
    )
    groups = synthetic_groups(
        4,
        4,
        prompt_len=(3, 8),
        response_len=(2, 11),
        vocab=mcfg.vocab_size,
        versions=lambda g, i: i % 2,
        behav_range=(3.0, 6.0),
        admitted_at_version=1,
        seed=3,
    )
    build = packing.pack_groups if packed else build_batch
    batch = {
        k: jnp.asarray(v)
        for k, v in build(groups, advantage="grpo", length_bucket=16).arrays().items()
    }
    algo = step_builder.algorithm(cfg, mcfg)
    reference = full_logits_packed_forward if packed else full_logits_forward
    old_algo = dataclasses.replace(
        algo, forward=functools.partial(reference, model_config=mcfg, temperature=temperature)
    )
    params = model.init_params(mcfg, jax.random.key(0))
    ref_params = model.init_params(mcfg, jax.random.key(1)) if algo.needs_reference else None
    opt = step_builder.optimizer(cfg)

    results = {}
    for name, a in (("chunked", algo), ("full_logits", old_algo)):
        step = jax.jit(functools.partial(ts.train_step, algo=a, optimizer=opt, grad_clip=1.0))
        # Trainer version 2, rollouts at versions 0 and 1: staleness 1-2, a3po interpolates.
        state = optim.init_train_state(params, opt)._replace(step=jnp.asarray(2, jnp.int32))
        results[name] = step(state, batch, ref_params)
    (new, m_new), (old, m_old) = results["chunked"], results["full_logits"]
    assert float(m_new["step/skipped"]) == 0.0
    # The loss and gradient are non-trivial, so equal values are a real check.
    assert abs(float(m_old["loss/total"])) > 1e-4 and float(m_old["optim/grad_norm"]) > 1e-4
    for key in ("loss/total", "optim/grad_norm", "policy/logp", "policy/entropy"):
        chex.assert_trees_all_close(m_new[key], m_old[key], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new.params, old.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_step_holds_no_full_vocabulary_logits(packed):
    """Neither the step's forward nor its backward holds [B, T, V] (packed: [N, K, V])
    logits: at most one chunk's [C, V] (C = DEFAULT_CHUNK_SIZE tokens). A vocabulary large
    next to every other width makes the logits the largest values of the old step."""
    mcfg = model.ModelConfig.tiny(vocab_size=4096)
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4),
        algo=AlgoSection(prox="recompute"),
        system=SystemSection(batch=BatchSection(packed_prompts=packed)),
    )
    groups = synthetic_groups(4, 4, prompt_len=60, response_len=100, vocab=mcfg.vocab_size, seed=4)
    build = packing.pack_groups if packed else build_batch
    batch = {
        k: jnp.asarray(v)
        for k, v in build(groups, advantage="grpo", length_bucket=128).arrays().items()
    }
    # Rows of the logits: the rows' completion positions [N, K] (packed) or all of [B, T].
    tokens = math.prod(batch["row_pred_pos" if packed else "tokens"].shape)
    assert tokens > DEFAULT_CHUNK_SIZE
    algo = step_builder.algorithm(cfg, mcfg)
    reference = full_logits_packed_forward if packed else full_logits_forward
    old_algo = dataclasses.replace(
        algo, forward=functools.partial(reference, model_config=mcfg, temperature=1.0)
    )
    opt = step_builder.optimizer(cfg)
    state = optim.init_train_state(model.init_params(mcfg, jax.random.key(0)), opt)

    def largest(a):
        step = functools.partial(ts.train_step, algo=a, optimizer=opt, grad_clip=1.0)
        return largest_intermediate(jax.make_jaxpr(step)(state, batch, None).jaxpr)

    full = tokens * mcfg.vocab_size
    assert largest(old_algo) >= full  # the check can fail: the old step holds the logits
    assert largest(algo) <= DEFAULT_CHUNK_SIZE * mcfg.vocab_size < full
