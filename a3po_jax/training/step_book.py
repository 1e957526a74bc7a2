"""A run's per-step accounting: the step record, and what a short, empty or non-finite
step does to the run.

Training layer (host-side shell). The record's own fields are
:func:`a3po_jax.training.metrics.step_record`'s; this module keeps what carries from step
to step (skipped steps, non-finite steps in a row, the filter counts already reported, the
samples the overlong filter masked since the last record).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from a3po_jax.core.batching import TrainBatch
from a3po_jax.core.types import RolloutGroup
from a3po_jax.inference.host_metrics import loop_time
from a3po_jax.training import compilation, recording
from a3po_jax.training.metrics import step_record

log = logging.getLogger(__name__)


class StepBook:
    """The counts a run carries across steps, and the records it writes from them.

    Args:
      cfg: the run's config (``rollout.groups_per_step``, ``rollout.extra_groups_budget``,
        ``system.run.max_nonfinite_steps``, ``algo.num_minibatches``).
      workers: the rollout source (its queue's counters; admissions given back).
    """

    def __init__(self, cfg: Any, workers: Any):
        self.cfg = cfg
        self.workers = workers
        self.batch_groups = cfg.rollout.groups_per_step
        self.skipped_steps = 0
        self.nonfinite_in_a_row = 0
        self.overlong_masked = 0  # samples masked by the overlong filter since the last record
        self._filter_counts_seen = {"filtered_groups": 0, "refilled_groups": 0}
        self._reward_seconds_seen = 0.0
        self._host_busy_seen: float | None = None  # host/busy_s at the last record
        # (when, the host's loop_s, its decode_steps) at the last record's read of its stats
        self._host_loop_seen: tuple[float, dict[str, float], int | None] | None = None
        self._compile_seen = compilation.compile_seconds()  # from the run's start

    def reward_time(self) -> dict[str, float]:
        """``time/reward_s``: seconds the reward stage spent scoring since the last record
        (the groups of this step and of the steps generating beside it), and
        ``mem/reward_model_gb``, the reward model's weights (GiB) where it says; neither
        in a replay, which scores nothing."""
        stats = self.workers.reward_stats()
        if "seconds" not in stats:
            return {}
        total = stats["seconds"]
        seconds, self._reward_seconds_seen = total - self._reward_seconds_seen, total
        out = {"time/reward_s": seconds}
        if "param_bytes" in stats:
            out["mem/reward_model_gb"] = stats["param_bytes"] / 2**30
        return out

    def compile_time(self) -> dict[str, float]:
        """``time/compile_s``: seconds this process spent making JAX executables since the
        last record (a new shape's train step, a prefill bucket, in any thread; loads from
        the persistent cache included): the part of a step that a longer run amortises."""
        total = compilation.compile_seconds()
        seconds, self._compile_seen = total - self._compile_seen, total
        return {"time/compile_s": seconds}

    def demand(self, record: dict[str, Any]) -> dict[str, float]:
        """Which side of the run waited during this step, from its own record:
        ``time/wait_frac``, the share of the step the trainer waited for rollouts, and
        ``host/busy_frac``, the share of it the host's serving loop worked (``host/busy_s``
        since the last record; a pool sums its hosts, so it passes 1 with several busy).
        The first record has no ``host/busy_frac`` (nothing to take the difference from)."""
        step_s = record.get("time/step_s", 0.0)
        if step_s <= 0:
            return {}
        out = {"time/wait_frac": record.get("time/wait_rollouts_s", 0.0) / step_s}
        busy = record.get("host/busy_s")
        if busy is not None:
            if self._host_busy_seen is not None:
                out["host/busy_frac"] = max(busy - self._host_busy_seen, 0.0) / step_s
            self._host_busy_seen = busy
        return out

    def host_time(self, stats: dict[str, Any], read_at: float) -> dict[str, float]:
        """Where the host's time went since the last record, from ``stats`` read at
        ``read_at`` (``time.perf_counter``): ``host/<part>_s``, the
        seconds its serving loop spent in each part (the differences of ``stats["loop_s"]``;
        the parts are ``host_metrics.LOOP_PARTS``), and ``host/idle_s``, the rest of the
        seconds since the last record (times the healthy hosts of a pool, which sums its
        hosts' parts): :func:`a3po_jax.inference.host_metrics.loop_time`; and
        ``host/decode_steps``, the decode steps it ran meanwhile (a pool's hosts summed), so
        that ``host/decode_wait_s`` per step compares runs and benchmarks whose answers end
        at other lengths. The first record has none (nothing to take the difference from),
        nor a host without ``loop_s``; a host that does not count its steps has no
        ``host/decode_steps``."""
        loop = stats.get("loop_s")
        if loop is None:
            return {}
        steps = stats.get("decode_steps")
        seen, self._host_loop_seen = self._host_loop_seen, (read_at, dict(loop), steps)
        if seen is None:
            return {}
        then, before, steps_seen = seen
        parts = loop_time(before, loop, read_at - then, int(stats.get("hosts_healthy", 1)))
        out = {f"host/{part}_s": seconds for part, seconds in parts.items()}
        if steps is not None and steps_seen is not None:
            # Never negative: a pool's sum drops the steps of a host that went down.
            out["host/decode_steps"] = max(int(steps) - int(steps_seen), 0)
        return out

    def resumed(self, skipped_steps: int) -> None:
        """After a resume: the skipped steps so far, and the queue's counts as the origin of
        the per-step ``rollout/*`` counts."""
        counters = self.workers.queue.counters()
        self._filter_counts_seen = {k: int(counters.get(k, 0)) for k in self._filter_counts_seen}
        self.skipped_steps = skipped_steps

    def say_if_short(self, step: int, groups: list[RolloutGroup]) -> None:
        """The log line of a short batch (dynamic sampling spent its refill budget)."""
        if len(groups) < self.batch_groups:
            log.warning(
                "step %d trains %d of %d groups: %d slots left empty by groups with zero "
                "reward variance after rollout.max_extra_groups=%d fresh prompts this step",
                step + 1,
                len(groups),
                self.batch_groups,
                self.batch_groups - len(groups),
                self.cfg.rollout.extra_groups_budget,
            )

    def empty_step(
        self, step: int, version: int, timings: dict[str, float], t_step: float
    ) -> dict[str, Any]:
        """Every slot of the batch was left empty (dynamic sampling): no update, the slots'
        admissions are given back (as a skipped step's are: the version does not advance),
        and the record says so."""
        log.warning(
            "step %d: all %d groups had zero reward variance and the refill budget "
            "(rollout.max_extra_groups=%d) is spent: no update this step",
            step + 1,
            self.batch_groups,
            self.cfg.rollout.extra_groups_budget,
        )
        self.workers.consumed([], step=step + 1, version=version)  # the ledger's step
        self.workers.discard(self.batch_groups)
        timings["time/step_s"] = time.perf_counter() - t_step
        counters = self.workers.queue.counters()
        return {
            **timings,
            **self.reward_time(),
            "version": version,
            "step/skipped": 1.0,
            "step/skipped_total": self.skipped_steps,
            **self.filter_metrics([], counters),
            **{f"queue/{k}": v for k, v in counters.items() if not isinstance(v, dict)},
        }

    def filter_metrics(
        self, groups: list[RolloutGroup], counters: dict[str, Any]
    ) -> dict[str, float]:
        """``rollout/*`` of the step: groups filtered for zero reward variance and fresh
        prompts drawn for them since the last step, slots the batch was short by, and
        samples masked by the overlong filter. ``counters`` is the snapshot the record's
        ``queue/*`` come from (the collector files groups meanwhile: one read for both)."""
        metrics = {}
        for name, seen in self._filter_counts_seen.items():
            now = int(counters.get(name, 0))
            metrics[f"rollout/{name}"] = float(now - seen)
            self._filter_counts_seen[name] = now
        metrics["rollout/batch_short"] = float(self.batch_groups - len(groups))
        metrics["rollout/overlong_masked"] = float(self.overlong_masked)
        self.overlong_masked = 0
        return metrics

    def trained(self) -> None:
        """A step updated the weights: the non-finite streak ends."""
        self.nonfinite_in_a_row = 0

    def nonfinite(self, batch: TrainBatch, metrics: dict) -> None:
        """A step's loss or gradient was not finite: its update was skipped; its admissions
        are given back; FloatingPointError after ``system.run.max_nonfinite_steps`` in a row."""
        self.skipped_steps += 1
        self.nonfinite_in_a_row += 1
        # The batch is thrown away: give its admissions back (every slot, empty ones too)
        # so the producer can refill.
        self.workers.discard(self.batch_groups)
        log.warning(
            "non-finite loss/gradient (loss %s, grad norm %s): update skipped; prompts %s",
            metrics.get("loss/total"),
            metrics.get("optim/grad_norm"),
            sorted(set(batch.prompt_ids)),
        )
        limit = self.cfg.system.run.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise FloatingPointError(
                f"{self.nonfinite_in_a_row} non-finite steps in a row "
                f"(system.run.max_nonfinite_steps={limit}); "
                f"last prompts: {sorted(set(batch.prompt_ids))}"
            )

    def record(
        self, host, batch, groups, version: int, new_version: int, metrics, timings
    ) -> dict[str, Any]:
        """The step's record (:func:`a3po_jax.training.metrics.step_record`) with the
        ``rollout/*`` counts and the reward of the real rows; ``host`` is None in a replay
        (no ``host/*`` metrics rather than placeholders)."""
        replay = host is None
        queue_counters = self.workers.queue.counters()
        host_stats = {} if replay else host.stats()
        read_at = time.perf_counter()
        record = step_record(
            groups=groups,
            batch=batch,
            start_version=version,
            num_minibatches=self.cfg.algo.num_minibatches,
            step_metrics=metrics,
            timings=timings,
            version=new_version,
            host_stats=host_stats,
            counters={"queue": queue_counters}
            if replay
            else {"queue": queue_counters, "hosts": host.counters()},
            skipped_total=self.skipped_steps,
        )
        if replay:
            record = {k: v for k, v in record.items() if not k.startswith(recording.NOT_IN_REPLAY)}
        record.update(self.filter_metrics(groups, queue_counters))
        record.update(self.reward_time())
        record.update(self.compile_time())
        record.update(self.demand(record))
        record.update(self.host_time(host_stats, read_at))
        real = batch.group_ids >= 0  # a short batch's filler rows are not data
        record["reward/mean"] = float(np.mean(batch.rewards[real]))
        return record
