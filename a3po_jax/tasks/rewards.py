"""Reward shaping on top of a task's correctness score: format bonus, no-EOS penalty, length cap.

Tasks layer (host-side shell).

    reward = [score + format_reward · format_ok] · (num_tokens <= length_cap)
             - no_eos_penalty · (not finished)

* `score` is the task's correctness in [0, 1] (`Task.score`), or a reward model's score
  (`task.reward=model:PATH`, :mod:`a3po_jax.tasks.scorers`; `shape_reward` shapes a score
  already computed).
* `format_ok`: the completion states its answer in the requested format (``\\boxed{}`` for
  the built-in tasks); the bonus teaches the format (a rule-based format reward, as in DeepSeek-R1).
* `finished`: the sample ended with EOS; a sample cut at `max_new_tokens`
  (finish_reason "length") is penalised so the policy learns to stop instead of rambling
  to the token budget (its correctness score is kept: a truncated completion can still
  hold a correct boxed answer).
* `length_cap`: completions longer than this many tokens earn nothing for correctness or
  format (their answer is ignored), while the no-EOS penalty still applies. It is a cap
  below the sampler's `max_new_tokens`, e.g. to hold responses short without changing
  the generation budget.

All options default to off, giving the raw correctness score.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from a3po_jax.tasks.task import Prompt, Task


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward shaping options; all default to off."""

    format_reward: float = 0.0  # added when the completion has the requested answer format
    no_eos_penalty: float = 0.0  # subtracted when the sample did not end with EOS
    length_cap: int | None = None  # over this many completion tokens: no correctness/format

    def __post_init__(self):
        for field in ("format_reward", "no_eos_penalty"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"RewardConfig.{field} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"RewardConfig.{field} must be finite and >= 0, got {value!r}")
        cap = self.length_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"RewardConfig.length_cap must be None or an int >= 1, got {cap!r}")


def shaped_reward(
    task: Task,
    prompt: Prompt,
    completion_text: str,
    *,
    finished: bool,
    num_tokens: int,
    config: RewardConfig,
) -> tuple[float, dict[str, Any]]:
    """The shaped reward of one completion (formula in the module docstring).

    Args:
      task: the task that owns `prompt`.
      prompt: the prompt the completion answers.
      completion_text: the decoded completion, special tokens removed.
      finished: True if generation stopped at EOS, False if cut at the token budget.
      num_tokens: completion length in tokens (EOS included if generated).
      config: the shaping options.

    Returns:
      (reward, info) with info {"score": task score in [0, 1], "correct": 1 if the score is
      1 else 0, "format_ok": bool, "finished": bool, "over_length": bool}.
    """
    if num_tokens < 0:
        raise ValueError(f"shaped_reward: num_tokens must be >= 0, got {num_tokens}")
    return shape_reward(
        float(task.score(prompt, completion_text)),
        format_ok=bool(task.format_ok(completion_text)),
        finished=finished,
        num_tokens=num_tokens,
        config=config,
    )


def shape_reward(
    score: float, *, format_ok: bool, finished: bool, num_tokens: int, config: RewardConfig
) -> tuple[float, dict[str, Any]]:
    """The shaping of :func:`shaped_reward` on a score already computed (by the task's
    verifier or a reward model: :mod:`a3po_jax.tasks.scorers`); same ``(reward, info)``,
    ``correct`` read from ``score``."""
    if num_tokens < 0:
        raise ValueError(f"shape_reward: num_tokens must be >= 0, got {num_tokens}")
    score = float(score)
    over_length = config.length_cap is not None and num_tokens > config.length_cap
    reward = 0.0 if over_length else score + config.format_reward * format_ok
    if not finished:
        reward -= config.no_eos_penalty
    info = {
        "score": score,
        "correct": int(score >= 1.0),
        "format_ok": format_ok,
        "finished": bool(finished),
        "over_length": over_length,
    }
    return reward, info
