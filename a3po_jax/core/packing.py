"""Shared-prompt packing and one-pass policy / old / reference log-probs (docs/performance.md).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Periodic Asynchrony (arXiv 2511.18871) gets most of its training-side speed from two changes:

* **Shared-prompt packing.** The G samples of a group share one prompt, so instead of G rows
  ``[prompt | response_i | pad]`` (``batching.build_batch``) a group becomes ONE span

      [prompt | response_1 | response_2 | … | response_G]

  where response tokens attend to the prompt and to their own earlier tokens only, and the
  positions of every response restart after the prompt (response i token j has position
  P + j), so each response sees exactly what it saw in its own row. Token work drops from
  ``G·(P+R)`` to ``P + G·R``. A packed row holds ``groups_per_row`` such spans one after
  the other (then padding to the length bucket); a token never attends outside its own
  group's span, and positions restart at 0 with each group. Several groups per row cut
  the padding of rows to the longest one (a long group shares its row with a short one).
* **One pass for several policies.** In one jitted function the current log-probs (with
  gradient), the reference log-probs (frozen params, no gradient) and, when one optimizer
  step per iteration makes the old policy equal to the current one, the old log-probs as
  ``stop_gradient(current)``: no forward pass for "old".

The first completion token of every response is predicted from the *last prompt position*,
whose hidden state all G responses share, so per-token targets cannot live in one
target-aligned packed row. Instead each packed row keeps a compact list of the completion
tokens it holds (every response of every group of the row, in row order):
``row_pred_pos[n, k]`` is the packed position whose hidden state predicts the row's k-th
completion token (the last prompt position of its group for a response's token 0, else the
position of the previous token of the same response) and ``row_targets[n, k]`` the token.
The hidden states are gathered there ([N, K, D]; K = the largest per-row count of completion
tokens, bucketed), the lm_head is applied to those rows only (never to prompt or padding
positions, whose log-probs the loss never reads), and the results are laid out like
``build_batch``'s target-aligned ``[B, T]`` arrays (sample b's tokens are the entries
``completion_offset[b] … + response_len[b] - 1`` of its row's list), so the loss code does
not change.

Group order: with ``groups_per_row > 1`` and ``balance_rows`` the groups are reordered
(longest packed group first, each to the row with the fewest tokens so far) BEFORE both the
unpacked ``build_batch`` and the packing, so every per-sample array (advantages, DPO pairs,
versions, the metrics' batch) follows the same order: ``PackedBatch.group_order`` says which
input group each position holds. The trainer asks for that only with one minibatch per
batch (with k > 1 minibatches the order decides which groups train at which version).

Shape letters: N packed rows (= groups / groups_per_row), L packed length, G samples per
group, S = B / N samples per row, B samples, T the unpacked row length of ``build_batch``,
K compact completion tokens per row, D d_model, V vocab.
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
from a3po_jax.core.batching import TrainBatch, build_batch, group_rows, round_up
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
    """A batch of groups packed ``groups_per_row`` groups per row (numpy, host side).

    ``batch`` is exactly what ``build_batch`` makes from the same groups in the same order
    (``groups[i] for i in group_order``): the target-aligned ``[B, T]`` loss inputs (mask,
    behaviour log-probs, versions, advantages) come from it, so the packed and unpacked
    layouts feed the loss the same numbers by construction.
    """

    batch: TrainBatch  # the unpacked batch of the same groups ([B, T] arrays), packed order
    tokens: np.ndarray  # [N, L] int32 rows [prompt_1 | responses_1 | prompt_2 | … | pad]
    positions: np.ndarray  # [N, L] int32 RoPE positions; per group, response i token j at P + j
    response_id: np.ndarray  # [N, L] int32: 0 prompt, i = response i (1-based), -1 padding
    group_slot: np.ndarray  # [N, L] int32: which group of the row (0-based), -1 padding
    prompt_len: np.ndarray  # [N·groups_per_row] int32 P of each group (>= 1), packed order
    response_start: np.ndarray  # [B] int32 packed position of each response's first token
    response_len: np.ndarray  # [B] int32 R of each sample
    window_start: np.ndarray  # [B] int32 P - 1: unpacked row position predicting token 0
    completion_offset: np.ndarray  # [B] int32 index of the sample's token 0 in its row's list
    row_pred_pos: np.ndarray  # [N, K] int32 packed position predicting the row's k-th token
    row_targets: np.ndarray  # [N, K] int32 the row's k-th completion token (0 past the end)
    row_valid: np.ndarray  # [N, K] float32, 1 for the row's real completion tokens
    group_order: np.ndarray  # [N·groups_per_row] int index into the input groups, packed order
    groups_per_row: int = 1

    @property
    def group_size(self) -> int:
        return self.response_len.shape[0] // self.prompt_len.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, L) of the packed rows."""
        return self.tokens.shape

    @property
    def packed_token_slots(self) -> int:
        """N·L: token slots the model runs over packed (``build_batch`` runs B·T)."""
        return int(self.tokens.size)

    @property
    def head_token_slots(self) -> int:
        """N·K: positions the lm_head runs over (real completion tokens plus padding)."""
        return int(self.row_pred_pos.size)

    def arrays(self) -> dict[str, np.ndarray]:
        """What the jitted step reads: packed model inputs ([N, L]), the compact completion
        lists ([N, K]), the per-sample map back ([B]) and the target-aligned loss inputs
        ([B, T], [B]).

        Every array's leading axis is N or B = N·S with the S samples of row n at rows
        ``n·S … n·S + S - 1``, so ``train_step.split_micro_batches(arrays, M)`` splits it
        into M consistent micro-batches whenever M divides N.
        """
        out = {
            "packed_tokens": self.tokens,
            "packed_positions": self.positions,
            "response_id": self.response_id,
            "group_slot": self.group_slot,
            "row_pred_pos": self.row_pred_pos,
            "row_targets": self.row_targets,
            "window_start": self.window_start,
            "completion_offset": self.completion_offset,
            "response_len": self.response_len,
        }
        unpacked = self.batch.arrays()
        out.update({k: unpacked[k] for k in _LOSS_FIELDS})
        return out


