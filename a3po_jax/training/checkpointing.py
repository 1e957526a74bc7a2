"""Training checkpoints with orbax (the SIGTERM flag that asks for one lives in
:mod:`a3po_jax.training.stopping`).

Training layer (host-side shell).

:func:`save_train_state` / :func:`restore_train_state` checkpoint the trainer's state (params,
optimizer state, version) with the run's host-side state (prompt order, queue and admission
counters) in ``extra``; :class:`CheckpointManager` is the storage underneath.

A checkpoint step holds three items::

    <directory>/<step>/params     # the parameter pytree (any dtypes, e.g. bfloat16)
    <directory>/<step>/opt_state  # the optax state (NamedTuples restored as NamedTuples)
    <directory>/<step>/extra      # a JSON dict: version, data iterator state, PRNG key
                                  # data as a list, queue and controller counters, ...

In ``one_step_off`` and lockstep ``async`` runs a step also has the complete groups that
were generated for the next steps and not trained yet (a resume could not regenerate them
exactly), in the rollout recording's format (:func:`a3po_jax.training.recording.write_step`)::

    <directory>/held/step_<step>.npz  # written (temp file + rename) before the step's save
                                      # starts, so a committed step always has it; removed
                                      # with the step (:func:`prune_held_groups`)

A checkpoint does not fix the mesh: :func:`restore_train_state` reads every array into the
layout of the state it is given (built on the run's mesh), so a run saved on N devices
resumes on M; orbax's record of the saving mesh is only reported
(:meth:`CheckpointManager.saved_mesh`).

Saves are atomic: orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it when
complete, after writing its commit marker ``commit_success.txt`` into it. Leftovers of an
interrupted save are ignored with a logged warning: tmp dirs (orbax deletes them), and step
dirs without the commit marker (a partial copy, a crash on a filesystem without atomic
rename), which are moved aside to ``<step>.incomplete-<time>`` so the previous complete
step is the latest one and the step number can be saved again.

Saves are asynchronous by default: ``save`` copies the arrays to host memory and returns
while the files are written, so the next train step may donate the saved buffers. Call
``wait_until_finished`` (or ``close``) before the process exits. On a CPU that does not pay
(:func:`async_save_pays`): the arrays already live in host memory, the save keeps them
referenced while the files are written, and a step that donates them meanwhile must copy
the whole state instead, while the write shares its cores.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

# Re-exported: the stop flag was defined here before it got a module of its own.
from a3po_jax.training import recording
from a3po_jax.training.stopping import TerminationFlag, install_sigterm_handler  # noqa: F401

log = logging.getLogger(__name__)

# Written by orbax (>= 0.11) into every step before it becomes final; a step dir without it
# (or, for older orbax, without a commit time in its step metadata) was never finished.
COMMIT_MARKER = "commit_success.txt"
_STEP_METADATA = "_CHECKPOINT_METADATA"
_TMP_MARKER = ".orbax-checkpoint-tmp"
# Beside the step dirs (orbax lists only step-named dirs): the groups saved with each step.
HELD_DIR = "held"


class CheckpointManager:
    """Saves and restores ``(params, opt_state, extra)`` per training step.

    Wraps ``orbax.checkpoint.CheckpointManager`` with one fixed layout, keep-N garbage
    collection, a save interval (``force=True`` overrides it, e.g. on SIGTERM), and the
    half-written-checkpoint handling of the module docstring.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        """
        Args:
          directory: where step dirs live; created if missing.
          max_to_keep: newest complete steps kept (None keeps all).
          save_interval_steps: ``save`` writes only steps that are multiples of this.
          async_save: write files in a background thread after copying arrays to host.
        """
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or >= 1, got {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        self.directory = Path(directory).absolute()  # orbax wants absolute paths
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            set_aside_incomplete_steps(self.directory)
        if jax.process_count() > 1:
            # Other processes must not list steps before process 0 moved bad ones aside.
            ocp.multihost.sync_global_processes("a3po_checkpoint_scan")
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            # Exactly the multiples of the interval (orbax's default also saves the first
            # step of a run), plus orbax's own preemption notice on multi-host runs.
            save_decision_policy=policies.AnySavePolicy(
                [
                    policies.FixedIntervalPolicy(save_interval_steps),
                    policies.PreemptionCheckpointingPolicy(),
                ]
            ),
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
        )
        # The arrays' bytes as they are, not zstd-compressed: float weights and Adam moments
        # barely compress, and a compressing write buffers the whole encoded state
        # (docs/performance.md).
        tree = lambda: ocp.PyTreeCheckpointHandler(use_compression=False)  # noqa: E731
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "params": tree(),
                "opt_state": tree(),
                "extra": ocp.JsonCheckpointHandler(),
            },
        )
        self.async_save = bool(async_save)

    def save(
        self,
        step: int,
        *,
        params: Any,
        opt_state: Any,
        extra: Mapping[str, Any],
        force: bool = False,
    ) -> bool:
        """Starts saving ``step``; returns False when the interval skips it.

        ``extra`` must round-trip through JSON unchanged: string keys; values None, bool,
        int, float, str, lists and dicts of those (convert numpy scalars and PRNG key data,
        e.g. ``jax.random.key_data(key).tolist()``). Anything else raises ``TypeError``
        naming the entry.
        """
        check_json_roundtrip(extra, "extra")
        with _naming_failed_writes(self.directory / str(step)):
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.PyTreeSave(params),
                    opt_state=ocp.args.PyTreeSave(opt_state),
                    extra=ocp.args.JsonSave(dict(extra)),
                ),
                force=force,
            )
        return bool(saved)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` without ``force`` would write."""
        return bool(self._manager.should_save(step))

    def latest_step(self) -> int | None:
        """Newest complete step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(
        self,
        step: int | None = None,
        *,
        params_template: Any,
        opt_state_template: Any,
    ) -> tuple[Any, Any, dict]:
        """Restores ``step`` (default: the latest complete one).

        Args:
          params_template: a pytree of arrays or ``jax.ShapeDtypeStruct`` with the saved
            structure; gives shapes, dtypes and shardings of the result.
          opt_state_template: the same for the optimizer state, e.g.
            ``optimizer.init(params)`` or its ``jax.eval_shape``.
        Returns:
          ``(params, opt_state, extra)``.
        Raises:
          FileNotFoundError when there is no such complete step.
        """
        step = self._complete_step(step)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=_tree_restore(params_template),
                opt_state=_tree_restore(opt_state_template),
                extra=ocp.args.JsonRestore(),
            ),
        )
        return restored.params, restored.opt_state, dict(restored.extra)

    def restore_params(self, step: int | None = None, *, params_template: Any) -> Any:
        """Only the params of ``step`` (default: latest), e.g. to evaluate a trained run
        without building an optimizer state."""
        step = self._complete_step(step)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(params=_tree_restore(params_template))
        )
        return restored.params

    def read_extra(self, step: int | None = None) -> dict:
        """Only the ``extra`` dict of ``step`` (default: latest), e.g. to read the config or
        version of a run before building the templates."""
        step = self._complete_step(step)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(extra=ocp.args.JsonRestore())
        )
        return dict(restored.extra)

    def saved_mesh(self, step: int | None = None) -> dict[str, int] | None:
        """The mesh the params of ``step`` (default: latest) were saved from, as orbax
        recorded it (axis name: size), or None where it recorded none (arrays not placed
        with a ``NamedSharding``). Only a record: a restore lays the arrays out as its
        template asks, on any mesh."""
        step = self._complete_step(step)
        try:
            tree = self._manager.item_metadata(step)["params"]
            leaves = jax.tree.leaves(getattr(tree, "tree", tree))
        except (KeyError, TypeError, ValueError, AttributeError, OSError) as err:
            log.debug("no sharding metadata for step %d: %s", step, err)
            return None
        for leaf in leaves:
            layout = getattr(leaf, "sharding", None)
            if getattr(layout, "axis_names", None) is not None:
                sizes = (int(size) for size in layout.shape)
                return dict(zip(layout.axis_names, sizes, strict=True))
        return None

    def _complete_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory}; "
                f"complete steps: {self.all_steps()}"
            )
        return step

    def wait_until_finished(self) -> None:
        """Blocks until the last asynchronous save is on disk (and raises its error)."""
        with _naming_failed_writes(self.directory):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's threads."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@contextlib.contextmanager
def _naming_failed_writes(path: Path):
    """A save that failed on a write (disk full, read-only, a file size limit) as an
    ``OSError`` naming the checkpoint, whatever orbax wrapped it in; the step is left
    uncommitted, so the previous complete step stays the one restored."""
    try:
        yield
    except Exception as err:
        if isinstance(err, OSError) and err.filename:
            raise
        code = _os_error_code(err)
        if code is None:
            raise
        reason = os.strerror(code) if code else str(err)
        what = f"{reason} (the checkpoint was not written)"
        raise OSError(code or errno.EIO, what, str(path)) from err


def _os_error_code(err: BaseException | None) -> int | None:
    """The errno behind ``err``: an ``OSError`` along its causes, or the
    ``[os_error_code='27']`` that tensorstore (orbax's writer) puts in the ``ValueError`` it
    raises for a failed write; None when it is not a failed write (0: no errno given)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err.errno or 0
        found = re.search(r"os_error_code='(\d+)'", str(err))
        if found:
            return int(found.group(1))
        err = err.__cause__ or err.__context__
    return None


def _tree_restore(template: Any) -> ocp.args.PyTreeRestore:
    """Restores a saved pytree into ``template``'s structure, shapes, dtypes and shardings
    (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
    return ocp.args.PyTreeRestore(
        template, restore_args=ocp.checkpoint_utils.construct_restore_args(template)
    )


def async_save_pays(devices: Iterable[jax.Device]) -> bool:
    """Whether a state on ``devices`` should be saved asynchronously: yes on accelerators
    (the copy to host frees the device's buffers for the next step, and the write runs on
    otherwise idle host cores), no on a CPU.

    On a CPU the save holds the state's own buffers while it writes; the next train step,
    which donates them, then copies the whole state, and the write competes with the step
    for the same cores: more peak memory and a slower step after each save than a save in
    place (docs/performance.md).
    """
    return any(d.platform != "cpu" for d in devices)


def save_train_state(
    manager: CheckpointManager,
    step: int,
    state: Any,
    *,
    extra: Mapping[str, Any],
    force: bool = False,
) -> bool:
    """Saves a trainer's ``state`` (a ``TrainState``: params, opt_state, step = version) at
    training step ``step``, with ``extra`` (JSON) plus ``version`` and ``step``.

    Returns False when the manager's interval skips the step.
    """
    extra = {**extra, "version": int(state.step), "step": int(step)}
    return manager.save(
        step, params=state.params, opt_state=state.opt_state, extra=extra, force=force
    )


def restore_train_state(manager: CheckpointManager, template: Any) -> tuple[Any, dict, int]:
    """Restores the newest complete step saved by :func:`save_train_state`.

    Args:
      manager: where the run's checkpoints are.
      template: the trainer's current ``TrainState``; gives the structure, and the shardings
        the jitted step was built for, which the restored state is read into: on the run's
        mesh, which need not be the mesh (or the number of devices) that saved it.
    Returns:
      ``(state, extra, step)``.
    Raises:
      FileNotFoundError when there is no complete checkpoint.
    """
    step = manager.latest_step()
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint in {manager.directory}")
    saved, target = manager.saved_mesh(step), _mesh_of(template.params)
    if saved is not None and target is not None and saved != target:
        # The mesh is no part of the state: orbax reads each array into the template's
        # layout (the same numbers), so a resume may change the number of devices.
        log.info(
            "checkpoint step %d was saved on a mesh of %s; restoring it onto %s",
            step,
            _describe_mesh(saved),
            _describe_mesh(target),
        )
    params, opt_state, extra = manager.restore(
        step, params_template=template.params, opt_state_template=template.opt_state
    )
    restored = template._replace(
        params=params, opt_state=opt_state, step=jnp.int32(extra["version"])
    )
    state = jax.device_put(restored, jax.tree.map(lambda x: x.sharding, template))
    return state, extra, step


def _mesh_of(tree: Any) -> dict[str, int] | None:
    """The mesh (axis name: size) of the first leaf of ``tree`` placed with a
    ``NamedSharding``, or None."""
    for leaf in jax.tree.leaves(tree):
        layout = getattr(leaf, "sharding", None)
        if isinstance(layout, jax.sharding.NamedSharding):
            return {name: int(size) for name, size in layout.mesh.shape.items()}
    return None


def _describe_mesh(axes: Mapping[str, int]) -> str:
    """``data 1 x fsdp 4 x tensor 1 (4 devices)``."""
    devices = 1
    for size in axes.values():
        devices *= size
    layout = " x ".join(f"{name} {size}" for name, size in axes.items())
    return f"{layout} ({devices} device{'s' if devices != 1 else ''})"


def held_groups_path(manager: CheckpointManager, step: int) -> Path:
    """The file of the complete, untrained groups saved with checkpoint ``step``."""
    return recording.step_path(manager.directory / HELD_DIR, step)


def write_held_groups(
    manager: CheckpointManager, step: int, groups: list, *, trainer_version: int
) -> Path:
    """Writes the groups held at checkpoint ``step`` (atomically); call it before the step's
    :meth:`CheckpointManager.save`, so no committed step lacks its file."""
    return recording.write_step(
        manager.directory / HELD_DIR, step, groups, trainer_version=trainer_version
    )


def read_held_groups(manager: CheckpointManager, step: int, group_ids: list[int]) -> list:
    """The groups :func:`write_held_groups` saved with ``step`` (in their saved order);
    ``group_ids`` are the ids the step's ``extra`` says it holds."""
    path = held_groups_path(manager, step)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint step {step} holds groups {sorted(group_ids)} saved in {path}, which "
            "is missing (moved or deleted?): the resume cannot continue that run exactly"
        )
    groups, meta = recording.read_step(path)
    if int(meta["step"]) != step or sorted(g.group_id for g in groups) != sorted(group_ids):
        raise ValueError(
            f"{path} holds groups {sorted(g.group_id for g in groups)} of step {meta['step']}, "
            f"but checkpoint step {step} names {sorted(group_ids)}"
        )
    return groups


def prune_held_groups(manager: CheckpointManager, keep: int) -> None:
    """Removes the held-group files of steps orbax no longer has, but ``keep`` (a step being
    saved, not listed until it is committed)."""
    directory = manager.directory / HELD_DIR
    steps = set(manager.all_steps()) | {keep}
    for step in recording.list_steps(directory):
        if step not in steps:
            recording.step_path(directory, step).unlink(missing_ok=True)


def is_committed_step(step_dir: Path) -> bool:
    """Whether orbax finished writing ``step_dir``."""
    if (step_dir / COMMIT_MARKER).exists():
        return True
    metadata = step_dir / _STEP_METADATA
    if not metadata.exists():
        return False
    try:
        return json.loads(metadata.read_text()).get("commit_timestamp_nsecs") is not None
    except (OSError, ValueError):
        return False


def set_aside_incomplete_steps(directory: Path) -> list[Path]:
    """Logs interrupted saves in ``directory`` and moves uncommitted step dirs aside.

    Returns:
      The new paths of the step dirs moved aside.
    """
    moved = []
    for child in sorted(directory.iterdir()):
        if not child.is_dir():
            continue
        if _TMP_MARKER in child.name:
            log.warning(
                "ignoring unfinished checkpoint %s: a save was interrupted before its final "
                "rename (orbax deletes it)",
                child,
            )
        elif child.name.isdigit() and not is_committed_step(child):
            target = child.with_name(f"{child.name}.incomplete-{time.time_ns()}")
            child.rename(target)
            moved.append(target)
            log.warning(
                "ignoring checkpoint step %s: %s has no commit marker (%s), so it is half "
                "written or partially copied; moved it to %s",
                child.name,
                child,
                COMMIT_MARKER,
                target.name,
            )
    return moved


def check_json_roundtrip(value: Any, path: str) -> None:
    """Raises ``TypeError`` naming the first entry JSON would not give back unchanged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json_roundtrip(item, f"{path}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{path} has key {key!r} of type {type(key).__name__}; JSON keys must be "
                    "str (they would come back as strings)"
                )
            check_json_roundtrip(item, f"{path}[{key!r}]")
        return
    hint = " (use a list)" if isinstance(value, tuple) else " (convert it to a Python value)"
    raise TypeError(f"{path} has type {type(value).__name__}, which JSON does not round-trip{hint}")
