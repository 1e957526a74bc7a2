"""Experiment files, sweeps, scripts/run_sweep.py and scripts/launch.py (dry runs)."""

import dataclasses
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from a3po_jax.analysis.sweeps import (
    SweepRun,
    completed_steps,
    entry_overrides,
    format_value,
    is_complete,
    load_sweep,
    resolve,
    run_name,
)
from a3po_jax.training import compilation
from a3po_jax.training.config import (
    ConfigError,
    TaskSection,
    TrainConfig,
    apply_overrides,
    import_experiment,
    load_experiment,
)

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.py"))
# Files this issue adds; the others (quickstart, smoke) are checked for loading only.
REPRODUCTIONS = (
    "a3po_compare_local",
    "a3po_compare_toy",
    "a3po_qwen25_1p5b_gsm8k",
    "a3po_qwen3_8b_math",
    "staleness_sweep_toy",
    "staleness_sweep_local",
    "async_rlhf_dpo",
    "periodic_vs_sync",
    "rlhf_miniature_smollm2",
)


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses look their module up in sys.modules.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- experiment files ----------------------------------------------------------------------


def test_every_reproduction_file_exists():
    assert {p.stem for p in EXPERIMENTS} >= set(REPRODUCTIONS)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_experiment_loads_and_every_sweep_entry_applies(path, tmp_path):
    base = load_experiment(path)
    assert isinstance(base, TrainConfig)
    runs = load_sweep(path)
    assert len({r.name for r in runs}) == len(runs)
    for run in runs:
        # apply_overrides re-validates the whole config (e.g. periodic needs η = 0).
        cfg, overrides = resolve(path, run, tmp_path)
        assert cfg.run_dir == str(tmp_path / run.name)
        assert overrides[-1] == f"run_dir={tmp_path / run.name}"
        if cfg.system.mode == "periodic" and cfg.system.batch.micro_batch_size:
            # The periodic trainer folds in one group at a time, split into micro-batches
            # of micro_batch_size: it must divide the group, not only the batch.
            assert cfg.rollout.group_size % cfg.system.batch.micro_batch_size == 0


@pytest.mark.parametrize("name", REPRODUCTIONS)
def test_docstring_gives_command_hardware_and_parent(name):
    text = (ROOT / "experiments" / f"{name}.py").read_text()
    doc = text.split('"""')[1]
    for part in ("Command:", "Hardware:", "Parent:"):
        assert part in doc, f"{name}: docstring lacks {part!r}"
    assert "run_sweep.py" in doc or "a3po-train" in doc


def sweep_of(name):
    return load_sweep(ROOT / "experiments" / f"{name}.py")


def configs_of(name, tmp_path):
    path = ROOT / "experiments" / f"{name}.py"
    return [resolve(path, run, tmp_path)[0] for run in load_sweep(path)]


@pytest.mark.parametrize("name", ["staleness_sweep_toy", "staleness_sweep_local"])
def test_staleness_sweeps_cover_eta_times_prox(name, tmp_path):
    cells = {(c.system.effective_staleness, c.algo.prox) for c in configs_of(name, tmp_path)}
    assert cells == {(eta, p) for eta in (0, 1, 2, 4, 8) for p in ("behav", "recompute", "a3po")}


@pytest.mark.parametrize(
    "name",
    ["a3po_compare_toy", "a3po_compare_local", "a3po_qwen25_1p5b_gsm8k", "a3po_qwen3_8b_math"],
)
def test_comparisons_hold_everything_but_the_method_fixed(name, tmp_path):
    configs = configs_of(name, tmp_path)
    methods = {(c.system.mode, c.algo.prox) for c in configs}
    assert methods == {
        ("sync", "behav"),
        ("async", "recompute"),
        ("async", "a3po"),
        ("async", "behav"),
    }
    async_etas = {c.system.max_staleness for c in configs if c.system.mode == "async"}
    assert len(async_etas) == 1  # same η for every asynchronous method
    for c in configs:
        assert (c.model, c.task, c.rollout, c.optim, c.steps) == (
            configs[0].model,
            configs[0].task,
            configs[0].rollout,
            configs[0].optim,
            configs[0].steps,
        )


