"""Preference pairs made offline: completions sampled from a policy on a task's training
prompts, ranked by a gold scorer, best against worst.

CLI layer (entry points): nothing in the package imports it.

Examples::

    python -m a3po_jax.cli.make_preferences --task letters --model tiny \\
        --prompts 8 --samples 4 --out pairs.jsonl
    python -m a3po_jax.cli.make_preferences --task chain_sum --model smollm2 \\
        --prompts 512 --samples 4 --temperature 1.0 --max-new-tokens 64 --out pairs.jsonl

For each of the first ``--prompts`` prompts of the task's **train** split (never a test
prompt: the pairs train a reward model whose policy is then judged on the test split),
``--samples`` completions are sampled from ``--model`` on an in-process inference host, as
the evaluation command samples them, and scored by the gold scorer (``--gold``: the task's
verifier by default, through :class:`a3po_jax.tasks.scorers.Scorer`, the interface the
trainer's ``task.reward`` uses). The best and the worst completion of a prompt become one
line of the JSONL file when their scores differ::

    {"prompt_id": ..., "prompt": [chat messages], "chosen": text, "rejected": text,
     "chosen_score": s+, "rejected_score": s-}

A prompt whose completions all score the same gives no pair (a tie, counted). The counts
are printed at the end, and a progress line at each tenth of the prompts sampled.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from a3po_jax.cli.refusals import Refused, run_refusing
from a3po_jax.tasks import make_task, render_prompt
from a3po_jax.tasks.scorers import DEFAULT_REWARD, Scorer, resolve_scorer
from a3po_jax.training.config_values import json_object

PROG = "python -m a3po_jax.cli.make_preferences"
SPLIT = "train"  # pairs come from training prompts only
HELD_OUT = "test"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--task", required=True, help="task name (a3po_jax.tasks.make_task)")
    parser.add_argument("--task-options", default="{}", help="JSON object of task arguments")
    parser.add_argument("--model", required=True, help="tiny | smollm2 | checkpoint path")
    parser.add_argument("--prompts", type=int, required=True, help="the first N train prompts")
    parser.add_argument("--samples", type=int, required=True, help="K completions per prompt")
    parser.add_argument("--out", required=True, help="the JSONL file written")
    parser.add_argument("--gold", default=DEFAULT_REWARD, help="the scorer (task.reward's forms)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-slots", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_refusing(PROG, _run, parse_args(argv))


def training_prompts(task: Any, n: int) -> list:
    """The first ``n`` prompts of the train split; AssertionError if any is a test prompt."""
    prompts = list(task.prompts(SPLIT))
    if not 1 <= n <= len(prompts):
        raise Refused(f"--prompts must be in [1, {len(prompts)}] for {task.name}/{SPLIT}")
    chosen = prompts[:n]
    held_out = {p.prompt_id for p in task.prompts(HELD_OUT)}
    leaked = [p.prompt_id for p in chosen if p.prompt_id in held_out]
    assert not leaked, f"test-split prompts among the training prompts: {leaked}"
    return chosen


def preference_pairs(
    prompts: Sequence[Any], completions: Sequence[Sequence[str]], scorer: Scorer
) -> tuple[list[dict], int]:
    """One pair per prompt whose completions' scores differ: the best (first of the best)
    against the worst (first of the worst), each prompt's K scored in one call; returns the
    pairs and the number of prompts left out as ties."""
    pairs, ties = [], 0
    for prompt, texts in zip(prompts, completions, strict=True):
        scores = [float(s) for s in scorer.score([prompt] * len(texts), list(texts))]
        best = max(range(len(texts)), key=lambda i: (scores[i], -i))
        worst = min(range(len(texts)), key=lambda i: (scores[i], i))
        if scores[best] == scores[worst]:
            ties += 1
            continue
        pairs.append(
            {
                "prompt_id": prompt.prompt_id,
                "prompt": [dict(m) for m in prompt.messages],
                "chosen": texts[best],
                "rejected": texts[worst],
                "chosen_score": scores[best],
                "rejected_score": scores[worst],
            }
        )
    return pairs, ties


def _run(args: argparse.Namespace) -> int:
    if args.samples < 2:
        raise Refused("--samples must be >= 2 (a pair needs two completions)")
    if args.max_new_tokens < 1 or args.num_slots < 1 or args.temperature < 0:
        raise Refused("--max-new-tokens and --num-slots must be >= 1, --temperature >= 0")
    options = json_object("--task-options", args.task_options, error=Refused)
    try:
        task = make_task(args.task, **options)
    except (TypeError, ValueError, KeyError) as err:
        raise Refused(f"task {args.task!r} with options {args.task_options}: {err}") from err
    prompts = training_prompts(task, args.prompts)

    from a3po_jax.model.loader import load_model  # heavy: once the arguments are good

    try:
        policy = load_model(args.model, seed=args.seed)
    except FileNotFoundError as err:
        raise Refused(str(err)) from err
    try:
        scorer, _ = resolve_scorer(args.gold, task=task, tokenizer=policy.tokenizer)
    except (ValueError, ImportError) as err:
        raise Refused(f"--gold {args.gold!r}: {err}") from err
    completions = _sample(args, policy, prompts)
    pairs, ties = preference_pairs(prompts, completions, scorer)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for pair in pairs:
            f.write(json.dumps(pair) + "\n")
    print(
        f"{len(pairs)} pairs from {len(prompts)} {task.name}/{SPLIT} prompts x {args.samples} "
        f"samples ({ties} ties skipped), scored by {scorer.name}@{scorer.version}: {out}"
    )
    return 0


def progress_printer(samples: int, *, parts: int = 10) -> Callable[[int, int], None]:
    """A `progress` callback that prints a line each time another tenth (``parts``) of the
    prompts is sampled, with the seconds since it was made: 512 prompts take minutes."""
    start = time.perf_counter()
    printed = 0  # parts already announced

    def progress(done: int, total: int) -> None:
        nonlocal printed
        part = done * parts // total  # integers: 9 of 30 is three tenths exactly
        if part > printed:
            printed = part
            seconds = time.perf_counter() - start
            print(f"sampled {done}/{total} prompts x {samples} ({seconds:.0f} s)", flush=True)

    return progress


def _sample(args: argparse.Namespace, policy, prompts) -> list[list[str]]:
    """K decoded completions per prompt, sampled on an in-process host."""
    from a3po_jax.analysis.evaluation import policy_generate_fn

    tokenizer = policy.tokenizer
    rendered = [render_prompt(tokenizer, p) for p in prompts]
    with policy_generate_fn(
        policy,
        rendered,
        num_slots=args.num_slots,
        max_new_tokens=args.max_new_tokens,
        progress=progress_printer(args.samples),
    ) as generate:
        samples = generate(
            rendered,
            num_samples=args.samples,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
    return [
        [tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in group]
        for group in samples
    ]


if __name__ == "__main__":
    sys.exit(main())