def balanced_group_order(lengths: Sequence[int], groups_per_row: int) -> np.ndarray:
    """Order of groups so that consecutive runs of ``groups_per_row`` form rows of similar
    total length: longest group first, each to the row (with room left) holding the fewest
    tokens so far (ties: the lowest row). Within a row the groups keep their input order.

    Deterministic; the identity when ``groups_per_row`` is 1.
    """
    n = len(lengths)
    if groups_per_row < 1 or n % groups_per_row:
        raise ValueError(f"groups_per_row={groups_per_row} must be >= 1 and divide {n} groups")
    if groups_per_row == 1:
        return np.arange(n)
    rows = n // groups_per_row
    totals = [0] * rows
    members: list[list[int]] = [[] for _ in range(rows)]
    for i in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        open_rows = [r for r in range(rows) if len(members[r]) < groups_per_row]
        r = min(open_rows, key=lambda r: (totals[r], r))
        members[r].append(i)
        totals[r] += int(lengths[i])
    return np.array([i for m in members for i in sorted(m)], np.int64)


def pack_groups(
    groups: Sequence[RolloutGroup],
    *,
    length_bucket: int,
    advantage: str = "grpo",
    dpo_pairs: bool = False,
    min_length: int = 0,
    completion_bucket: int | None = None,
    min_packed_length: int = 0,
    groups_per_row: int = 1,
    balance_rows: bool = True,
) -> PackedBatch:
    """Pack ``groups_per_row`` groups into each row ``[prompt | response_1 | … | response_G]
    …  | pad``.

    Args:
      groups: complete groups of equal size G; all samples of a group share its prompt.
      length_bucket: the packed length L and the unpacked T are rounded up to a multiple.
      advantage: "grpo", "drgrpo" or "rloo", as for ``build_batch``.
      dpo_pairs: order each group of 2 as (chosen, rejected), as ``build_batch`` does.
      min_length: lower bound on the unpacked T (to reuse a compiled shape).
      completion_bucket: K (completion tokens per row) is rounded up to a multiple of this
        (default ``length_bucket``).
      min_packed_length: lower bound on L (to reuse a compiled shape).
      groups_per_row: groups packed into one row; must divide ``len(groups)``.
      balance_rows: with ``groups_per_row > 1``, reorder the groups (see
        :func:`balanced_group_order`) so long groups share rows with short ones; the
        returned ``batch`` and every array follow the new order (``group_order``). False
        keeps the input order (consecutive groups share a row).

    Returns:
      A :class:`PackedBatch`; its ``batch`` is ``build_batch`` of the same groups in
      ``group_order``.
    """
    completion_bucket = completion_bucket or length_bucket
    _check_packable(groups, length_bucket, completion_bucket, groups_per_row)
    group_lengths = [
        g.rollouts[0].prompt_tokens.shape[0] + sum(r.num_tokens for r in g.rollouts) for g in groups
    ]
    if balance_rows:
        order = balanced_group_order(group_lengths, groups_per_row)
    else:
        order = np.arange(len(groups))
    groups = [groups[i] for i in order]
    # build_batch validates group sizes and rewards and computes the loss inputs.
    batch = build_batch(
        groups,
        advantage=advantage,
        length_bucket=length_bucket,
        dpo_pairs=dpo_pairs,
        min_length=min_length,
    )
    num_groups, g = len(groups), groups[0].size
    n = num_groups // groups_per_row
    s = g * groups_per_row  # samples per row
    # The rows build_batch made, in its order: sample b = gi·G + i is ordered[gi][i].
    ordered = [group_rows(group, dpo_pairs=dpo_pairs) for group in groups]

    prompt_len = np.array([rs[0].prompt_tokens.shape[0] for rs in ordered], np.int32)
    response_len = np.array([r.num_tokens for rs in ordered for r in rs], np.int32)
    group_tokens = prompt_len + response_len.reshape(num_groups, g).sum(axis=1)
    row_tokens = group_tokens.reshape(n, groups_per_row).sum(axis=1)
    row_completions = response_len.reshape(n, s).sum(axis=1)
    l = max(round_up(int(row_tokens.max()), length_bucket), min_packed_length)
    k_len = max(round_up(int(row_completions.max()), completion_bucket), completion_bucket)

    arrays = _fill_rows(ordered, prompt_len, groups_per_row=groups_per_row, l=l, k_len=k_len)
    return PackedBatch(
        batch=batch,
        prompt_len=prompt_len,
        response_len=response_len,
        group_order=np.asarray(order),
        groups_per_row=groups_per_row,
        **arrays,
    )


