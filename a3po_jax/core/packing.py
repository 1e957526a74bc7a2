"""Shared-prompt packing and one-pass policy / old / reference log-probs (design §6).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Periodic Asynchrony (arXiv 2511.18871) gets most of its training-side speed from two changes:

* **Shared-prompt packing.** The G samples of a group share one prompt, so instead of G rows
  ``[prompt | response_i | pad]`` (``batching.build_batch``) a group becomes ONE packed row

      [prompt | response_1 | response_2 | … | response_G | pad]

  where response tokens attend to the prompt and to their own earlier tokens only, and the
  positions of every response restart after the prompt (response i token j has position
  P + j), so each response sees exactly what it saw in its own row. Token work drops from
  ``G·(P+R)`` to ``P + G·R``.
* **One pass for several policies.** In one jitted function the current log-probs (with
  gradient), the reference log-probs (frozen params, no gradient) and, when one optimizer
  step per iteration makes the old policy equal to the current one, the old log-probs as
  ``stop_gradient(current)``: no forward pass for "old".

The first completion token of every response is predicted from the *last prompt position*,
whose hidden state all G responses share, so per-token targets cannot live in one
target-aligned packed row. Instead each sample keeps a compact list of its completion
tokens: ``pred_pos[b, j]`` is the packed position whose hidden state predicts completion
token j of sample b (the last prompt position for j = 0, else the position of token j-1 of
the same response) and ``completion_targets[b, j]`` the token. The hidden states are
gathered there ([B, C, D]; C = longest completion, bucketed), the lm_head is applied to
those rows only (never to prompt positions, whose log-probs the loss never reads), and the
results are laid out like ``build_batch``'s target-aligned ``[B, T]`` arrays, so the loss
code does not change.

Shape letters: N packed rows (= groups), L packed length, G samples per group, B = N·G
samples, T the unpacked row length of ``build_batch``, C compact completion length,
D d_model, V vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax import model
from a3po_jax.core import logprobs, prox
from a3po_jax.core.batching import TrainBatch, build_batch, round_up
from a3po_jax.core.types import Rollout, RolloutGroup

Params = Any
PackedArrays = Mapping[str, jax.Array]

# `response_id` values: the shared prompt, and padding; responses are 1..G.
PROMPT_ID = 0
PAD_ID = -1

# Per-sample target-aligned fields of `TrainBatch` that the loss reads; the unpacked
# `tokens`/`positions`/`segment_ids`/`targets` are replaced by the packed arrays.
_LOSS_FIELDS = ("loss_mask", "behav_logp", "versions", "advantages", "pair_mask")


@dataclasses.dataclass
class PackedBatch:
    """A batch of N groups packed one group per row (numpy, host side).

    ``batch`` is exactly what ``build_batch`` makes from the same groups: the target-aligned
    ``[B, T]`` loss inputs (mask, behaviour log-probs, versions, advantages) come from it, so
    the packed and unpacked layouts feed the loss the same numbers by construction.
    """

    batch: TrainBatch  # the unpacked batch of the same groups ([B, T] arrays)
    tokens: np.ndarray  # [N, L] int32 packed rows [prompt | response_1 | … | response_G | pad]
    positions: np.ndarray  # [N, L] int32 RoPE positions; response i token j at P + j
    response_id: np.ndarray  # [N, L] int32: 0 prompt, i = response i (1-based), -1 padding
    prompt_len: np.ndarray  # [N] int32 P of each group (>= 1)
    response_start: np.ndarray  # [B] int32 packed position of each response's first token
    response_len: np.ndarray  # [B] int32 R of each sample
    pred_pos: np.ndarray  # [B, C] int32 packed position predicting completion token j
    completion_targets: np.ndarray  # [B, C] int32 completion token j (0 past the end)
    completion_mask: np.ndarray  # [B, C] float32, 1 for j < R

    @property
    def group_size(self) -> int:
        return self.response_len.shape[0] // self.tokens.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, L) of the packed rows."""
        return self.tokens.shape

    @property
    def packed_token_slots(self) -> int:
        """N·L: token slots the model runs over packed (``build_batch`` runs B·T)."""
        return int(self.tokens.size)

    def arrays(self) -> dict[str, np.ndarray]:
        """What the jitted step reads: packed model inputs ([N, L], [N]), the gather
        indices ([B, C]) and the target-aligned loss inputs ([B, T], [B]).

        Every array's leading axis is N or B = N·G with the samples of group n at rows
        ``n·G … n·G + G - 1``, so ``train_step.split_micro_batches(arrays, M)`` splits it
        into M consistent micro-batches whenever M divides N.
        """
        out = {
            "packed_tokens": self.tokens,
            "packed_positions": self.positions,
            "response_id": self.response_id,
            "prompt_len": self.prompt_len,
            "pred_pos": self.pred_pos,
            "completion_targets": self.completion_targets,
            "completion_mask": self.completion_mask,
        }
        unpacked = self.batch.arrays()
        out.update({k: unpacked[k] for k in _LOSS_FIELDS})
        return out


