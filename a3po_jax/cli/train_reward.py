"""Train a reward model on preference pairs with the Bradley-Terry loss.

CLI layer (entry points): nothing in the package imports it.

Examples::

    python -m a3po_jax.cli.train_reward --pairs pairs.jsonl --model smollm2 --out rm/
    python -m a3po_jax.cli.train_reward --pairs pairs.jsonl --model tiny --out rm/ --steps 40
    python -m a3po_jax.cli.train_reward --pairs pairs.jsonl --model smollm2 --out rm/ --resume

``--pairs`` is JSON Lines, one ``{"prompt": str or [chat messages], "chosen": str,
"rejected": str}`` per line (other keys allowed); a malformed line stops the command with
``file:line: field ...``. Each side is tokenized as the pipeline's reward stage tokenizes a
rollout (`a3po_jax.tasks.reward_model_scorer.reward_model_tokens`). A fraction of the
prompts, chosen by a hash of the prompt, is held out; the held-out pair accuracy and loss
are printed before and after training. The model (``tiny``, ``smollm2``, a causal-LM
checkpoint directory with a new zero head, or a reward checkpoint to train on) is trained
with AdamW on every device of a (data, fsdp, tensor) mesh, one line per ``--log-every``
steps.

``--out`` receives the reward model as a Hugging Face sequence-classification checkpoint
(config.json, model.safetensors, tokenizer files) and ``reward_model.json`` (base model,
steps, pairs, held-out accuracy and loss), written last, once the rest is in place:
``load_reward_scorer(OUT)`` and ``task.reward=model:OUT`` read it. Training state is
checkpointed with orbax in ``OUT/checkpoints`` every ``--checkpoint-every`` steps; after a
crash ``--resume`` continues from the newest one with the same batches (a run into a
directory that has checkpoints is refused without it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence

import numpy as np

from a3po_jax.cli.refusals import Refused, run_refusing

PROG = "python -m a3po_jax.cli.train_reward"
CHECKPOINTS = "checkpoints"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--pairs", required=True, help="JSONL of prompt, chosen, rejected")
    parser.add_argument(
        "--model", required=True, help="tiny | smollm2 | checkpoint directory (causal or reward)"
    )
    parser.add_argument("--out", required=True, help="directory for the reward model")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="0 = no clipping")
    parser.add_argument(
        "--holdout-fraction", type=float, default=0.1, help="share of prompts held out"
    )
    parser.add_argument("--seed", type=int, default=0, help="batch order (and a tiny model)")
    parser.add_argument(
        "--max-length", type=int, default=512, help="longer sequences keep their last tokens"
    )
    parser.add_argument(
        "--head-std", type=float, default=0.0, help="new head: 0 = zeros, else normal(std)"
    )
    parser.add_argument("--param-dtype", default="float32", help="float32 | bfloat16")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between saves")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_refusing(PROG, _run, parse_args(argv))


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "batch_size", "max_length", "log_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise Refused(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup_steps",):
        if getattr(args, name) < 0:
            raise Refused(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("lr", "weight_decay", "grad_clip", "head_std"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
            rule = "> 0" if name == "lr" else ">= 0"
            raise Refused(f"--{name.replace('_', '-')} must be finite and {rule}, got {value}")
    if not 0.0 <= args.holdout_fraction < 1.0:
        raise Refused(f"--holdout-fraction must be in [0, 1), got {args.holdout_fraction}")
    if args.param_dtype not in ("float32", "bfloat16"):
        raise Refused(f"--param-dtype must be float32 or bfloat16, got {args.param_dtype!r}")


def _settings(args: argparse.Namespace, pairs_sha: str) -> dict:
    """What a resumed run must share with the run it continues."""
    keys = ("model", "batch_size", "lr", "warmup_steps", "weight_decay", "grad_clip")
    keys += ("holdout_fraction", "seed", "max_length", "head_std", "param_dtype")
    return {"pairs_sha256": pairs_sha, **{k: getattr(args, k) for k in keys}}


def _run(args: argparse.Namespace) -> int:
    _check_args(args)
    from a3po_jax.tasks.preference_pairs import load_preference_pairs, split_pairs

    try:
        pairs = load_preference_pairs(args.pairs)
    except FileNotFoundError as err:
        raise Refused(f"--pairs {args.pairs}: no such file") from err
    except (ValueError, OSError) as err:
        raise Refused(str(err)) from err
    if not pairs:
        raise Refused(f"--pairs {args.pairs}: no pairs in the file")
    train, held = split_pairs(pairs, args.holdout_fraction)
    if not train:
        raise Refused(f"--holdout-fraction {args.holdout_fraction} holds out every prompt")
    if args.holdout_fraction > 0 and not held:
        raise Refused(
            f"--holdout-fraction {args.holdout_fraction} holds out none of the "
            f"{len(pairs)} pairs' prompts: raise it, or pass 0 to train on all"
        )
    out = pathlib.Path(args.out)
    ckpt_dir = out / CHECKPOINTS
    has_checkpoints = ckpt_dir.is_dir() and any(ckpt_dir.iterdir())
    if not args.resume and (has_checkpoints or (out / "reward_model.json").exists()):
        raise Refused(
            f"--out {out} already holds a reward model or checkpoints: pass --resume to "
            "continue it, or choose another directory"
        )
    pairs_sha = hashlib.sha256(pathlib.Path(args.pairs).read_bytes()).hexdigest()
    print(
        f"pairs: {len(pairs)} from {args.pairs} ({len(train)} train, {len(held)} held out, "
        f"{len({p.prompt.prompt_id for p in pairs})} prompts)",
        file=sys.stderr,
    )
    return _train(args, train, held, pairs_sha, out)


def _load_model(args: argparse.Namespace):
    """The reward model to train (``--model``) and the mesh it trains on, or a refusal."""
    from a3po_jax.model.checkpoint_io import CheckpointError
    from a3po_jax.model.reward_model import init_reward_model
    from a3po_jax.parallel.sharding import check_batch_divisible, make_mesh

    try:
        model = init_reward_model(
            args.model,
            seed=args.seed,
            head_std=args.head_std,
            param_dtype=args.param_dtype,
            compute_dtype=args.param_dtype,
        )
    except (FileNotFoundError, CheckpointError) as err:
        raise Refused(f"--model {args.model}: {err}") from err
    if model.tokenizer is None:
        raise Refused(f"--model {args.model}: no tokenizer files")
    if args.max_length > model.config.max_seq_len:
        raise Refused(
            f"--max-length {args.max_length} exceeds the model's max_seq_len "
            f"{model.config.max_seq_len}"
        )
    mesh = make_mesh()
    try:
        check_batch_divisible(args.batch_size, mesh)
    except ValueError as err:
        raise Refused(f"--batch-size {args.batch_size}: {err}") from err
    return model, mesh


class _PairRows:
    """The pairs tokenized as the pipeline scores them (``reward_model_tokens``), padded to
    one length bucket, and the batches drawn from them."""

    def __init__(self, args: argparse.Namespace, model, train, held):
        from a3po_jax.tasks.reward_model_scorer import (
            bucket_for,
            length_buckets,
            reward_model_tokens,
        )

        def encode(split):
            return [
                (
                    reward_model_tokens(model.tokenizer, p.prompt, p.chosen),
                    reward_model_tokens(model.tokenizer, p.prompt, p.rejected),
                )
                for p in split
            ]

        self.args, self.pad_id = args, model.pad_token_id
        self.train, self.held = encode(train), encode(held)
        rows = (*self.train, *self.held)
        longest = max(len(side) for pair in rows for side in pair)
        self.truncated = sum(max(len(c), len(r)) > args.max_length for c, r in rows)
        self.length = bucket_for(longest, length_buckets(args.max_length))
        print(
            f"tokens: longest side {longest}, padded to {self.length}; {self.truncated} pairs "
            f"longer than --max-length keep their last {args.max_length} tokens",
            file=sys.stderr,
        )

    def batch_of(self, rows):
        from a3po_jax.core.bradley_terry import PairBatch
        from a3po_jax.tasks.reward_model_scorer import pad_rows

        size = self.args.batch_size
        chosen, chosen_len = pad_rows([c for c, _ in rows], self.length, size, self.pad_id)
        rejected, rejected_len = pad_rows([r for _, r in rows], self.length, size, self.pad_id)
        mask = (np.arange(size) < len(rows)).astype(np.float32)
        return PairBatch(chosen, chosen_len, rejected, rejected_len, mask)

    def train_batch(self, step: int):
        """The pairs of `step`: a seeded permutation per epoch, a function of the step alone
        so a resumed run draws what the first one would have drawn."""
        n, size = len(self.train), self.args.batch_size
        picks = []
        for k in range(size):
            g = step * size + k
            order = np.random.default_rng([self.args.seed, g // n]).permutation(n)
            picks.append(self.train[order[g % n]])
        return self.batch_of(picks)

    def held_out(self, eval_fn, params) -> dict | None:
        """Held-out pair loss and accuracy of `params` (None without held-out pairs)."""
        if not self.held:
            return None
        total = np.zeros(3)
        for start in range(0, len(self.held), self.args.batch_size):
            rows = self.held[start : start + self.args.batch_size]
            total += np.asarray(eval_fn(params, self.batch_of(rows)))
        return {
            "loss": total[0] / total[2],
            "accuracy": total[1] / total[2],
            "pairs": int(total[2]),
        }


def _resume(args, manager, state, settings: dict, out: pathlib.Path):
    """The state and step a ``--resume`` continues from, refusing other settings or a
    checkpoint past ``--steps``; (state, 0, None) for a fresh start."""
    from a3po_jax.training.checkpointing import restore_train_state

    if not args.resume or manager.latest_step() is None:
        return state, 0, None
    saved = manager.read_extra()
    if saved.get("settings") != settings:
        changed = sorted(k for k in settings if settings[k] != saved.get("settings", {}).get(k))
        raise Refused(f"--resume: {out / CHECKPOINTS} was trained with other settings ({changed})")
    if manager.latest_step() > args.steps:
        raise Refused(
            f"--resume: {out / CHECKPOINTS} is at step {manager.latest_step()}, past "
            f"--steps {args.steps}"
        )
    state, extra, start = restore_train_state(manager, state)
    print(f"resumed from step {start} of {manager.directory}", file=sys.stderr)
    return state, start, extra["held_out_before"]


def _train(args, train, held, pairs_sha: str, out: pathlib.Path) -> int:
    # Heavy imports once the arguments and the pairs are known to be good.
    import jax

    from a3po_jax.core.bradley_terry import jit_pair_eval, jit_reward_step
    from a3po_jax.core.optim import make_optimizer
    from a3po_jax.core.placement import place_train_state
    from a3po_jax.model.reward_model import INFO_FILE, weights_version
    from a3po_jax.training.checkpointing import CheckpointManager, save_train_state

    model, mesh = _load_model(args)
    data = _PairRows(args, model, train, held)
    optimizer = make_optimizer(
        learning_rate=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay
    )
    state = place_train_state(model.params, optimizer, mesh)
    model.params = None  # the placed copy is the one trained
    step_fn = jit_reward_step(
        state,
        mesh,
        config=model.config,
        optimizer=optimizer,
        grad_clip=args.grad_clip,
        batch_size=args.batch_size,
    )
    eval_fn = jit_pair_eval(state.params, mesh, config=model.config, batch_size=args.batch_size)

    settings = _settings(args, pairs_sha)
    with CheckpointManager(
        out / CHECKPOINTS, max_to_keep=2, save_interval_steps=args.checkpoint_every,
        async_save=False,
    ) as manager:  # fmt: skip
        state, start, before = _resume(args, manager, state, settings, out)
        if start == 0:
            before = data.held_out(eval_fn, state.params)
        _print_held_out("before training", before)
        metrics, t0 = {}, time.perf_counter()
        for step in range(start, args.steps):
            state, metrics = step_fn(state, data.train_batch(step))
            done = step + 1
            if done % args.log_every == 0 or done == args.steps:
                _print_step(done, args.steps, jax.device_get(metrics), time.perf_counter() - t0)
            if manager.should_save(done) or done == args.steps:
                extra = {"settings": settings, "held_out_before": before}
                save_train_state(manager, done, state, extra=extra, force=True)
    after = data.held_out(eval_fn, state.params)
    _print_held_out("after training", after)

    model.params = jax.device_get(state.params)
    info = {
        "base_model": args.model,
        "pairs_file": os.fspath(args.pairs),
        "pairs_sha256": pairs_sha,
        "pairs": len(train) + len(held),
        "train_pairs": len(train),
        "held_out_pairs": len(held),
        "truncated_pairs": int(data.truncated),
        "steps": args.steps,
        "settings": settings,
        "held_out_before": before,
        "held_out_after": after,
        "train_last_step": {k: float(v) for k, v in jax.device_get(metrics).items()},
    }
    version = _write_model(model, info, out, INFO_FILE, weights_version)
    print(f"reward model: {out} (version {version}); load it with task.reward=model:{out}")
    return 0


def _print_step(done: int, steps: int, metrics: dict, seconds: float) -> None:
    m = {k: float(v) for k, v in metrics.items()}
    print(
        f"step {done}/{steps}  loss {m['loss/bradley_terry']:.4f}  "
        f"accuracy {m['reward/pair_accuracy']:.3f}  margin {m['reward/margin']:+.3f}  "
        f"grad_norm {m['optim/grad_norm']:.3g}  ({seconds:.1f} s)",
        flush=True,
    )


def _print_held_out(when: str, result: dict | None) -> None:
    if result is None:
        print(f"held-out {when}: none (--holdout-fraction 0)")
    else:
        print(
            f"held-out {when}: pair accuracy {result['accuracy']:.3f}, loss "
            f"{result['loss']:.4f} ({result['pairs']} pairs)",
            flush=True,
        )


def _write_model(model, info: dict, out: pathlib.Path, info_file: str, weights_version) -> str:
    """Writes the checkpoint into a temporary folder inside `out`, moves its files into
    `out`, and writes `reward_model.json` last: a directory with that file is complete."""
    from a3po_jax.model.reward_model import save_reward_checkpoint

    (out / info_file).unlink(missing_ok=True)
    tmp = out / ".reward_model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_reward_checkpoint(model, tmp)
    for file in sorted(tmp.iterdir()):
        os.replace(file, out / file.name)
    tmp.rmdir()
    version = weights_version(out)
    info = {**info, "version": version}
    staged = out / (info_file + ".tmp")
    staged.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(staged, out / info_file)
    return version


if __name__ == "__main__":
    sys.exit(main())