def test_toy_files_use_the_tiny_model_and_the_letters_task():
    for name in ("a3po_compare_toy", "staleness_sweep_toy"):
        cfg = load_experiment(ROOT / "experiments" / f"{name}.py")
        assert (cfg.model.name, cfg.task.name, cfg.checkpoint_every) == ("tiny", "letters", 0)


@pytest.mark.e2e
def test_smoke_run_visibly_learns(tmp_path, capsys):
    """The smoke experiment as a newcomer runs it (about 10 s): reward, loss and gradient
    are not stuck at 0, and the reward climbs. Before, it trained a random model on sums it
    could never answer: reward, loss and gradient norm were exactly 0 on every step."""
    from a3po_jax.cli.train import main
    from a3po_jax.training.metrics import read_metrics

    run_dir = tmp_path / "smoke"
    assert main([str(ROOT / "experiments" / "smoke_tiny.py"), f"run_dir={run_dir}"]) == 0
    capsys.readouterr()
    records = read_metrics(run_dir)
    assert len(records) == 20
    rewards = np.asarray([r["reward/mean"] for r in records])
    grad_norms = np.asarray([r["optim/grad_norm"] for r in records])
    # A group of 8 samples whose rewards are all equal (all 0 at the start, when ~1 % of
    # characters hit) has zero advantages; a whole batch of such groups is rare.
    assert (grad_norms > 0).sum() >= 16 and any(r["loss/total"] != 0 for r in records)
    # Uniform sampling starts near 0.01; 20 steps lift the last five to ~0.15 (0.13-0.16
    # over seeds 0-3). A margin of 0.05 holds whatever the timing of the async run.
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.05, rewards


def test_paper_scale_files_point_at_a_user_checkpoint():
    for name, task in (("a3po_qwen25_1p5b_gsm8k", "gsm8k"), ("a3po_qwen3_8b_math", "jsonl")):
        cfg = load_experiment(ROOT / "experiments" / f"{name}.py")
        assert cfg.model.name not in ("tiny", "smollm2") and cfg.task.name == task
        assert "model.name" in (ROOT / "experiments" / f"{name}.py").read_text()


def test_qwen3_is_derived_from_the_qwen25_comparison():
    # One comparison, written once: the child reuses its parent's SWEEP and changes only
    # what its docstring lists (model, task, sizes, clip, optimizer, η, schedule).
    parent = ROOT / "experiments" / "a3po_qwen25_1p5b_gsm8k.py"
    child = ROOT / "experiments" / "a3po_qwen3_8b_math.py"
    assert load_sweep(child) == load_sweep(parent)
    assert "Parent:   experiments/a3po_qwen25_1p5b_gsm8k.py" in child.read_text()
    a, b = load_experiment(parent), load_experiment(child)
    kept = ("remat", "compute_dtype")
    assert [getattr(b.model, f) for f in kept] == [getattr(a.model, f) for f in kept]
    assert (b.algo.prox, b.algo.behav_weight_cap, b.algo.cap_mode, b.seed) == (
        a.algo.prox,
        a.algo.behav_weight_cap,
        a.algo.cap_mode,
        a.seed,
    )
    assert (b.system.mode, b.system.update_policy) == (a.system.mode, a.system.update_policy)


def test_async_rlhf_sweeps_losses_over_off_policyness(tmp_path):
    configs = configs_of("async_rlhf_dpo", tmp_path)
    losses = {(c.algo.loss, c.algo.advantage) for c in configs}
    assert losses == {("dpo", "grpo"), ("ppo", "grpo"), ("ppo", "rloo")}
    sync_n = {c.algo.num_minibatches for c in configs if c.system.mode == "sync"}
    assert sync_n == {1, 2, 4, 8}
    assert {c.system.mode for c in configs} == {"sync", "one_step_off"}
    assert all(c.rollout.group_size == 2 for c in configs)  # DPO's pair, for all three


