"""Recorded rollouts and replay: every consumed batch on disk, and a source that hands it back.

Training layer (host-side shell).

An asynchronous run is not reproducible: which policy version generated which sample
depends on timing. With ``system.run.record_rollouts=true`` the trainer writes the groups of
every step, in the order it consumed them (in ``periodic`` mode the order they were folded
into the gradient), to ``RUN_DIR/rollouts/``; ``a3po-train --replay RUN_DIR`` trains the
same model on exactly those groups, without an inference host or rollout threads
(:class:`ReplaySource`), and compares the losses with the recording's ``metrics.jsonl``
(:func:`compare_runs`). The train step is a pure function of the state and the batch, so
on the same machine the replay reproduces the recorded losses and parameters exactly;
across machines, to float tolerance.

File format (one file per step, append-only, nothing pickled)
--------------------------------------------------------------
``rollouts/step_000007.npz`` holds the groups of logged step 7 (the ``step`` of
``metrics.jsonl``; 1-based), written by ``np.savez_compressed`` to a hidden temporary file
in the same directory and moved into place with ``os.replace``, so a reader sees a whole
file or none (a leftover temporary file of a killed run is not a step file and is ignored).
A resumed run writes the steps after its checkpoint again (the file of the run that
continued replaces the earlier one, as :func:`a3po_jax.training.metrics.read_metrics` keeps
the records of the run that continued). Arrays, N samples of the step in group then
``sample_index`` order:

=====================  ==========  ===========================================================
``prompt_tokens``      int32       every sample's prompt tokens, concatenated
``prompt_offsets``     int64 N+1   sample i's prompt is ``prompt_tokens[off[i]:off[i+1]]``
``completion_tokens``  int32       every sample's completion tokens, concatenated
``behav_logprobs``     float32     behaviour log-prob of each completion token (same layout)
``versions``           int32       policy version that produced each completion token
``completion_offsets`` int64 N+1   sample i's completion is ``[off[i]:off[i+1]]`` of the above
``group_sizes``        int32 B     samples per group, in consumption order
``meta``               str (0-d)   JSON: the small metadata, below
=====================  ==========  ===========================================================

``meta`` is ``{"format": 1, "step": s, "trainer_version": v, "groups": [{"prompt_id",
"group_id", "admitted_at_version"}, ...], "samples": [{"prompt_id", "group_id",
"sample_index", "finish_reason", "reward", "info", "admitted_at_version"}, ...]}``:
``trainer_version`` is the version the step started from; ``reward`` is the float64 reward
(or null), ``info`` the sample's ``info`` dict (``correct``, ``num_tokens``, ... as the
metrics read them). JSON keeps floats exactly (shortest round-trip repr); a tuple in
``info`` comes back as a list and a NumPy scalar as the Python number. Read back with
``np.load(path, allow_pickle=False)`` (:func:`read_step`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from a3po_jax.core.types import Rollout, RolloutGroup

log = logging.getLogger(__name__)

ROLLOUTS_DIR = "rollouts"
FORMAT_VERSION = 1
STEP_FILE = re.compile(r"^step_(\d{6,})\.npz$")
# The per-step values a replay must reproduce (metrics.jsonl keys).
COMPARED_KEYS = ("loss/total", "optim/grad_norm")
# Keys of the step record a replay cannot know (the inference host; what was generated
# or dropped besides the trained groups): absent from a replay's records.
NOT_IN_REPLAY = (
    "host/",
    "throughput/host_",
    "hosts/",
    "length/generated_mean",
    "length/dropped_",
    "length/trained_minus_generated",
)


# XLA:GPU sums scatter-adds (the embedding's gradient) and some reductions with atomics, in
# no fixed order, unless told otherwise: without this flag two runs of the same step on the
# same GPU can differ in the last bits, which AdamW can carry past float tolerance.
GPU_DETERMINISM_FLAG = "--xla_gpu_deterministic_ops=true"


def nondeterminism_warning(backend: str, xla_flags: str) -> str | None:
    """Why a recording or a replay on `backend` (``jax.default_backend()``) with these
    ``XLA_FLAGS`` may not reproduce its steps, or None when it should."""
    name = GPU_DETERMINISM_FLAG.split("=")[0]
    values = [f.partition("=")[2] for f in xla_flags.split() if f.partition("=")[0] == name]
    if backend != "gpu" or (values and values[-1] in ("", "true", "1")):  # the last one counts
        return None
    return (
        "recording or replaying on a GPU without deterministic ops: XLA:GPU sums scatter-adds "
        "(the embedding's gradient) in no fixed order, so a replay may not match its "
        f"recording; set XLA_FLAGS={GPU_DETERMINISM_FLAG} for both runs"
    )


def step_path(directory: str | Path, step: int) -> Path:
    """The file of logged step ``step`` (1-based) in a ``rollouts/`` directory."""
    return Path(directory) / f"step_{step:06d}.npz"


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"info value {value!r} of type {type(value).__name__} is not JSON-able")


def write_step(
    directory: str | Path, step: int, groups: Sequence[RolloutGroup], *, trainer_version: int
) -> Path:
    """Write the groups of logged step ``step`` atomically (temporary file, then
    ``os.replace``); returns the file's path. The format is in the module docstring."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    samples = [r for g in groups for r in g.rollouts]

    def flat(name: str, dtype) -> np.ndarray:
        pieces = [getattr(r, name) for r in samples]
        return np.concatenate(pieces).astype(dtype) if pieces else np.zeros((0,), dtype)

    def offsets(name: str) -> np.ndarray:
        lengths = [len(getattr(r, name)) for r in samples]
        return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)

    meta = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "trainer_version": int(trainer_version),
        "groups": [
            {
                "prompt_id": g.prompt_id,
                "group_id": int(g.group_id),
                "admitted_at_version": int(g.admitted_at_version),
            }
            for g in groups
        ],
        "samples": [
            {
                "prompt_id": r.prompt_id,
                "group_id": int(r.group_id),
                "sample_index": int(r.sample_index),
                "finish_reason": r.finish_reason,
                "reward": None if r.reward is None else float(r.reward),
                "info": r.info,
                "admitted_at_version": (
                    None if r.admitted_at_version is None else int(r.admitted_at_version)
                ),
            }
            for r in samples
        ],
    }
    arrays = {
        "prompt_tokens": flat("prompt_tokens", np.int32),
        "prompt_offsets": offsets("prompt_tokens"),
        "completion_tokens": flat("completion_tokens", np.int32),
        "behav_logprobs": flat("behav_logprobs", np.float32),
        "versions": flat("versions", np.int32),
        "completion_offsets": offsets("completion_tokens"),
        "group_sizes": np.asarray([g.size for g in groups], np.int32),
        "meta": np.asarray(json.dumps(meta, default=_json_default)),
    }
    final = step_path(directory, step)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:  # a file object: savez adds no ".npz" to the name
        np.savez_compressed(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def read_step(path: str | Path) -> tuple[list[RolloutGroup], dict[str, Any]]:
    """The groups of one step file (in consumption order) and its ``meta`` (without the
    per-sample entries). Raises ``ValueError`` for a file of another format."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"][()]))
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: rollout format {meta.get('format')!r}, expected {FORMAT_VERSION}"
        )
    p_off, c_off = arrays["prompt_offsets"], arrays["completion_offsets"]
    samples = []
    for i, s in enumerate(meta["samples"]):
        c0, c1 = int(c_off[i]), int(c_off[i + 1])
        samples.append(
            Rollout(
                prompt_id=s["prompt_id"],
                group_id=s["group_id"],
                sample_index=s["sample_index"],
                prompt_tokens=arrays["prompt_tokens"][int(p_off[i]) : int(p_off[i + 1])],
                completion_tokens=arrays["completion_tokens"][c0:c1],
                behav_logprobs=arrays["behav_logprobs"][c0:c1],
                versions=arrays["versions"][c0:c1],
                finish_reason=s["finish_reason"],
                reward=s["reward"],
                info=s["info"],
                admitted_at_version=s["admitted_at_version"],
            )
        )
    groups, start = [], 0
    for g, size in zip(meta["groups"], arrays["group_sizes"].tolist(), strict=True):
        groups.append(
            RolloutGroup(
                prompt_id=g["prompt_id"],
                group_id=g["group_id"],
                rollouts=samples[start : start + size],
                admitted_at_version=g["admitted_at_version"],
            )
        )
        start += size
    if start != len(samples):
        raise ValueError(f"{path}: group_sizes add up to {start}, the file has {len(samples)}")
    meta.pop("samples")
    return groups, meta


def list_steps(directory: str | Path) -> list[int]:
    """The steps recorded in a ``rollouts/`` directory, ascending (temporary files ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = []
    for child in directory.iterdir():
        match = STEP_FILE.match(child.name)
        if match and child.is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


class RolloutRecorder:
    """Writes each step's consumed groups under ``run_dir/rollouts/`` (the trainer's
    ``system.run.record_rollouts``)."""

    def __init__(self, run_dir: str | Path):
        self.directory = Path(run_dir) / ROLLOUTS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, groups: Sequence[RolloutGroup], *, trainer_version: int) -> Path:
        return write_step(self.directory, step, groups, trainer_version=trainer_version)


class ReplayError(ValueError):
    """A recording that cannot be replayed with this configuration (the message says why)."""


class ReplaySource:
    """The recorded groups, step by step, with the interface the trainer uses from
    :class:`a3po_jax.rollout.workers.RolloutWorkers` (and from its queue: ``get_batch``,
    ``counters``). No threads, no host: ``get_batch`` reads the next step's file.

    Args:
      run_dir: the recorded run (its ``rollouts/`` directory is read).
      group_size: G of the replaying config; every recorded group must have G samples.
      batch_groups: groups per step of the replaying config; every recorded step must have
        that many.
    """

    def __init__(self, run_dir: str | Path, *, group_size: int, batch_groups: int):
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir / ROLLOUTS_DIR
        self.steps = recorded_steps(self.run_dir)
        self.group_size = group_size
        self.batch_groups = batch_groups
        self._next = 0  # index into self.steps of the next step to hand out
        self._pending: collections.deque[RolloutGroup] = collections.deque()
        self._current: int | None = None  # the step whose groups are being handed out
        self._consumed_groups = 0
        self._consumed_samples = 0
        self._consumed_tokens = 0
        self._version_mismatches = 0

    @property
    def queue(self) -> ReplaySource:
        """The trainer reads counters (and, in periodic mode, groups) from ``queue``."""
        return self

    # ------------------------------------------------------------------ the trainer's side

    def start(self) -> None:
        """Nothing to start (no threads)."""

    def raise_if_failed(self) -> None:
        """Nothing can fail in the background."""

    def get_batch(
        self,
        num_groups: int,
        *,
        trainer_version: int,
        timeout: float | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> list[RolloutGroup]:
        """The next ``num_groups`` recorded groups (of the current step, in recorded order;
        they are read, never waited for, so ``timeout`` and ``interrupted`` do not apply)."""
        if not self._pending:
            self._load_next(trainer_version)
        if len(self._pending) < num_groups:
            raise ReplayError(
                f"recorded step {self._current} has {len(self._pending)} groups left, the "
                f"trainer asked for {num_groups}"
            )
        return [self._pending.popleft() for _ in range(num_groups)]

    def consumed(self, groups: list[RolloutGroup], **kwargs: Any) -> None:
        """The trainer finished a step: it must have taken every group of the recorded step."""
        if self._pending:
            raise ReplayError(
                f"recorded step {self._current} has {len(self._pending)} groups the trainer did "
                "not take: rollout.groups_per_step differs from the recording"
            )
        self._consumed_groups += len(groups)
        self._consumed_samples += sum(g.size for g in groups)
        self._consumed_tokens += sum(r.num_tokens for g in groups for r in g.rollouts)

    def discard(self, num_groups: int) -> None:
        """A skipped step: nothing to give back (the recording is fixed)."""

    def reward_stats(self) -> dict[str, float]:
        """Nothing is scored: the rewards are the recorded ones (no ``time/reward_s``)."""
        return {}

    def notify_version(self, version: int) -> None:
        """Versions do not steer a replay."""

    def state(self) -> dict:
        """The replay cursor, for a checkpoint of the replaying run."""
        return {
            "replay_next_index": self._next,
            "queue": {
                "consumed_groups": self._consumed_groups,
                "consumed_samples": self._consumed_samples,
                "consumed_tokens": self._consumed_tokens,
            },
        }

    def restore(self, state: dict, *, version: int, **kwargs: Any) -> None:
        """Continue after the steps a checkpoint of the replaying run already trained."""
        if "replay_next_index" not in state:
            raise ReplayError(
                "the checkpoint was not written by a replay (no replay cursor): resume the "
                "recorded run itself with --resume"
            )
        self._next = int(state["replay_next_index"])
        queue = state.get("queue", {})
        self._consumed_groups = int(queue.get("consumed_groups", 0))
        self._consumed_samples = int(queue.get("consumed_samples", 0))
        self._consumed_tokens = int(queue.get("consumed_tokens", 0))
        self._pending.clear()

    def close(self, reason: str = "trainer finished") -> None:
        """Nothing to stop."""

    def counters(self) -> dict:
        return {
            "consumed_groups": self._consumed_groups,
            "consumed_samples": self._consumed_samples,
            "consumed_tokens": self._consumed_tokens,
            "replayed_steps": self._next,
            "recorded_steps": len(self.steps),
            "replay_version_mismatches": self._version_mismatches,
        }

    # ------------------------------------------------------------------ internals

    def _load_next(self, trainer_version: int) -> None:
        if self._next >= len(self.steps):
            raise ReplayError(
                f"{self.directory} has {len(self.steps)} recorded steps; the run asked for "
                "more (set steps= at most that)"
            )
        step = self.steps[self._next]
        groups, meta = read_step(step_path(self.directory, step))
        if len(groups) != self.batch_groups:
            raise ReplayError(
                f"recorded step {step} has {len(groups)} groups, but rollout.groups_per_step="
                f"{self.batch_groups}: replay needs the recorded batch shape"
            )
        sizes = {g.size for g in groups}
        if sizes != {self.group_size}:
            raise ReplayError(
                f"recorded step {step} has groups of {sorted(sizes)} samples, but "
                f"rollout.group_size={self.group_size}: replay needs the recorded batch shape"
            )
        if meta["trainer_version"] != trainer_version:
            self._version_mismatches += 1
            log.warning(
                "replay: recorded step %d started at version %d, this run is at %d (the "
                "staleness of its tokens differs from the recording)",
                step,
                meta["trainer_version"],
                trainer_version,
            )
        self._pending.extend(groups)
        self._current = step
        self._next += 1


def recorded_steps(run_dir: str | Path) -> list[int]:
    """The steps recorded in ``run_dir/rollouts/`` (1, 2, ..., n); raises
    :class:`ReplayError` naming ``system.run.record_rollouts`` when there are none, and for
    a gap."""
    directory = Path(run_dir) / ROLLOUTS_DIR
    steps = list_steps(directory)
    if not steps:
        raise ReplayError(
            f"{run_dir} has no recorded rollouts ({directory} has no step files): record a run "
            "with system.run.record_rollouts=true to replay it"
        )
    if steps != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, steps[-1] + 1)) - set(steps))
        raise ReplayError(f"{directory} misses steps {missing[:10]}: the recording has a gap")
    return steps


