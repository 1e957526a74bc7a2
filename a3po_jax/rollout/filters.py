"""What DAPO's dynamic sampling and overlong filtering do to a step's batch (host side).

Rollout layer (plain Python + numpy; nothing here enters jit). DAPO: arXiv 2503.14476.

* **Short batches** (``rollout.dynamic_sampling``): the queue filters groups whose samples
  all got the same reward (:func:`a3po_jax.rollout.queue.zero_reward_variance`); once a
  step's refill budget is spent, a filtered group leaves its batch slot empty and the step
  gets fewer than B groups. The jitted step has one shape (B groups), so
  :func:`fill_short_batch` pads the batch with *filler* copies of its own groups (negative
  group ids, so the lengths and the compiled shape stay those of real data), and
  :func:`mask_rows` gives every filler row loss mask 0: they add nothing to any sum or
  count, and the step trains on the real groups only.
* **Overlong filtering** (``rollout.overlong_filter``): a sample cut at
  ``rollout.max_new_tokens`` (``finish_reason == "length"``, no EOS) gets loss mask 0 in
  :func:`mask_rows`; its reward still enters its group's advantage baseline, as in DAPO.

Masking a row zeroes its ``loss_mask`` and ``advantages``; for pair objectives (DPO) a
pair with a masked row gets ``pair_mask`` 0 on both rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from a3po_jax.core.batching import TrainBatch, group_rows
from a3po_jax.core.types import RolloutGroup


def is_filler(group_id: int) -> bool:
    """Filler groups (:func:`fill_short_batch`) have negative ids; real ones count from 0."""
    return group_id < 0


def fill_short_batch(groups: Sequence[RolloutGroup], num_groups: int) -> list[RolloutGroup]:
    """``groups`` followed by filler copies of them (cycling, ids -1, -2, ...) up to
    ``num_groups``; :func:`mask_rows` then masks every filler row out.

    Raises ValueError for no groups (nothing to copy) or more than ``num_groups``.
    """
    groups = list(groups)
    if not groups or len(groups) > num_groups:
        raise ValueError(f"fill_short_batch needs 1..{num_groups} groups, got {len(groups)}")
    fillers = []
    for i in range(num_groups - len(groups)):
        source, group_id = groups[i % len(groups)], -1 - i
        # The rows take their ids from the samples (TrainBatch.group_ids): renumber both.
        rollouts = [dataclasses.replace(r, group_id=group_id) for r in source.rollouts]
        fillers.append(dataclasses.replace(source, group_id=group_id, rollouts=rollouts))
    return groups + fillers


def mask_rows(
    batch: TrainBatch,
    arrays: dict[str, np.ndarray],
    groups: Sequence[RolloutGroup],
    *,
    overlong_filter: bool,
    dpo_pairs: bool = False,
) -> dict[str, int]:
    """Masks the filler rows, and with ``overlong_filter`` the truncated samples, of a
    batch built from ``groups`` (any order: rows are matched through ``batch.group_ids``
    and :func:`a3po_jax.core.batching.group_rows`, the one row order of a group).

    Updates ``batch`` and the step's ``arrays`` (its ``loss_mask``, ``advantages``,
    ``pair_mask``) in place.

    Returns:
      ``{"filler_rows": n, "overlong_masked": m}``: rows masked as fillers, and real
      samples masked for being truncated.
    """
    by_id = {g.group_id: g for g in groups}
    group_size = groups[0].size
    keep = np.ones(batch.group_ids.shape[0], np.float32)  # [R]
    filler = overlong = 0
    for start in range(0, keep.shape[0], group_size):
        group = by_id[int(batch.group_ids[start])]
        if is_filler(group.group_id):
            keep[start : start + group_size] = 0.0
            filler += group_size
            continue
        if overlong_filter:
            for i, rollout in enumerate(group_rows(group, dpo_pairs=dpo_pairs)):
                if rollout.finish_reason == "length":
                    keep[start + i] = 0.0
                    overlong += 1
    if filler or overlong:
        batch.loss_mask = (batch.loss_mask * keep[:, None]).astype(np.float32)
        batch.advantages = (batch.advantages * keep[:, None]).astype(np.float32)
        if dpo_pairs:  # a pair trains only with both of its rows
            both = np.repeat(keep[0::2] * keep[1::2], 2)
            batch.pair_mask = (batch.pair_mask * both).astype(np.float32)
        for name in ("loss_mask", "advantages", "pair_mask"):
            if name in arrays:
                arrays[name] = getattr(batch, name)
    return {"filler_rows": filler, "overlong_masked": overlong}