def test_rlhf_miniature_crosses_losses_modes_and_seeds_against_the_proxy(tmp_path):
    configs = configs_of("rlhf_miniature_smollm2", tmp_path)
    # Trained against the proxy, judged by the gold verifier on the disjoint test split.
    assert {c.task.reward for c in configs} == {"model:runs/rlhf_miniature/reward_model"}
    assert all(c.evaluate and c.algo.track_ref_kl and c.algo.kl_in_reward for c in configs)
    cells = {
        (c.algo.loss, c.algo.advantage, c.system.mode, c.staleness_bound, c.seed) for c in configs
    }
    assert len(cells) == len(configs) == 27
    assert {cell[:2] for cell in cells} == {("dpo", "grpo"), ("ppo", "grpo"), ("ppo", "rloo")}
    assert {cell[2:4] for cell in cells} == {("sync", 0), ("one_step_off", 1), ("async", 4)}
    assert all(c.rollout.group_size == 2 for c in configs)  # DPO's pair, for all three


def test_periodic_vs_sync_differs_only_in_mode(tmp_path):
    a, b = configs_of("periodic_vs_sync", tmp_path)
    assert {a.system.mode, b.system.mode} == {"periodic", "sync"}
    assert a.system.effective_staleness == b.system.effective_staleness == 0
    assert (a.algo, a.rollout, a.optim, a.steps) == (b.algo, b.rollout, b.optim, b.steps)


def test_a3po_vs_recompute_smollm2_crosses_methods_etas_and_seeds(tmp_path):
    configs = configs_of("a3po_vs_recompute_smollm2", tmp_path)
    cells = [(c.system.mode, c.algo.prox, c.system.effective_staleness, c.seed) for c in configs]
    expected = {("sync", "behav", 0, s) for s in (0, 1, 2)} | {
        ("async", p, eta, s)
        for p in ("a3po", "recompute", "behav")
        for eta in (2, 4)
        for s in (0, 1, 2)
    }
    assert len(cells) == len(set(cells)) and set(cells) == expected
    # Seed-major: an interrupted sweep holds whole seeds of every method.
    assert [c.seed for c in configs] == sorted(c.seed for c in configs)
    workload = load_experiment(ROOT / "experiments" / "smollm2_chain_sum.py")
    for c in configs:
        assert (c.model, c.task, c.rollout, c.optim, c.steps) == (
            workload.model,
            workload.task,
            workload.rollout,
            workload.optim,
            workload.steps,
        )


def test_disaggregation_crosses_modes_with_seeds_on_split_cores_and_once_shared(tmp_path):
    configs = configs_of("disaggregation_smollm2", tmp_path)
    cells = [
        (c.system.mode, c.algo.prox, c.staleness_bound, c.system.placement.inference_cores, c.seed)
        for c in configs
    ]
    modes = {
        ("sync", "behav", 0),
        ("periodic", "behav", 0),
        ("one_step_off", "a3po", 1),
        ("async", "a3po", 1),
        ("async", "recompute", 1),
    }
    expected = {(*m, 1, s) for m in modes for s in (0, 1, 2)} | {(*m, 0, 0) for m in modes}
    assert len(cells) == len(set(cells)) and set(cells) == expected
    workload = load_experiment(ROOT / "experiments" / "smollm2_chain_sum.py")
    for c in configs:  # the chain_sum workload, whatever the mode and placement
        assert (c.model, c.task, c.rollout, c.optim, c.steps) == (
            workload.model,
            workload.task,
            workload.rollout,
            workload.optim,
            workload.steps,
        )