# Fields a replay must not change: they fix the recorded batches' shapes.
SHAPE_FIELDS = (("rollout", "group_size"), ("rollout", "groups_per_step"))


def replay_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Any:
    """The config of a replay of ``run_dir``: its ``config.json``, recording off,
    ``run_dir=RUN_DIR/replay``, then ``overrides``; ``steps`` is capped at the recorded steps.

    Raises:
      ReplayError: no recording, no config.json, or an override of a batch-shape field.
      a3po_jax.training.config.ConfigError: a bad override.
    """
    from a3po_jax.training.config import apply_overrides, config_from_dict

    run_dir = Path(run_dir)
    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise ReplayError(f"{run_dir} is not a run dir (no config.json)")
    steps = recorded_steps(run_dir)
    recorded = config_from_dict(json.loads(config_file.read_text()))
    base = dataclasses.replace(
        recorded,
        system=dataclasses.replace(
            recorded.system, run=dataclasses.replace(recorded.system.run, record_rollouts=False)
        ),
        run_dir=str(run_dir / "replay"),
    )
    cfg = apply_overrides(base, list(overrides))
    for section, field in SHAPE_FIELDS:
        was = getattr(getattr(recorded, section), field)
        now = getattr(getattr(cfg, section), field)
        if was != now:
            raise ReplayError(
                f"{section}.{field}={now} differs from the recording's {was}: a replay trains "
                "on the recorded batches, whose shape it cannot change"
            )
    if Path(cfg.run_dir).resolve() == run_dir.resolve():
        raise ReplayError(f"run_dir={cfg.run_dir} is the recorded run: replay into another dir")
    return dataclasses.replace(cfg, steps=min(cfg.steps, len(steps)))


