"""Score a policy (a run's checkpoint or a named model) on a task: pass@1 / mean@k.

CLI layer (entry points): nothing in the package imports it.

Examples::

    python -m a3po_jax.cli.evaluate --run-dir runs/quickstart_a3po    # on what the run trained on
    python -m a3po_jax.cli.evaluate --run-dir RUN --step 40 --num-prompts 200
    python -m a3po_jax.cli.evaluate --model smollm2 --task chain_sum --num-prompts 64
    python -m a3po_jax.cli.evaluate --model smollm2 --k 4 --temperature 1.0  # mean@4

With ``--run-dir`` the run's ``config.json`` says what is scored, as the trainer's own
evaluation (``eval_every``) scores it: the run's model (its newest checkpoint, or
``--step``), its task with its options, the test split, its ``eval_prompts`` prompts and
its answer budget (``eval_max_new_tokens``, else ``rollout.max_new_tokens``); prompts are
rendered with the run's tokenizer and completions stop at its EOS. A flag given explicitly
overrides the run's value and says so. Without ``--run-dir`` the defaults are a 2-term
1-digit chain_sum.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

from a3po_jax.analysis.evaluation import EVAL_SPLIT, EvalSpec, evaluate, policy_generate_fn
from a3po_jax.cli.refusals import Refused, run_refusing
from a3po_jax.tasks import make_task, render_prompt
from a3po_jax.training.config import ConfigError, ModelSection, config_from_dict
from a3po_jax.training.config_values import json_object

PROG = "python -m a3po_jax.cli.evaluate"
# What is scored without a run: docs/tasks.md's SmolLM2 figure (2-term, 1-digit chain_sum).
DEFAULT_SPEC = EvalSpec(
    task="chain_sum",
    task_options='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
    split=EVAL_SPLIT,
    num_prompts=64,
    max_new_tokens=64,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="smollm2 (default) | tiny | checkpoint path")
    source.add_argument(
        "--run-dir",
        help="evaluate a trained run: its config's model with the params of its newest "
        "checkpoint, on what its config says (the flags below override)",
    )
    parser.add_argument("--step", type=int, help="checkpoint step with --run-dir (default: newest)")
    # None = not given: the run's value (with --run-dir) or DEFAULT_SPEC's.
    parser.add_argument("--task", help=f"task name (default: {DEFAULT_SPEC.task})")
    parser.add_argument("--task-options", help="JSON object of task keyword arguments")
    parser.add_argument("--split", help=f"split to score (default: {EVAL_SPLIT})")
    parser.add_argument("--num-prompts", type=int, help="score the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, help="token budget per completion")
    parser.add_argument("--k", type=int, default=1, help="samples per prompt (mean@k)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--num-slots", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result (with per-prompt records) here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_refusing(PROG, _run, parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    if args.step is not None and not args.run_dir:
        raise Refused("--step needs --run-dir")
    _check_task_options(args)
    run_cfg = _read_run_config(args.run_dir) if args.run_dir else None
    if run_cfg is not None:
        base, origin = EvalSpec.from_run_config(run_cfg), "the run's config"
    else:
        base, origin = DEFAULT_SPEC, "the defaults"
    spec, changed = base.override(
        task=args.task,
        task_options=args.task_options,
        split=args.split,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
    )
    if run_cfg is not None:
        for line in changed:
            print(f"{PROG}: a flag overrides the run's config: {line}", file=sys.stderr)

    try:
        task = make_task(spec.task, **spec.task_kwargs)
        prompts = task.prompts(spec.split)
    except (TypeError, ValueError, KeyError) as err:
        raise Refused(
            f"task {spec.task!r} with options {spec.task_options} ({origin}): {err}"
        ) from err
    if not prompts:
        raise Refused(f"task {spec.task!r} has no prompts in split {spec.split!r}")
    num_prompts = spec.num_prompts
    if run_cfg is not None and args.num_prompts is None:
        num_prompts = min(num_prompts, len(prompts))  # as the trainer caps eval_prompts
    if not 1 <= num_prompts <= len(prompts):
        raise Refused(f"--num-prompts must be in [1, {len(prompts)}] for {task.name}/{spec.split}")

    policy = _load_policy(args, run_cfg)
    print(
        f"task={spec.task} options={spec.task_options} split={spec.split} "
        f"prompts={num_prompts} max_new_tokens={spec.max_new_tokens} (from {origin}"
        f"{', with the overrides above' if changed and run_cfg is not None else ''})",
        file=sys.stderr,
    )
    result = _evaluate_on_host(args, policy, task, spec, prompts[:num_prompts])
    print(result.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0


def _check_task_options(args: argparse.Namespace) -> None:
    """``--task-options`` must be a JSON object; it is kept in its canonical JSON form."""
    if args.task_options is None:
        return
    options = json_object("--task-options", args.task_options, error=Refused)
    args.task_options = json.dumps(options)


def _read_run_config(run_dir: str):
    """The run's config, read from ``run_dir/config.json``."""
    config_file = pathlib.Path(run_dir) / "config.json"
    try:
        return config_from_dict(json.loads(config_file.read_text()))
    except FileNotFoundError as err:
        raise Refused(f"--run-dir {run_dir}: no config.json (not a run directory)") from err
    except (json.JSONDecodeError, ConfigError, TypeError) as err:
        raise Refused(f"--run-dir {run_dir}: config.json is not a run config: {err}") from err


def _load_policy(args: argparse.Namespace, run_cfg):
    """The model scored: the run's, with its checkpoint's weights, or ``--model``."""
    # Heavy imports once the arguments are known to be good.
    from a3po_jax.model.loader import load_model

    # Read-only check first: the checkpoint manager would create checkpoints/ in the run.
    if run_cfg is not None and not (pathlib.Path(args.run_dir) / "checkpoints").is_dir():
        raise Refused(f"--run-dir {args.run_dir}: no checkpoints/ (nothing to evaluate)")
    section = run_cfg.model if run_cfg is not None else ModelSection(name=args.model or "smollm2")
    try:  # the one model loader, as the trainer and the gRPC server build models
        policy = load_model(
            section.name,
            param_dtype=section.param_dtype,
            compute_dtype=section.compute_dtype,
            seed=section.seed,
        )
    except FileNotFoundError as err:
        raise Refused(str(err)) from err
    if run_cfg is not None:
        from a3po_jax.training.checkpointing import CheckpointManager

        manager = CheckpointManager(pathlib.Path(args.run_dir) / "checkpoints", async_save=False)
        try:
            policy.params = manager.restore_params(args.step, params_template=policy.params)
        except FileNotFoundError as err:
            raise Refused(f"--run-dir {args.run_dir}: {err}") from err
        step = args.step if args.step is not None else manager.latest_step()
        manager.close()
        print(f"evaluating {args.run_dir} at step {step}", file=sys.stderr)
    return policy


def _evaluate_on_host(args: argparse.Namespace, policy, task, spec: EvalSpec, prompts):
    """Scores ``prompts`` (the first of the split) with the policy on an in-process host."""
    rendered = [render_prompt(policy.tokenizer, p) for p in prompts]
    with policy_generate_fn(
        policy, rendered, num_slots=args.num_slots, max_new_tokens=spec.max_new_tokens
    ) as generate:
        return evaluate(
            task,
            spec.split,
            generate,
            policy.tokenizer,
            num_prompts=len(prompts),
            k=args.k,
            temperature=args.temperature,
            max_new_tokens=spec.max_new_tokens,
            seed=args.seed,
        )


if __name__ == "__main__":
    sys.exit(main())