def test_periodic_smollm2_baseline_is_the_a3po_sweeps_sync_runs(tmp_path):
    """The periodic sweep borrows its sync baseline: same config but mode and run_dir."""
    periodic = configs_of("periodic_vs_sync_smollm2", tmp_path)
    assert [(c.system.mode, c.seed) for c in periodic] == [("periodic", s) for s in (0, 1, 2)]
    sync = {
        c.seed: c
        for c in configs_of("a3po_vs_recompute_smollm2", tmp_path)
        if c.system.mode == "sync"
    }
    for c in periodic:
        as_sync = dataclasses.replace(
            c,
            system=dataclasses.replace(c.system, mode="sync"),
            run_dir=sync[c.seed].run_dir,
        )
        assert as_sync == sync[c.seed]


def test_offpolicy_smollm2_keeps_the_minibatch_and_updates_fixed(tmp_path):
    configs = configs_of("offpolicy_robustness_smollm2", tmp_path)
    cells = {(c.algo.loss, c.algo.advantage, c.algo.num_minibatches, c.seed) for c in configs}
    assert cells == {
        (loss, adv, n, s)
        for loss, adv in (("dpo", "grpo"), ("ppo", "grpo"), ("ppo", "rloo"))
        for n in (1, 4)
        for s in (0, 1, 2)
    }
    for c in configs:
        n = c.algo.num_minibatches
        assert c.system.mode == "sync" and c.rollout.group_size == 2 and c.algo.track_ref_kl
        assert c.rollout.groups_per_step // n == 8  # the same minibatch for every N
        assert (c.steps - 1) * n == 16  # the same number of optimizer steps, plus one


# --- sweeps --------------------------------------------------------------------------------


def test_override_formatting_and_names():
    assert format_value(True) == "true" and format_value((64, 128)) == "64,128"
    entry = {"algo.prox": "a3po", "system.max_staleness": 4, "seed": 1}
    assert entry_overrides(entry) == ("algo.prox=a3po", "system.max_staleness=4", "seed=1")
    assert run_name(entry) == "prox-a3po_max_staleness-4_seed-1"
    assert run_name({}) == "base"
    assert run_name({"task.options": '{"a": 1}'}) == "options-a-1"


def test_bad_sweeps_are_rejected(tmp_path):
    body = (
        "from a3po_jax.training.config import TrainConfig\n\n"
        "def config():\n    return TrainConfig()\n"
    )
    cases = {
        "notalist.py": ("SWEEP = {'algo.prox': 'a3po'}", "non-empty list"),
        "dup.py": ("SWEEP = [{'seed': 1}, {'seed': 1}]", "both 'seed-1'"),
        "rundir.py": ("SWEEP = [{'run_dir': 'x'}]", "sets run_dir"),
        "badkey.py": ("SWEEP = [{1: 2}]", r"SWEEP\[0\] must be a dict"),
    }
    for file, (sweep, match) in cases.items():
        (tmp_path / file).write_text(body + sweep + "\n")
        with pytest.raises(ConfigError, match=match):
            load_sweep(tmp_path / file)
    (tmp_path / "plain.py").write_text(body)
    assert load_sweep(tmp_path / "plain.py") == [SweepRun("base", ())]
    (tmp_path / "typo.py").write_text(body + "SWEEP = [{'algo.proxx': 'a3po'}]\n")
    with pytest.raises(ConfigError, match="unknown config field 'algo.proxx'"):
        resolve(tmp_path / "typo.py", load_sweep(tmp_path / "typo.py")[0], tmp_path)


