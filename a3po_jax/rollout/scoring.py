"""The reward stage: finished samples in, scored and shaped rollouts out, for the queue.

Rollout layer (host-side shell; design §5, the data flow). The collector
(:mod:`a3po_jax.rollout.workers`) hands each finished sample to :meth:`RewardStage.add` and
files what it returns. A scorer that scores per sample (the task's verifier) scores it at
once; one that scores per group (a reward model, :mod:`a3po_jax.tasks.scorers`) holds the
group's samples until the G-th arrives and scores the G in one call, so the model runs one
batched forward pass per group, not one per sample. Reward shaping
(:func:`a3po_jax.tasks.rewards.shape_reward`: format bonus, no-EOS penalty, length cap)
applies on top of either score; KL-in-reward acts later, in the trainer.

Every rollout's ``info`` says what scored it (``scorer``, ``scorer_version``); under a
scorer other than the verifier it also keeps the verifier's score (``gold_score``) and
``correct`` is the verifier's, so ``reward/correct`` stays the gold measure.
:meth:`RewardStage.stats` has the time spent scoring so far (``time/reward_s``) and the
bytes of a reward model's weights (``mem/reward_model_gb``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from a3po_jax.core.types import Rollout
from a3po_jax.inference.types import SampleResult
from a3po_jax.tasks.rewards import RewardConfig, shape_reward
from a3po_jax.tasks.scorers import Scorer, VerifierScorer, scorer_label


class RewardStage:
    """Scores finished samples into :class:`Rollout` s (module docstring).

    Args:
      scorer: the :class:`a3po_jax.tasks.scorers.Scorer` (None: the task's verifier).
      task: the task (``format_ok`` for the format bonus; ``score`` for ``gold_score``).
      config: reward shaping.
      group_size: G.
      per_group: hold a group's samples and score the G together once it is whole.
    """

    def __init__(
        self,
        scorer: Scorer | None,
        *,
        task: Any,
        config: RewardConfig,
        group_size: int,
        per_group: bool = False,
    ):
        self.scorer = VerifierScorer(task) if scorer is None else scorer
        self.task = task
        self.config = config
        self.group_size = group_size
        self.per_group = per_group
        self.gold = not isinstance(self.scorer, VerifierScorer)  # keep the verifier's too
        self.label = scorer_label(self.scorer)
        self._held: dict[int, list[tuple[SampleResult, str]]] = {}
        self._lock = threading.Lock()
        self._seconds = 0.0

    def add(
        self, res: SampleResult, text: str, *, prompt: Any, group_id: int, version: int
    ) -> list[Rollout]:
        """One finished sample (decoded to ``text``) of group ``group_id`` (``prompt``,
        admitted at ``version``): the rollouts now scored, in arrival order (this one alone
        per sample; the whole group once its last sample arrives per group; else none)."""
        if not self.per_group:
            batch = [(res, text)]
        else:
            with self._lock:
                held = self._held.setdefault(group_id, [])
                held.append((res, text))
                if len(held) < self.group_size:
                    return []
                batch = self._held.pop(group_id)
        return self._score(batch, prompt=prompt, group_id=group_id, version=version)

    def forget(self, group_id: int) -> None:
        """The group was dropped: its held samples go (none are filed)."""
        with self._lock:
            self._held.pop(group_id, None)

    def held_samples(self) -> int:
        """Samples waiting for the rest of their group."""
        with self._lock:
            return sum(len(v) for v in self._held.values())

    def seconds(self) -> float:
        """Seconds spent scoring so far (the scorer and the shaping)."""
        with self._lock:
            return self._seconds

    def stats(self) -> dict[str, float]:
        """``seconds`` (:meth:`seconds`) and, for a scorer that holds weights and says how
        many bytes they take (a reward model's ``param_bytes``), ``param_bytes``."""
        stats = {"seconds": self.seconds()}
        param_bytes = getattr(self.scorer, "param_bytes", None)  # optional: a model's
        if param_bytes is not None:
            stats["param_bytes"] = float(param_bytes)
        return stats

    def _score(
        self, batch: list[tuple[SampleResult, str]], *, prompt: Any, group_id: int, version: int
    ) -> list[Rollout]:
        t0 = time.perf_counter()
        texts = [text for _, text in batch]
        scores = np.asarray(self.scorer.score([prompt] * len(batch), texts))
        if scores.shape != (len(batch),):
            raise ValueError(
                f"scorer {self.scorer.name} returned shape {scores.shape} for "
                f"{len(batch)} completions"
            )
        rollouts = []
        for (res, text), score in zip(batch, scores.tolist(), strict=True):
            reward, info = shape_reward(
                score,
                format_ok=bool(self.task.format_ok(text)),
                finished=res.finish_reason == "stop",
                num_tokens=len(res.tokens),
                config=self.config,
            )
            if self.gold:
                gold = float(self.task.score(prompt, text))
                info = {**info, "gold_score": gold, "correct": int(gold >= 1.0)}
            info = {
                **info,
                "num_tokens": len(res.tokens),
                "scorer": self.scorer.name,
                "scorer_version": self.scorer.version,
            }
            rollouts.append(
                res.to_rollout(
                    prompt_id=prompt.prompt_id,
                    group_id=group_id,
                    reward=float(reward),
                    info=info,
                    admitted_at_version=version,
                )
            )
        with self._lock:
            self._seconds += time.perf_counter() - t0
        return rollouts


def scorer_metrics(rollouts: Sequence[Any]) -> dict[str, Any]:
    """What scored the step's samples (their ``info``, written by the reward stage,
    :mod:`a3po_jax.rollout.scoring`): ``reward/scorer``, the ``name@version`` of each
    scorer, comma-separated; and, where a scorer other than the verifier scored,
    ``reward/gold_score_mean``, the mean of the verifier's scores of the same samples (the
    gold reward beside the learned one), and ``reward/proxy_score_mean``, the mean of that
    scorer's own scores before any shaping (format bonus, no-EOS penalty, a KL penalty in
    the reward): proxy against gold is over-optimisation. Nothing for samples that do not
    say (recordings from before the stage)."""
    labels = sorted(
        {
            f"{r.info['scorer']}@{r.info.get('scorer_version', '')}"
            for r in rollouts
            if "scorer" in r.info
        }
    )
    out: dict[str, Any] = {}
    if labels:
        out["reward/scorer"] = ", ".join(labels)
    judged = [r for r in rollouts if "gold_score" in r.info]
    if judged:
        out["reward/gold_score_mean"] = float(np.mean([r.info["gold_score"] for r in judged]))
        out["reward/proxy_score_mean"] = float(np.mean([r.info["score"] for r in judged]))
    return out
