"""Evaluation: pass@1 (greedy) and mean@k (sampled) accuracy on a task split, with standard error.

The caller supplies `generate_fn`, the inference engine's batch generation:

    generate_fn(prompt_token_lists: list[list[int]], *, num_samples: int,
                temperature: float, max_new_tokens: int, seed: int)
        -> list[list[tuple[list[int], bool]]]

returning, for each prompt, `num_samples` pairs (completion token ids, finished), where
`finished` is True when the sample ended with EOS. Completions are decoded with the
tokenizer, special tokens skipped, and scored by `task.score` (correctness in [0, 1], no
reward shaping).

Metrics, over n prompts with k samples each and per-prompt mean score m_i:

    accuracy  = mean_i m_i                      (pass@1 when k = 1; mean@k otherwise)
    stderr    = sqrt(mean_i (m_i - accuracy)^2 / n)
    pass@k    = fraction of prompts with at least one sample scored 1

With k = 1 and 0/1 scores the stderr is exactly the binomial sqrt(p (1 - p) / n); with
k > 1 it is the standard error over prompts of the per-prompt means (prompts are the
independent units; samples of one prompt are correlated).

What a run is scored on (task, options, split, prompts, generation budget) is an
:class:`EvalSpec`, read from the run's config by :meth:`EvalSpec.from_run_config` the same
way the trainer's own evaluation (``eval_every``) reads it. Analysis layer: imports the
tasks and the config, never the trainer; the command line is :mod:`a3po_jax.cli.evaluate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from a3po_jax.tasks.task import Prompt, Task, render_prompt
from a3po_jax.training.config import EVAL_SPLIT, TrainConfig

GenerateFn = Callable[..., list[list[tuple[list[int], bool]]]]
# EVAL_SPLIT, the split a run is evaluated on, is the config's: the trainer draws prompts
# from ``task.split`` (train) and its own evaluation scores the test split, as the CLI does.


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What an evaluation scores, and with which generation budget."""

    task: str  # a name for a3po_jax.tasks.make_task
    task_options: str  # JSON object of the task's keyword arguments
    split: str  # the split whose first `num_prompts` prompts are scored
    num_prompts: int  # prompts scored (capped at the split's size by `capped`)
    max_new_tokens: int  # token budget per completion

    @classmethod
    def from_run_config(cls, cfg: TrainConfig) -> EvalSpec:
        """What a run's own evaluation scores: its task with its options, the test split,
        its ``eval_prompts`` prompts and its budget ``eval_max_new_tokens`` (0: the
        rollouts' ``rollout.max_new_tokens``)
        (prompts are rendered with the run's tokenizer and completions stop at its EOS,
        as in training)."""
        return cls(
            task=cfg.task.name,
            task_options=cfg.task.options,
            split=EVAL_SPLIT,
            num_prompts=cfg.eval_prompts,
            max_new_tokens=cfg.eval_budget,
        )

    @property
    def task_kwargs(self) -> dict[str, Any]:
        return json.loads(self.task_options)

    def override(self, **values: Any) -> tuple[EvalSpec, list[str]]:
        """This spec with the fields given a different value (None: not given) replaced,
        and one line per field that changed (``"task: 'letters' -> 'chain_sum'"``)."""
        changes = {
            k: v
            for k, v in values.items()
            if v is not None and not _same_value(k, v, getattr(self, k))
        }
        notes = [f"{k}: {getattr(self, k)!r} -> {v!r}" for k, v in changes.items()]
        return dataclasses.replace(self, **changes), notes


def _same_value(field: str, a: Any, b: Any) -> bool:
    # Options are JSON text: '{"a": 1}' and '{"a":1}' are the same options.
    return json.loads(a) == json.loads(b) if field == "task_options" else a == b


