"""The batch plan: a step's geometry, computed once from the run config, and ``make_batch``.

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

One frozen :class:`BatchPlan` says how a step's batch is built and split; the config
validates it (an impossible split is refused naming the fields), the trainer builds batches
and shards them with it, the step splits minibatches and micro-batches with it, and the
periodic fold takes its one-group plan (:attr:`BatchPlan.fold`). With G samples per group,
N groups per step, k minibatches and ``groups_per_row`` = R:

    rows             = G · N                 sequences per optimizer step
    minibatch_rows   = rows / k              sequences per optimizer update
    micro_batch_rows = system.batch.micro_batch_size, or minibatch_rows
    micro_batches    = k · minibatch_rows / micro_batch_rows    the step's split
    leading_rows     = N / R packed rows (shared-prompt packing), else rows

``system.batch.packed_prompts`` is resolved here, once, on the host: ``"auto"`` (the default)
packs whenever the geometry allows it (:meth:`BatchPlan.packing_refusal` says why not),
``true`` packs or refuses naming the fields, ``false`` never packs.

:func:`make_batch` builds a step's final batch from whole groups in one pass: the rows in
the plan's layout (padded, :func:`a3po_jax.core.batching.build_batch`, or shared-prompt
packed, :func:`a3po_jax.core.packing.pack_groups`) in the objective's row order (pairs for
DPO), then the reward-shaping stage, then the row masks (:mod:`a3po_jax.core.row_masks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from a3po_jax.core import objectives, packing, row_masks
from a3po_jax.core.batching import TrainBatch, build_batch
from a3po_jax.core.objectives.registry import ROWS, BatchLayout
from a3po_jax.core.types import RolloutGroup

# system.batch.packed_prompts' default: packed rows wherever the batch geometry allows them
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """A step's batch geometry, validated at construction (errors name the config fields)."""

    group_size: int  # G samples per prompt (rollout.group_size)
    groups: int  # N groups per optimizer step (rollout.groups_per_step)
    num_minibatches: int = 1  # k optimizer updates per batch (algo.num_minibatches)
    micro_batch_size: int = 0  # sequences per micro-batch; 0 = a whole minibatch
    packed: bool = False  # shared-prompt packing, one row per group (system.batch.packed_prompts)
    groups_per_row: int = 1  # groups per packed row (system.batch.groups_per_row)
    periodic: bool = False  # groups are folded in one at a time (system.mode="periodic")
    layout: BatchLayout = ROWS  # the objective's row order
    advantage: str = "grpo"  # advantage estimator build_batch applies (algo.advantage)
    length_bucket: int = 32  # row lengths are padded to multiples of this

    def __post_init__(self):
        g, k, mb = self.group_size, self.num_minibatches, self.micro_batch_size
        if self.rows % k:
            raise ValueError(
                f"algo.num_minibatches={k} must divide the batch of {self.rows} sequences "
                "(rollout.group_size x rollout.groups_per_step)"
            )
        if mb and self.minibatch_rows % mb:
            raise ValueError(
                f"system.batch.micro_batch_size={mb} must divide the minibatch of "
                f"{self.minibatch_rows} sequences"
            )
        if self.packed and mb and mb % g:
            raise ValueError(
                "system.batch.packed_prompts packs whole groups: "
                f"system.batch.micro_batch_size={mb} must be a multiple of rollout.group_size={g}"
            )
        if self.groups_per_row != 1:
            self._check_groups_per_row()
        if self.periodic and mb and not self.packed and g % mb:
            raise ValueError(
                "system.mode='periodic' folds each group into the gradient as it arrives: "
                f"system.batch.micro_batch_size={mb} must divide rollout.group_size={g}"
            )
        if self.periodic and k != 1:
            raise ValueError(
                "system.mode='periodic' takes one optimizer step per iteration: "
                "algo.num_minibatches must be 1"
            )

    def _check_groups_per_row(self) -> None:
        """Packed rows of several groups must split evenly into the minibatches and
        micro-batches (the step splits the packed arrays along their rows)."""
        gpr, groups, k = self.groups_per_row, self.groups, self.num_minibatches
        if not self.packed:
            raise ValueError(
                f"system.batch.groups_per_row={gpr} packs groups into rows: it needs "
                "system.batch.packed_prompts=true"
            )
        if groups % gpr:
            raise ValueError(
                f"system.batch.groups_per_row={gpr} must divide rollout.groups_per_step={groups}"
            )
        if self.periodic:  # the fold takes one group at a time: one group per row
            return
        if groups % (gpr * k):
            raise ValueError(
                f"system.batch.groups_per_row={gpr}: each of the algo.num_minibatches={k} "
                f"minibatches of rollout.groups_per_step={groups} groups must hold whole "
                f"packed rows of {gpr} groups"
            )
        mb, row = self.micro_batch_size, gpr * self.group_size
        if mb and mb % row:
            raise ValueError(
                f"system.batch.micro_batch_size={mb} must be a multiple of a packed row's "
                f"{row} sequences (system.batch.groups_per_row={gpr} x rollout.group_size="
                f"{self.group_size})"
            )

    @classmethod
    def from_config(cls, cfg: Any, *, batch_shards: int = 1) -> BatchPlan:
        """The plan of a run configuration (``a3po_jax.training.config.TrainConfig``: its
        ``rollout``, ``algo`` and ``system`` sections; the objective gives the layout).

        ``system.batch.packed_prompts="auto"`` is packed unless :meth:`packing_refusal` gives a
        reason, with ``batch_shards`` the ways the trainer's mesh splits the batch (its
        data x fsdp axes); ``system.batch.groups_per_row`` > 1 always packs, since that is what it
        asks for, so its geometry is refused as packing's."""
        packed = cfg.system.batch.packed_prompts
        if packed == AUTO:
            packed = (
                cfg.system.batch.groups_per_row != 1
                or cls.packing_refusal(cfg, batch_shards=batch_shards) is None
            )
        return cls(packed=packed, **cls._geometry(cfg))

    @classmethod
    def packing_refusal(cls, cfg: Any, *, batch_shards: int = 1) -> str | None:
        """Why this config's batch cannot train in packed rows (None: it can): the packed
        plan's refusal naming the fields (micro-batches must hold whole groups), or each
        micro-batch's packed rows not splitting over ``batch_shards`` mesh parts."""
        try:
            plan = cls(packed=True, **cls._geometry(cfg))
        except ValueError as err:
            return str(err)
        rows = plan.leading_rows_per_micro_batch
        if rows % batch_shards:
            return (
                f"a micro-batch's {rows} packed rows do not split over the mesh's "
                f"{batch_shards} batch parts (system.mesh.data x system.mesh.fsdp)"
            )
        return None

    @staticmethod
    def _geometry(cfg: Any) -> dict[str, Any]:
        """Every field of the plan but ``packed``, from the config."""
        return dict(
            group_size=cfg.rollout.group_size,
            groups=cfg.rollout.groups_per_step,
            num_minibatches=cfg.algo.num_minibatches,
            micro_batch_size=cfg.system.batch.micro_batch_size,
            groups_per_row=cfg.system.batch.groups_per_row,
            periodic=cfg.system.mode == "periodic",
            layout=objectives.get(cfg.algo.loss).layout,
            advantage=cfg.algo.advantage,
            length_bucket=cfg.system.batch.length_bucket,
        )

    @property
    def rows(self) -> int:
        """Sequences per optimizer step, G · N."""
        return self.group_size * self.groups

    @property
    def minibatch_rows(self) -> int:
        """Sequences per optimizer update."""
        return self.rows // self.num_minibatches

    @property
    def micro_batch_rows(self) -> int:
        """Sequences per micro-batch."""
        return self.micro_batch_size or self.minibatch_rows

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step, over all minibatches: the step's split of the batch."""
        return self.num_minibatches * (self.minibatch_rows // self.micro_batch_rows)

    @property
    def leading_rows(self) -> int:
        """Length of the step's arrays' leading axis: packed rows, or sequences."""
        return self.groups // self.groups_per_row if self.packed else self.rows

    @property
    def leading_rows_per_micro_batch(self) -> int:
        """Leading-axis rows of one micro-batch (what the mesh's batch axes must divide)."""
        row = self.group_size * self.groups_per_row if self.packed else 1
        return self.micro_batch_rows // row

    @property
    def balance_rows(self) -> bool:
        """Reorder groups to balance packed rows: only with one minibatch, since with k > 1
        the order decides which groups train at which version."""
        return self.num_minibatches == 1

    @property
    def fold(self) -> BatchPlan:
        """The plan of one arriving group in periodic mode: one group, one row, one update;
        unpacked it splits into micro-batches of ``micro_batch_size``, packed it is one row."""
        return dataclasses.replace(
            self,
            groups=1,
            groups_per_row=1,
            num_minibatches=1,
            micro_batch_size=0 if self.packed else self.micro_batch_size,
            periodic=False,
        )

    @property
    def padded(self) -> BatchPlan:
        """The same groups in padded rows, not split (the metrics' batch of a periodic step,
        whose update came from the folds)."""
        return dataclasses.replace(
            self,
            packed=False,
            groups_per_row=1,
            num_minibatches=1,
            micro_batch_size=0,
            periodic=False,
        )


# What a reward-shaping stage takes and returns: the step's arrays (every row's completion
# tokens still in ``loss_mask``) and the rewards [R] -> new rewards [R], advantages [R, T].
ShapeRewards = Callable[[dict[str, np.ndarray], np.ndarray], tuple[np.ndarray, np.ndarray]]
_MASKED_FIELDS = ("loss_mask", "advantages", "pair_mask")  # what apply_row_keep changes


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """A step's batch, final: built, reward-shaped and masked in one pass (:func:`make_batch`).

    Attributes:
      batch: the padded :class:`~a3po_jax.core.batching.TrainBatch` (rewards, ids and the
        per-token loss inputs; with packing in the packed order), for the metrics.
      arrays: what the jitted step reads, with the same final masks and advantages.
      filler_rows: rows of filler groups (a short batch's padding), masked.
      overlong_masked: real samples cut at the token budget, masked (``overlong_filter``).
    """

    batch: TrainBatch
    arrays: dict[str, np.ndarray]
    filler_rows: int = 0
    overlong_masked: int = 0


def make_batch(
    groups: Sequence[RolloutGroup],
    plan: BatchPlan,
    *,
    overlong_filter: bool = False,
    shape_rewards: ShapeRewards | None = None,
) -> StepBatch:
    """A step's batch from ``plan.groups`` whole groups (a short batch already filled by
    :func:`a3po_jax.core.row_masks.fill_short_batch`), in the plan's layout, in one pass:

    1. the rows: padded, or shared-prompt packed;
    2. ``shape_rewards`` (KL-in-reward), on every row's completion tokens: a masked
       sample's KL still shapes its own reward, hence its group's baseline;
    3. last, the row masks (:mod:`a3po_jax.core.row_masks`): filler rows, and with
       ``overlong_filter`` truncated samples, get loss mask and advantages 0.

    Nothing is changed in place: every stage returns new arrays.
    """
    if len(groups) != plan.groups:
        raise ValueError(f"make_batch: {len(groups)} groups, the plan has {plan.groups}")
    kwargs = dict(
        advantage=plan.advantage, length_bucket=plan.length_bucket, dpo_pairs=plan.layout.pairs
    )
    if plan.packed:
        packed = packing.pack_groups(
            groups, groups_per_row=plan.groups_per_row, balance_rows=plan.balance_rows, **kwargs
        )
        batch, arrays = packed.batch, packed.arrays()
    else:
        batch = build_batch(groups, **kwargs)
        arrays = batch.arrays()
    if shape_rewards is not None:
        rewards, adv = shape_rewards(arrays, batch.rewards)
        batch = dataclasses.replace(
            batch,
            rewards=np.asarray(rewards, np.float32),
            advantages=np.asarray(adv, np.float32),
        )
    keep = row_masks.row_keep(
        batch.group_ids, groups, overlong_filter=overlong_filter, dpo_pairs=plan.layout.pairs
    )
    batch = row_masks.apply_row_keep(batch, keep.keep, dpo_pairs=plan.layout.pairs)
    arrays = {**arrays, **{k: getattr(batch, k) for k in _MASKED_FIELDS if k in arrays}}
    return StepBatch(batch, arrays, keep.filler_rows, keep.overlong_masked)
