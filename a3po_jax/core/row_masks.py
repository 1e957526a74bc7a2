"""Which rows of a step's batch train: DAPO's short-batch fillers and overlong filter.

Core layer (pure numpy): imports only ``a3po_jax.core``. DAPO: arXiv 2503.14476.

* **Short batches** (``rollout.dynamic_sampling``): the queue filters groups whose samples
  all got the same reward (:func:`a3po_jax.rollout.queue.zero_reward_variance`); once a
  step's refill budget is spent, a filtered group leaves its batch slot empty and the step
  gets fewer than B groups. The jitted step has one shape (B groups), so
  :func:`fill_short_batch` pads the batch with *filler* copies of its own groups (negative
  group ids: the record's filler flag, so the lengths and the compiled shape stay those of
  real data), and :func:`row_keep` gives every filler row weight 0: they add nothing to
  any sum or count, and the step trains on the real groups only.
* **Overlong filtering** (``rollout.overlong_filter``): a sample cut at
  ``rollout.max_new_tokens`` (its record's ``finish_reason == "length"``, no EOS) gets
  weight 0 in :func:`row_keep`; its reward still enters its group's advantage baseline, as
  in DAPO.

:func:`apply_row_keep` returns a new batch whose weight-0 rows have ``loss_mask`` and
``advantages`` 0; for pair objectives (DPO) a pair with a weight-0 row gets ``pair_mask`` 0
on both rows. :func:`a3po_jax.core.batch_plan.make_batch` calls both, once, last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from a3po_jax.core.batching import TrainBatch, group_rows
from a3po_jax.core.types import RolloutGroup


def is_filler(group_id: int) -> bool:
    """Filler groups (:func:`fill_short_batch`) have negative ids; real ones count from 0."""
    return group_id < 0


def fill_short_batch(groups: Sequence[RolloutGroup], num_groups: int) -> list[RolloutGroup]:
    """``groups`` followed by filler copies of them (cycling, ids -1, -2, ...) up to
    ``num_groups``; :func:`row_keep` then gives every filler row weight 0.

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


class RowKeep(NamedTuple):
    """Each row's training weight and why rows got 0."""

    keep: np.ndarray  # [R] float32, 1 = the row trains
    filler_rows: int  # rows of filler groups
    overlong_masked: int  # real samples cut at the token budget (with the overlong filter)


def row_keep(
    group_ids: np.ndarray,
    groups: Sequence[RolloutGroup],
    *,
    overlong_filter: bool,
    dpo_pairs: bool = False,
) -> RowKeep:
    """The weights of a batch's rows, whose group ids are ``group_ids`` ``[R]`` (rows of a
    group consecutive, in :func:`a3po_jax.core.batching.group_rows`' order; groups in any
    order), built from ``groups``."""
    by_id = {g.group_id: g for g in groups}
    group_size = groups[0].size
    keep = np.ones(group_ids.shape[0], np.float32)  # [R]
    filler = overlong = 0
    for start in range(0, keep.shape[0], group_size):
        group = by_id[int(group_ids[start])]
        if is_filler(group.group_id):
            keep[start : start + group_size] = 0.0
            filler += group_size
            continue
        if overlong_filter:
            for i, rollout in enumerate(group_rows(group, dpo_pairs=dpo_pairs)):
                if rollout.finish_reason == "length":
                    keep[start + i] = 0.0
                    overlong += 1
    return RowKeep(keep, filler, overlong)


def apply_row_keep(batch: TrainBatch, keep: np.ndarray, *, dpo_pairs: bool = False) -> TrainBatch:
    """``batch`` with the weight-0 rows of ``keep`` ``[R]`` masked (a new batch; ``batch``
    itself is returned when every row trains)."""
    if keep.all():
        return batch
    masked = {
        "loss_mask": (batch.loss_mask * keep[:, None]).astype(np.float32),
        "advantages": (batch.advantages * keep[:, None]).astype(np.float32),
    }
    if dpo_pairs:  # a pair trains only with both of its rows
        both = np.repeat(keep[0::2] * keep[1::2], 2)
        masked["pair_mask"] = (batch.pair_mask * both).astype(np.float32)
    return dataclasses.replace(batch, **masked)
