"""``system.mode=periodic``: Periodic Asynchrony's iteration, groups folded into the gradient
as they finish, one optimizer step per iteration: strictly on-policy.

Training layer (host-side shell). Design §4.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp

from a3po_jax.core.batching import TrainBatch, concat_batches
from a3po_jax.core.types import RolloutGroup
from a3po_jax.training.schedules.base import Run, Schedule, Trained, register


@register("periodic")
class Periodic(Schedule):
    """Consumes the batch's groups one by one as they finish and folds each into the
    gradient (the prox rule's old pass and the reference pass run inside the fold), then
    applies one update: the same update as ``sync`` up to summation order."""

    single_process_only = "system.mode='periodic' (it folds groups in as they arrive)"
    drives_in_lockstep = False  # a fold waits for each group as it finishes

    def __init__(self, run: Run):
        super().__init__(run)
        from a3po_jax.core import train_step as ts  # (the config loads no train step)

        self._fold_group = jax.jit(functools.partial(ts.fold_group, algo=run.algo))
        self._apply_folded = jax.jit(
            functools.partial(
                ts.apply_accumulated,
                optimizer=run.optimizer,
                grad_clip=run.cfg.optim.grad_clip,
            ),
            donate_argnums=(0,),
        )

    @classmethod
    def staleness_bound(
        cls, max_staleness: int, num_minibatches: int, *, error: type[Exception] = ValueError
    ) -> int:
        return num_minibatches - 1

    @classmethod
    def check(cls, system: Any, *, error: type[Exception] = ValueError) -> None:
        if system.max_staleness > 0:
            raise error(
                "system.mode='periodic' is strictly on-policy: system.max_staleness must be 0, "
                f"got {system.max_staleness}"
            )

    def train(self, version: int, timings: dict[str, float]) -> Trained | None:
        run = self.run
        t0 = time.perf_counter()
        groups, batches, folded, wait = self._fold_arrivals(version)
        timings["time/wait_rollouts_s"] = wait
        if folded is None:  # every slot left empty: nothing to apply
            return None
        run.state, metrics = self._apply_folded(run.state, folded)
        # The metrics' batch is the folded groups' own final batches (masks, shaped rewards),
        # side by side: no second build.
        merged = concat_batches(batches)
        metrics = jax.device_get(metrics)
        timings["time/train_s"] = time.perf_counter() - t0 - wait
        return Trained(groups, merged, metrics)

    def _fold_arrivals(
        self, version: int
    ) -> tuple[list[RolloutGroup], list[TrainBatch], Any, float]:
        """The groups in arrival order, their final batches, their folded gradient (None if
        none came) and the seconds spent waiting for them."""
        from a3po_jax.core import optim
        from a3po_jax.core import train_step as ts

        run = self.run
        params = run.state.params
        fold = run.algo.plan.fold  # one group per row and per batch
        folded = None
        groups: list[RolloutGroup] = []
        batches: list[TrainBatch] = []
        wait = 0.0
        for i in range(run.batch_groups):
            t0 = time.perf_counter()
            # A stop is taken before the iteration's first group only: one taken is folded.
            taken = run.workers.get_batch(
                1,
                trainer_version=version,
                timeout=run.cfg.system.hosts.rollout_timeout_s,
                interrupted=run.stop_while_waiting() if i == 0 else None,
            )
            wait += time.perf_counter() - t0
            if not taken:  # a slot left empty (dynamic sampling)
                continue
            groups.extend(taken)
            made = run.step_batch(taken, fold)
            batches.append(made.batch)
            mbs = ts.split_micro_batches(
                {k: jnp.asarray(v) for k, v in made.arrays.items()}, fold.micro_batches
            )
            acc = self._fold_group(params, run.ref_params, mbs, jnp.int32(version))
            folded = acc if folded is None else optim.add_accumulated(folded, acc)
        return groups, batches, folded, wait
