"""Every shell command the README and the docs pages show runs.

Each ```bash / ```sh block of README.md and docs/*.md is split into commands (continuation
lines joined, a trailing `# comment` dropped, spaces collapsed) and every command must
appear in `COMMANDS` below, which says how the test runs it:

* `AS_WRITTEN`: exactly as the page shows it;
* `Append(args)`: with arguments added that keep it cheap (`--print-config`, `--dry-run`,
  `steps=2`): the rest is as written;
* `PARSE_ONLY`: as written, but the program stops right after its own argparse parser has
  read the arguments (a `sitecustomize` hook, switched on by an environment variable, wraps
  `ArgumentParser.parse_args`): every flag and value is checked by the program that would
  run it, without starting a benchmark, a server or an hour-long sweep;
* `Replace(command, why)`: another command, for the few that cannot run here at all (a
  GPU, the test suite itself).

A command on a page that `COMMANDS` does not name fails the test, and so does an entry of
`COMMANDS` that no page shows any more: a new command must say how it is checked.

The commands of one block run in order, in a fresh working directory of their own that
links the repository's `a3po_jax/`, `experiments/`, `scripts/` and `results/` (so
`runs/...` and other outputs land in the temporary directory), with `python`,
`.venv/bin/python` and `a3po-train` standing for this interpreter and `HOME` a temporary
folder. The Python blocks of the same pages are run by `tests/docs/test_readme.py`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.codegen import CHEAP_CODEGEN

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = ("a3po_jax", "experiments", "scripts", "results", "tests", "notebooks", "docs")
PARSE_ONLY_ENV = "A3PO_DOCS_PARSE_ONLY"


@dataclasses.dataclass(frozen=True)
class Append:
    args: str


@dataclasses.dataclass(frozen=True)
class Replace:
    command: str
    why: str


AS_WRITTEN = "as written"
PARSE_ONLY = "parse only"
PRINT_CONFIG = Append("--print-config")
DRY_RUN = Append("--dry-run")
TINY_RUN = Append("steps=2")

MULTIPROCESS = (
    "for i in 0 1; do JAX_COORDINATOR_ADDRESS=127.0.0.1:8476 JAX_NUM_PROCESSES=2 "
    "JAX_PROCESS_ID=$i a3po-train experiments/smoke_tiny.py system.mode=sync & done; wait"
)

COMMANDS: dict[str, object] = {
    # README: the two commands.
    "bash scripts/setup.sh && .venv/bin/a3po-train experiments/quickstart_a3po.py": Replace(
        "bash -n scripts/setup.sh && .venv/bin/a3po-train experiments/quickstart_a3po.py "
        "--print-config",
        "the suite was set up by setup.sh itself (scripts/run_tests.sh); the main job's "
        "config resolves",
    ),
    "bash scripts/run_tests.sh": Replace(
        "bash -n scripts/run_tests.sh", "it is the command running this test"
    ),
    # docs/development.md: the tiers and their selections.
    **{
        f"bash scripts/run_tests.sh {args}": Replace(
            "bash -n scripts/run_tests.sh", "the test suite runs itself; its script parses"
        )
        for args in ("--quick tests/core", "tests/e2e/test_trainer_e2e.py", "--cov=a3po_jax")
    },
    "A3PO_TEST_COMPILE_REPORT=/tmp/compiles.jsonl bash scripts/run_tests.sh --quick": Replace(
        "bash -n scripts/run_tests.sh", "the test suite runs itself; its script parses"
    ),
    # The report of one test written by hand (tests/project/test_suite_layout.py makes a
    # real one), then totalled as the page shows.
    ".venv/bin/python tests/helpers/compile_report.py /tmp/compiles.jsonl": Replace(
        "python -c \"import json; open('compiles.jsonl', 'w').write(json.dumps(dict("
        "test='tests/core/test_x.py::test_y', programs=3, trace_s=0.1, lower_s=0.1, "
        'compile_s=0.2, wall_s=0.5)) + chr(10))" && '
        "python tests/helpers/compile_report.py compiles.jsonl | grep -F "
        "'| tests/core/test_x.py | 1 | 3 | 0.2 | 0.2 | 0.5 |'",
        "a report written by hand in the block's own directory, not /tmp",
    ),
    # Training runs: the config resolves (experiment file and every override).
    "a3po-train experiments/quickstart_a3po.py algo.prox=recompute run_dir=runs/recompute": (
        PRINT_CONFIG
    ),
    "a3po-train experiments/smoke_tiny.py system.mode=periodic system.max_staleness=0": (
        PRINT_CONFIG
    ),
    "a3po-train experiments/quickstart_a3po.py --print-config": AS_WRITTEN,
    # A reward model's path is read when the run is built: the config alone resolves here.
    "a3po-train experiments/smoke_tiny.py task.reward=model:runs/reward_model "
    "task.no_eos_penalty=0.5": PRINT_CONFIG,
    "a3po-train experiments/smoke_tiny.py task.reward=model:runs/reward_model "
    "algo.kl_coef=0.05 algo.kl_in_reward=true": PRINT_CONFIG,
    "a3po-train experiments/smoke_tiny.py system.mode=sync rollout.batch_invariant=true "
    "system.consume_order=admission": TINY_RUN,
    "a3po-train experiments/quickstart_a3po.py system.mode=one_step_off "
    "rollout.batch_invariant=true system.consume_order=admission run_dir=runs/a": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.mode=one_step_off "
    "rollout.batch_invariant=true system.consume_order=admission run_dir=runs/b": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.lockstep_decode_steps=64 "
    "run_dir=runs/async_a": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py seed=1 run_dir=runs/quickstart_seed1": (
        PRINT_CONFIG
    ),
    "a3po-train experiments/smollm2_chain_sum.py steps=8 checkpoint_every=0 evaluate=false": (
        PRINT_CONFIG
    ),
    "a3po-train experiments/quickstart_a3po.py eval_every=8": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.run.mmap_threshold_mib=0": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.run.compile_cache_dir=": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.run.max_train_programs=0": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py model.remat=false "
    "system.run.mmap_threshold_mib=0": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.mode=sync rollout.temperature=1.0 "
    "rollout.max_new_tokens=32 steps=6 evaluate=false eval_every=0 checkpoint_every=0 "
    "run_dir=runs/where_time_goes": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.consume_order=completion "
    "run_dir=runs/completion": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.consume_order=admission "
    "run_dir=runs/admission": PRINT_CONFIG,
    "a3po-train experiments/quickstart_a3po.py system.placement.inference_hosts=127.0.0.1:50051 "
    "system.placement.host_token_file=$HOME/.a3po_host_token": PRINT_CONFIG,
    "nice -n 5 .venv/bin/python -m a3po_jax.cli.train experiments/smollm2_chain_sum.py "
    "run_dir=/tmp/lb_completion steps=12": PRINT_CONFIG,
    "nice -n 5 .venv/bin/python -m a3po_jax.cli.train experiments/smollm2_chain_sum.py "
    "run_dir=/tmp/lb_admission steps=12 system.consume_order=admission": PRINT_CONFIG,
    MULTIPROCESS: Replace(
        "pids=(); for i in 0 1; do JAX_COORDINATOR_ADDRESS=127.0.0.1:8476 "
        "JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=$i a3po-train experiments/smoke_tiny.py "
        'system.mode=sync --print-config & pids+=($!); done; for p in "${pids[@]}"; do '
        'wait "$p"; done',
        "each process resolves its config; two processes training like one is "
        "tests/e2e/test_trainer_multiprocess.py",
    ),
    # Placements: the config resolves (a split run is tests/inference/test_local_host.py and
    # tests/inference/test_split_devices.py).
    "a3po-train experiments/quickstart_a3po.py system.placement.inference_cores=1": PRINT_CONFIG,
    "a3po-train experiments/a3po_qwen25_1p5b_gsm8k.py system.placement.inference_devices=4 "
    "system.placement.inference_mesh_tensor=2": PRINT_CONFIG,
    "python scripts/launch.py tpu-pod experiments/a3po_qwen3_8b_math.py --tpu my-v5p-32 "
    "--zone us-east5-a --workers 4 --inference-tpu my-v5e-8 --inference-address 10.0.0.7 "
    "--dry-run": AS_WRITTEN,
    # docs/scale-out.md: a run resumed on another number of devices (a tiny run on 4
    # virtual devices resumed on 2: two steps, then one after the resume, where the page's
    # runs longer, compiled with the suite's cheaper code generation beside the device
    # count; tests/e2e/test_resume_on_another_mesh.py checks what the resume trains; the
    # pod's settings resolve).
    "XLA_FLAGS=--xla_force_host_platform_device_count=4 a3po-train experiments/smoke_tiny.py "
    "steps=4 checkpoint_every=2 run_dir=runs/mesh": Replace(
        f"XLA_FLAGS='--xla_force_host_platform_device_count=4 {CHEAP_CODEGEN}' a3po-train "
        "experiments/smoke_tiny.py steps=4 checkpoint_every=2 run_dir=runs/mesh steps=2",
        "two steps on 4 devices, the suite's code generation",
    ),
    "XLA_FLAGS=--xla_force_host_platform_device_count=2 a3po-train experiments/smoke_tiny.py "
    "checkpoint_every=2 run_dir=runs/mesh --resume": Replace(
        f"XLA_FLAGS='--xla_force_host_platform_device_count=2 {CHEAP_CODEGEN}' a3po-train "
        "experiments/smoke_tiny.py checkpoint_every=2 run_dir=runs/mesh --resume steps=3",
        "one step after the resume on 2 devices, the suite's code generation",
    ),
    "a3po-train experiments/a3po_qwen25_1p5b_gsm8k.py system.mesh.data=2 system.mesh.fsdp=2 "
    "--resume": PRINT_CONFIG,
    # docs/scale-out.md: a run's hosts growing and shrinking through its hosts file (the
    # whole sequence under a training run is tests/e2e/test_trainer_elastic_hosts.py).
    "python -m a3po_jax.cli.serve --model tiny --port 50051 --token-file ~/.a3po_host_token": (
        PARSE_ONLY
    ),
    "a3po-train experiments/smoke_tiny.py system.placement.inference_hosts=127.0.0.1:50051 "
    "system.placement.host_token_file=~/.a3po_host_token "
    "system.placement.hosts_file=hosts.txt": PRINT_CONFIG,
    "python -m a3po_jax.cli.serve --model tiny --port 50061 --token-file ~/.a3po_host_token "
    "--join hosts.txt": PARSE_ONLY,
    "python scripts/launch.py join-host experiments/smoke_tiny.py "
    "system.placement.inference_hosts=127.0.0.1:50051 system.placement.hosts_file=hosts.txt "
    "--port 50061 "
    "--weight-port 50062 --token-file ~/.a3po_host_token": Append("--dry-run"),
    "echo 127.0.0.1:50071 >> hosts.txt": AS_WRITTEN,
    "sed -i /127.0.0.1:50051/d hosts.txt": AS_WRITTEN,
    # Tiny real runs, and what the pages do with them afterwards.
    "a3po-train experiments/smoke_tiny.py": TINY_RUN,
    "a3po-train experiments/smoke_tiny.py rollout.dynamic_sampling=true "
    "rollout.max_extra_groups=4 rollout.overlong_filter=true": TINY_RUN,
    "python -m a3po_jax.cli.ledger runs/smoke_tiny": AS_WRITTEN,
    "a3po-train experiments/smoke_tiny.py evaluate=true eval_prompts=16 run_dir=runs/smoke_eval": (
        TINY_RUN
    ),
    "python -m a3po_jax.cli.results runs/smoke_eval": AS_WRITTEN,
    "a3po-train experiments/smoke_tiny.py system.run.record_rollouts=true run_dir=runs/rec": (
        TINY_RUN
    ),
    "a3po-train --replay runs/rec": AS_WRITTEN,
    "a3po-train experiments/smoke_tiny.py run_dir=runs/smoke_mismatch": TINY_RUN,
    "python -m a3po_jax.cli.results runs/smoke_mismatch --out runs/smoke_mismatch/report": (
        AS_WRITTEN
    ),
    # The objective recipe's module lives in the page: tests/core/test_objectives.py trains it.
    "PYTHONPATH=plugins a3po-train experiments/smoke_tiny.py algo.loss=reinforce "
    "algo.advantage=drgrpo": Replace(
        "mkdir -p plugins && python -c \"import pathlib; page = pathlib.Path('docs/losses.md')"
        ".read_text(); s = page[page.index('### Adding an objective'):]; fence = chr(96) * 3; "
        "a = s.index(fence + 'python') + 10; "
        "pathlib.Path('plugins/reinforce.py').write_text(s[a:s.index(fence, a)])\" && "
        "PYTHONPATH=plugins a3po-train experiments/smoke_tiny.py algo.loss=reinforce "
        "algo.advantage=drgrpo --print-config",
        "the page's module written to plugins/ first; the config resolves with it (it trains "
        "in tests/core/test_objectives.py)",
    ),
    # Evaluation, serving, assets: their own parsers read the arguments.
    "python -m a3po_jax.cli.evaluate --run-dir runs/quickstart_a3po": PARSE_ONLY,
    "python -m a3po_jax.cli.make_preferences --task letters --model tiny --prompts 8 "
    "--samples 4 --out runs/pairs/letters.jsonl": PARSE_ONLY,
    "python -m a3po_jax.cli.evaluate --run-dir runs/quickstart_a3po --step 20": PARSE_ONLY,
    "python scripts/bench_reward_model.py --repeats 3": Replace(
        "python scripts/bench_reward_model.py --config tiny --batch 8 --repeats 2",
        "the tiny model's shapes (SmolLM2's take a minute; the figures' page says so)",
    ),
    # docs/training.md: the offline RLHF chain (gold pairs, a proxy, a run against it).
    "python -m a3po_jax.cli.make_preferences --task letters --model tiny --prompts 32 "
    "--samples 4 --out runs/pairs/letters.jsonl": AS_WRITTEN,
    "python -m a3po_jax.cli.train_reward --pairs runs/pairs/letters.jsonl --model tiny "
    "--out runs/rm_letters --steps 20": AS_WRITTEN,
    "a3po-train experiments/smoke_tiny.py task.reward=model:runs/rm_letters "
    "run_dir=runs/rlhf_letters": TINY_RUN,
    "python -m a3po_jax.cli.evaluate --model smollm2 --task chain_sum --num-prompts 64": (
        PARSE_ONLY
    ),
    "python -m a3po_jax.cli.evaluate --model smollm2 --k 4 --temperature 1.0": PARSE_ONLY,
    "python -m a3po_jax.cli.evaluate --model smollm2 --task basic_arithmetic --num-prompts 64 "
    '--task-options \'{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, '
    '"operators": ["+"], "allow_parentheses": false, "allow_negation": false}\'': (PARSE_ONLY),
    "python -m a3po_jax.cli.serve --model smollm2 --port 50051 --token-file "
    "~/.a3po_host_token --update-policy in_flight": PARSE_ONLY,
    "python -m a3po_jax.cli.assets prepare-smollm2": PARSE_ONLY,
    # README and docs/training.md: the reward model (a pairs file of the reader's own).
    "python -m a3po_jax.cli.train_reward --pairs pairs.jsonl --model smollm2 "
    "--out runs/reward_model --steps 200": PARSE_ONLY,
    "python -m a3po_jax.cli.train_reward --pairs pairs.jsonl --model tiny --out runs/rm_tiny "
    "--steps 40 --lr 1e-3": PARSE_ONLY,
    "python -m a3po_jax.cli.train_reward --pairs pairs.jsonl --model tiny --out runs/rm_tiny "
    "--steps 80 --lr 1e-3 --resume": PARSE_ONLY,
    # docs/results.md: the RLHF miniature (hours on SmolLM2; its sweep as a dry run).
    "python -m a3po_jax.cli.make_preferences --task basic_arithmetic --task-options "
    "\"$(python -c 'import experiments.quickstart_a3po as q; print(q.ADDITIONS)')\" "
    "--model smollm2 --prompts 512 --samples 4 --max-new-tokens 128 "
    "--out runs/rlhf_miniature/pairs.jsonl": PARSE_ONLY,
    "python -m a3po_jax.cli.train_reward --pairs runs/rlhf_miniature/pairs.jsonl "
    "--model smollm2 --out runs/rlhf_miniature/reward_model --steps 200": PARSE_ONLY,
    "python scripts/run_sweep.py experiments/rlhf_miniature_smollm2.py --subprocess --prune "
    "--out runs/rlhf_miniature/runs": DRY_RUN,
    "python -m a3po_jax.cli.results results/rlhf_miniature_smollm2 --out "
    "results/rlhf_miniature_smollm2": PARSE_ONLY,
    "python -m a3po_jax.cli.results runs/completion runs/admission --out runs/length_bias": (
        PARSE_ONLY
    ),
    "python -m a3po_jax.cli.results runs/where_time_goes": PARSE_ONLY,
    # Launchers and sweeps print what they would run.
    "python scripts/launch.py tpu-pod experiments/a3po_qwen3_8b_math.py --tpu my-v5p-32 "
    "--zone us-east5-a --workers 4 --dry-run": AS_WRITTEN,
    "python scripts/run_sweep.py experiments/staleness_sweep_toy.py --prune": DRY_RUN,
    "python scripts/run_sweep.py experiments/a3po_compare_toy.py --prune": DRY_RUN,
    "python scripts/run_sweep.py experiments/a3po_compare_local.py --prune --subprocess": (DRY_RUN),
    "python scripts/run_sweep.py experiments/staleness_sweep_local.py --prune --subprocess": (
        DRY_RUN
    ),
    "nice -n 5 python scripts/run_sweep.py experiments/offpolicy_robustness_toy.py --prune": (
        DRY_RUN
    ),
    "python scripts/run_sweep.py experiments/offpolicy_robustness_smollm2.py --subprocess "
    "--prune": DRY_RUN,
    "nice -n 5 python scripts/run_sweep.py experiments/offpolicy_lab_toy.py --prune": DRY_RUN,
    "nice -n 5 python scripts/run_sweep.py experiments/offpolicy_lab_smollm2.py --subprocess "
    "--prune --out runs/offpolicy_lab_smollm2": DRY_RUN,
    "python scripts/run_sweep.py experiments/offpolicy_edge_smollm2.py --subprocess --prune "
    "--out runs/edge --only prox-behav_seed-0 prox-behav_seed-1": DRY_RUN,
    "python scripts/run_sweep.py experiments/one_step_off_vs_sync.py --subprocess --prune": (
        DRY_RUN
    ),
    "python scripts/run_sweep.py experiments/a3po_vs_recompute_smollm2.py --subprocess "
    "--prune": DRY_RUN,
    "python scripts/run_sweep.py experiments/periodic_vs_sync_smollm2.py --subprocess "
    "--prune": DRY_RUN,
    "python scripts/run_sweep.py experiments/disaggregation_smollm2.py --subprocess --prune": (
        DRY_RUN
    ),
    # Reports over the committed results (as written they would rewrite results/).
    "python -m a3po_jax.cli.results results/staleness_sweep_toy --out runs/staleness_sweep_toy": (
        AS_WRITTEN
    ),
    "python -m a3po_jax.cli.results results/a3po_compare_toy --out results/a3po_compare_toy": (
        PARSE_ONLY
    ),
    "python -m a3po_jax.cli.results results/staleness_sweep_toy --out "
    "results/staleness_sweep_toy": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/a3po_compare_local --out "
    "results/a3po_compare_local": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/staleness_sweep_local --out "
    "results/staleness_sweep_local": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/offpolicy_robustness_toy --out "
    "results/offpolicy_robustness_toy": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/offpolicy_robustness_smollm2 --out "
    "results/offpolicy_robustness_smollm2": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/offpolicy_lab_toy --out results/offpolicy_lab_toy": (
        PARSE_ONLY
    ),
    "python -m a3po_jax.cli.results results/offpolicy_lab_smollm2 --out "
    "results/offpolicy_lab_smollm2": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/one_step_off_vs_sync --out "
    "results/one_step_off_vs_sync": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/a3po_vs_recompute_smollm2 --out "
    "results/a3po_vs_recompute_smollm2": PARSE_ONLY,
    "python -m a3po_jax.cli.results results/periodic_vs_sync_smollm2 "
    "results/a3po_vs_recompute_smollm2/mode-sync_* --out results/periodic_vs_sync_smollm2": (
        PARSE_ONLY
    ),
    "python -m a3po_jax.cli.results results/disaggregation_smollm2 --out "
    "results/disaggregation_smollm2 --level 0.65": PARSE_ONLY,
    # Benchmarks: minutes to hours each; their parsers check the flags.
    "python scripts/bench_inference.py --model smollm2": PARSE_ONLY,
    "python scripts/bench_inference.py --model smollm2 --no-hf --repeats 3 --no-profile": (
        PARSE_ONLY
    ),
    "python scripts/bench_inference.py --experiment experiments/quickstart_a3po.py --rounds 5 "
    "rollout.temperature=1.0 rollout.max_new_tokens=32": PARSE_ONLY,
    "python scripts/bench_inference.py --experiment experiments/quickstart_a3po.py --rounds 5 "
    "--heap-as-run rollout.temperature=1.0 rollout.max_new_tokens=32": PARSE_ONLY,
    "python scripts/bench_model.py --config smollm2 --batch 4 --seq 256": PARSE_ONLY,
    "python scripts/bench_train_step.py --config smollm2 --batch 32 --group-size 4 "
    "--prompt-len 40 --response-len 32 --repeats 3": PARSE_ONLY,
    "python scripts/bench_train_step.py --config smollm2 --batch 32 --group-size 4 "
    "--prompt-len 57 --response-len 13 --packed --groups-per-row 2": PARSE_ONLY,
    "python scripts/bench_logprobs.py --batch 10 --seq 128 --vocab-chunk-sizes auto,0": (
        PARSE_ONLY
    ),
    "python scripts/bench_modes.py --experiment experiments/smollm2_chain_sum.py --steps 10 "
    "--warmup 2": PARSE_ONLY,
    "python scripts/bench_weight_push.py": PARSE_ONLY,
    "python scripts/bench_reproducible.py": PARSE_ONLY,
    "python scripts/bench_reproducible.py --experiment experiments/smoke_tiny.py --steps 12 "
    "--lockstep-steps 8": PARSE_ONLY,
    "python scripts/bench_weight_push.py --dtype bfloat16": PARSE_ONLY,
    "python scripts/bench_weight_push.py --placement devices": PARSE_ONLY,
    "python scripts/bench_packing.py": PARSE_ONLY,
    "python scripts/bench_elastic.py": PARSE_ONLY,
    "python scripts/bench_peers.py --tunix-python .venv-tunix/bin/python": PARSE_ONLY,
    "python scripts/bench_peers.py --only a3po_jax,trl --compile-cache cold": PARSE_ONLY,
    "python scripts/bench_peers.py --only a3po_jax,trl --compile-cache warm": PARSE_ONLY,
    "python scripts/bench_peers.py --tunix-python .venv-tunix/bin/python "
    "model.remat=false system.run.mmap_threshold_mib=0": PARSE_ONLY,
    "bash scripts/setup.sh --tunix": Replace(
        "bash -n scripts/setup.sh", "it installs Tunix from PyPI: the script's syntax is checked"
    ),
    "python scripts/bench_decode_dispatch.py --models smollm2,qwen2.5-1.5b --dtype bfloat16": (
        PARSE_ONLY
    ),
    "bash scripts/bench_gpu.sh": Replace(
        "bash -n scripts/bench_gpu.sh", "it needs a GPU: the script's syntax is checked"
    ),
}


def shell_blocks(page: Path) -> list[tuple[int, list[str]]]:
    """(line of the fence, commands) of every ```bash / ```sh block of a page."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() in ("```bash", "```sh"):
            start, commands, pending = i + 1, [], ""
            i += 1
            while lines[i].strip() != "```":
                line = lines[i].rstrip()
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                else:
                    command = pending + line
                    pending = ""
                    if not command.strip().startswith("#"):
                        command = re.sub(r"\s+#\s.*$", "", command)
                    command = " ".join(command.split())
                    if command and not command.startswith("#"):
                        commands.append(command)
                i += 1
            blocks.append((start, commands))
        i += 1
    return blocks