@dataclasses.dataclass(frozen=True)
class EvalRecord:
    """The samples of one prompt and their scores."""

    prompt_id: str
    answer: str  # the gold answer
    completions: tuple[str, ...]  # decoded, special tokens skipped
    extracted: tuple[str | None, ...]  # the answer the scorer read from each completion
    scores: tuple[float, ...]  # task.score of each completion, in [0, 1]
    finished: tuple[bool, ...]  # whether each sample ended with EOS
    num_tokens: tuple[int, ...]  # completion length of each sample in tokens

    @property
    def mean_score(self) -> float:
        return float(np.mean(self.scores))


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Accuracy of a task split with its standard error, and the per-prompt records."""

    task: str
    split: str
    k: int  # samples per prompt
    temperature: float
    n: int  # number of prompts
    accuracy: float  # mean over prompts of the mean score: pass@1 (k = 1) or mean@k
    stderr: float  # standard error of `accuracy` over prompts
    pass_at_k: float  # fraction of prompts with at least one sample scored 1
    finished_fraction: float  # fraction of samples that ended with EOS
    mean_completion_tokens: float
    records: tuple[EvalRecord, ...]

    @property
    def interval(self) -> tuple[float, float]:
        """The 95 % confidence interval of `accuracy` (:func:`accuracy_interval`)."""
        return accuracy_interval(np.array([r.scores for r in self.records], dtype=np.float64))

    @property
    def finished_accuracy(self) -> float:
        """Mean score of the samples that ended with EOS (NaN when none did): what a rise in
        `accuracy` owes to answering right, apart from answering at all."""
        scores = np.array([r.scores for r in self.records], dtype=np.float64)
        finished = np.array([r.finished for r in self.records], dtype=bool)
        return float(scores[finished].mean()) if finished.any() else float("nan")

    @property
    def metric(self) -> str:
        """The name of `accuracy`: "pass@1" for one sample per prompt, else "mean@k"."""
        return "pass@1" if self.k == 1 else f"mean@{self.k}"

    def summary(self) -> str:
        """One line, e.g. "chain_sum/test pass@1 = 0.594 ± 0.061 (n=64, T=0.0, ...)"."""
        extra = f", pass@{self.k} = {self.pass_at_k:.3f}" if self.k > 1 else ""
        scoring = f" scoring {self.finished_accuracy:.3f}" if self.finished_fraction else ""
        return (
            f"{self.task}/{self.split} {self.metric} = {self.accuracy:.3f} ± {self.stderr:.3f} "
            f"(n={self.n}, T={self.temperature}{extra}, finished {self.finished_fraction:.0%}"
            f"{scoring}, mean length {self.mean_completion_tokens:.1f} tokens)"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the metrics and records."""
        out = dataclasses.asdict(self)
        out["metric"] = self.metric
        return out


