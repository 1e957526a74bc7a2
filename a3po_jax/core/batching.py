"""From rollout groups to the padded arrays the jitted train step consumes (host side).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Each sample becomes one row ``[prompt | completion | pad]``. Position t of the row predicts
token t+1, so every per-token quantity of the loss (behaviour log-prob, version, advantage,
mask) is stored at the position of the token that *predicts* it ("target-aligned"). Row
lengths are padded up to a multiple of ``length_bucket`` so a run compiles a handful of
shapes, not one per batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from a3po_jax.core import advantages
from a3po_jax.core.types import Rollout, RolloutGroup


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """A batch of B sequences padded to T, all numpy, target-aligned (see module doc).
    Frozen: a stage that changes it returns a new one (``dataclasses.replace``)."""

    tokens: np.ndarray  # [B, T] int32 inputs
    positions: np.ndarray  # [B, T] int32 RoPE positions
    segment_ids: np.ndarray  # [B, T] int32, 1 = real token, 0 = padding
    targets: np.ndarray  # [B, T] int32, tokens shifted left by one
    loss_mask: np.ndarray  # [B, T] float32, 1 where the target is a completion token
    behav_logp: np.ndarray  # [B, T] float32 behaviour log-prob of the target
    versions: np.ndarray  # [B, T] int32 policy version that sampled the target (0 if masked)
    advantages: np.ndarray  # [B, T] float32
    rewards: np.ndarray  # [B] float32 sequence rewards (after shaping / KL-in-reward)
    pair_mask: np.ndarray  # [B] float32 DPO: 1 on both rows of a pair with a preference
    prompt_ids: list[str]
    group_ids: np.ndarray  # [B] int64

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    def arrays(self) -> dict[str, np.ndarray]:
        """The fields the jitted step reads (everything but ids and rewards)."""
        return {
            "tokens": self.tokens,
            "positions": self.positions,
            "segment_ids": self.segment_ids,
            "targets": self.targets,
            "loss_mask": self.loss_mask,
            "behav_logp": self.behav_logp,
            "versions": self.versions,
            "advantages": self.advantages,
            "pair_mask": self.pair_mask,
        }


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def group_advantages(rewards: np.ndarray, group_size: int, kind: str) -> np.ndarray:
    """Per-sequence advantages ``[N*G]`` from rewards by the estimator ``kind`` of
    :data:`a3po_jax.core.advantages.ESTIMATORS` (grpo, drgrpo, rloo)."""
    return np.asarray(advantages.estimator(kind)(rewards, group_size), np.float32)


def group_rows(group: RolloutGroup, *, dpo_pairs: bool = False) -> list[Rollout]:
    """A group's samples in the order they take as batch rows: sample order, or with
    ``dpo_pairs`` (chosen, rejected) by reward (a stable sort: a tie keeps sample order).
    The one row order of the padded batch and of the packed layout built from it."""
    rollouts = list(group.rollouts)
    if dpo_pairs:
        rollouts.sort(key=lambda r: -float(r.reward))
    return rollouts


def build_batch(
    groups: Sequence[RolloutGroup],
    *,
    advantage: str,
    length_bucket: int,
    dpo_pairs: bool = False,
    min_length: int = 0,
) -> TrainBatch:
    """Pad and align a list of whole groups into a :class:`TrainBatch`.

    Args:
      groups: complete groups of equal size G, every rollout with a reward.
      advantage: a name from ``advantages.ESTIMATORS`` (for DPO still computed, unused).
      length_bucket: T is rounded up to a multiple of this.
      dpo_pairs: order each group of 2 as (chosen, rejected) by reward, so rows 2i and 2i+1
        form pair i; ``pair_mask`` is 0 on both rows where the rewards tie.
      min_length: lower bound on T (to reuse a compiled shape).
    """
    if not groups:
        raise ValueError("build_batch needs at least one group")
    group_size = groups[0].size
    rows = []
    for group in groups:
        if group.size != group_size:
            raise ValueError(
                f"group {group.group_id} has {group.size} samples, expected {group_size}"
            )
        for r in group.rollouts:
            if r.reward is None:
                raise ValueError(f"group {group.group_id} sample {r.sample_index} has no reward")
        if dpo_pairs and group_size != 2:
            raise ValueError(f"DPO pairs need groups of 2, got {group_size}")
        rows.extend(group_rows(group, dpo_pairs=dpo_pairs))

    b = len(rows)
    lengths = [r.prompt_tokens.shape[0] + r.completion_tokens.shape[0] for r in rows]
    t = max(round_up(max(lengths), length_bucket), min_length)
    tokens = np.zeros((b, t), np.int32)
    segment_ids = np.zeros((b, t), np.int32)
    targets = np.zeros((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.float32)
    behav = np.zeros((b, t), np.float32)
    versions = np.zeros((b, t), np.int32)
    rewards = np.array([float(r.reward) for r in rows], np.float32)
    for i, r in enumerate(rows):
        p, n = r.prompt_tokens.shape[0], r.completion_tokens.shape[0]
        seq = np.concatenate([r.prompt_tokens, r.completion_tokens])
        tokens[i, : p + n] = seq
        segment_ids[i, : p + n] = 1
        targets[i, : p + n - 1] = seq[1:]
        # Completion token j sits at row position p + j and is predicted from p + j - 1.
        loss_mask[i, p - 1 : p + n - 1] = 1.0
        behav[i, p - 1 : p + n - 1] = r.behav_logprobs
        versions[i, p - 1 : p + n - 1] = r.versions
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()

    seq_adv = group_advantages(rewards, group_size, advantage)
    token_adv = (seq_adv[:, None] * loss_mask).astype(np.float32)
    if dpo_pairs:
        pair_mask = np.repeat(rewards[0::2] != rewards[1::2], 2).astype(np.float32)
    else:
        pair_mask = np.zeros((b,), np.float32)
    return TrainBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        targets=targets,
        loss_mask=loss_mask,
        behav_logp=behav,
        versions=versions,
        advantages=token_adv,
        rewards=rewards,
        pair_mask=pair_mask,
        prompt_ids=[r.prompt_id for r in rows],
        group_ids=np.array([r.group_id for r in rows], np.int64),
    )


def concat_batches(batches: Sequence[TrainBatch]) -> TrainBatch:
    """The rows of ``batches`` in order, padded to the longest T (padding as
    :func:`build_batch` pads: zeros, positions counting on). With batches of whole groups
    built with one ``length_bucket``, the result is the batch :func:`build_batch` builds
    from all their groups at once."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    t = max(b.shape[1] for b in batches)

    def rows(name: str) -> np.ndarray:
        parts = []
        for part in (getattr(batch, name) for batch in batches):
            n, pad = part.shape[0], t - part.shape[1]
            # Padding positions count on from each row's last, as build_batch's do.
            tail = np.arange(part.shape[1], t, dtype=part.dtype) if name == "positions" else 0
            parts.append(
                np.concatenate([part, np.broadcast_to(tail, (n, pad)).astype(part.dtype)], 1)
            )
        return np.concatenate(parts)

    per_token = (
        "tokens", "positions", "segment_ids", "targets", "loss_mask", "behav_logp", "versions",
        "advantages",
    )  # fmt: skip
    return TrainBatch(
        **{name: rows(name) for name in per_token},
        rewards=np.concatenate([x.rewards for x in batches]),
        pair_mask=np.concatenate([x.pair_mask for x in batches]),
        prompt_ids=[p for x in batches for p in x.prompt_ids],
        group_ids=np.concatenate([x.group_ids for x in batches]),
    )