BLOCKS = [
    (str(page.relative_to(ROOT)), line, commands)
    for page in PAGES
    for line, commands in shell_blocks(page)
    if commands
]


def test_every_documented_command_says_how_it_is_run():
    shown = {command for _, _, commands in BLOCKS for command in commands}
    unmapped = sorted(shown - set(COMMANDS))
    assert not unmapped, (
        "shell commands in the docs that tests/docs/test_doc_commands.py neither runs nor maps "
        f"(add each to COMMANDS with how to check it): {unmapped}"
    )
    stale = sorted(set(COMMANDS) - shown)
    assert not stale, f"COMMANDS entries no page shows any more: {stale}"
    assert len(BLOCKS) >= 10, "the docs' shell blocks were not found"


def test_the_block_parser_joins_lines_and_drops_comments(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n# a comment line\na --x 1 \\\n    --y 2   # what it does\n\nb c\n```\n"
        "```python\nnot_a_command()\n```\n"
    )
    assert shell_blocks(page) == [(1, ["a --x 1 --y 2", "b c"])]


def runnable(command: str) -> str:
    form = COMMANDS[command]
    if form == AS_WRITTEN or form == PARSE_ONLY:
        return command
    if isinstance(form, Append):
        return f"{command} {form.args}"
    assert isinstance(form, Replace) and form.why, f"{command}: unknown form {form!r}"
    return form.command


