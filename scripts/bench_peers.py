"""Benchmark: one synchronous GRPO workload in a3po_jax, TRL and Tunix, each through its own
trainer as a new user would run it, and the seconds of a step side by side.

    python scripts/bench_peers.py                           # defaults: 8 x 4, 32 tokens, 5 steps
    python scripts/bench_peers.py --tunix-python .venv-tunix/bin/python
    python scripts/bench_peers.py --steps 2 --prompts 2 --samples 2 --new-tokens 8 --only a3po_jax

The workload: SmolLM2-135M-Instruct in float32 (the prepared cache of
`a3po_jax.model.assets`, nothing downloaded), `--prompts` prompts x `--samples` samples per
step, at most `--new-tokens` new tokens at `--temperature`, no reference model (KL 0), one
optimizer step per batch, `--warmup` steps left out (compilation) and `--steps` counted. The
prompts are the experiment's task's training prompts in the run's order (the task of
`--experiment`, default the quickstart's additions), written with the tokenizer's chat
template; the reward is the project's own verifier with the experiment's shaping
(`a3po_jax.tasks.shaped_reward`), wrapped as each peer's reward function.
a3po_jax decodes `--slots` samples at once (`rollout.num_slots`; default the whole step's
prompts x samples, as each peer's generate takes its batch; `--slots experiment` keeps the
experiment's own, the quickstart's 16, which decodes a step of 8 x 4 in two waves); the
row's `slots` says which it ran.

Each project runs in a child process (the peers under `--trl-python` / `--tunix-python`,
default this interpreter); one that its interpreter cannot import gets a row "not installed".
Per project, over the counted steps:

* step s: the median wall seconds of a step;
* generation s / train s (medians): a3po_jax's own step record (`time/wait_rollouts_s`,
  sampling and scoring the batch; `time/train_s`). TRL: the seconds in
  `GRPOTrainer._generate_and_score_completions` (sampling with transformers `generate`,
  reward, advantages) and the rest of the step (a `TrainerCallback`'s step begin to step
  end). Tunix: the seconds in `RLCluster.generate` and in `RLCluster.update_actor`, the step
  being the learner's `_run_global_step` plus its weight sync (its reward and advantage work
  falls in neither part);
* a3po_jax's compiling: the seconds its counted steps spent making executables for new
  shapes (`time/compile_s`, summed), printed under the table;
* tokens per answer: the mean completion length of the counted steps' samples (a3po_jax
  `response/length_mean`, TRL's logged `completions/mean_length`, Tunix the lengths
  `RLCluster.generate` returns);
* peak memory: the child process's peak resident set (`os.wait4`'s rusage, GiB).

`--compile-cache` says what the JAX projects (a3po_jax, Tunix) find in their persistent
compilation caches, each its own under the temporary directory: `cold` (the default), an
empty one, so every new shape compiles inside the run as on a first run; `warm`, one that
the same run of that project filled just before, unmeasured, as on a re-run
(a3po_jax's `system.run.compile_cache_dir` is on by default). TRL compiles nothing.

Then the ratio of a3po_jax's step to each peer's against the target of at most 0.5, the
machine (`bench_common.describe_machine`), the 1-minute load average at each row's start and
end (the rows run one after another, so a machine shared with other work slows them
unequally), and one JSON line. Progress goes to stderr.

Installing the peers: TRL from the project's `peers` extra (`pip install -e '.[peers]'`),
Tunix into an environment of its own (`bash scripts/setup.sh --tunix`, then
`--tunix-python .venv-tunix/bin/python`); docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("a3po_jax", "tunix", "trl")  # the issue table's order
# What a peer's interpreter must import to get a row (its trainer's package).
PEER_MODULES = {"trl": "trl", "tunix": "tunix"}
JAX_ROWS = ("a3po_jax", "tunix")  # the rows that compile, and so have a compilation cache
TARGET = 0.5  # the target: a3po_jax's sync step at most half of each peer's


def log(message: str) -> None:
    print(f"[bench_peers] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the parent


def slots_rule(text: str) -> str | int:
    """`--slots`: "batch", "experiment" or a positive number of slots."""
    if text in ("batch", "experiment"):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(
        f"--slots takes 'batch', 'experiment' or a positive number, got {text!r}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experiment", default=str(ROOT / "experiments" / "quickstart_a3po.py"))
    p.add_argument("--steps", type=int, default=5, help="counted steps")
    p.add_argument("--warmup", type=int, default=1, help="steps left out (compilation)")
    p.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="most new tokens per answer")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--slots",
        type=slots_rule,
        default="batch",
        help="a3po_jax's decode slots (rollout.num_slots): 'batch' = prompts x samples, the\n"
        "whole step's samples decoded at once as the peers' generate does; 'experiment' =\n"
        "the experiment's own (the quickstart's 16: two waves of 16 at 8 x 4); or a number",
    )
    p.add_argument(
        "--compile-cache",
        choices=("cold", "warm"),
        default="cold",
        help="the JAX rows' persistent compilation caches: 'cold' = empty (a first run),\n"
        "'warm' = filled by the same run just before, unmeasured (a re-run)",
    )
    p.add_argument("--only", default=",".join(PEERS), help="comma-separated subset of rows")
    p.add_argument("--trl-python", default=sys.executable, help="interpreter with trl")
    p.add_argument("--tunix-python", default=sys.executable, help="interpreter with tunix")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per project")
    p.add_argument("--json", help="also write the JSON object to this path")
    p.add_argument("overrides", nargs="*", help="section.field=value for a3po_jax's run")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(PEERS)
    if unknown:
        p.error(f"--only takes names from {PEERS}, got {sorted(unknown)}")
    return args


def workload(args: argparse.Namespace) -> dict:
    """What every project runs, resolved from the experiment in the parent (project) process."""
    from a3po_jax.model import assets
    from a3po_jax.training.config import apply_overrides, load_experiment

    cfg = apply_overrides(load_experiment(args.experiment), list(args.overrides))
    if (cfg.model.name, cfg.model.param_dtype) != ("smollm2", "float32"):
        # The peers always load the SmolLM2 cache: the rows would not compare like with like.
        log(f"a3po_jax runs {cfg.model.name} in {cfg.model.param_dtype}; the peers SmolLM2 float32")
    named = {"batch": args.prompts * args.samples, "experiment": cfg.rollout.num_slots}
    slots = named.get(args.slots, args.slots)
    return {
        "experiment": str(args.experiment),
        "model_dir": str(assets.prepare_smollm2()),
        "task": cfg.task.name,
        "task_options": cfg.task.kwargs,
        "split": cfg.task.split,
        "format_reward": cfg.task.format_reward,
        "no_eos_penalty": cfg.task.no_eos_penalty,
        "seed": cfg.seed,
        "learning_rate": cfg.optim.learning_rate,
        "prompts": args.prompts,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "warmup": args.warmup,
        "steps": args.steps,
        "a3po_slots": slots,
    }


def run_child(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, float, str]:
    """Runs `cmd` to its end: (exit code, peak RSS in GiB from its own rusage, stderr tail).
    The child's progress lines (this script's `log`) are echoed to stderr as they come."""
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )

    def read() -> None:
        for line in proc.stderr:
            tail.append(line)
            if line.startswith("[bench_peers]"):
                sys.stderr.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while True:
        # wait4 reaps this child alone: its rusage, not the sum over earlier children.
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=10)
    # ru_maxrss is in KiB on Linux.
    return proc.returncode, usage.ru_maxrss / 2**20, "".join(tail)[-3000:]


def cache_dir(tmp: Path, name: str) -> Path:
    """The persistent compilation cache of the JAX row `name`, fresh in each run of this script."""
    return tmp / "jax-cache" / name


def run_a3po(args: argparse.Namespace, work: dict, tmp: Path) -> dict:
    """This project's row: `a3po-train EXPERIMENT` in sync mode, read from its metrics.jsonl."""
    from a3po_jax.training.metrics import read_metrics

    run_dir = tmp / "a3po_jax"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run (after the one filling the cache)
    cmd = [
        sys.executable, "-m", "a3po_jax.cli.train", args.experiment,
        "system.mode=sync", f"rollout.groups_per_step={args.prompts}",
        f"rollout.group_size={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
        f"rollout.temperature={args.temperature}", f"steps={args.warmup + args.steps}",
        "checkpoint_every=0", "evaluate=false", "eval_every=0", f"run_dir={run_dir}",
        f"rollout.num_slots={work['a3po_slots']}",
        f"system.run.compile_cache_dir={cache_dir(tmp, 'a3po_jax')}", *args.overrides,
    ]  # fmt: skip
    # The run's own setting, not a cache this process may have, or have turned off.
    own = ("JAX_COMPILATION_CACHE", "JAX_ENABLE_COMPILATION_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    code, rss, tail = run_child(cmd, args.timeout, env)
    if code:
        last = tail.strip().splitlines()[-1:] or ["no output"]
        return {"status": f"failed (exit {code}): {last[0][:300]}"}
    records = read_metrics(run_dir)[args.warmup :]
    median = lambda key: statistics.median(float(r[key]) for r in records)  # noqa: E731
    return {
        "status": "ran",
        "version": _version("a3po_jax"),
        "step_s": median("time/step_s"),
        "generation_s": median("time/wait_rollouts_s"),
        "train_s": median("time/train_s"),
        # Seconds the counted steps spent making executables (new shapes), in all.
        "compile_s": sum(float(r.get("time/compile_s", 0.0)) for r in records),
        "tokens_per_answer": statistics.mean(float(r["response/length_mean"]) for r in records),
        "steps": len(records),
        "peak_rss_gb": rss,
        "slots": json.loads((run_dir / "config.json").read_text())["rollout"]["num_slots"],
    }


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version({"tunix": "google-tunix"}.get(module, module))
    except PackageNotFoundError:
        return None


def importable(python: str, module: str) -> bool:
    """Whether `python` can find `module` (without importing it: a find_spec)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def run_peer(name: str, python: str, args: argparse.Namespace, work: dict, tmp: Path) -> dict:
    """A peer's row: this script's `--worker NAME` under `python`, or why it did not run."""
    if not importable(python, PEER_MODULES[name]):
        return {"status": f"not installed ({PEER_MODULES[name]} not importable by {python})"}
    spec, out = tmp / f"{name}.spec.json", tmp / f"{name}.json"
    spec.write_text(json.dumps(work))
    cmd = [python, str(Path(__file__).resolve()), "--worker", name, str(spec), str(out)]
    from a3po_jax.training import compilation  # the parent's: a worker needs none of it

    # The checkout first on the path: a peer's environment need not have the project installed.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **(compilation.environment(cache_dir(tmp, name)) if name in JAX_ROWS else {}),
    }
    code, rss, tail = run_child(cmd, args.timeout, env)
    if code or not out.exists():
        last = tail.strip().splitlines()[-1:] or ["no output"]
        return {"status": f"failed (exit {code}): {last[0][:300]}"}
    return {**json.loads(out.read_text()), "status": "ran", "peak_rss_gb": rss}


def run_row(name: str, args: argparse.Namespace, work: dict, tmp: Path) -> dict:
    """One project's row (`run_a3po` or `run_peer` under the peer's interpreter)."""
    if name == "a3po_jax":
        return run_a3po(args, work, tmp)
    python = {"trl": args.trl_python, "tunix": args.tunix_python}[name]
    return run_peer(name, python, args, work, tmp)


LABELS = {"a3po_jax": "a3po_jax", "trl": "TRL", "tunix": "Tunix"}
CACHE_STATES = {
    "cold": "cold (empty: every new shape compiles inside the run, as on a first run)",
    "warm": "warm (filled by the same run just before: as on a re-run)",
}


def table(rows: dict[str, dict], work: dict) -> str:
    head = "| | step s | generation s | train s | tokens per answer | peak memory |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        label = LABELS[name] + (f" {row['version']}" if row.get("version") else "")
        if row["status"] != "ran":
            lines.append(f"| {label} | {row['status']} | | | | |")
            continue
        lines.append(
            f"| {label} | {row['step_s']:.2f} | {row['generation_s']:.2f} | {row['train_s']:.2f} "
            f"| {row['tokens_per_answer']:.1f} | {row['peak_rss_gb']:.2f} GiB |"
        )
    return "\n".join(lines)


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """a3po_jax's step over each peer's that ran (the target: at most `TARGET`)."""
    own = rows.get("a3po_jax", {})
    if own.get("status") != "ran":
        return {}
    return {
        name: own["step_s"] / row["step_s"]
        for name, row in rows.items()
        if name != "a3po_jax" and row.get("status") == "ran"
    }


def main(argv: list[str] | None = None) -> dict:
    """Runs the rows `--only` names, prints the table and one JSON line; returns the JSON."""
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import describe_machine

    machine = describe_machine()
    log(f"machine: {machine}")
    work = workload(args)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_peers.") as tmp:
        for name in args.only.split(","):
            if args.compile_cache == "warm" and name in JAX_ROWS:
                log(f"{name}: filling its compilation cache (the same run, unmeasured)")
                run_row(name, args, work, Path(tmp))
            log(f"{name}: running ({args.warmup} + {args.steps} steps)")
            t0, load = time.perf_counter(), os.getloadavg()[0]
            rows[name] = run_row(name, args, work, Path(tmp))
            # Other processes on the machine slow a row: the 1-minute load at its start and end.
            rows[name]["load_avg"] = [load, os.getloadavg()[0]]
            log(f"{name}: {rows[name]['status']} in {time.perf_counter() - t0:.0f} s")
    result = {
        "machine": machine,
        "workload": {k: v for k, v in work.items() if k != "model_dir"},
        "compile_cache": args.compile_cache,
        "rows": rows,
        "ratio_step_a3po_over_peer": ratios(rows),
        "target": TARGET,
    }
    print(
        f"GRPO, SmolLM2-135M-Instruct float32, {args.prompts} prompts x {args.samples} samples, "
        f"<= {args.new_tokens} new tokens, temperature {args.temperature}, sync, "
        f"{args.steps} steps after {args.warmup} warm-up; medians per step"
    )
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores, {' '.join(machine['isa'])}), "
        f"{machine['device']}"
    )
    print(f"JAX rows' compilation caches: {CACHE_STATES[args.compile_cache]}")
    if rows.get("a3po_jax", {}).get("status") == "ran":
        slots = rows["a3po_jax"]["slots"]
        print(f"a3po_jax decodes up to {slots} samples at once (rollout.num_slots)")
        compiled = rows["a3po_jax"]["compile_s"]
        print(f"a3po_jax compiled for {compiled:.1f} s in its counted steps (time/compile_s)")
    print(table(rows, work))
    loads = ", ".join(
        f"{LABELS[n]} {r['load_avg'][0]:.1f} -> {r['load_avg'][1]:.1f}" for n, r in rows.items()
    )
    print(f"load average (1 min) at each row's start and end: {loads} ({machine['cores']} cores)")
    for name, ratio in result["ratio_step_a3po_over_peer"].items():
        verdict = "reached" if ratio <= TARGET else "not reached"
        print(f"a3po_jax step / {LABELS[name]} step: {ratio:.2f} (target <= {TARGET}: {verdict})")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


# ----------------------------------------------------------------------------- the workers


class Verifier:
    """The project's reward on the workload's prompts: `shaped_reward` with the experiment's
    shaping, the prompts drawn as a run draws them (`PromptIterator`, the run's seed)."""

    def __init__(self, work: dict, tokenizer):
        from a3po_jax.tasks import PromptIterator, RewardConfig, make_task

        self.task = make_task(work["task"], **work["task_options"])
        it = PromptIterator(self.task.prompts(work["split"]), batch_size=1, seed=work["seed"])
        self.prompts = [
            it.next_batch()[0] for _ in range(work["prompts"] * (work["warmup"] + work["steps"]))
        ]
        self.config = RewardConfig(
            format_reward=work["format_reward"], no_eos_penalty=work["no_eos_penalty"]
        )
        self.tokenizer, self.new_tokens = tokenizer, work["new_tokens"]

    def text(self, index: int) -> str:
        """Prompt `index` under the tokenizer's chat template, ready for the model to answer."""
        from a3po_jax.tasks import render_prompt

        return self.tokenizer.decode(render_prompt(self.tokenizer, self.prompts[index]))

    def __call__(self, indices, completions) -> list[float]:
        from a3po_jax.tasks import shaped_reward

        rewards = []
        for index, text in zip(indices, completions, strict=True):
            # A peer's reward function sees text: its length in tokens says whether it was cut.
            n = len(self.tokenizer.encode(text, add_special_tokens=False))
            reward, _ = shaped_reward(
                self.task, self.prompts[int(index)], text,
                finished=n < self.new_tokens, num_tokens=n, config=self.config,
            )  # fmt: skip
            rewards.append(float(reward))
        return rewards


def worker_trl(work: dict) -> dict:
    """TRL's `GRPOTrainer` on the workload, timed by a callback and a wrapper (module doc)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(work["seed"])
    tokenizer = AutoTokenizer.from_pretrained(work["model_dir"])
    verifier = Verifier(work, tokenizer)
    # Conversational prompts: TRL applies the tokenizer's chat template itself.
    data = Dataset.from_list(
        [
            {"prompt": [dict(m) for m in p.messages], "index": i}
            for i, p in enumerate(verifier.prompts)
        ]
    )

    def reward(prompts, completions, index, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return verifier(index, texts)

    reward.__name__ = "a3po_jax_verifier"
    total = work["warmup"] + work["steps"]
    batch = work["prompts"] * work["samples"]
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_peers_trl."),
        per_device_train_batch_size=batch,  # completions per step: prompts x samples
        num_generations=work["samples"],
        max_completion_length=work["new_tokens"],
        temperature=work["temperature"],
        learning_rate=work["learning_rate"],
        beta=0.0,
        num_iterations=1,
        max_steps=total,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=work["seed"],
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data,
        processing_class=tokenizer,
    )  # fmt: skip
    steps, generation, lengths = [], [], []
    inner = trainer._generate_and_score_completions

    def timed_generation(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        generation.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generation

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(time.perf_counter() - self.t0)
            log(f"trl: step {len(steps)} {steps[-1]:.1f} s")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer.add_callback(Steps())
    trainer.train()
    import trl

    return summarize(
        work,
        steps,
        generation,
        [s - g for s, g in zip(steps, generation, strict=True)],
        lengths,
        trl.__version__,
    )


def summarize(work, steps, generation, train, lengths, version) -> dict:
    """The counted steps' medians (and mean length) of a peer's per-step lists."""
    w = work["warmup"]
    if len(steps) < w + 1:
        raise RuntimeError(f"only {len(steps)} steps ran, {w} of them warm-up")
    return {
        "version": version,
        "step_s": statistics.median(steps[w:]),
        "generation_s": statistics.median(generation[w:]),
        "train_s": statistics.median(train[w:]),
        "tokens_per_answer": statistics.mean(lengths[w:]) if lengths[w:] else float("nan"),
        "steps": len(steps) - w,
    }


def worker_tunix(work: dict) -> dict:
    """Tunix's `GRPOLearner` (vanilla rollout, one device) on the workload: SmolLM2 as its
    Llama3 model from the cache's safetensors, timed by wrappers (module doc)."""
    import jax
    import numpy as np
    import optax
    from transformers import AutoTokenizer
    from tunix.models.llama3 import model as llama_lib
    from tunix.models.llama3 import params as llama_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    hf = json.loads((Path(work["model_dir"]) / "config.json").read_text())
    config = llama_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf.get("rope_theta") or hf.get("rope_parameters", {}).get("rope_theta")),
        norm_eps=hf["rms_norm_eps"],
        weight_tying=hf.get("tie_word_embeddings", False),
    )
    # Auto axes: Tunix's models annotate shardings for jit to resolve (jax's default mesh
    # axes are explicit, under which its embedding lookup is refused).
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)
    model = llama_params.create_model_from_safe_tensors(work["model_dir"], config, mesh)
    tokenizer = AutoTokenizer.from_pretrained(work["model_dir"])
    verifier = Verifier(work, tokenizer)
    texts = [verifier.text(i) for i in range(len(verifier.prompts))]
    prompt_len = max(len(tokenizer.encode(t)) for t in texts)
    total = work["warmup"] + work["steps"]
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=work["new_tokens"],
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + work["new_tokens"] + 32,
        temperature=work["temperature"],
        top_p=1.0,
        eos_tokens=[tokenizer.eos_token_id],
    )
    cluster = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(work["learning_rate"]),
            eval_every_n_steps=10**9,
            max_steps=total,
        ),
        rollout_config=rollout,
    )
    rl = rl_cluster_lib.RLCluster(actor=model, tokenizer=tokenizer, cluster_config=cluster)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=rl,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=work["samples"], num_iterations=1, beta=0.0
        ),
        reward_fns=lambda prompts, completions, index, **_: verifier(index, completions),
    )
    steps, generation, train, lengths = [], [], [], []

    def timed(obj, name, into, after=None):
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = inner(*a, **k)
            into.append(time.perf_counter() - t0)
            if after:
                after(out)
            return out

        setattr(obj, name, wrapper)

    timed(rl, "generate", generation, lambda out: lengths.append(
        statistics.mean(len(t) for t in out.tokens)))  # fmt: skip
    timed(rl, "update_actor", train)
    timed(
        learner,
        "_run_global_step",
        steps,
        lambda _: log(f"tunix: step {len(steps)} {steps[-1]:.1f} s"),
    )
    sync: list[float] = []
    timed(rl, "sync_weights", sync, lambda _: steps.__setitem__(-1, steps[-1] + sync[-1]))
    P = work["prompts"]
    # Batches as a grain loader gives them (arrays): Tunix repeats and splits them per sample.
    batches = [
        {"prompts": np.array(texts[i * P : (i + 1) * P]), "index": np.arange(i * P, (i + 1) * P)}
        for i in range(total)
    ]
    learner.train(batches)
    import tunix  # noqa: F401

    return summarize(work, steps, generation, train, lengths, _version("tunix"))


WORKERS = {"trl": worker_trl, "tunix": worker_tunix}


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        name, spec, out = sys.argv[2:]
        result = WORKERS[name](json.loads(Path(spec).read_text()))
        Path(out).write_text(json.dumps(result))
    else:
        main()
