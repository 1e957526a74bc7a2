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
* checkpoint save/resume: :mod:`a3po_jax.training.run_checkpoints` (what a save holds) over
  :mod:`a3po_jax.training.checkpointing` (the files);
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

from a3po_jax.core import row_masks
from a3po_jax.core import train_step as ts
from a3po_jax.core.batch_plan import BatchPlan, ShapeRewards, StepBatch, make_batch
from a3po_jax.core.batching import TrainBatch
from a3po_jax.core.types import RolloutGroup
from a3po_jax.inference.protocol import Host
from a3po_jax.parallel import distributed
from a3po_jax.rollout.evaluation import HeldOutEvaluation, evaluation_line
from a3po_jax.rollout.ledger import Ledger, ledger_path
from a3po_jax.rollout.queue import RolloutQueue, WaitInterrupted
from a3po_jax.training import compilation, heap, host_placement, schedules
from a3po_jax.training.build import Policy, build_run, load_policy, refuse_unsupported
from a3po_jax.training.config import TrainConfig
from a3po_jax.training.follower import follow_leader
from a3po_jax.training.metrics import MetricsLogger, ProgressBar
from a3po_jax.training.run_checkpoints import RunCheckpoints
from a3po_jax.training.schedules.lockstep import Lockstep
from a3po_jax.training.schedules.replay import Replayed
from a3po_jax.training.step_book import StepBook
from a3po_jax.training.stopping import STOP_SIGNALS, install_sigterm_handler, signal_name
from a3po_jax.training.weight_push import WeightPush

__all__ = ["Policy", "Trainer", "load_policy", "refuse_unsupported"]

log = logging.getLogger(__name__)

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
      replay_dir: replay this recorded run (``system.run.record_rollouts``): the groups come from
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
        self._programs = compilation.ProgramBound(
            self._train_step, cfg.system.run.max_train_programs
        )
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
        # SIGTERM or SIGINT: save and stop at the next step boundary; a second one: exit now.
        self._sigterm = install_sigterm_handler(signals=STOP_SIGNALS, exit_on_second=True)
        self.book = StepBook(cfg, self.workers)
        self._push = WeightPush(
            self.host,
            leader=self.leader,
            multi_process=self.multi_process,
            releases_replaced_weights=self.schedule.releases_replaced_weights,
            trims=lambda: self._trimmer is not None,
        )
        self.saves = None
        if self.checkpoints is not None:
            self.saves = RunCheckpoints(
                self.checkpoints,
                workers=self.workers,
                schedule=self.schedule,
                book=self.book,
                leader=self.leader,
                rollout_timeout_s=cfg.system.hosts.rollout_timeout_s,
                interrupted=self.stop_while_waiting(),
                stop_signum=lambda: self._sigterm.signum,
                trim=self._trim_heap,
            )
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

    def step_batch(self, groups: list[RolloutGroup], plan: BatchPlan) -> StepBatch:
        """The final batch of ``groups`` in ``plan``'s layout, in one pass
        (:func:`a3po_jax.core.batch_plan.make_batch`): a short batch (dynamic sampling left
        slots empty) filled with masked filler copies, KL-in-reward's shaped rewards and
        advantages when the algorithm charges the KL to the reward, and with
        ``rollout.overlong_filter`` truncated samples masked.

        With ``system.batch.groups_per_row`` > 1 and one minibatch, packing reorders the groups to
        balance its rows, and the batch (advantages, versions, the metrics' staleness)
        follows that order."""
        made = make_batch(
            row_masks.fill_short_batch(groups, plan.groups),
            plan,
            overlong_filter=self.cfg.rollout.overlong_filter,
            shape_rewards=self._shape_rewards(),
        )
        self.book.overlong_masked += made.overlong_masked
        return made

    def _shape_rewards(self) -> ShapeRewards | None:
        """KL in the reward at the current weights: R_i ← R_i − β Σ_t KL_t and the
        advantages of those rewards (:func:`a3po_jax.core.train_step.kl_in_reward`)."""
        if self._kl_in_reward is None:
            return None
        params, ref = self.state.params, self.ref_params
        return lambda arrays, rewards: self._kl_in_reward(
            params, ref, _to_device(arrays), jnp.asarray(rewards)
        )

    def train_on(self, groups: list[RolloutGroup]) -> tuple[TrainBatch, dict]:
        """Dispatches the jitted step on the batch of ``groups`` (not waited for)."""
        made = self.step_batch(groups, self.plan)
        return made.batch, self._dispatch_step(made.arrays)

    def _dispatch_step(self, arrays: dict[str, np.ndarray] | None) -> dict:
        """The jitted step on ``arrays`` (None on processes other than 0), its compiled
        programs kept within ``system.run.max_train_programs``; returns its metrics."""
        arrays = self._step_input(arrays)
        self._programs(arrays)
        self.state, metrics = self._train_step(self.state, arrays, self.ref_params)
        return metrics

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
        """Serve the current weights with their version (:mod:`a3po_jax.training.weight_push`)."""
        self._push(self.state.params, int(self.state.step))

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self, step: int, *, force: bool = False) -> None:
        if self.saves is not None:
            self.saves.save(step, self.state, force=force)

    def _trim_heap(self) -> None:
        if self._trimmer is not None:
            heap.trim()

    def _resume(self) -> int:
        """Restore the newest complete checkpoint; returns the step to continue from."""
        if self.saves is None:
            log.info("no checkpoint in %s: starting fresh", self.run_dir / "checkpoints")
            return 0
        self.state, step = self.saves.resume(self.state, self.ledger)
        if step:  # the host must serve the resumed weights before it generates anything
            self._push_weights()
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
        if self.saves is None:
            log.warning("%s: stopping (checkpoint_every=0: no checkpoint)", what)
        else:
            self.saves.save_on_stop(step, self.state, what)

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
            metrics = self._dispatch_step(None)
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