def write_metrics(run_dir, steps):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "wall_time": float(s), "reward/mean": 0.1}) for s in steps]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_completion_is_read_from_the_metrics(tmp_path):
    path = ROOT / "experiments" / "a3po_compare_toy.py"
    run = load_sweep(path)[0]
    cfg, _ = resolve(path, run, tmp_path)
    assert completed_steps(cfg.run_dir) == 0 and not is_complete(cfg)
    write_metrics(Path(cfg.run_dir), range(1, cfg.steps))
    assert completed_steps(cfg.run_dir) == cfg.steps - 1 and not is_complete(cfg)
    write_metrics(Path(cfg.run_dir), range(1, cfg.steps + 1))
    assert is_complete(cfg)


def test_run_sweep_dry_run_lists_every_run_and_skips_complete_ones(tmp_path, capsys):
    run_sweep = load_script("run_sweep")
    path = ROOT / "experiments" / "staleness_sweep_toy.py"
    runs = load_sweep(path)
    write_metrics(tmp_path / runs[0].name, range(1, 41))  # complete (40 steps)
    write_metrics(tmp_path / runs[1].name, range(1, 5))  # unfinished, no checkpoint
    assert run_sweep.main([str(path), "--out", str(tmp_path), "--dry-run", "steps=40"]) == 0
    out = capsys.readouterr().out
    assert f"[1/{len(runs)}] {runs[0].name}: complete (40 steps), skipped" in out
    assert f"[2/{len(runs)}] {runs[1].name}: new (logged 4 steps)" in out
    commands = [line.strip() for line in out.splitlines() if line.startswith("  a3po-train")]
    assert len(commands) == len(runs) - 1
    words = shlex.split(commands[0])
    assert words[1] == str(path) and "algo.prox=recompute" in words
    assert words[-1] == f"run_dir={tmp_path / runs[1].name}"
    assert "steps=40" in words
    # Nothing ran: the unfinished run's metrics are untouched.
    assert completed_steps(tmp_path / runs[1].name) == 4


def test_run_sweep_rejects_bad_input(tmp_path, capsys):
    run_sweep = load_script("run_sweep")
    path = str(ROOT / "experiments" / "a3po_compare_toy.py")
    assert run_sweep.main([path, "--dry-run", "--only", "nope"]) == 2
    assert "unknown run(s) ['nope']" in capsys.readouterr().err
    assert run_sweep.main([path, "--dry-run", "algo.prox=bogus"]) == 2
    assert "algo.prox='bogus' is not one of" in capsys.readouterr().err


@pytest.mark.e2e
def test_run_sweep_runs_prunes_and_resumes(tmp_path, capsys):
    """Two 2-step runs of the toy comparison end to end (about a minute on a CPU)."""
    run_sweep = load_script("run_sweep")
    path = str(ROOT / "experiments" / "a3po_compare_toy.py")
    only = ["mode-sync_prox-behav_seed-0", "mode-async_prox-a3po_seed-0"]
    argv = [path, "--out", str(tmp_path), "--prune", "--compile-cache", "", "steps=2"]
    assert run_sweep.main([*argv, "--only", *only]) == 0
    for name in only:
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [
            "config.json",
            "metrics.jsonl",
        ]
        assert completed_steps(tmp_path / name) == 2
    capsys.readouterr()
    assert run_sweep.main([*argv, "--only", *only]) == 0
    assert capsys.readouterr().out.count("complete (2 steps), skipped") == 2


# --- launch.py -----------------------------------------------------------------------------


def launch_dry(capsys, *argv):
    launch = load_script("launch")
    assert launch.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    roles = [line[2:] for line in out if line.startswith("# ")]
    commands = [line for line in out if not line.startswith("# ")]
    assert len(roles) == len(commands)
    return dict(zip(roles, commands, strict=True))


def test_launch_cpu_dry_run(capsys):
    hosts = launch_dry(capsys, "cpu", "experiments/smoke_tiny.py", "steps=2")
    (command,) = hosts.values()
    words = shlex.split(command)
    assert words[0] == "JAX_PLATFORMS=cpu"
    assert words[2:] == ["-m", "a3po_jax.cli.train", "experiments/smoke_tiny.py", "steps=2"]