def _ordered_rollouts(group: RolloutGroup, dpo_pairs: bool) -> list[Rollout]:
    """The group's samples in the row order ``build_batch`` uses (same stable sort)."""
    rollouts = list(group.rollouts)
    if dpo_pairs:
        rollouts.sort(key=lambda r: -float(r.reward))
    return rollouts


def pack_groups(
    groups: Sequence[RolloutGroup],
    *,
    length_bucket: int,
    advantage: str = "grpo",
    dpo_pairs: bool = False,
    min_length: int = 0,
    completion_bucket: int | None = None,
    min_packed_length: int = 0,
) -> PackedBatch:
    """Pack each group into one row ``[prompt | response_1 | … | response_G | pad]``.

    Args:
      groups: complete groups of equal size G; all samples of a group share its prompt.
      length_bucket: the packed length L and the unpacked T are rounded up to a multiple.
      advantage: "grpo", "drgrpo" or "rloo", as for ``build_batch``.
      dpo_pairs: order each group of 2 as (chosen, rejected), as ``build_batch`` does.
      min_length: lower bound on the unpacked T (to reuse a compiled shape).
      completion_bucket: C is rounded up to a multiple of this (default ``length_bucket``).
      min_packed_length: lower bound on L (to reuse a compiled shape).

    Returns:
      A :class:`PackedBatch`; its ``batch`` is ``build_batch`` of the same groups.
    """
    if length_bucket <= 0:
        raise ValueError(f"pack_groups length_bucket must be > 0, got {length_bucket}")
    completion_bucket = completion_bucket or length_bucket
    if completion_bucket <= 0:
        raise ValueError(f"pack_groups completion_bucket must be > 0, got {completion_bucket}")
    # build_batch validates group sizes and rewards and computes the loss inputs.
    batch = build_batch(
        groups,
        advantage=advantage,
        length_bucket=length_bucket,
        dpo_pairs=dpo_pairs,
        min_length=min_length,
    )
    n, g = len(groups), groups[0].size
    ordered = [_ordered_rollouts(group, dpo_pairs) for group in groups]
    for group, rollouts in zip(groups, ordered, strict=True):
        prompt = rollouts[0].prompt_tokens
        if prompt.shape[0] == 0:
            raise ValueError(
                f"group {group.group_id} has an empty prompt; packing predicts each "
                "response's first token from the last prompt position"
            )
        for r in rollouts[1:]:
            if not np.array_equal(r.prompt_tokens, prompt):
                raise ValueError(
                    f"group {group.group_id} sample {r.sample_index} has a different prompt "
                    "from sample 0; shared-prompt packing needs one prompt per group"
                )

    prompt_len = np.array([rs[0].prompt_tokens.shape[0] for rs in ordered], np.int32)
    response_len = np.array([r.num_tokens for rs in ordered for r in rs], np.int32)
    packed_lengths = prompt_len + response_len.reshape(n, g).sum(axis=1)
    l = max(round_up(int(packed_lengths.max()), length_bucket), min_packed_length)
    c = max(round_up(int(response_len.max()), completion_bucket), completion_bucket)

    tokens = np.zeros((n, l), np.int32)
    positions = np.zeros((n, l), np.int32)
    response_id = np.full((n, l), PAD_ID, np.int32)
    response_start = np.zeros((n * g,), np.int32)
    pred_pos = np.zeros((n * g, c), np.int32)
    completion_targets = np.zeros((n * g, c), np.int32)
    completion_mask = np.zeros((n * g, c), np.float32)
    for row, rollouts in enumerate(ordered):
        p = int(prompt_len[row])
        tokens[row, :p] = rollouts[0].prompt_tokens
        positions[row, :p] = np.arange(p)
        response_id[row, :p] = PROMPT_ID
        start = p
        for i, r in enumerate(rollouts):
            b, k = row * g + i, r.num_tokens
            span = slice(start, start + k)
            tokens[row, span] = r.completion_tokens
            positions[row, span] = p + np.arange(k)  # restart after the prompt
            response_id[row, span] = i + 1
            response_start[b] = start
            # Token 0 is predicted from the last prompt position (shared by all G
            # responses), token j > 0 from token j-1 of the same response.
            pred_pos[b, :k] = np.concatenate([[p - 1], start + np.arange(k - 1)])[:k]
            completion_targets[b, :k] = r.completion_tokens
            completion_mask[b, :k] = 1.0
            # The unpacked row must hold the same completion at the same window; a change
            # in build_batch's ordering would otherwise silently pair wrong targets.
            if not np.array_equal(batch.targets[b, p - 1 : p - 1 + k], r.completion_tokens):
                raise AssertionError(
                    f"build_batch row {b} does not hold group {row} sample {i}; its row "
                    "order changed and pack_groups must follow it"
                )
            start += k

    return PackedBatch(
        batch=batch,
        tokens=tokens,
        positions=positions,
        response_id=response_id,
        prompt_len=prompt_len,
        response_start=response_start,
        response_len=response_len,
        pred_pos=pred_pos,
        completion_targets=completion_targets,
        completion_mask=completion_mask,
    )