SITECUSTOMIZE = f'''
import os
if os.environ.get("{PARSE_ONLY_ENV}"):
    import argparse

    _parse_args = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        parsed = _parse_args(self, args, namespace)
        print(f"parsed by {{self.prog}}: {{parsed}}", flush=True)
        os._exit(0)

    argparse.ArgumentParser.parse_args = parse_args
'''


def workdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working directory linking the repository, and the environment commands run in."""
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        (work / name).symlink_to(ROOT / name, target_is_directory=True)
    bin_dir = work / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    programs = {"python": "", "a3po-train": " -m a3po_jax.cli.train"}
    for name, module in programs.items():
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{module} "$@"\n')
        (bin_dir / name).chmod(0o755)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".a3po_host_token").write_text("docs-test-token\n")
    env = dict(os.environ)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([str(hooks), str(ROOT), env.get("PYTHONPATH", "")]),
        HOME=str(home),
        JAX_PLATFORMS="cpu",
        MPLBACKEND="Agg",
    )
    env.pop(PARSE_ONLY_ENV, None)
    return work, env


@pytest.mark.e2e  # a block's commands start whole programs (trainers, benchmarks) as a user would
@pytest.mark.parametrize(
    "page, line, commands", BLOCKS, ids=[f"{page}:{line}" for page, line, _ in BLOCKS]
)
def test_documented_commands_run(page, line, commands, tmp_path):
    work, env = workdir(tmp_path)
    for command in commands:
        run_env = dict(env)
        if COMMANDS.get(command) == PARSE_ONLY:
            run_env[PARSE_ONLY_ENV] = "1"
        result = subprocess.run(
            ["bash", "-c", f"set -euo pipefail\n{runnable(command)}"],
            cwd=work,
            env=run_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, (
            f"{page}:{line}: `{command}` (run as `{runnable(command)}`) exited "
            f"{result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
            f"--- stderr\n{result.stderr[-3000:]}"
        )
        if COMMANDS.get(command) == PARSE_ONLY:
            assert "parsed by " in result.stdout, f"{command}: no argparse parser ran"