def _fill_rows(
    ordered: list[list[Rollout]],
    prompt_len: np.ndarray,
    *,
    groups_per_row: int,
    l: int,
    k_len: int,
) -> dict[str, np.ndarray]:
    """The packed rows' arrays (the :class:`PackedBatch` fields of those names) of the
    groups' samples ``ordered`` as ``build_batch`` ordered them, ``groups_per_row`` groups
    to a row of length ``l`` with ``k_len`` completion tokens listed per row."""
    g = len(ordered[0])
    n = len(ordered) // groups_per_row
    s = g * groups_per_row  # samples per row
    tokens = np.zeros((n, l), np.int32)
    positions = np.zeros((n, l), np.int32)
    response_id = np.full((n, l), PAD_ID, np.int32)
    group_slot = np.full((n, l), PAD_ID, np.int32)
    response_start = np.zeros((n * s,), np.int32)
    window_start = np.zeros((n * s,), np.int32)
    completion_offset = np.zeros((n * s,), np.int32)
    row_pred_pos = np.zeros((n, k_len), np.int32)
    row_targets = np.zeros((n, k_len), np.int32)
    row_valid = np.zeros((n, k_len), np.float32)
    for row in range(n):
        start = 0  # next free packed position of the row
        listed = 0  # completion tokens of the row listed so far
        for slot in range(groups_per_row):
            gi = row * groups_per_row + slot
            rollouts = ordered[gi]
            p = int(prompt_len[gi])
            prompt_span = slice(start, start + p)
            tokens[row, prompt_span] = rollouts[0].prompt_tokens
            positions[row, prompt_span] = np.arange(p)
            response_id[row, prompt_span] = PROMPT_ID
            group_slot[row, prompt_span] = slot
            last_prompt = start + p - 1
            start += p
            for i, r in enumerate(rollouts):
                b, k = gi * g + i, r.num_tokens
                span = slice(start, start + k)
                tokens[row, span] = r.completion_tokens
                positions[row, span] = p + np.arange(k)  # restart after the prompt
                response_id[row, span] = i + 1
                group_slot[row, span] = slot
                response_start[b] = start
                window_start[b] = p - 1
                completion_offset[b] = listed
                # Token 0 is predicted from the group's last prompt position (shared by
                # all G responses), token j > 0 from token j-1 of the same response.
                listed_span = slice(listed, listed + k)
                row_pred_pos[row, listed_span] = np.concatenate(
                    [[last_prompt], start + np.arange(k - 1)]
                )[:k]
                row_targets[row, listed_span] = r.completion_tokens
                row_valid[row, listed_span] = 1.0
                start += k
                listed += k

    return dict(
        tokens=tokens,
        positions=positions,
        response_id=response_id,
        group_slot=group_slot,
        response_start=response_start,
        window_start=window_start,
        completion_offset=completion_offset,
        row_pred_pos=row_pred_pos,
        row_targets=row_targets,
        row_valid=row_valid,
    )