def unpack_sequences(packed: PackedBatch) -> list[tuple[np.ndarray, np.ndarray]]:
    """The B ``(prompt [P], completion [R])`` pairs a packed batch holds, in row order
    (host side; the inverse of :func:`pack_groups` on tokens)."""
    g = packed.group_size
    out = []
    for b in range(packed.response_len.shape[0]):
        row = b // g
        prompt = packed.tokens[row, : packed.prompt_len[row]]
        start = packed.response_start[b]
        out.append((prompt.copy(), packed.tokens[row, start : start + packed.response_len[b]]))
    return out


# ---------------------------------------------------------------------------------------------
# Inside jit


def packed_attention_mask(response_id: jax.Array) -> jax.Array:
    """[N, L, L] bool "query q may attend key k", built on device from ``response_id [N, L]``.

    q attends k iff k <= q, k is not padding, and k is a prompt token or in q's own
    response. Prompt queries therefore see the causal prompt only, and a response token the
    whole prompt plus its own earlier tokens, never another response. Padding queries see
    the prompt (a finite softmax; their outputs are never read).

    Built inside jit from O(L) ints so the host sends no O(L²) mask.
    """
    chex.assert_rank(response_id, 2)
    l = response_id.shape[1]
    idx = jnp.arange(l)
    causal = idx[:, None] >= idx[None, :]  # [L, L]
    q = response_id[:, :, None]  # [N, L, 1]
    k = response_id[:, None, :]  # [N, 1, L]
    return causal[None] & (k != PAD_ID) & ((k == PROMPT_ID) | (k == q))


def completions_to_rows(
    values: jax.Array, completion_mask: jax.Array, window_start: jax.Array, length: int
) -> jax.Array:
    """Lay compact per-completion-token values out like ``build_batch``'s target-aligned rows.

    out[b, t] = values[b, t - window_start[b]] where that index is a real completion token,
    else 0. With ``window_start = P - 1`` position t of an unpacked row ``[prompt |
    completion]`` holds what predicts token t+1, i.e. completion token ``t - (P - 1)``.

    Args:
      values: [B, C] per completion token.
      completion_mask: [B, C] 1 for real completion tokens.
      window_start: [B] int row position of completion token 0's prediction (P - 1).
      length: T, the row length.
    Returns:
      [B, T] values, 0 outside each sample's completion window.
    """
    b, c = values.shape
    chex.assert_shape(completion_mask, (b, c))
    chex.assert_shape(window_start, (b,))
    j = jnp.arange(length)[None, :] - window_start[:, None]  # [B, T]
    inside = (j >= 0) & (j < c)
    j_safe = jnp.clip(j, 0, c - 1)
    real = jnp.take_along_axis(completion_mask, j_safe, axis=1) > 0
    picked = jnp.take_along_axis(values, j_safe, axis=1)
    return jnp.where(inside & real, picked, jnp.zeros((), values.dtype))


def packed_hidden(
    params: Params, packed: PackedArrays, *, model_config: model.ModelConfig
) -> jax.Array:
    """[N, L, D] float32 final-norm hidden states of the packed rows (no lm_head)."""
    tokens = packed["packed_tokens"]
    chex.assert_rank(tokens, 2)
    chex.assert_equal_shape([tokens, packed["packed_positions"], packed["response_id"]])
    hidden, _ = model.hidden_states(
        params,
        tokens,
        packed["packed_positions"],
        config=model_config,
        attention_mask=packed_attention_mask(packed["response_id"]),
    )
    return hidden


