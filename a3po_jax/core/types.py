"""The data the core trains on: completed samples (`Rollout`) and whole groups (`RolloutGroup`).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

Plain dataclasses of numpy arrays, validated at construction; the pure core (batching,
packing) turns them into arrays and the host-side shell (rollout queue, workers) builds them.
This module is part of the core: it imports nothing from the shell.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

FINISH_REASONS = ("stop", "length", "aborted")


@dataclasses.dataclass
class Rollout:
    """One completed sample: a prompt, its completion, and per-token generation metadata.

    Arrays are converted to the documented dtypes at construction; a wrong rank, length,
    dtype kind or finish reason raises ``ValueError`` naming the field.
    """

    prompt_id: str
    group_id: int  # id of the prompt admission (one group = G samples of one prompt)
    sample_index: int  # position of this sample in its group, in [0, G)
    prompt_tokens: np.ndarray  # [P] int32
    completion_tokens: np.ndarray  # [R] int32
    behav_logprobs: np.ndarray  # [R] float32, log π_behav of each completion token
    versions: np.ndarray  # [R] int32, policy version that produced each completion token
    finish_reason: str  # "stop" | "length" | "aborted"
    reward: float | None = None
    info: dict = dataclasses.field(default_factory=dict)
    # Trainer version when the group was admitted (StalenessController.admit's argument);
    # None when the producer does not track it (the group then reports its oldest token's
    # version). At the end so positional construction in the documented order still works.
    admitted_at_version: int | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = _as_1d(self.prompt_tokens, np.int32, "prompt_tokens", integer=True)
        self.completion_tokens = _as_1d(
            self.completion_tokens, np.int32, "completion_tokens", integer=True
        )
        self.behav_logprobs = _as_1d(self.behav_logprobs, np.float32, "behav_logprobs")
        self.versions = _as_1d(self.versions, np.int32, "versions", integer=True)
        num_tokens = self.completion_tokens.shape[0]
        for name in ("behav_logprobs", "versions"):
            if getattr(self, name).shape[0] != num_tokens:
                raise ValueError(
                    f"Rollout.{name} has length {getattr(self, name).shape[0]}, expected the "
                    f"completion length R={num_tokens} (group {self.group_id}, sample "
                    f"{self.sample_index})"
                )
        if num_tokens and int(self.versions.min()) < 0:
            raise ValueError(
                f"Rollout.versions must be >= 0 for completion tokens, got min "
                f"{int(self.versions.min())} (group {self.group_id}, sample {self.sample_index})"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Rollout.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        if self.sample_index < 0:
            raise ValueError(f"Rollout.sample_index must be >= 0, got {self.sample_index}")

    @property
    def num_tokens(self) -> int:
        """R, the number of completion tokens."""
        return int(self.completion_tokens.shape[0])

    def staleness(self, trainer_version: int) -> np.ndarray:
        """Per-token staleness ``d = v_θ - v_b`` ([R] int32) at ``trainer_version``."""
        return (trainer_version - self.versions).astype(np.int32)


def _as_1d(value: Any, dtype: type, name: str, *, integer: bool = False) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"Rollout.{name} must be 1-D, got shape {array.shape}")
    # An empty list has dtype float64; only non-empty arrays say what kind they hold.
    if integer and array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"Rollout.{name} must hold integers, got dtype {array.dtype}")
    return array.astype(dtype, copy=False)


@dataclasses.dataclass
class RolloutGroup:
    """G samples of one prompt, in ``sample_index`` order, ready to be trained on."""

    prompt_id: str
    group_id: int
    rollouts: list[Rollout]  # len G, rollouts[i].sample_index == i
    admitted_at_version: int

    @property
    def size(self) -> int:
        return len(self.rollouts)

    @property
    def min_version(self) -> int:
        """Oldest policy version of any completion token (the group's worst staleness);
        ``admitted_at_version`` when no sample has a token."""
        return oldest_version(self.rollouts, default=self.admitted_at_version)

    @property
    def max_version(self) -> int:
        """Newest policy version of any completion token (``admitted_at_version`` when no
        sample has a token)."""
        versions = [int(r.versions.max()) for r in self.rollouts if r.num_tokens]
        return max(versions) if versions else self.admitted_at_version

    @property
    def rewards(self) -> np.ndarray:
        """[G] float32 rewards; raises if a sample was not scored yet."""
        missing = [r.sample_index for r in self.rollouts if r.reward is None]
        if missing:
            raise ValueError(f"group {self.group_id} has unscored samples {missing}")
        return np.asarray([r.reward for r in self.rollouts], dtype=np.float32)


def oldest_version(rollouts: Sequence[Rollout], *, default: int) -> int:
    """Oldest policy version of any completion token of `rollouts` (`default` when none has one)."""
    versions = [int(r.versions.min()) for r in rollouts if r.num_tokens]
    return min(versions) if versions else default


def token_staleness(groups: Sequence[RolloutGroup], trainer_version: int) -> np.ndarray:
    """Staleness of every completion token of ``groups`` at ``trainer_version``.

    Returns:
      [N] int32, N = total completion tokens, in group then sample order; the raw samples
      for a staleness histogram (``MetricsLogger`` turns arrays into histograms).
    """
    pieces = [r.staleness(trainer_version) for g in groups for r in g.rollouts]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