def compare_runs(
    recorded_dir: str | Path,
    replay_dir: str | Path,
    *,
    keys: Sequence[str] = COMPARED_KEYS,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> dict[str, Any]:
    """Per-step ``keys`` of the replay against the recording's ``metrics.jsonl``.

    Returns ``{"steps": n, "max_abs_diff": {key: d}, "match": bool, "rtol", "atol"}``:
    ``match`` when every compared value is within ``atol + rtol * |recorded|`` (NaN equals
    NaN) and every replayed step was in the recording.
    """
    from a3po_jax.training.metrics import read_metrics

    # Training steps only: a step-0 record holds the held-out evaluation before training.
    recorded = {r["step"]: r for r in read_metrics(recorded_dir) if r["step"] >= 1}
    replayed = [r for r in read_metrics(replay_dir) if r["step"] >= 1]
    diffs = {k: 0.0 for k in keys}
    match = bool(replayed)
    for r in replayed:
        rec = recorded.get(r["step"])
        if rec is None:
            match = False
            continue
        for key in keys:
            a, b = rec.get(key), r.get(key)
            if a is None or b is None:
                match = match and a is None and b is None
                continue
            if math.isnan(a) and math.isnan(b):
                continue
            d = abs(float(a) - float(b))
            diffs[key] = max(diffs[key], d) if not math.isnan(d) else math.inf
            match = match and d <= atol + rtol * abs(float(a))
    return {
        "steps": len(replayed),
        "max_abs_diff": diffs,
        "match": match,
        "rtol": rtol,
        "atol": atol,
    }
