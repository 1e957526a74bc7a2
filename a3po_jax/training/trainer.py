"""The asynchronous trainer loop: the host-side shell around the jitted train step.

Training layer (host-side shell).

The loop only (Tunix's ``rl_learner`` / AReaL's split): each step the mode's schedule takes
B whole groups from the rollout source and trains on them (:mod:`a3po_jax.training.schedules`:
sync, periodic, one-step-off, async; lockstep and replay wrap them), then the new weights
are pushed with their version, the step is recorded (:mod:`a3po_jax.training.step_book`) and
checkpointed. What the loop runs over is built once by :func:`a3po_jax.training.build.build_run`
(meshes, algorithm, state, host, rollout source, recorder, checkpointer). Around it:

* producer and collector threads: :mod:`a3po_jax.rollout.workers`;
* staleness admission and the staleness of trained tokens (in optimizer versions):
  :mod:`a3po_jax.rollout.admission`;
* held-out scoring: :mod:`a3po_jax.rollout.evaluation`;
* checkpoint save/resume: :mod:`a3po_jax.training.checkpointing`;
* the loop of the other processes of a multi-process run: :mod:`a3po_jax.training.follower`.

With several processes (``a3po_jax.parallel.distributed.initialize``), process 0 alone runs
the rollout workers, the inference host, logging and checkpoint metadata; every step it
broadcasts the batch, all processes run the jitted step over one global mesh, and the
weights are gathered to process 0 for the push.

Nothing here enters jit; everything jitted lives in ``train_step.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax.core import train_step as ts
from a3po_jax.core.batch_plan import BatchPlan, make_batch
from a3po_jax.core.batching import TrainBatch
from a3po_jax.core.types import RolloutGroup
from a3po_jax.inference.protocol import Host
from a3po_jax.parallel import distributed
from a3po_jax.rollout import filters
from a3po_jax.rollout.evaluation import HeldOutEvaluation, evaluation_line
from a3po_jax.rollout.ledger import Ledger, ledger_path
from a3po_jax.rollout.queue import RolloutQueue, RolloutTimeout, WaitInterrupted
from a3po_jax.training import heap, host_placement, schedules
from a3po_jax.training.build import Policy, build_run, load_policy, refuse_unsupported
from a3po_jax.training.checkpointing import (
    prune_held_groups,
    read_held_groups,
    restore_train_state,
    save_train_state,
    write_held_groups,
)
from a3po_jax.training.config import TrainConfig
from a3po_jax.training.follower import follow_leader
from a3po_jax.training.metrics import MetricsLogger, ProgressBar
from a3po_jax.training.schedules.lockstep import Lockstep
from a3po_jax.training.schedules.replay import Replayed
from a3po_jax.training.step_book import StepBook
from a3po_jax.training.stopping import STOP_SIGNALS, install_sigterm_handler, signal_name

__all__ = ["Policy", "Trainer", "load_policy", "refuse_unsupported"]

log = logging.getLogger(__name__)

# How long a weight push waits for an in-process host to start serving the new weights (a
# decode step, or a prefill, under the in-flight policies) before it trims the heap.
SWAP_WAIT_S = 1.0

CONSOLE_KEYS = (
    "reward/mean",
    "reward/correct",
    "eval/accuracy",
    "loss/total",
    "staleness/max",
    "time/step_s",
)


class Trainer:
    """Runs one configured RL run against an inference host.

    Args:
      cfg: the run's configuration (validated).
      policy: model config, initial params and tokenizer.
      host: an inference host (:class:`a3po_jax.inference.protocol.Host`: the in-process
        host, a gRPC client or a pool of them); if None the run starts its own, placed as
        ``system`` says (closed by :meth:`close`).
      task: an object with the ``a3po_jax.tasks.Task`` protocol (``prompts``, ``score``,
        ``format_ok``, ``extract_answer``); default ``make_task(cfg.task.name, ...)``.
      console: print a progress line per step.
      on_step: called as ``on_step(step, record)`` after each step is logged (notebooks,
        tests, custom stopping rules); an exception from it stops the run.
      replay_dir: replay this recorded run (``system.record_rollouts``): the groups come from
        its ``rollouts/`` step by step (:class:`a3po_jax.training.recording.ReplaySource`),
        with no inference host and no rollout threads; no ``host/*`` metrics.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        policy: Policy,
        *,
        host: Host | None = None,
        task: Any = None,
        console: bool = True,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        replay_dir: str | Path | None = None,
    ):
        self.cfg = cfg
        self.on_step = on_step
        self.console = console
        parts = build_run(cfg, policy, host=host, task=task, replay_dir=replay_dir)
        train = parts.train
        self.mesh, self.algo, self.optimizer = train.mesh, train.algo, train.optimizer
        self.state, self.ref_params = train.state, train.ref_params
        self._train_step, self._batch_sharding = train.train_step, train.batch_sharding
        self._kl_in_reward = None
        if self.algo.kl_in_reward is not None:
            self._kl_in_reward = jax.jit(functools.partial(ts.kl_in_reward, algo=self.algo))
        self.task, self.host, self.workers = parts.task, parts.host, parts.workers
        self.recorder, self.checkpoints, self._trimmer = (
            parts.recorder,
            parts.checkpoints,
            parts.trimmer,
        )
        self.leader = parts.leader
        self.multi_process = jax.process_count() > 1
        self.run_dir = Path(cfg.run_dir)
        self.batch_groups = cfg.rollout.groups_per_step
        self._own_host, self._local_host = parts.own_host, parts.local_host
        # The state and an in-process host hold copies of the initial params; the trainer
        # keeps only the policy's config and tokenizer, so a caller that drops its own
        # reference (the CLI does) frees one whole copy of the weights.
        self.policy = dataclasses.replace(policy, params=None)
        self.schedule = self._schedule(parts.replay_dir is not None)
        self.book = StepBook(cfg, self.workers)
        self._evaluate = HeldOutEvaluation(
            cfg,
            self.task,
            policy.tokenizer,
            parts.sampling.stop_tokens,
            workers=None if self.host is None else self.workers,
            replay_host=self._replay_eval_host,
        )
        self.ledger: Ledger | None = None  # opened by run() once the run is accepted
        self._live_source = self.leader and parts.replay_dir is None
        # SIGTERM or SIGINT: save and stop at the next step boundary; a second one: exit now.
        self._sigterm = install_sigterm_handler(signals=STOP_SIGNALS, exit_on_second=True)

    def _schedule(self, replay: bool) -> schedules.Schedule:
        """The mode's schedule over this run; lockstep or replay around it."""
        schedule = self.cfg.system.schedule(self)
        if replay:
            return Replayed(schedule)
        steps = self.cfg.system.lockstep_decode_steps
        return Lockstep(schedule, steps) if steps > 0 else schedule

    def _replay_eval_host(self, params: Any, version: int) -> Host:
        """A replay's evaluation host: in-process, started, under "drain"."""
        return host_placement.embedded_host(
            self.cfg,
            self.policy.config,
            params,
            None,
            start=True,
            version=version,
            update_policy="drain",
        )

    @property
    def plan(self) -> BatchPlan:
        """The batch plan the algorithm was built with (rows, minibatches, packing)."""
        return self.algo.plan

    @property
    def queue(self) -> RolloutQueue:
        """The rollout queue (counters, invariant checks)."""
        return self.workers.queue

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped (non-finite, or every slot empty)."""
        return self.book.skipped_steps

    # ------------------------------------------------------------------ what schedules use

    def batch_arrays(
        self, groups: list[RolloutGroup], plan: BatchPlan
    ) -> tuple[TrainBatch, dict[str, np.ndarray]]:
        """The padded batch (for metrics) and the arrays the jitted step reads, in the
        plan's layout (:func:`a3po_jax.core.batch_plan.make_batch`), with KL-in-reward's
        shaped rewards and advantages when the algorithm charges the KL to the reward.

        With ``system.groups_per_row`` > 1 and one minibatch, packing reorders the groups to
        balance its rows, and the returned batch (advantages, versions, the metrics'
        staleness) follows that order.

        A short batch (dynamic sampling left slots empty) is filled up to the plan's groups
        with masked filler copies, and with ``rollout.overlong_filter`` truncated samples
        get loss mask 0 (:mod:`a3po_jax.rollout.filters`)."""
        filled = filters.fill_short_batch(groups, plan.groups)
        batch, arrays = make_batch(filled, plan)
        if self._kl_in_reward is not None:
            # KL in the reward: R_i ← R_i − β Σ_t KL_t, then the advantages of those rewards
            # (core.train_step.kl_in_reward); the step then reads the new advantages.
            rewards, adv = self._kl_in_reward(
                self.state.params, self.ref_params, _to_device(arrays), jnp.asarray(batch.rewards)
            )
            batch.rewards = np.asarray(rewards, np.float32)
            batch.advantages = arrays["advantages"] = np.asarray(adv, np.float32)
        # Last: the masks zero the final advantages too (a truncated sample's KL still
        # shapes its own reward, hence its group's baseline).
        masked = filters.mask_rows(
            batch,
            arrays,
            filled,
            overlong_filter=self.cfg.rollout.overlong_filter,
            dpo_pairs=plan.layout.pairs,
        )
        self.book.overlong_masked += masked["overlong_masked"]
        return batch, arrays

    def train_on(self, groups: list[RolloutGroup]) -> tuple[TrainBatch, dict]:
        """Dispatches the jitted step on the batch of ``groups`` (not waited for)."""
        batch, arrays = self.batch_arrays(groups, self.plan)
        self.state, metrics = self._train_step(
            self.state, self._step_input(arrays), self.ref_params
        )
        return batch, metrics

    def stop_while_waiting(self) -> Callable[[], bool] | None:
        """What a wait for rollouts asks to end early: this process's SIGTERM flag (one
        process; with several, every process stops together at a step boundary)."""
        return None if self.multi_process else self._sigterm.is_set

    def _step_input(self, arrays: dict[str, np.ndarray] | None) -> dict[str, jax.Array]:
        """The step's batch on the mesh. With several processes, process 0's arrays (None on
        the others) are broadcast first: a collective, called by every process."""
        if not self.multi_process:
            return _to_device(arrays)
        arrays = distributed.broadcast_batch(arrays if self.leader else None)
        return distributed.global_batch(arrays, self._batch_sharding)

    def _push_weights(self) -> None:
        """Serve the current weights on the inference host (process 0's). With several
        processes they are gathered to process 0 first: a collective, called by every process."""
        params = self.state.params
        if self.multi_process:
            params = distributed.gather_params(params)
        if self.leader and self.host is not None:  # None: a replay, nothing to serve
            version = int(self.state.step)
            # A pool of remote hosts copies the weights and returns; they travel meanwhile.
            self.host.update_weights(params, version)
            self._release_replaced_weights(version)

    def _release_replaced_weights(self, version: int) -> None:
        """Hands an in-process host's previous copy of the weights back to the OS before the
        next train step allocates its temporaries.

        The host frees that copy when the new weights start serving (its next decode step
        under the in-flight policies), but glibc keeps the freed pages until the heap trimmer
        comes by, up to `system.trim_heap_every_s` later: by then the next step's temporaries
        are resident too, and the run's peak holds both (docs/performance.md). So wait for
        the swap, briefly, and trim. Under "drain" the swap waits for older requests to
        finish: nothing to wait for here.
        """
        if (
            self._trimmer is None
            or not self.host.in_process
            or self.host.update_policy == "drain"
            or not self.schedule.releases_replaced_weights
        ):
            return
        if self.host.wait_serving(version, timeout=SWAP_WAIT_S):
            heap.trim()

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self, step: int, *, force: bool = False) -> None:
        if self.checkpoints is None:
            return
        holds = self.leader and self.schedule.holds_groups
        hold = holds and (force or self.checkpoints.should_save(step))
        if hold:
            self._settle_in_flight(step)
            state, held = self.workers.snapshot(hold=True)
            # Before the save starts: a committed step always has its groups.
            write_held_groups(self.checkpoints, step, held, trainer_version=int(self.state.step))
        else:
            state = self.workers.state()
        extra = {**state, "skipped_steps": self.book.skipped_steps}
        saved = save_train_state(self.checkpoints, step, self.state, extra=extra, force=force)
        if hold:
            prune_held_groups(self.checkpoints, keep=step)  # (orbax dropped old steps)
        if saved and not self.checkpoints.async_save and self._trimmer is not None:
            heap.trim()  # the write's buffers, before the next step's temporaries

    def _settle_in_flight(self, step: int) -> None:
        """Lets the groups in flight that a resume could not regenerate exactly complete
        (`RolloutWorkers.settle`); the uninterrupted run does the same at the same step, so
        both go on alike. A stop request ends the wait: those groups are then re-issued on
        resume, with the saved weights."""
        timeout = self.cfg.system.rollout_timeout_s
        try:
            settled = self.workers.settle(
                older_than=self.schedule.settle_older_than(int(self.state.step)),
                timeout=timeout,
                interrupted=self.stop_while_waiting(),
            )
        except RolloutTimeout as err:
            raise RolloutTimeout(
                f"checkpoint of step {step}: the groups in flight from older weights did not "
                f"complete within system.rollout_timeout_s={timeout}s: {err}"
            ) from err
        if not settled:
            log.warning(
                "%s: saving step %d without waiting for the groups in flight (a resume "
                "regenerates them with the saved weights)",
                signal_name(self._sigterm.signum),
                step,
            )

    def _resume(self) -> int:
        """Restore the newest complete checkpoint; returns the step to continue from."""
        if self.checkpoints is None or self.checkpoints.latest_step() is None:
            log.info("no checkpoint in %s: starting fresh", self.run_dir / "checkpoints")
            return 0
        self.state, extra, step = restore_train_state(self.checkpoints, self.state)
        if self.ledger is not None:  # voids the ledger's events after this checkpoint
            self.ledger.resume(step, version=int(extra["version"]))
        held_ids = extra.get("held_groups")
        if held_ids:  # complete groups saved with the checkpoint: back as they were
            held = read_held_groups(self.checkpoints, step, held_ids)
            self.workers.restore(extra, version=int(extra["version"]), held=held)
        else:
            self.workers.restore(extra, version=int(extra["version"]))
        self.book.resumed(int(extra.get("skipped_steps", 0)))
        # The host must serve the resumed weights before it generates anything.
        self._push_weights()
        log.info("resumed from step %d (version %d)", step, extra["version"])
        return step

    def run(self, *, resume: bool = False) -> dict[str, Any]:
        """Train for ``cfg.steps`` steps (from the last checkpoint with ``resume``).

        Returns the last step's metrics.
        """
        if not resume and self.checkpoints is not None and self.checkpoints.latest_step():
            self.close()
            raise FileExistsError(
                f"{self.run_dir} already has checkpoints (newest step "
                f"{self.checkpoints.latest_step()}): pass --resume to continue that run, or "
                "choose a new run_dir=... (nothing was overwritten)"
            )
        try:
            start = self._begin(resume)
        except BaseException:  # a write that failed, a resume that could not: no threads left
            self.close()
            raise
        if not self.leader:
            return self._follow(start)
        logger = MetricsLogger(self.run_dir, console=False, purge_step=start + 1 if start else None)
        progress = ProgressBar(self.cfg.steps, initial=start) if self.console else None
        self.workers.start()
        record: dict[str, Any] = {}
        try:
            if start == 0 and self.cfg.evaluates:
                # Before training, while the first groups generate beside it; a resumed run
                # (start > 0) has this record already.
                start_eval = logger.log(0, self._evaluate_now())
                if progress is not None:
                    progress.write(evaluation_line(0, start_eval))
            for step in range(start, self.cfg.steps):
                try:
                    record = self._one_step(step)
                except WaitInterrupted:  # SIGTERM while no batch came (e.g. every host down)
                    self._stop_before(step)
                    break
                if self._evaluation_due(step + 1):
                    record.update(self._evaluate_now())
                logger.log(step + 1, record)
                if progress is not None:
                    progress.update(step + 1, {k: record[k] for k in CONSOLE_KEYS if k in record})
                if self.on_step is not None:
                    self.on_step(step + 1, record)
                if self._stop_requested():  # SIGTERM here or on another process
                    log.warning(
                        "%s: saving a checkpoint at step %d and stopping",
                        signal_name(self._sigterm.signum),
                        step + 1,
                    )
                    self._checkpoint(step + 1, force=True)
                    break
                is_last = step + 1 == self.cfg.steps
                self._checkpoint(step + 1, force=is_last)
                if self._sigterm.is_set() and not self.multi_process:
                    # Asked during the save: stop now, not a step later (several processes
                    # vote once per step, above).
                    self._stop_before(step + 1, during="while saving a checkpoint")
                    break
                self.workers.notify_version(int(self.state.step))
        finally:
            if progress is not None:
                progress.close()
            logger.close()
            self.close()
        return record

    def _evaluation_due(self, step: int) -> bool:
        """Whether step ``step`` (1-based) ends with an evaluation: every ``eval_every``
        steps, and after the last step of an evaluating run (once: a resumed run that has
        nothing left to train does not evaluate again)."""
        cfg = self.cfg
        if not cfg.evaluates:
            return False
        return step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)

    def _begin(self, resume: bool) -> int:
        """The run's config.json and ledger, the resumed state; returns the first step."""
        # Written only once the run is accepted: a refused run leaves the old config, which
        # evaluation rebuilds the run's model from.
        if self.leader:
            path = self.run_dir / "config.json"
            try:
                path.write_text(json.dumps(self.cfg.to_dict(), indent=2))
            except OSError as err:  # a failed write() does not say which file
                raise OSError(err.errno, err.strerror, str(path)) from err
        self._open_ledger()
        start = self._resume() if resume else 0
        if start == 0 and self.ledger is not None:
            # What scores the completions (name@version): the ledger keeps it per run.
            self.ledger.start(seed=self.cfg.seed, scorer=self.workers.scorer)
        in_process = self.host is not None and self.host.in_process
        if start == 0 and (self.multi_process or not in_process):
            # A host in another process starts with weights of its own: serve ours before
            # generating. (With several processes every process takes part.)
            self._push_weights()
        return start

    @property
    def stop_signal(self) -> str | None:
        """The signal that asked this run to stop early (``"SIGTERM"``, ``"SIGINT"``), or
        None."""
        return signal_name(self._sigterm.signum) if self._sigterm.is_set() else None

    def _stop_before(self, step: int, *, during: str = "while waiting for rollouts") -> None:
        """SIGTERM while step ``step + 1`` waited for its rollouts (or step ``step`` was
        being saved): the state is that of the ``step`` steps done, so save it (unless it is
        saved already, or nothing was trained) and stop; ``--resume`` re-issues the groups
        still pending."""
        what = f"{signal_name(self._sigterm.signum)} {during}"
        if self.checkpoints is not None:
            self.checkpoints.wait_until_finished()  # an asynchronous save counts once on disk
        if self.checkpoints is None:
            log.warning("%s: stopping (checkpoint_every=0: no checkpoint)", what)
        elif step == 0:
            log.warning("%s: stopping before any step trained (no checkpoint to make)", what)
        elif self.checkpoints.latest_step() == step:
            log.warning("%s: step %d is saved; stopping", what, step)
        else:
            log.warning("%s: saving step %d and stopping", what, step)
            self._checkpoint(step, force=True)

    def _open_ledger(self) -> None:
        """The run's prompt ledger (``run_dir/ledger.jsonl``, process 0, rollout workers
        only): admissions, trained groups, drops, checkpoints, resumes
        (:mod:`a3po_jax.rollout.ledger`)."""
        if self._live_source and self.ledger is None:
            self.ledger = Ledger(ledger_path(self.run_dir))
            self.workers.ledger = self.ledger

    def _stop_requested(self) -> bool:
        """SIGTERM here, or (with several processes) on any process: all stop together."""
        if not self.multi_process:
            return self._sigterm.is_set()
        return distributed.sync_stop(self._sigterm.is_set())

    def _follow(self, start: int) -> dict[str, Any]:
        """Every process but 0: :func:`a3po_jax.training.follower.follow_leader`."""

        def train_step() -> bool:
            self.state, metrics = self._train_step(
                self.state, self._step_input(None), self.ref_params
            )
            return bool(jax.device_get(metrics["step/skipped"]))

        try:
            follow_leader(
                range(start, self.cfg.steps),
                train_step=train_step,
                push_weights=self._push_weights,
                stop_requested=self._stop_requested,
                checkpoint=self._checkpoint,
            )
        finally:
            self.close()
        return {}

    def _evaluate_now(self) -> dict[str, float]:
        """``eval/*`` of the current weights (the version the host serves after the push)."""
        return self._evaluate(self.state.params, int(self.state.step))

    def _one_step(self, step: int) -> dict[str, Any]:
        timings: dict[str, float] = {}
        version = int(self.state.step)
        t_step = time.perf_counter()
        self.workers.raise_if_failed()
        trained = self.schedule.train(version, timings)
        if trained is None:  # every slot left empty (dynamic sampling): nothing to train
            return self.book.empty_step(step, version, timings, t_step)
        groups, batch, metrics = trained
        self.book.say_if_short(step, groups)
        skipped = bool(metrics["step/skipped"])
        # The ledger's train (or nonfinite_step drop) events, one per group, at this step.
        self.workers.consumed(groups, step=step + 1, version=version, skipped=skipped)
        if self.recorder is not None:  # the groups in consumption (periodic: fold) order
            self.recorder.write(step + 1, groups, trainer_version=version)
        if skipped:
            self.book.nonfinite(batch, metrics)
        else:
            self.book.trained()
            self.schedule.before_push(version, timings)
            t0 = time.perf_counter()
            self._push_weights()
            timings["time/weight_push_s"] = time.perf_counter() - t0
        timings["time/step_s"] = time.perf_counter() - t_step
        return self.book.record(
            self.host, batch, groups, version, int(self.state.step), metrics, timings
        )

    def close(self) -> None:
        """Stop the threads, and the host if this trainer started it."""
        self.workers.close("trainer finished")
        if self.ledger is not None:
            self.ledger.close()
        if self.checkpoints is not None:
            self.checkpoints.wait_until_finished()
        if self._own_host:
            self.host.close()
        if self._local_host is not None:
            self._local_host.close()
            self._local_host = None
        self._evaluate.close()
        if self._trimmer is not None:
            self._trimmer.close()
            self._trimmer = None
        if threading.current_thread() is threading.main_thread():  # (signal's rule)
            self._sigterm.uninstall()  # the handlers from before this trainer, back


def _to_device(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in arrays.items()}