def test_launch_gpu_node_dry_run_splits_devices(capsys, tmp_path):
    token = str(tmp_path / "tok")
    hosts = launch_dry(
        capsys,
        "gpu-node",
        "experiments/a3po_qwen25_1p5b_gsm8k.py",
        "--trainer-gpus",
        "0",
        "--inference-gpus",
        "1,2",
        "--port",
        "50077",
        "--token-file",
        token,
        "model.name=/ckpt/qwen",
    )
    assert list(hosts) == ["inference host", "trainer"]
    host, trainer = (shlex.split(hosts[k]) for k in hosts)
    assert "CUDA_VISIBLE_DEVICES=1,2" in host and "CUDA_VISIBLE_DEVICES=0" in trainer
    # The host serves exactly what the trainer's config asks for.
    assert host[3:5] == ["-m", "a3po_jax.cli.serve"]
    assert host[host.index("--model") + 1] == "/ckpt/qwen"
    assert host[host.index("--port") + 1] == "50077"
    assert host[host.index("--num-slots") + 1] == "256"
    assert host[host.index("--prefill-buckets") + 1] == "256,512"
    assert host[host.index("--max-cache-len") + 1] == str(512 + 1024)
    assert host[host.index("--token-file") + 1] == token
    assert "system.placement.inference_hosts=127.0.0.1:50077" in trainer
    assert f"system.placement.host_token_file={token}" in trainer
    assert "model.name=/ckpt/qwen" in trainer


def test_launch_gpu_node_without_inference_gpus_embeds_the_host(capsys):
    hosts = launch_dry(capsys, "gpu-node", "experiments/smoke_tiny.py", "--trainer-gpus", "3")
    assert list(hosts) == ["trainer (embedded inference host)"]
    assert "CUDA_VISIBLE_DEVICES=3" in hosts["trainer (embedded inference host)"]
    launch = load_script("launch")
    with pytest.raises(SystemExit, match="must not overlap"):
        launch.main(["gpu-node", "experiments/smoke_tiny.py", "--inference-gpus", "0", "--dry-run"])