def _check_packable(
    groups: Sequence[RolloutGroup], length_bucket: int, completion_bucket: int, groups_per_row: int
) -> None:
    """:func:`pack_groups`' settings, and one non-empty prompt per group."""
    if length_bucket <= 0:
        raise ValueError(f"pack_groups length_bucket must be > 0, got {length_bucket}")
    if completion_bucket <= 0:
        raise ValueError(f"pack_groups completion_bucket must be > 0, got {completion_bucket}")
    if groups_per_row < 1 or len(groups) % groups_per_row:
        raise ValueError(
            f"pack_groups groups_per_row={groups_per_row} must be >= 1 and divide the "
            f"{len(groups)} groups"
        )
    for group in groups:
        prompt = group.rollouts[0].prompt_tokens
        if prompt.shape[0] == 0:
            raise ValueError(
                f"group {group.group_id} has an empty prompt; packing predicts each "
                "response's first token from the last prompt position"
            )
        for r in group.rollouts[1:]:
            if not np.array_equal(r.prompt_tokens, prompt):
                raise ValueError(
                    f"group {group.group_id} sample {r.sample_index} has a different prompt "
                    "from sample 0; shared-prompt packing needs one prompt per group"
                )


def unpack_sequences(packed: PackedBatch) -> list[tuple[np.ndarray, np.ndarray]]:
    """The B ``(prompt [P], completion [R])`` pairs a packed batch holds, in row order
    (host side; the inverse of :func:`pack_groups` on tokens)."""
    b_total = packed.response_len.shape[0]
    n = packed.tokens.shape[0]
    s = b_total // n
    g = packed.group_size
    out = []
    for b in range(b_total):
        row, gi = b // s, b // g
        first = packed.response_start[gi * g]  # the group's first response follows its prompt
        p = packed.prompt_len[gi]
        prompt = packed.tokens[row, first - p : first]
        start = packed.response_start[b]
        out.append((prompt.copy(), packed.tokens[row, start : start + packed.response_len[b]]))
    return out


# ---------------------------------------------------------------------------------------------
# Inside jit


def packed_attention_mask(response_id: jax.Array, group_slot: jax.Array | None = None) -> jax.Array:
    """[N, L, L] bool "query q may attend key k", built on device from ``response_id [N, L]``
    and ``group_slot [N, L]`` (None: one group per row).

    q attends k iff k <= q, k is not padding, k is in q's group, and k is a prompt token or
    in q's own response. Prompt queries therefore see their group's causal prompt only, and a
    response token its group's whole prompt plus its own earlier tokens, never another
    response or another group. Padding queries see the prompts (a finite softmax; their
    outputs are never read).

    Built inside jit from O(L) ints so the host sends no O(L²) mask.
    """
    chex.assert_rank(response_id, 2)
    l = response_id.shape[1]
    idx = jnp.arange(l)
    causal = idx[:, None] >= idx[None, :]  # [L, L]
    q = response_id[:, :, None]  # [N, L, 1]
    k = response_id[:, None, :]  # [N, 1, L]
    mask = causal[None] & (k != PAD_ID) & ((k == PROMPT_ID) | (k == q))
    if group_slot is not None:
        chex.assert_equal_shape([response_id, group_slot])
        qs, ks = group_slot[:, :, None], group_slot[:, None, :]
        mask = mask & ((ks == qs) | (qs == PAD_ID))
    return mask


