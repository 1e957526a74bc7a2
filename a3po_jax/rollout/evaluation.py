"""Held-out scoring during a run: ``eval/*`` of the weights the run's host serves.

Rollout layer (host-side shell). The requests go to the run's own host beside the training
groups, through the rollout workers' side channel (the collector hands their results over):
no second host and no second copy of the weights. The scoring itself is
:func:`a3po_jax.analysis.evaluation.evaluate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from a3po_jax.inference.protocol import Host


@dataclasses.dataclass
class HeldOutEvaluation:
    """Scores the served weights of a run on its task's held-out split.

    Attributes:
      cfg: the run's config (``eval_prompts``, ``eval_budget``, ``eval_samples``, the
        rollout temperature).
      task, tokenizer, stop_tokens: the run's task, tokenizer and end tokens.
      workers: the run's rollout workers (their side channel reaches the run's host); None
        in a replay, which has no host.
      replay_host: in a replay, builds an in-process host serving ``(params, version)``;
        built once, at the first evaluation, and pushed each later version.
    """

    cfg: Any
    task: Any
    tokenizer: Any
    stop_tokens: tuple[int, ...]
    workers: Any = None
    replay_host: Callable[[Any, int], Host] | None = None
    _replay_host: Host | None = dataclasses.field(default=None, init=False, repr=False)

    def __call__(self, params: Any, version: int) -> dict[str, float]:
        """``eval/*`` of version ``version`` (:func:`evaluation_metrics`) and ``time/eval_s``.

        The host serves ``version`` to these requests: under ``drain`` they wait for the
        requests of older versions, under the in-flight policies the staged weights swap in
        before anything submitted after the push starts. In a replay ``params`` are pushed
        to the evaluation's own host."""
        t0 = time.perf_counter()
        if self.workers is not None:
            channel = self.workers.side_channel()
        else:
            if self._replay_host is None:
                self._replay_host = self.replay_host(params, version)
            else:
                self._replay_host.update_weights(params, version)
            channel = contextlib.nullcontext(self._replay_host)
        cfg = self.cfg
        with channel as host:
            metrics = evaluation_metrics(
                host,
                self.task,
                self.tokenizer,
                num_prompts=cfg.eval_prompts,
                max_new_tokens=cfg.eval_budget,
                stop_tokens=self.stop_tokens,
                seed=version,
                samples=cfg.eval_samples,
                temperature=cfg.rollout.temperature,
            )
        return {**metrics, "time/eval_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Closes the replay's evaluation host, if one was built."""
        if self._replay_host is not None:
            self._replay_host.close()
            self._replay_host = None


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
    from a3po_jax.analysis.evaluation import EVAL_SPLIT, evaluate, host_generate_fn

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
