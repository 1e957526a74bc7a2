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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from a3po_jax.tasks.task import Prompt, Task, render_prompt

GenerateFn = Callable[..., list[list[tuple[list[int], bool]]]]


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
    def metric(self) -> str:
        """The name of `accuracy`: "pass@1" for one sample per prompt, else "mean@k"."""
        return "pass@1" if self.k == 1 else f"mean@{self.k}"

    def summary(self) -> str:
        """One line, e.g. "chain_sum/test pass@1 = 0.594 ± 0.061 (n=64, T=0.0, ...)"."""
        extra = f", pass@{self.k} = {self.pass_at_k:.3f}" if self.k > 1 else ""
        return (
            f"{self.task}/{self.split} {self.metric} = {self.accuracy:.3f} ± {self.stderr:.3f} "
            f"(n={self.n}, T={self.temperature}{extra}, finished {self.finished_fraction:.0%}, "
            f"mean length {self.mean_completion_tokens:.1f} tokens)"
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
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"evaluate: k must be an int >= 1, got {k!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"evaluate: temperature must be finite and >= 0, got {temperature!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"evaluate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"evaluate: batch_size must be None or an int >= 1, got {batch_size!r}")
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


def host_generate_fn(host: Any, *, stop_tokens: Sequence[int] = ()) -> GenerateFn:
    """A `generate_fn` over an inference host (`InferenceHost` or the gRPC client).

    Each prompt is one request of `num_samples` samples; results are collected by request id
    so the order returned is the prompts' order whatever order they finish in.
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
        return out

    return generate


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m a3po_jax.cli.evaluate --model smollm2 --task chain_sum --num-prompts 64`."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m a3po_jax.cli.evaluate",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | checkpoint path")
    parser.add_argument(
        "--run-dir",
        help="evaluate a trained run: its config's model with the params of its newest "
        "checkpoint (overrides --model)",
    )
    parser.add_argument("--step", type=int, help="checkpoint step with --run-dir (default: newest)")
    parser.add_argument("--task", default="chain_sum")
    parser.add_argument(
        "--task-options",
        default='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        help="JSON object of task keyword arguments",
    )
    parser.add_argument("--split", default="test")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--k", type=int, default=1, help="samples per prompt (mean@k)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-slots", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result (with per-prompt records) here")
    args = parser.parse_args(argv)

    from a3po_jax.inference.host import InferenceHost
    from a3po_jax.tasks import make_task
    from a3po_jax.training.config import ModelSection
    from a3po_jax.training.trainer import load_policy

    task = make_task(args.task, **json.loads(args.task_options))
    if args.run_dir:
        import pathlib

        from a3po_jax.training.checkpointing import CheckpointManager
        from a3po_jax.training.config import config_from_dict

        run_cfg = config_from_dict(
            json.loads((pathlib.Path(args.run_dir) / "config.json").read_text())
        )
        policy = load_policy(run_cfg.model)
        manager = CheckpointManager(pathlib.Path(args.run_dir) / "checkpoints", async_save=False)
        policy.params = manager.restore_params(args.step, params_template=policy.params)
        print(f"evaluating {args.run_dir} at step {args.step or manager.latest_step()}")
    else:
        policy = load_policy(ModelSection(name=args.model))
    eos = policy.tokenizer.eos_token_id
    longest = max(
        len(render_prompt(policy.tokenizer, p))
        for p in task.prompts(args.split)[: args.num_prompts]
    )
    bucket = 64
    while bucket < longest:
        bucket *= 2
    with InferenceHost(
        policy.config,
        policy.params,
        num_slots=args.num_slots,
        prefill_buckets=(bucket,),
        max_cache_len=bucket + args.max_new_tokens,
    ) as host:
        result = evaluate(
            task,
            args.split,
            host_generate_fn(host, stop_tokens=() if eos is None else (eos,)),
            policy.tokenizer,
            num_prompts=args.num_prompts,
            k=args.k,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
    print(result.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
