"""The asynchronous trainer loop: the host-side shell around the jitted train step.

Training layer (host-side shell).

The loop only (Tunix's ``rl_learner`` / AReaL's split): each step takes B whole groups
from the rollout workers, builds the batch, runs the jitted step, pushes the new weights
with their version, logs and checkpoints. The pieces around it live in their own modules:

* producer and collector threads: :mod:`a3po_jax.rollout.workers`;
* staleness admission and the staleness of trained tokens (in optimizer versions):
  :mod:`a3po_jax.rollout.admission`;
* checkpoint save/resume: :mod:`a3po_jax.training.checkpointing`;
* the per-step record: :func:`a3po_jax.training.metrics.step_record`;
* the loop of the other processes of a multi-process run: :mod:`a3po_jax.training.follower`.

The training mode only changes three knobs (design §4): the staleness bound η (in optimizer
versions, :func:`a3po_jax.training.config.staleness_bound`), the host's update
policy (``drain`` except for ``async``), and, for ``periodic``, that groups are folded into
the gradient one by one as they finish and one optimizer step is taken per iteration.

With several processes (``a3po_jax.parallel.distributed.initialize``), process 0 alone runs
the rollout workers, the inference host, logging and checkpoint metadata; every step it
broadcasts the batch, all processes run the jitted step over one global mesh, and the
weights are gathered to process 0 for the push.

Nothing here enters jit; everything jitted lives in ``train_step.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax.core import optim, placement
from a3po_jax.core import train_step as ts
from a3po_jax.core.batch_plan import AUTO, BatchPlan, make_batch
from a3po_jax.core.batching import TrainBatch
from a3po_jax.core.types import RolloutGroup
from a3po_jax.inference.host import InferenceHost
from a3po_jax.inference.protocol import Host
from a3po_jax.inference.types import SamplingParams
from a3po_jax.model.loader import LoadedModel, load_model
from a3po_jax.parallel import distributed, sharding
from a3po_jax.rollout import filters
from a3po_jax.rollout.ledger import Ledger, ledger_path
from a3po_jax.rollout.queue import RolloutQueue, RolloutTimeout, WaitInterrupted
from a3po_jax.rollout.workers import RolloutWorkers
from a3po_jax.tasks import PromptIterator, RewardConfig, make_task
from a3po_jax.training import heap, host_placement, recording, step_builder
from a3po_jax.training.checkpointing import (
    CheckpointManager,
    async_save_pays,
    prune_held_groups,
    read_held_groups,
    restore_train_state,
    save_train_state,
    write_held_groups,
)
from a3po_jax.training.config import TrainConfig
from a3po_jax.training.follower import follow_leader
from a3po_jax.training.metrics import MetricsLogger, ProgressBar, step_record
from a3po_jax.training.stopping import STOP_SIGNALS, install_sigterm_handler, signal_name

log = logging.getLogger(__name__)

# How long a weight push waits for the embedded host to start serving the new weights (a
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


# A model to train: its architecture, parameters and tokenizer (the loader's type).
Policy = LoadedModel


def load_policy(section) -> Policy:
    """The policy a :class:`a3po_jax.training.config.ModelSection` names, built by the one
    model loader (:func:`a3po_jax.model.loader.load_model`, which lists the names)."""
    return load_model(
        section.name,
        param_dtype=section.param_dtype,
        compute_dtype=section.compute_dtype,
        remat=section.remat,
        seed=section.seed,
    )


def refuse_unsupported(cfg: TrainConfig, *, processes: int, host: Any, replay_dir) -> None:
    """ValueError naming what this job cannot run: the single-process features in a
    multi-process job, a replay given a host or several processes, and dynamic sampling
    with a recording or a replay."""
    if processes > 1:
        single = (
            (cfg.system.mode == "periodic", "system.mode='periodic' (it folds groups in as they "
             "arrive)"),
            (cfg.evaluates, "evaluate / eval_every (process 0 would evaluate while the "
             "others wait in the next step's collective, which is not tested; set "
             "evaluate=false eval_every=0 and evaluate checkpoints with python -m "
             "a3po_jax.cli.evaluate --run-dir RUN_DIR --step N)"),
            (cfg.algo.kl_coef > 0 and cfg.algo.kl_in_reward, "algo.kl_in_reward=True (process "
             "0 scores the batch with the sharded params)"),
            (bool(cfg.system.inference_devices), "system.inference_devices (serve from hosts "
             "of their own: system.inference_hosts, scripts/launch.py)"),
            (cfg.rollout.dynamic_sampling, "rollout.dynamic_sampling=true (a step whose "
             "groups were all filtered takes no update on process 0 alone)"),
            (cfg.system.lockstep_decode_steps > 0, "system.lockstep_decode_steps (process 0 "
             "would decode while the others wait in the step's collective)"),
        )  # fmt: skip
        for on, what in single:
            if on:
                raise ValueError(
                    f"{what} runs in one process so far; this job has {processes} processes"
                )
    if cfg.rollout.dynamic_sampling and (cfg.system.record_rollouts or replay_dir is not None):
        raise ValueError(
            "rollout.dynamic_sampling=true makes short and empty steps, which a recording "
            "cannot replay yet: set system.record_rollouts=false (and do not --replay)"
        )
    if replay_dir is not None and (host is not None or processes > 1):
        raise ValueError(
            "a replay runs in one process without an inference host (it reads the groups "
            f"recorded in {replay_dir})"
        )


def sampling_params(rollout, tokenizer: Any) -> SamplingParams:
    """The rollout section's sampling settings, stopping at the tokenizer's end token."""
    eos = tokenizer.eos_token_id
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        stop_tokens=() if eos is None else (int(eos),),
    )


def check_host_settings(host: Host, cfg) -> None:
    """A host started elsewhere has its update policy and batch invariance fixed: refuse a
    mismatch now rather than train on samples that span versions in a mode that forbids it,
    or call a run reproducible whose host is not."""
    system = cfg.system
    stats = host.stats()
    want = system.effective_update_policy
    got = stats.get("update_policy", want)
    if got != want:
        raise ValueError(
            f"system.mode={system.mode!r} needs inference hosts with update policy {want!r}, "
            f"but the host runs {got!r} (start it with --update-policy {want})"
        )
    if cfg.rollout.batch_invariant and not stats.get("batch_invariant", False):
        raise ValueError(
            "rollout.batch_invariant=true needs batch-invariant inference hosts, but the host "
            "is not (start it with --batch-invariant)"
        )


class Trainer:
    """Runs one configured RL run against an inference host.

    Args:
      cfg: the run's configuration (validated).
      policy: model config, initial params and tokenizer.
      host: an inference host (:class:`a3po_jax.inference.protocol.Host`: the in-process
        host, a gRPC client or a pool of them); if None an embedded in-process host is
        started (closed by :meth:`close`).
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
        self.policy = policy  # its params are dropped once the state and the host hold copies
        # Process 0 talks to the inference hosts; the others only run the step with it.
        self.leader = distributed.is_coordinator()
        self.multi_process = jax.process_count() > 1
        self.replay_dir = None if replay_dir is None else Path(replay_dir)
        refuse_unsupported(
            cfg, processes=jax.process_count(), host=host, replay_dir=self.replay_dir
        )
        self.mode = cfg.system.mode
        self.num_minibatches = cfg.algo.num_minibatches
        # Staleness in optimizer versions: k minibatches per batch, k versions per step.
        self.eta = cfg.staleness_bound
        self.group_size = cfg.rollout.group_size
        self.batch_groups = cfg.rollout.groups_per_step
        # Deterministic asynchrony: this thread drives the embedded host (`_lockstep_batch`).
        self.lockstep = cfg.system.lockstep_decode_steps > 0 and replay_dir is None
        if self.lockstep and host is not None:
            raise ValueError(
                "system.lockstep_decode_steps drives a host this trainer starts (embedded), "
                "not one it is given: set system.lockstep_decode_steps=0"
            )
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.task = task if task is not None else make_task(cfg.task.name, **cfg.task.kwargs)
        self.sampling = sampling_params(cfg.rollout, policy.tokenizer)

        # Training state first: a mesh or batch that does not fit fails before a host starts.
        self._build_train_state(policy)
        # A host this trainer starts (and closes): embedded, or a local process.
        self._own_host = host is None and self.leader and self.replay_dir is None
        self._local_host = None
        if self._own_host:
            host = self._start_host(policy.params)
        elif self.leader and host is not None:
            check_host_settings(host, cfg)
        self.host = host
        self._embedded = isinstance(host, InferenceHost)
        # The state and the embedded host hold copies of the initial params; the trainer keeps
        # only the policy's config and tokenizer, so a caller that drops its own reference
        # (the CLI does) frees one whole copy of the weights.
        self.policy = dataclasses.replace(policy, params=None)
        # The held-out evaluation runs on the run's host (the rollout workers' side channel);
        # only a replay, which has none, builds one for it (at its first evaluation).
        self._replay_eval_host = None

        self.workers = self._rollout_source(host, policy.tokenizer)
        self.recorder = self._recorder()
        self._nonfinite_in_a_row = 0
        self.skipped_steps = 0
        # Per step (dynamic sampling, overlong filter): samples masked, queue counts seen.
        self._overlong_masked = 0
        self._filter_counts_seen = {"filtered_groups": 0, "refilled_groups": 0}
        self.ledger: Ledger | None = None  # opened by run() once the run is accepted
        # SIGTERM or SIGINT: save and stop at the next step boundary; a second one: exit now.
        self._sigterm = install_sigterm_handler(signals=STOP_SIGNALS, exit_on_second=True)
        self.checkpoints = self._checkpoint_manager()
        # Freed heap pages back to the OS while the run goes on (training/heap.py).
        every = cfg.system.trim_heap_every_s
        self._trimmer = heap.Trimmer(every) if every > 0 else None

    # ------------------------------------------------------------------ construction

    def _build_train_state(self, policy: Policy) -> None:
        """The meshes (the host's too, with split devices: host_placement.py), the algorithm
        with its batch plan, the optimizer, the placed train state, the frozen reference and
        the jitted step."""
        cfg = self.cfg
        self.mesh, self._host_mesh = host_placement.meshes(cfg.system)
        # The algorithm is resolved from its tables here, once, with the batch plan (its
        # packing for this mesh).
        shards = sharding.batch_shards(self.mesh)
        self.algo = step_builder.algorithm(cfg, policy.config, batch_shards=shards)
        if cfg.system.packed_prompts == AUTO and self.leader:
            why = BatchPlan.packing_refusal(cfg, batch_shards=shards)
            log.info(
                "system.packed_prompts=auto: %s",
                "packed rows" if self.plan.packed else f"padded rows, since {why}",
            )
        self.optimizer = step_builder.optimizer(cfg)
        self.state = placement.place_train_state(policy.params, self.optimizer, self.mesh)
        # The reference is the initial policy, frozen (a copy: the state's buffers are donated).
        self.ref_params = (
            jax.tree.map(jnp.copy, self.state.params) if self.algo.keeps_reference else None
        )
        self._build_jitted()

    def _rollout_source(self, host: Host | None, tokenizer: Any):
        """Where batches come from: the rollout threads over `host`, or, in a replay, the
        recorded groups step by step in place of the threads and the host."""
        cfg = self.cfg
        if self.replay_dir is not None:
            return recording.ReplaySource(
                self.replay_dir, group_size=self.group_size, batch_groups=self.batch_groups
            )
        prompts = self.task.prompts(cfg.task.split)
        if not prompts:
            raise ValueError(f"task {cfg.task.name!r} has no prompts in split {cfg.task.split!r}")
        return RolloutWorkers(
            host=host,
            task=self.task,
            tokenizer=tokenizer,
            prompts=PromptIterator(prompts, batch_size=1, seed=cfg.seed),
            sampling=self.sampling,
            reward_config=RewardConfig(
                format_reward=cfg.task.format_reward, no_eos_penalty=cfg.task.no_eos_penalty
            ),
            group_size=self.group_size,
            batch_groups=self.batch_groups,
            max_staleness=self.eta,
            versions_per_batch=self.num_minibatches,
            seed=cfg.seed,
            consume_order=cfg.system.consume_order,
            dynamic_sampling=cfg.rollout.dynamic_sampling,
            max_extra_groups=cfg.rollout.extra_groups_budget,
            lockstep=self.lockstep,
        )

    def _recorder(self) -> recording.RolloutRecorder | None:
        """The recorder of consumed batches (``system.record_rollouts``); warns where the
        recording or a replay cannot be reproduced exactly."""
        recorder = (
            recording.RolloutRecorder(self.run_dir)
            if self.cfg.system.record_rollouts and self.leader
            else None
        )
        if recorder is not None or self.replay_dir is not None:
            reason = recording.nondeterminism_warning(
                jax.default_backend(), os.environ.get("XLA_FLAGS", "")
            )
            if reason:
                log.warning(reason)
        return recorder

    def _checkpoint_manager(self) -> CheckpointManager | None:
        if not self.cfg.checkpoint_every:
            return None
        return CheckpointManager(
            self.run_dir / "checkpoints",
            save_interval_steps=self.cfg.checkpoint_every,
            async_save=async_save_pays(self.mesh.devices.flat),
        )

    # ------------------------------------------------------------------ jitted pieces

    @property
    def plan(self) -> BatchPlan:
        """The batch plan the algorithm was built with (rows, minibatches, packing)."""
        return self.algo.plan

    def _build_jitted(self) -> None:
        from a3po_jax.parallel.sharding import TRAIN_RULES, check_batch_divisible

        # Each micro-batch splits evenly over the mesh (packed arrays lead with packed rows).
        check_batch_divisible(self.plan.leading_rows_per_micro_batch, self.mesh, TRAIN_RULES)
        self._batch_sharding = placement.batch_shardings(self.mesh, self.plan.leading_rows)
        self._train_step = placement.jit_train_step(
            self.state,
            self.mesh,
            algo=self.algo,
            optimizer=self.optimizer,
            grad_clip=self.cfg.optim.grad_clip,
            with_reference=self.ref_params is not None,
        )
        # Periodic mode: fold each arriving group into the gradient, one update at the end.
        self._fold_group = jax.jit(functools.partial(ts.fold_group, algo=self.algo))
        self._apply_folded = jax.jit(
            functools.partial(
                ts.apply_accumulated,
                optimizer=self.optimizer,
                grad_clip=self.cfg.optim.grad_clip,
            ),
            donate_argnums=(0,),
        )
        self._kl_in_reward = None
        if self.algo.kl_in_reward is not None:
            self._kl_in_reward = jax.jit(functools.partial(ts.kl_in_reward, algo=self.algo))

    @property
    def queue(self) -> RolloutQueue:
        """The rollout queue (counters, invariant checks)."""
        return self.workers.queue

    # ------------------------------------------------------------------ batches

    def _batch_from_groups(
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
        self._overlong_masked += masked["overlong_masked"]
        return batch, arrays

    def _lockstep_batch(self, version: int) -> list[RolloutGroup]:
        """Lockstep: the step's batch, driving the host one decode step at a time until it
        is there; `WaitInterrupted` on SIGTERM."""
        stop = self._stop_while_waiting()
        while True:
            try:
                return self.workers.get_batch(self.batch_groups, trainer_version=version, timeout=0)
            except RolloutTimeout:
                pass
            if stop is not None and stop():
                raise WaitInterrupted("stop requested while generating the batch")
            if not self.workers.drive():
                try:  # a sample filed by the last iteration may have completed it
                    return self.workers.get_batch(
                        self.batch_groups, trainer_version=version, timeout=0
                    )
                except RolloutTimeout:
                    raise RuntimeError(
                        "lockstep: the host has nothing left to generate and the batch is "
                        "not complete (groups lost?)"
                    ) from None

    def _train_on(self, groups: list[RolloutGroup], version: int) -> tuple[TrainBatch, dict]:
        batch, arrays = self._batch_from_groups(groups, self.plan)
        self.state, metrics = self._train_step(
            self.state, self._step_input(arrays), self.ref_params
        )
        return batch, metrics

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
            if self._embedded:
                self._release_replaced_weights(version)

    def _release_replaced_weights(self, version: int) -> None:
        """Hands the embedded host's previous copy of the weights back to the OS before the
        next train step allocates its temporaries.

        The host frees that copy when the new weights start serving (its next decode step
        under the in-flight policies), but glibc keeps the freed pages until the heap trimmer
        comes by, up to `system.trim_heap_every_s` later: by then the next step's temporaries
        are resident too, and the run's peak holds both (docs/performance.md). So wait for
        the swap, briefly, and trim. Under "drain" the swap waits for older requests to
        finish: nothing to wait for here.
        """
        if self._trimmer is None or self.host.update_policy == "drain" or self.lockstep:
            return  # (lockstep: the swap comes with the next decode step this thread runs)
        if self.host.wait_serving(version, timeout=SWAP_WAIT_S):
            heap.trim()

    def _train_periodic(self, version: int, timings: dict) -> tuple[list, TrainBatch, dict]:
        """Periodic Asynchrony: consume groups as they finish, fold each into the gradient,
        then one optimizer step. Same update as ``sync`` up to summation order."""
        params = self.state.params
        folded = None
        groups: list[RolloutGroup] = []
        wait = 0.0
        fold = self.plan.fold  # one group per row and per batch
        for i in range(self.batch_groups):
            t0 = time.perf_counter()
            # A stop is taken before the iteration's first group only: one taken is folded.
            taken = self.queue.get_batch(
                1,
                trainer_version=version,
                timeout=self.cfg.system.rollout_timeout_s,
                interrupted=self._stop_while_waiting() if i == 0 else None,
            )
            wait += time.perf_counter() - t0
            if not taken:  # a slot left empty (dynamic sampling)
                continue
            (group,) = taken
            groups.append(group)
            _, arrays = self._batch_from_groups([group], fold)
            mbs = ts.split_micro_batches(_to_device(arrays), fold.micro_batches)
            # The prox rule's old pass and the reference pass run inside the fold.
            acc = self._fold_group(params, self.ref_params, mbs, jnp.int32(version))
            folded = acc if folded is None else optim.add_accumulated(folded, acc)
        timings["time/wait_rollouts_s"] = wait
        if folded is None:  # every slot left empty: nothing to apply
            return None, None, None
        self.state, metrics = self._apply_folded(self.state, folded)
        merged, _ = make_batch(groups, dataclasses.replace(self.plan.padded, groups=len(groups)))
        filters.mask_rows(  # the metrics' staleness counts the trained tokens only
            merged,
            {},
            groups,
            overlong_filter=self.cfg.rollout.overlong_filter,
            dpo_pairs=self.plan.layout.pairs,
        )
        return groups, merged, metrics

    # ------------------------------------------------------------------ checkpoints

    @property
    def _holds_groups(self) -> bool:
        """Whether checkpoints save the complete untrained groups beside them: the modes
        whose groups in flight at a save a resume could not regenerate exactly (generated
        by older weights in one_step_off; by several versions in lockstep async)."""
        return (
            self.leader
            and isinstance(self.workers, RolloutWorkers)
            and (self.mode == "one_step_off" or self.lockstep)
        )

    def _checkpoint(self, step: int, *, force: bool = False) -> None:
        if self.checkpoints is None:
            return
        hold = self._holds_groups and (force or self.checkpoints.should_save(step))
        if hold:
            self._settle_in_flight(step)
            state, held = self.workers.snapshot(hold=True)
            # Before the save starts: a committed step always has its groups.
            write_held_groups(self.checkpoints, step, held, trainer_version=int(self.state.step))
        else:
            state = self.workers.state()
        extra = {**state, "skipped_steps": self.skipped_steps}
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
                older_than=None if self.lockstep else int(self.state.step),
                timeout=timeout,
                interrupted=self._stop_while_waiting(),
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
        counters = self.queue.counters()  # the per-step rollout/* count from here on
        self._filter_counts_seen = {k: int(counters.get(k, 0)) for k in self._filter_counts_seen}
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        # The host must serve the resumed weights before it generates anything.
        self._push_weights()
        log.info("resumed from step %d (version %d)", step, extra["version"])
        return step

    # ------------------------------------------------------------------ main loop

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
                start_eval = logger.log(0, self._evaluate(int(self.state.step)))
                if progress is not None:
                    progress.write(evaluation_line(0, start_eval))
            for step in range(start, self.cfg.steps):
                try:
                    record = self._one_step(step)
                except WaitInterrupted:  # SIGTERM while no batch came (e.g. every host down)
                    self._stop_before(step)
                    break
                if self._evaluation_due(step + 1):
                    record.update(self._evaluate(int(self.state.step)))
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
            self.ledger.start(seed=self.cfg.seed)
        if start == 0 and (self.multi_process or not self._embedded):
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
        if self.leader and isinstance(self.workers, RolloutWorkers) and self.ledger is None:
            self.ledger = Ledger(ledger_path(self.run_dir))
            self.workers.ledger = self.ledger

    def _stop_while_waiting(self) -> Callable[[], bool] | None:
        """What a wait for rollouts asks to end early: this process's SIGTERM flag (one
        process; with several, every process stops together at a step boundary)."""
        return None if self.multi_process else self._sigterm.is_set

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

    def _one_step(self, step: int) -> dict[str, Any]:
        timings: dict[str, float] = {}
        version = int(self.state.step)
        t_step = time.perf_counter()
        self.workers.raise_if_failed()
        if self.mode == "periodic":
            t0 = time.perf_counter()
            groups, batch, metrics = self._train_periodic(version, timings)
            metrics = jax.device_get(metrics)
            timings["time/train_s"] = time.perf_counter() - t0 - timings["time/wait_rollouts_s"]
        else:
            t0 = time.perf_counter()
            if self.lockstep:
                groups = self._lockstep_batch(version)
            else:
                groups = self.workers.get_batch(
                    self.batch_groups,
                    trainer_version=version,
                    timeout=self.cfg.system.rollout_timeout_s,
                    interrupted=self._stop_while_waiting(),
                )
            timings["time/wait_rollouts_s"] = time.perf_counter() - t0
            if not groups:  # every slot left empty (dynamic sampling): nothing to train
                return self._empty_step(step, version, timings, t_step)
            t0 = time.perf_counter()
            batch, metrics = self._train_on(groups, version)
            # Lockstep: the host's decode steps while the step (dispatched) runs.
            for _ in range(self.cfg.system.lockstep_decode_steps if self.lockstep else 0):
                self.workers.drive()
            metrics = jax.device_get(metrics)  # blocks until the step is done
            timings["time/train_s"] = time.perf_counter() - t0
        if groups is None:  # periodic: every slot left empty
            return self._empty_step(step, version, timings, t_step)
        self._say_if_short(step, groups)
        skipped = bool(metrics["step/skipped"])
        # The ledger's train (or nonfinite_step drop) events, one per group, at this step.
        self.workers.consumed(groups, step=step + 1, version=version, skipped=skipped)

        if self.recorder is not None:  # the groups in consumption (periodic: fold) order
            self.recorder.write(step + 1, groups, trainer_version=version)
        if skipped:
            self._on_nonfinite(batch, metrics)
        else:
            self._nonfinite_in_a_row = 0
            if self.mode == "one_step_off":
                t0 = time.perf_counter()
                self._keep_one_step_off(version)
                timings["time/one_step_off_wait_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self._push_weights()
            timings["time/weight_push_s"] = time.perf_counter() - t0
        timings["time/step_s"] = time.perf_counter() - t_step
        return self._record(batch, groups, version, metrics, timings)

    def _keep_one_step_off(self, version: int) -> None:
        """Before version + 1 is pushed: every group admitted at ``version`` has reached the
        host, and the host serves ``version``. Then, under "drain", each of those groups is
        generated by ``version`` exactly, whatever the threads' timing: a request submitted
        after the push would get the newer weights, and a push that finds ``version`` still
        staged replaces it for every request submitted since (`InferenceHost.update_weights`).
        Both waits are short: the producer only submits, and the requests older than
        ``version`` are the batch this step just trained."""
        if not isinstance(self.workers, RolloutWorkers) or self.lockstep:
            return  # (a follower process or a replay has no producer)
        timeout = self.cfg.system.rollout_timeout_s
        self.workers.wait_submitted(timeout=timeout)
        wait_serving = getattr(self.host, "wait_serving", None)  # remote hosts: no such wait
        if wait_serving is not None and not wait_serving(version, timeout=timeout):
            log.warning(
                "version %d did not start serving within system.rollout_timeout_s=%ss: "
                "pushing version %d anyway (groups submitted since get the newer weights)",
                version,
                timeout,
                version + 1,
            )

    def _say_if_short(self, step: int, groups: list[RolloutGroup]) -> None:
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

    def _empty_step(
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
        counters = self.queue.counters()
        return {
            **timings,
            "version": int(self.state.step),
            "step/skipped": 1.0,
            "step/skipped_total": self.skipped_steps,
            **self._filter_metrics([], counters),
            **{f"queue/{k}": v for k, v in counters.items() if not isinstance(v, dict)},
        }

    def _filter_metrics(
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
        metrics["rollout/overlong_masked"] = float(self._overlong_masked)
        self._overlong_masked = 0
        return metrics

    def _on_nonfinite(self, batch: TrainBatch, metrics: dict) -> None:
        self.skipped_steps += 1
        self._nonfinite_in_a_row += 1
        # The batch is thrown away: give its admissions back (every slot, empty ones too)
        # so the producer can refill.
        self.workers.discard(self.batch_groups)
        log.warning(
            "non-finite loss/gradient (loss %s, grad norm %s): update skipped; prompts %s",
            metrics.get("loss/total"),
            metrics.get("optim/grad_norm"),
            sorted(set(batch.prompt_ids)),
        )
        if self._nonfinite_in_a_row >= self.cfg.system.max_nonfinite_steps:
            raise FloatingPointError(
                f"{self._nonfinite_in_a_row} non-finite steps in a row "
                f"(system.max_nonfinite_steps={self.cfg.system.max_nonfinite_steps}); "
                f"last prompts: {sorted(set(batch.prompt_ids))}"
            )

    def _record(self, batch, groups, version, metrics, timings) -> dict[str, Any]:
        replay = self.host is None
        queue_counters = self.queue.counters()
        record = step_record(
            groups=groups,
            batch=batch,
            start_version=version,
            num_minibatches=self.num_minibatches,
            step_metrics=metrics,
            timings=timings,
            version=int(self.state.step),
            host_stats={} if replay else self.host.stats(),
            counters={"queue": queue_counters}
            if replay
            else {"queue": queue_counters, "hosts": self.host.counters()},
            skipped_total=self.skipped_steps,
        )
        if replay:  # no inference host: no host/* metrics rather than placeholders
            record = {k: v for k, v in record.items() if not k.startswith(recording.NOT_IN_REPLAY)}
        record.update(self._filter_metrics(groups, queue_counters))
        real = batch.group_ids >= 0  # a short batch's filler rows are not data
        record["reward/mean"] = float(np.mean(batch.rewards[real]))
        return record

    def close(self) -> None:
        """Stop the threads, and the embedded host if this trainer started it."""
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
        if self._replay_eval_host is not None:
            self._replay_eval_host.close()
            self._replay_eval_host = None
        if self._trimmer is not None:
            self._trimmer.close()
            self._trimmer = None
        if threading.current_thread() is threading.main_thread():  # (signal's rule)
            self._sigterm.uninstall()  # the handlers from before this trainer, back

    def _start_host(self, params: Any) -> Host:
        """The run's own inference host, placed as ``system`` says (`host_placement.py`): a local
        host process on cores of its own behind a pool, or an embedded host."""
        system, rollout = self.cfg.system, self.cfg.rollout
        if system.inference_cores:
            host_placement.pin_trainer(system.inference_cores)  # the CLI did, before JAX started
            self._local_host = host_placement.start_local_host(
                self.cfg,
                num_slots=rollout.num_slots,
                prefill_buckets=tuple(rollout.prompt_buckets),
                max_cache_len=self.cfg.host_cache_len,
            )
            try:
                return host_placement.host_pool(
                    [self._local_host.address], self._local_host.token, system
                )
            except BaseException:
                self._local_host.close()
                raise
        return self._embedded_host(params, 0, system.effective_update_policy)

    def _embedded_host(self, params: Any, version: int, update_policy: str):
        """A started in-process inference host sized by the rollout settings."""
        rollout = self.cfg.rollout
        host = InferenceHost(
            self.policy.config,
            params,
            mesh=self._host_mesh,
            num_slots=rollout.num_slots,
            prefill_buckets=tuple(rollout.prompt_buckets),
            max_cache_len=self.cfg.host_cache_len,
            version=version,
            update_policy=update_policy,
            seed=0,
            batch_invariant=rollout.batch_invariant,
        )
        return host if self.lockstep else host.start()

    def _evaluate(self, version: int) -> dict[str, float]:
        """``eval/*`` metrics of the weights the host serves, version ``version``
        (:func:`evaluation_metrics`), and ``time/eval_s``.

        The requests go to the run's own host beside the training groups, through the
        rollout workers' side channel (the collector hands their results over): no second
        host and no second copy of the weights. The host serves ``version`` to them: under
        ``drain`` they wait for the requests of older versions, under the in-flight
        policies the staged weights swap in before anything submitted after the push starts.
        A replay has no host: it builds an embedded one, once, and pushes each version to it.
        """
        t0 = time.perf_counter()
        if self.host is None:
            if self._replay_eval_host is None:
                self._replay_eval_host = self._embedded_host(self.state.params, version, "drain")
            else:
                self._replay_eval_host.update_weights(self.state.params, version)
            channel = contextlib.nullcontext(self._replay_eval_host)
        else:
            channel = self.workers.side_channel()
        with channel as host:
            metrics = evaluation_metrics(
                host,
                self.task,
                self.policy.tokenizer,
                num_prompts=self.cfg.eval_prompts,
                max_new_tokens=self.cfg.eval_budget,
                stop_tokens=self.sampling.stop_tokens,
                seed=version,
                samples=self.cfg.eval_samples,
                temperature=self.cfg.rollout.temperature,
            )
        return {**metrics, "time/eval_s": time.perf_counter() - t0}


def evaluation_metrics(
    host: Host,
    task: Any,
    tokenizer: Any,
    *,
    num_prompts: int,
    max_new_tokens: int,
    stop_tokens: tuple[int, ...],
    seed: int,
    samples: int = 1,
    temperature: float = 1.0,
) -> dict[str, float]:
    """Greedy pass@1 of the weights ``host`` serves on the first ``num_prompts`` prompts
    (capped at the split's size) of the task's held-out split, as ``eval/*`` metrics with
    the 95 % interval (:func:`a3po_jax.analysis.evaluation.accuracy_interval`); with
    ``samples`` = k > 1 also mean@k and pass@k of k samples per prompt at ``temperature``
    (``eval/mean_at_k``, ``eval/pass_at_k``)."""
    from a3po_jax.analysis.evaluation import evaluate, host_generate_fn
    from a3po_jax.training.config import EVAL_SPLIT

    generate = host_generate_fn(host, stop_tokens=stop_tokens)
    common = dict(
        num_prompts=min(num_prompts, len(task.prompts(EVAL_SPLIT))),
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    greedy = evaluate(task, EVAL_SPLIT, generate, tokenizer, **common)
    low, high = greedy.interval
    metrics = {
        "eval/accuracy": greedy.accuracy,
        "eval/stderr": greedy.stderr,
        "eval/ci95_low": low,
        "eval/ci95_high": high,
        "eval/num_prompts": float(greedy.n),
        "eval/finished_frac": greedy.finished_fraction,
        "eval/completion_tokens": greedy.mean_completion_tokens,
    }
    if greedy.finished_fraction:  # undefined (NaN) when no answer finished: not logged
        metrics["eval/finished_accuracy"] = greedy.finished_accuracy
    if samples > 1:
        sampled = evaluate(
            task, EVAL_SPLIT, generate, tokenizer, k=samples, temperature=temperature, **common
        )
        low, high = sampled.interval
        metrics.update(
            {
                "eval/k": float(samples),
                "eval/mean_at_k": sampled.accuracy,
                "eval/mean_at_k_stderr": sampled.stderr,
                "eval/mean_at_k_ci95_low": low,
                "eval/mean_at_k_ci95_high": high,
                "eval/pass_at_k": sampled.pass_at_k,
            }
        )
    # Read after the samples came back: the version that generated them.
    metrics["eval/version"] = float(host.stats()["version"])
    return metrics


def evaluation_line(step: int, record: dict[str, Any]) -> str:
    """The console line of an evaluation: step, pass@1 with its 95 % interval (mean@k too
    where sampled), the number of held-out prompts and ``time/eval_s``."""
    line = (
        f"eval at step {step}: pass@1 {record['eval/accuracy']:.3f} "
        f"[{record['eval/ci95_low']:.3f}, {record['eval/ci95_high']:.3f}]"
    )
    if "eval/mean_at_k" in record:
        line += f", mean@{int(record['eval/k'])} {record['eval/mean_at_k']:.3f}"
    return (
        f"{line} on {int(record['eval/num_prompts'])} held-out prompts "
        f"({record['time/eval_s']:.0f} s)"
    )


def _to_device(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in arrays.items()}