def test_launch_tpu_pod_dry_run_prints_every_worker(capsys):
    hosts = launch_dry(
        capsys,
        "tpu-pod",
        "experiments/a3po_compare_toy.py",
        "--tpu",
        "pod1",
        "--zone",
        "us-east5-a",
        "--workers",
        "4",
        "--coordinator-address",
        "10.0.0.2:8476",
        "--inference-tpu",
        "inf1",
        "--inference-address",
        "10.0.0.7",
    )
    assert list(hosts) == ["inference host"] + [f"trainer worker {i}" for i in range(4)]
    assert "tpu-vm ssh inf1" in hosts["inference host"]
    assert "a3po_jax.cli.serve" in hosts["inference host"]
    for i in range(4):
        words = shlex.split(hosts[f"trainer worker {i}"])
        assert words[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod1"]
        assert f"--worker={i}" in words
        remote = words[words.index("--command") + 1]
        assert "JAX_COORDINATOR_ADDRESS=10.0.0.2:8476" in remote
        assert "JAX_NUM_PROCESSES=4" in remote and f"JAX_PROCESS_ID={i}" in remote
        assert "system.placement.inference_hosts=10.0.0.7:50051" in remote
        assert remote.startswith("cd ~/a3po_jax && ")


def test_launch_refuses_what_is_not_supported(capsys):
    launch = load_script("launch")
    assert launch.main(["cpu", "experiments/smoke_tiny.py", "algo.prox=nope", "--dry-run"]) == 2
    with pytest.raises(SystemExit):
        launch.main(["cpu", "experiments/smoke_tiny.py", "--bogus"])
    with pytest.raises(SystemExit):
        launch.main(["tpu-pod", "experiments/smoke_tiny.py", "--dry-run"])  # --tpu required


def test_launch_inference_host_dry_run(capsys):
    hosts = launch_dry(
        capsys, "inference-host", "--model", "smollm2", "--devices", "1", "--bind", "0.0.0.0"
    )
    words = shlex.split(hosts["inference host"])
    assert words[0] == "CUDA_VISIBLE_DEVICES=1"
    assert words[words.index("--model") + 1] == "smollm2"
    assert words[words.index("--host") + 1] == "0.0.0.0"
    assert not words[words.index("--token-file") + 1].startswith("~")  # expanded here


def test_launch_join_host_dry_run_serves_the_runs_settings_and_joins_its_file(capsys):
    run = ["experiments/smoke_tiny.py", "system.placement.inference_hosts=10.0.0.2:50051"]
    run.append("system.placement.hosts_file=/shared/hosts.txt")
    hosts = launch_dry(
        capsys, "join-host", *run, "--port", "50061", "--bind", "0.0.0.0",
        "--advertise", "10.0.0.3", "--devices", "2",
    )  # fmt: skip
    words = shlex.split(hosts["inference host"])
    assert words[0] == "CUDA_VISIBLE_DEVICES=2"
    assert words[words.index("--join") + 1] == "/shared/hosts.txt"
    assert words[words.index("--advertise") + 1] == "10.0.0.3"
    assert words[words.index("--port") + 1] == "50061"
    assert words[words.index("--model") + 1] == "tiny"  # the run's model, not a flag's
    # The run's compilation cache, "~" kept: a3po-serve expands it to the host's own home.
    assert words[words.index("--compile-cache-dir") + 1] == compilation.DEFAULT_DIR
    uncached = launch_dry(capsys, "join-host", *run, "system.run.compile_cache_dir=")
    words = shlex.split(uncached["inference host"])
    assert words[words.index("--compile-cache-dir") + 1] == ""
    launch = load_script("launch")
    with pytest.raises(SystemExit, match="sets no system.placement.hosts_file"):
        launch.main(["join-host", "experiments/smoke_tiny.py", "--dry-run"])


@pytest.mark.e2e
def test_run_sweep_subprocess_mode_runs_each_run_in_a_child(tmp_path, capsys):
    import jax

    run_sweep = load_script("run_sweep")
    path = str(ROOT / "experiments" / "a3po_compare_toy.py")
    cache = tmp_path / "jax_cache"
    argv = [path, "--out", str(tmp_path), "--prune", "--subprocess", "steps=2"]
    argv += ["--compile-cache", str(cache)]
    before = jax.config.jax_compilation_cache_dir
    assert run_sweep.main([*argv, "--only", "mode-sync_prox-behav_seed-0"]) == 0
    assert completed_steps(tmp_path / "mode-sync_prox-behav_seed-0") == 2
    assert "done in" in capsys.readouterr().out
    assert any(cache.iterdir())  # the child compiled into the sweep's cache...
    # ...and this process's compilations stay out of it (they would land there for the
    # rest of the test session).
    assert jax.config.jax_compilation_cache_dir == before


def test_run_sweep_stops_when_a_run_is_stopped(tmp_path, capsys, monkeypatch):
    """A run that returns 0 before its last step was stopped (SIGTERM): the sweep stops too,
    instead of going on with the next run."""
    run_sweep = load_script("run_sweep")
    from a3po_jax.cli import train

    calls = []
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv) or 0)
    path = str(ROOT / "experiments" / "a3po_compare_toy.py")
    only = ["mode-sync_prox-behav_seed-0", "mode-async_prox-a3po_seed-0"]
    argv = [path, "--out", str(tmp_path), "--compile-cache", "", "--only", *only]
    assert run_sweep.main(argv) == 1
    assert len(calls) == 1
    assert "stopped after" in capsys.readouterr().out


def saved_task(config: dict) -> dict:
    """A committed run's task section; runs saved before ``task.reward`` existed were scored
    by the verifier, its default."""
    return {"reward": TaskSection().reward, **config["task"]}


