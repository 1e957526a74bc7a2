"""`a3po-train` as one job of two JAX processes equals the same run in one process.

Two processes with one CPU device each (process 0 runs the embedded inference host, the
queue and the logs, broadcasts each batch and gathers the weights for the push) against one
process with two devices: the same (fsdp=2) mesh, the same synchronous run (tiny model,
letters task), so every step's loss, gradient norm and parameter norm must agree. Then the
two-process job stops on SIGTERM sent to process 1 only: both save and exit cleanly.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from helpers.processes import REPO, cpu_env, free_port

from a3po_jax.training.checkpointing import CheckpointManager
from a3po_jax.training.metrics import read_metrics

pytestmark = pytest.mark.multidevice

RUN = [
    sys.executable, "-m", "a3po_jax.cli.train", "experiments/smoke_tiny.py",
    "task.name=letters", "task.options={}", "system.mode=sync", "algo.prox=behav",
    "rollout.prompt_buckets=64", "rollout.group_size=8", "rollout.groups_per_step=4",
    "rollout.max_new_tokens=12", "rollout.num_slots=32", "optim.learning_rate=3e-3",
]  # fmt: skip
COMPARED = ("loss/total", "optim/grad_norm", "optim/param_norm", "reward/mean")


def launch(run_dir, processes: int, devices: int, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for pid in range(processes):
        env = cpu_env(devices)
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(pid),
            )
        procs.append(
            subprocess.Popen(
                [*RUN, f"run_dir={run_dir}", *extra],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(procs, timeout=600) -> list[str]:
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"rc={proc.returncode}\n{err[-3000:]}"
        outs.append(out)
    return outs


def test_two_processes_train_like_one_and_stop_together(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    outs = finish(launch(two, 2, 1, "steps=3"))
    finish(launch(one, 1, 2, "steps=3"))
    assert "  steps" in outs[0] and "3 of 3" in outs[0]  # the end-of-run report
    assert "report:" not in outs[1]  # only process 0 reports
    a, b = read_metrics(two), read_metrics(one)
    assert [r["version"] for r in a] == [r["version"] for r in b] == [1, 2, 3]
    assert any(r["optim/grad_norm"] > 0 for r in a)  # a real gradient, not zeros
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (key, ra, rb)

    # SIGTERM on process 1 alone: every process saves step k and exits 0.
    stop = tmp_path / "stop"
    procs = launch(stop, 2, 1, "steps=200", "checkpoint_every=1000")
    deadline = time.monotonic() + 300
    while not (stop / "metrics.jsonl").exists() or not read_metrics(stop):
        assert time.monotonic() < deadline, "the two-process run made no step"
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)
    finish(procs)
    records = read_metrics(stop)
    assert 1 <= len(records) < 200
    manager = CheckpointManager(stop / "checkpoints", save_interval_steps=1000)
    assert manager.all_steps() == [records[-1]["version"]]