def accuracy_with_stderr(per_prompt_scores: np.ndarray) -> tuple[float, float]:
    """Mean of per-prompt mean scores and its standard error over prompts.

    Args:
      per_prompt_scores: [N, K] scores of K samples for each of N prompts.

    Returns:
      (accuracy, stderr), stderr = std_over_prompts(mean_k) / sqrt(N) with the population
      std (ddof 0), which for K = 1 and 0/1 scores is the binomial sqrt(p (1 - p) / N).
    """
    scores = np.asarray(per_prompt_scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(f"per_prompt_scores must have shape [N, K] with N, K >= 1: {scores.shape}")
    means = scores.mean(axis=1)  # [N]
    accuracy = float(means.mean())
    stderr = float(np.sqrt(np.mean((means - accuracy) ** 2) / means.shape[0]))
    return accuracy, stderr


# Two-sided 95 % quantile of the standard normal.
Z_95 = 1.959963984540054


def accuracy_interval(per_prompt_scores: np.ndarray, *, z: float = Z_95) -> tuple[float, float]:
    """The 95 % confidence interval (``z`` = 1.96) of :func:`accuracy_with_stderr`'s accuracy.

    * One sample per prompt and every score 0 or 1 (greedy pass@1 on a 0/1 verifier): the
      Wilson score interval of c correct out of n, p = c / n,

          (p + z²/2n ± z·sqrt(p(1 − p)/n + z²/4n²)) / (1 + z²/n),

      which stays inside [0, 1] and does not shrink to a point at 0 or n correct (the
      normal interval p ± z·sqrt(p(1 − p)/n) is [0, 0] for 0 of 64; Wilson's is
      [0, z²/(n + z²)] = [0, 0.057]).
    * Otherwise (mean@k, partial-credit scores): accuracy ± z·stderr over prompts (the
      prompts are the independent units), clipped to [0, 1].

    Args:
      per_prompt_scores: [N, K] scores of K samples for each of N prompts.

    Returns:
      (low, high).
    """
    scores = np.asarray(per_prompt_scores, dtype=np.float64)
    accuracy, stderr = accuracy_with_stderr(scores)
    n, k = scores.shape
    if k == 1 and np.all((scores == 0.0) | (scores == 1.0)):
        z2 = z * z
        centre = (accuracy + z2 / (2 * n)) / (1 + z2 / n)
        half = z * math.sqrt(accuracy * (1 - accuracy) / n + z2 / (4 * n * n)) / (1 + z2 / n)
        return max(0.0, centre - half), min(1.0, centre + half)
    return max(0.0, accuracy - z * stderr), min(1.0, accuracy + z * stderr)


def evaluate(
    task: Task,
    split: str,
    generate_fn: GenerateFn,
    tokenizer: Any,
    *,
    num_prompts: int | None = None,
    k: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    seed: int = 0,
    batch_size: int | None = None,
) -> EvalResult:
    """Accuracy of `generate_fn`'s completions on the first `num_prompts` prompts of a split.

    Greedy pass@1 is `k=1, temperature=0.0`; mean@k samples `k` completions per prompt at
    `temperature > 0`.

    Args:
      task: the task whose split is evaluated.
      split: e.g. "test".
      generate_fn: the engine's batch generation (signature in the module docstring).
      tokenizer: transformers tokenizer, for the chat template and decoding.
      num_prompts: evaluate the first this many prompts of the split (None: all).
      k: samples per prompt.
      temperature: sampling temperature (0 = greedy).
      max_new_tokens: token budget per completion.
      seed: sampling seed given to `generate_fn` (batch i gets `seed + i`).
      batch_size: prompts per `generate_fn` call (None: all in one call).

    Returns:
      An `EvalResult`.
    """
    _check_sampling_args(k, temperature, max_new_tokens, batch_size)
    all_prompts = task.prompts(split)
    if num_prompts is None:
        num_prompts = len(all_prompts)
    if not isinstance(num_prompts, int) or not 1 <= num_prompts <= len(all_prompts):
        raise ValueError(
            f"evaluate: num_prompts must be in [1, {len(all_prompts)}] for {task.name}/{split}, "
            f"got {num_prompts!r}"
        )
    prompts: Sequence[Prompt] = [all_prompts[i] for i in range(num_prompts)]
    step = batch_size or num_prompts

    records = []
    for batch_index, start in enumerate(range(0, num_prompts, step)):
        batch = prompts[start : start + step]
        samples = generate_fn(
            [render_prompt(tokenizer, p) for p in batch],
            num_samples=k,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed + batch_index,
        )
        _check_samples(samples, num_prompts=len(batch), k=k)
        for prompt, prompt_samples in zip(batch, samples, strict=True):
            records.append(_score_prompt(task, tokenizer, prompt, prompt_samples))

    scores = np.array([r.scores for r in records], dtype=np.float64)  # [N, K]
    accuracy, stderr = accuracy_with_stderr(scores)
    finished = np.array([r.finished for r in records], dtype=np.float64)  # [N, K]
    lengths = np.array([r.num_tokens for r in records], dtype=np.float64)  # [N, K]
    return EvalResult(
        task=task.name,
        split=split,
        k=k,
        temperature=float(temperature),
        n=num_prompts,
        accuracy=accuracy,
        stderr=stderr,
        pass_at_k=float(np.mean(np.any(scores >= 1.0, axis=1))),
        finished_fraction=float(finished.mean()),
        mean_completion_tokens=float(lengths.mean()),
        records=tuple(records),
    )


def _check_sampling_args(
    k: int, temperature: float, max_new_tokens: int, batch_size: int | None
) -> None:
    """:func:`evaluate`'s sampling arguments, each named when it is out of range."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"evaluate: k must be an int >= 1, got {k!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"evaluate: temperature must be finite and >= 0, got {temperature!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"evaluate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"evaluate: batch_size must be None or an int >= 1, got {batch_size!r}")


def _check_samples(samples: Any, *, num_prompts: int, k: int) -> None:
    if not isinstance(samples, Sequence) or len(samples) != num_prompts:
        got = len(samples) if isinstance(samples, Sequence) else type(samples).__name__
        raise ValueError(f"generate_fn returned {got} sample lists for {num_prompts} prompts")
    for i, prompt_samples in enumerate(samples):
        if len(prompt_samples) != k:
            raise ValueError(
                f"generate_fn returned {len(prompt_samples)} samples for prompt {i}, "
                f"expected num_samples={k}"
            )
        for tokens, finished in prompt_samples:
            if not isinstance(tokens, (Sequence, np.ndarray)) or not isinstance(
                finished, (bool, np.bool_)
            ):
                raise ValueError(
                    f"generate_fn: each sample must be (token_ids, finished: bool), got "
                    f"({type(tokens).__name__}, {finished!r}) for prompt {i}"
                )


def _score_prompt(
    task: Task, tokenizer: Any, prompt: Prompt, samples: Sequence[tuple[list[int], bool]]
) -> EvalRecord:
    texts, extracted, scores, finished, lengths = [], [], [], [], []
    for tokens, done in samples:
        text = tokenizer.decode(list(tokens), skip_special_tokens=True)
        texts.append(text)
        extracted.append(task.extract_answer(prompt, text))
        scores.append(float(task.score(prompt, text)))
        finished.append(bool(done))
        lengths.append(len(tokens))
    return EvalRecord(
        prompt_id=prompt.prompt_id,
        answer=prompt.answer,
        completions=tuple(texts),
        extracted=tuple(extracted),
        scores=tuple(scores),
        finished=tuple(finished),
        num_tokens=tuple(lengths),
    )


# ---------------------------------------------------------------------------------------------
# The inference host as a `generate_fn`, and a command line.


def host_generate_fn(
    host: Any,
    *,
    stop_tokens: Sequence[int] = (),
    progress: Callable[[int, int], None] | None = None,
) -> GenerateFn:
    """A `generate_fn` over an inference host (`InferenceHost` or the gRPC client).

    Each prompt is one request of `num_samples` samples; results are collected by request id
    so the order returned is the prompts' order whatever order they finish in. ``progress``,
    if given, is called with (prompts complete, prompts) each time a prompt's last sample
    arrives.
    """
    from a3po_jax.inference.types import GenerateRequest, SamplingParams

    def generate(prompt_token_lists, *, num_samples, temperature, max_new_tokens, seed):
        sampling = SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens, stop_tokens=tuple(stop_tokens)
        )
        want = {}
        for i, tokens in enumerate(prompt_token_lists):
            rid = f"eval-{seed}-{i}"
            want[rid] = i
            host.submit(
                GenerateRequest(
                    request_id=rid,
                    prompt_tokens=tuple(int(t) for t in tokens),
                    num_samples=num_samples,
                    sampling=sampling,
                    seed=seed * 1_000_003 + i,
                )
            )
        out: list[list[Any]] = [[None] * num_samples for _ in prompt_token_lists]
        remaining = len(prompt_token_lists) * num_samples
        missing = [num_samples] * len(prompt_token_lists)  # per prompt
        complete = 0  # prompts with every sample in
        while remaining:
            for res in host.poll(timeout=1.0):
                if res.request_id not in want:
                    continue
                if res.finish_reason == "error":
                    raise RuntimeError(f"generation failed for {res.request_id}: {res.error}")
                out[want[res.request_id]][res.sample_index] = (
                    [int(t) for t in res.tokens],
                    res.finish_reason == "stop",
                )
                remaining -= 1
                missing[want[res.request_id]] -= 1
                if missing[want[res.request_id]] == 0:
                    complete += 1
                    if progress is not None:
                        progress(complete, len(missing))
        return out

    return generate


@contextlib.contextmanager
def policy_generate_fn(
    policy: Any,
    rendered_prompts: Sequence[Sequence[int]],
    *,
    num_slots: int,
    max_new_tokens: int,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[GenerateFn]:
    """A `generate_fn` over an in-process host serving ``policy`` (a `load_policy` result),
    sized for ``rendered_prompts`` (one prefill bucket: the smallest power of two from 64
    that holds the longest), stopping at the tokenizer's EOS; the host closes on exit.
    ``progress`` as in `host_generate_fn`."""
    from a3po_jax.inference.host import InferenceHost

    bucket = 64
    while bucket < max(len(r) for r in rendered_prompts):
        bucket *= 2
    eos = policy.tokenizer.eos_token_id
    with InferenceHost(
        policy.config,
        policy.params,
        num_slots=num_slots,
        prefill_buckets=(bucket,),
        max_cache_len=bucket + max_new_tokens,
    ) as host:
        stop = () if eos is None else (int(eos),)
        yield host_generate_fn(host, stop_tokens=stop, progress=progress)