def row_completions_to_rows(
    values: jax.Array,
    window_start: jax.Array,
    completion_offset: jax.Array,
    response_len: jax.Array,
    length: int,
) -> jax.Array:
    """Lay per-row compact completion values out like ``build_batch``'s target-aligned rows.

    out[b, t] = values[n, completion_offset[b] + t - window_start[b]] for
    ``0 <= t - window_start[b] < response_len[b]`` (n = b // S, the row of sample b), else 0.
    With ``window_start = P - 1`` position t of an unpacked row ``[prompt | completion]``
    holds what predicts token t+1, i.e. completion token ``t - (P - 1)``.

    Args:
      values: [N, K] per completion token of each packed row.
      window_start: [B] int row position of completion token 0's prediction (P - 1).
      completion_offset: [B] int index of sample b's token 0 in its row's list.
      response_len: [B] int completion tokens of sample b.
      length: T, the row length.
    Returns:
      [B, T] values, 0 outside each sample's completion window.
    """
    n, k = values.shape
    b = window_start.shape[0]
    chex.assert_shape([window_start, completion_offset, response_len], (b,))
    if b % n:
        raise ValueError(f"{b} samples are not a multiple of the {n} packed rows")
    row = jnp.arange(b) // (b // n)  # [B]
    j = jnp.arange(length)[None, :] - window_start[:, None]  # [B, T]
    inside = (j >= 0) & (j < response_len[:, None])
    idx = jnp.clip(completion_offset[:, None] + j, 0, k - 1)
    picked = values[row[:, None], idx]
    return jnp.where(inside, picked, jnp.zeros((), values.dtype))


def packed_hidden(
    params: Params, packed: PackedArrays, *, model_config: model.ModelConfig
) -> jax.Array:
    """[N, L, D] float32 final-norm hidden states of the packed rows (no lm_head)."""
    tokens = packed["packed_tokens"]
    chex.assert_rank(tokens, 2)
    chex.assert_equal_shape([tokens, packed["packed_positions"], packed["response_id"]])
    group_slot = packed.get("group_slot")
    hidden, _ = model.hidden_states(
        params,
        tokens,
        packed["packed_positions"],
        config=model_config,
        attention_mask=packed_attention_mask(
            jnp.asarray(packed["response_id"]),
            None if group_slot is None else jnp.asarray(group_slot),
        ),
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

    Drop-in for ``logprobs.forward_logprobs`` (same signature, same ``[B, T]`` layout):
    on every position where ``loss_mask`` is 1 the values equal those of the unpacked
    ``build_batch`` rows; elsewhere they are 0 (the loss never reads them).

        v[n, k] = log softmax(h[n, row_pred_pos[n, k]] · W / temperature)[row_targets[n, k]]
        logp[b, P-1+j] = v[n, completion_offset[b] + j]

    with h the final-norm hidden states of packed row n = b // S and W the lm_head. The
    lm_head runs on the N·K listed completion positions only, chunk by chunk over tokens.

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
    row_pred_pos = jnp.asarray(packed["row_pred_pos"])
    n, _ = tokens.shape
    _, k = row_pred_pos.shape
    b, t = packed["loss_mask"].shape
    chex.assert_shape([row_pred_pos, packed["row_targets"]], (n, k))
    chex.assert_shape(
        [packed["window_start"], packed["completion_offset"], packed["response_len"]], (b,)
    )

    hidden = packed_hidden(params, packed, model_config=model_config)  # [N, L, D]
    h = jnp.take_along_axis(hidden, row_pred_pos[:, :, None], axis=1)  # [N, K, D]
    # Same float32 head as model.apply, chunked over tokens (no [N, K, V] logits in either
    # pass); temperature as in forward_logprobs.
    head, is_table = model.lm_head_for_logprobs(params, model_config)
    logp_k, ent_k = logprobs.chunked_token_logprobs(
        h,
        head,
        jnp.asarray(packed["row_targets"]),
        temperature=temperature,
        head_is_table=is_table,
    )  # [N, K] each
    to_rows = lambda v: row_completions_to_rows(  # noqa: E731
        v,
        jnp.asarray(packed["window_start"]),
        jnp.asarray(packed["completion_offset"]),
        jnp.asarray(packed["response_len"]),
        t,
    )
    return to_rows(logp_k), to_rows(ent_k)


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
        dict with ``forward=logprobs.forward_logprobs``.
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