def test_committed_smollm2_results_ran_on_their_experiments_task():
    """The SmolLM2 reproductions derive from smollm2_chain_sum.py, and each committed run's
    task is its experiment file's: a change of the quickstart's task cannot quietly leave
    their results on another workload."""
    derived = [
        path.stem for path in EXPERIMENTS if 'with_name("smollm2_chain_sum.py")' in path.read_text()
    ]
    assert len(derived) == 6
    checked = 0
    for name in derived:
        task = dataclasses.asdict(load_experiment(ROOT / "experiments" / f"{name}.py").task)
        assert task["name"] == "chain_sum"
        for config_json in sorted((ROOT / "results" / name).rglob("config.json")):
            ran = saved_task(json.loads(config_json.read_text()))
            assert {k: ran.get(k) for k in task} == task, config_json
            checked += 1
    assert checked >= 30


def test_offpolicy_lab_smollm2_runs_the_toy_labs_methods_on_its_committed_runs_task(tmp_path):
    toy = configs_of("offpolicy_lab_toy", tmp_path / "toy")
    lab = configs_of("offpolicy_lab_smollm2", tmp_path / "lab")
    quickstart = load_experiment(ROOT / "experiments" / "quickstart_a3po.py")
    committed = json.loads(
        next((ROOT / "results" / "offpolicy_lab_smollm2").rglob("config.json")).read_text()
    )
    assert len(lab) == len(toy) == 27
    for small, big in zip(toy, lab, strict=True):
        # The same method and seed per cell: loss, prox rule, mode, bound, minibatches.
        assert (big.algo, big.system.mode, big.staleness_bound, big.seed, big.steps) == (
            small.algo,
            small.system.mode,
            small.staleness_bound,
            small.seed,
            small.steps,
        )
        assert big.model == quickstart.model
        assert dataclasses.asdict(big.task) == saved_task(committed)
        assert (big.eval_prompts, big.eval_budget) == (64, big.rollout.max_new_tokens)
        assert (big.rollout.group_size, big.rollout.groups_per_step) == (2, 32)
        assert big.optim.learning_rate == quickstart.optim.learning_rate and big.evaluate
    assert len({c.run_dir for c in lab}) == 27


def test_the_edge_sweeps_pilot_is_naive_ppo_on_the_main_jobs_held_out_task(tmp_path):
    """The rule of experiments/offpolicy_edge_smollm2.py reads its PILOT runs: they must be
    runs of its sweep, naive PPO, on a task whose test split is held out."""
    path = ROOT / "experiments" / "offpolicy_edge_smollm2.py"
    edge = import_experiment(path)
    runs = {run.name: run for run in load_sweep(path)}
    assert len(runs) == 11 * 3 and set(edge.PILOT) <= set(runs)  # 11 methods, 3 seeds
    # M2PO's three readings are three runs of each seed.
    readings = {resolve(path, runs[n], tmp_path)[0].algo.m2po.reading for n in runs if "m2po" in n}
    assert readings == {"all_tokens_mask", "clip_side_mask", "derived_clip"}
    for name in edge.PILOT:
        cfg, _ = resolve(path, runs[name], tmp_path)
        assert cfg.algo.prox == "behav" and cfg.algo.loss == "ppo"
        assert json.loads(cfg.task.options)["holdout"] > 0
        assert cfg.staleness_bound == 8 and cfg.algo.num_minibatches == 4
        # Every point of the ladder is a valid set of extra overrides on a pilot run.
        for point in edge.LADDER:
            moved = apply_overrides(cfg, [f"{key}={value}" for key, value in point.items()])
            assert moved.algo.prox == "behav"
    assert edge.LADDER[0] == {}, "the file's own settings are the first point"
    assert 0 < edge.FINISHED_AT_END <= 1, "a share of the held-out answers"