def packed_token_logprobs(
    params: Params,
    packed: PackedArrays,
    *,
    model_config: model.ModelConfig,
    temperature: float,
) -> tuple[jax.Array, jax.Array]:
    """Per-sample target-aligned log-probs and entropies from one pass over packed rows.

    Drop-in for ``train_step.forward_logprobs`` (same signature, same ``[B, T]`` layout):
    on every position where ``loss_mask`` is 1 the values equal those of the unpacked
    ``build_batch`` rows; elsewhere they are 0 (the loss never reads them).

        logp[b, P-1+j] = log softmax(h[n, pred_pos[b, j]] · W / temperature)[target_bj]

    with h the final-norm hidden states of packed row n = b // G and W the lm_head. The
    lm_head runs on the B·C completion positions only, chunk by chunk over tokens.

    Args:
      params: policy parameters.
      packed: ``PackedBatch.arrays()`` (possibly one micro-batch of it).
      model_config: the architecture.
      temperature: sampling temperature the behaviour log-probs were taken at.
    Returns:
      (logp [B, T], entropy [B, T]) float32.
    """
    # numpy inputs (closed-over constants) must become jax arrays before traced indexing.
    tokens = jnp.asarray(packed["packed_tokens"])
    pred_pos = jnp.asarray(packed["pred_pos"])
    n, _ = tokens.shape
    b, c = pred_pos.shape
    t = packed["loss_mask"].shape[1]
    if b % n:
        raise ValueError(f"pred_pos has {b} samples, not a multiple of the {n} packed rows")
    chex.assert_shape(packed["prompt_len"], (n,))
    chex.assert_shape([packed["completion_targets"], packed["completion_mask"]], (b, c))
    chex.assert_shape(packed["loss_mask"], (b, t))
    g = b // n

    hidden = packed_hidden(params, packed, model_config=model_config)  # [N, L, D]
    row = jnp.arange(b) // g  # [B] packed row of each sample
    h = hidden[row[:, None], pred_pos]  # [B, C, D]
    # Same float32 head as model.apply, chunked over tokens (no [B, C, V] logits in either
    # pass); temperature as in forward_logprobs.
    logp_c, ent_c = logprobs.chunked_token_logprobs(
        h,
        model.lm_head_kernel(params, model_config),
        jnp.asarray(packed["completion_targets"]),
        temperature=temperature,
    )  # [B, C] each
    window_start = jnp.asarray(packed["prompt_len"])[row] - 1  # [B]
    mask_c = jnp.asarray(packed["completion_mask"])
    return (
        completions_to_rows(logp_c, mask_c, window_start, t),
        completions_to_rows(ent_c, mask_c, window_start, t),
    )


# ---------------------------------------------------------------------------------------------
# One pass for policy, old policy and reference


class PolicyLogprobs(NamedTuple):
    """Log-probs of one batch under the current, old and reference policies ([B, T] each)."""

    logp: jax.Array  # current policy, differentiable
    entropy: jax.Array  # current policy's entropy
    old_logp: jax.Array | None  # old (proximal) policy, no gradient; None if not asked
    ref_logp: jax.Array | None  # frozen reference, no gradient; None without ref_params


LogprobFn = Callable[..., tuple[jax.Array, jax.Array]]


def policy_old_ref_logprobs(
    params: Params,
    batch: PackedArrays,
    *,
    model_config: model.ModelConfig,
    temperature: float,
    ref_params: Params | None = None,
    old_is_current: bool = False,
    old_params: Params | None = None,
    forward: LogprobFn = packed_token_logprobs,
) -> PolicyLogprobs:
    """Current, old and reference log-probs in one traced function (call it inside jit and
    inside the loss under ``jax.grad``).

    * current: ``forward(params, batch)``, the only pass that is differentiated;
    * old: ``stop_gradient(current)`` when ``old_is_current`` (one optimizer step per
      iteration: the step's starting weights ARE the current weights, so decoupled PPO's
      recompute pass would return the same numbers; none is run), else a no-grad pass of
      ``old_params``, else None;
    * reference: a no-grad pass of the frozen ``ref_params`` over the same batch, else None.

    So the passes run are 1 (policy) + 1 if ``ref_params`` + 1 if ``old_params``: with
    ``old_is_current`` "old" costs nothing.

    Args:
      params: current policy parameters.
      batch: ``PackedBatch.arrays()`` for the default ``forward``; a ``TrainBatch.arrays()``
        dict with ``forward=train_step.forward_logprobs``.
      model_config, temperature: as for ``forward``.
      ref_params: frozen reference parameters, or None.
      old_is_current: old = stop_gradient(current) (exclusive with ``old_params``).
      old_params: parameters of a different old policy (a separate no-grad pass).
      forward: ``(params, batch, *, model_config, temperature) -> (logp, entropy)``.
    """
    if old_is_current and old_params is not None:
        raise ValueError("policy_old_ref_logprobs: give old_is_current or old_params, not both")
    run = lambda p: forward(p, batch, model_config=model_config, temperature=temperature)  # noqa: E731
    logp, ent = run(params)
    old = None
    if old_is_current:
        old = prox.old_is_current(logp)  # no second forward
    elif old_params is not None:
        old = jax.lax.stop_gradient(run(old_params)[0])
    ref = None
    if ref_params is not None:
        # The reference is frozen: no gradient flows into ref_params or back into the KL.
        ref = jax.lax.stop_gradient(run(ref_params)[0])
    return PolicyLogprobs(logp=logp, entropy=ent, old_logp=old, ref_logp=ref)
