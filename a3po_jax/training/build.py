"""Everything a run is built from, built once: ``build_run(cfg, policy)``.

Training layer (host-side shell). The trainer (:mod:`a3po_jax.training.trainer`) is the
loop over what this module builds: the meshes, the algorithm with its batch plan, the
optimizer, the placed train state and frozen reference, the jitted step, the inference host
(placed by :mod:`a3po_jax.training.host_placement`), the rollout source (the rollout workers,
or a recording in a replay), the recorder, the checkpointer and the heap trimmer. A mesh or
batch that does not fit fails here, before a host starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from a3po_jax.core import placement
from a3po_jax.core.batch_plan import AUTO, BatchPlan
from a3po_jax.inference.protocol import Host
from a3po_jax.inference.types import SamplingParams
from a3po_jax.model.loader import LoadedModel, load_model
from a3po_jax.parallel import distributed, sharding
from a3po_jax.rollout.source import RolloutSource
from a3po_jax.rollout.workers import RolloutWorkers
from a3po_jax.tasks import PromptIterator, RewardConfig, make_task
from a3po_jax.tasks.scorers import Scorer, resolve_scorer
from a3po_jax.training import compilation, heap, host_placement, recording, step_builder
from a3po_jax.training.checkpointing import CheckpointManager, async_save_pays
from a3po_jax.training.config import TrainConfig

log = logging.getLogger(__name__)

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
            (cfg.system.schedule.single_process_only is not None,
             cfg.system.schedule.single_process_only),
            (cfg.evaluates, "evaluate / eval_every (process 0 would evaluate while the "
             "others wait in the next step's collective, which is not tested; set "
             "evaluate=false eval_every=0 and evaluate checkpoints with python -m "
             "a3po_jax.cli.evaluate --run-dir RUN_DIR --step N)"),
            (cfg.algo.kl_coef > 0 and cfg.algo.kl_in_reward, "algo.kl_in_reward=True (process "
             "0 scores the batch with the sharded params)"),
            (bool(cfg.system.placement.inference_devices), "system.placement.inference_devices "
             "(serve from hosts of their own: system.placement.inference_hosts, "
             "scripts/launch.py)"),
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
    if cfg.rollout.dynamic_sampling and (cfg.system.run.record_rollouts or replay_dir is not None):
        raise ValueError(
            "rollout.dynamic_sampling=true makes short and empty steps, which a recording "
            "cannot replay yet: set system.run.record_rollouts=false (and do not --replay)"
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


@dataclasses.dataclass
class TrainParts:
    """The training side: meshes, algorithm (with its batch plan), optimizer, placed state,
    frozen reference (None when the algorithm needs none) and the jitted step."""

    mesh: Any
    host_mesh: Any
    algo: Any
    optimizer: Any
    state: Any
    ref_params: Any
    train_step: Any
    batch_sharding: Any


def build_train(cfg: TrainConfig, policy: Policy, *, leader: bool) -> TrainParts:
    """The meshes (the host's too, with split devices: host_placement.py), the algorithm
    resolved from its tables once with its batch plan, the optimizer, the placed train state,
    the frozen reference and the jitted step."""
    mesh, host_mesh = host_placement.meshes(cfg.system)
    shards = sharding.batch_shards(mesh)
    algo = step_builder.algorithm(cfg, policy.config, batch_shards=shards)
    if cfg.system.batch.packed_prompts == AUTO and leader:
        why = BatchPlan.packing_refusal(cfg, batch_shards=shards)
        log.info(
            "system.batch.packed_prompts=auto: %s",
            "packed rows" if algo.plan.packed else f"padded rows, since {why}",
        )
    optimizer = step_builder.optimizer(cfg)
    with _naming_mesh_settings(cfg.system, mesh):
        state = placement.place_train_state(policy.params, optimizer, mesh)
    # The reference is the initial policy, frozen (a copy: the state's buffers are donated).
    ref_params = jax.tree.map(jnp.copy, state.params) if algo.keeps_reference else None
    plan = algo.plan
    # Each micro-batch splits evenly over the mesh (packed arrays lead with packed rows).
    with _naming_mesh_settings(cfg.system, mesh):
        rows = plan.leading_rows_per_micro_batch
        sharding.check_batch_divisible(rows, mesh, sharding.TRAIN_RULES)
    train_step = placement.jit_train_step(
        state,
        mesh,
        algo=algo,
        optimizer=optimizer,
        grad_clip=cfg.optim.grad_clip,
        with_reference=ref_params is not None,
    )
    return TrainParts(
        mesh=mesh,
        host_mesh=host_mesh,
        algo=algo,
        optimizer=optimizer,
        state=state,
        ref_params=ref_params,
        train_step=train_step,
        batch_sharding=placement.batch_shardings(mesh, plan.leading_rows),
    )


@contextlib.contextmanager
def _naming_mesh_settings(system, mesh):
    """A dimension the trainer's mesh does not divide (a weight, or the micro-batch's rows),
    refused with the ``system.mesh.*`` settings of the axes that split it: a fresh run and a
    resume alike (a checkpoint restores onto any mesh that divides the model,
    docs/scale-out.md)."""
    try:
        yield
    except sharding.IndivisibleError as err:
        settings = []
        for axis in err.mesh_axes:
            value = getattr(system, f"mesh_{axis}")
            size = "" if value == mesh.shape[axis] else f" ({axis} = {mesh.shape[axis]})"
            settings.append(f"system.mesh.{axis}={value}{size}")
        layout = " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items())
        raise ValueError(
            f"{', '.join(settings)}: the trainer's mesh ({layout} over {mesh.devices.size} "
            f"devices) cannot split {err}; choose mesh sizes that divide it"
        ) from err


@dataclasses.dataclass
class RunParts:
    """What :func:`build_run` builds; the trainer owns it all and closes what it started.

    ``host`` is None in a replay and on every process but 0; ``own_host`` says whether the
    run started it (and closes it); ``local_host`` is the local host process behind it with
    ``system.placement.inference_cores``."""

    train: TrainParts
    task: Any
    sampling: SamplingParams
    host: Host | None
    own_host: bool
    local_host: Any
    workers: RolloutSource
    recorder: recording.RolloutRecorder | None
    checkpoints: CheckpointManager | None
    trimmer: heap.Trimmer | None
    leader: bool
    replay_dir: Path | None


def build_run(
    cfg: TrainConfig,
    policy: Policy,
    *,
    host: Host | None = None,
    task: Any = None,
    replay_dir: str | Path | None = None,
) -> RunParts:
    """Builds one configured run (the trainer's arguments, `a3po_jax.training.trainer`)."""
    leader = distributed.is_coordinator()
    replay_dir = None if replay_dir is None else Path(replay_dir)
    refuse_unsupported(cfg, processes=jax.process_count(), host=host, replay_dir=replay_dir)
    if cfg.system.lockstep_decode_steps > 0 and replay_dir is None and host is not None:
        raise ValueError(
            "system.lockstep_decode_steps drives a host this trainer starts (embedded), "
            "not one it is given: set system.lockstep_decode_steps=0"
        )
    task = task if task is not None else make_task(cfg.task.name, **cfg.task.kwargs)
    # The scorer before anything starts: a bad reward model is refused by its field.
    scorer = None if replay_dir is not None or not leader else reward_scorer(cfg, task, policy)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    # Before the first step compiles, and before the split host's process starts (it inherits it).
    compilation.enable(cfg.system.run.compile_cache_dir)
    sampling = sampling_params(cfg.rollout, policy.tokenizer)
    train = build_train(cfg, policy, leader=leader)  # before a host starts: fails sooner
    own_host = host is None and leader and replay_dir is None
    local_host = None
    if own_host:
        host, local_host = host_placement.start_run_host(
            cfg, policy.config, policy.params, train.host_mesh
        )
    elif leader and host is not None:
        check_host_settings(host, cfg)
    return RunParts(
        train=train,
        task=task,
        sampling=sampling,
        host=host,
        own_host=own_host,
        local_host=local_host,
        workers=rollout_source(
            cfg, host, task, sampling, policy.tokenizer, replay_dir, scorer=scorer
        ),
        recorder=recorder(cfg, leader=leader, replay_dir=replay_dir),
        checkpoints=checkpoint_manager(cfg, train.mesh),
        trimmer=heap.Trimmer(
            cfg.system.run.trim_heap_every_s,
            mmap_threshold_mib=cfg.system.run.mmap_threshold_mib,
        )
        if cfg.system.run.trim_heap_every_s > 0
        else None,
        leader=leader,
        replay_dir=replay_dir,
    )


def reward_scorer(cfg: TrainConfig, task: Any, policy: Policy) -> tuple[Scorer, bool]:
    """The scorer ``task.reward`` names and whether it scores per group
    (:func:`a3po_jax.tasks.scorers.resolve_scorer`), loaded now: ValueError naming
    ``task.reward`` for a reward model that is not there or was trained with another
    tokenizer, before a host starts or a step compiles."""
    spec = cfg.task.reward
    try:
        scorer, per_group = resolve_scorer(spec, task=task, tokenizer=policy.tokenizer)
    except (ValueError, ImportError, OSError) as err:
        raise ValueError(f"task.reward={spec!r} cannot be used: {err}") from err
    log.info("rewards scored by %s@%s", scorer.name, scorer.version)
    return scorer, per_group


def rollout_source(
    cfg: TrainConfig,
    host,
    task,
    sampling,
    tokenizer,
    replay_dir: Path | None,
    *,
    scorer: tuple[Scorer, bool] | None = None,
) -> RolloutSource:
    """Where batches come from: the rollout threads over ``host``, or, in a replay, the
    recorded groups step by step in place of the threads and the host (whose rewards are
    the recorded ones: no scorer). ``scorer``: :func:`reward_scorer`'s (None: the task's
    verifier, per sample)."""
    rollout = cfg.rollout
    if replay_dir is not None:
        return recording.ReplaySource(
            replay_dir, group_size=rollout.group_size, batch_groups=rollout.groups_per_step
        )
    prompts = task.prompts(cfg.task.split)
    if not prompts:
        raise ValueError(f"task {cfg.task.name!r} has no prompts in split {cfg.task.split!r}")
    return RolloutWorkers(
        host=host,
        task=task,
        tokenizer=tokenizer,
        prompts=PromptIterator(prompts, batch_size=1, seed=cfg.seed),
        sampling=sampling,
        reward_config=RewardConfig(
            format_reward=cfg.task.format_reward, no_eos_penalty=cfg.task.no_eos_penalty
        ),
        group_size=rollout.group_size,
        batch_groups=rollout.groups_per_step,
        max_staleness=cfg.staleness_bound,
        versions_per_batch=cfg.algo.num_minibatches,
        seed=cfg.seed,
        consume_order=cfg.system.consume_order,
        dynamic_sampling=rollout.dynamic_sampling,
        max_extra_groups=rollout.extra_groups_budget,
        lockstep=cfg.system.lockstep_decode_steps > 0,
        scorer=None if scorer is None else scorer[0],
        score_per_group=scorer is not None and scorer[1],
    )


def recorder(cfg: TrainConfig, *, leader: bool, replay_dir) -> recording.RolloutRecorder | None:
    """The recorder of consumed batches (``system.run.record_rollouts``); warns where the
    recording or a replay cannot be reproduced exactly."""
    made = (
        recording.RolloutRecorder(Path(cfg.run_dir))
        if cfg.system.run.record_rollouts and leader
        else None
    )
    if made is not None or replay_dir is not None:
        reason = recording.nondeterminism_warning(
            jax.default_backend(), os.environ.get("XLA_FLAGS", "")
        )
        if reason:
            log.warning(reason)
    return made


def checkpoint_manager(cfg: TrainConfig, mesh) -> CheckpointManager | None:
    """The run's checkpointer (None with ``checkpoint_every=0``)."""
    if not cfg.checkpoint_every:
        return None
    return CheckpointManager(
        Path(cfg.run_dir) / "checkpoints",
        save_interval_steps=cfg.checkpoint_every,
        async_save=async_save_pays(mesh.devices.flat),
    )
