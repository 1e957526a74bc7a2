"""kill -9 the trainer mid-run, then --resume: it continues from the newest complete
checkpoint, nothing is corrupted, and the run reaches its last step."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from a3po_jax.rollout.ledger import audit
from a3po_jax.training.checkpointing import HELD_DIR, CheckpointManager
from a3po_jax.training.config import load_experiment
from a3po_jax.training.metrics import learning_metrics, read_metrics
from a3po_jax.training.recording import list_steps
from a3po_jax.training.trainer import load_policy

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "experiments" / "smoke_tiny.py"


def cli(run_dir, *extra, mode="sync"):
    return [
        sys.executable, "-m", "a3po_jax.cli.train", "experiments/smoke_tiny.py",
        f"run_dir={run_dir}", "steps=6", "checkpoint_every=1", f"system.mode={mode}",
        "task.name=letters", "task.options={}", *extra,
    ]  # fmt: skip


def kill_9_after_three_steps(run_dir, env, *extra, mode="sync") -> None:
    """Starts the run, kill -9s it once three step records are written (the process must
    still be running then)."""
    proc = subprocess.Popen(
        cli(run_dir, *extra, mode=mode), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_kill_9_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    kill_9_after_three_steps(run_dir, env)

    manager = CheckpointManager(run_dir / "checkpoints", async_save=False)
    last = manager.latest_step()
    manager.close()
    assert last is not None and last >= 2
    before = {r["version"]: r for r in read_metrics(run_dir)}

    resumed = subprocess.run(
        cli(run_dir, "--resume"), cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(run_dir)
    versions = [r["version"] for r in records]
    # One record per version 1..6: steps after the checkpoint are redone, not duplicated.
    assert versions == [1, 2, 3, 4, 5, 6]
    # Steps up to the checkpoint are the ones logged before the kill, untouched.
    for v in range(1, last + 1):
        assert records[v - 1]["loss/total"] == before[v]["loss/total"]


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_kill_9_then_resume_is_the_uninterrupted_run_bit_for_bit(tmp_path, mode):
    """With the reproducibility options (docs/reproducibility.md), three processes on one
    machine: an uninterrupted run, and a run killed after its third step and resumed, end
    with the same metrics and parameters, bit for bit (one_step_off: the groups in flight at
    the newest complete checkpoint come back from the file saved with it)."""
    options = ["rollout.batch_invariant=true", "system.consume_order=admission"]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        # The three launches compile the same programs: compile once (in the suite's cache
        # where it has one).
        JAX_COMPILATION_CACHE_DIR=os.environ.get(
            "JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache")
        ),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    full_dir, run_dir = tmp_path / "full", tmp_path / "run"
    done = subprocess.run(
        cli(full_dir, *options, mode=mode), cwd=REPO, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    kill_9_after_three_steps(run_dir, env, *options, mode=mode)
    resumed = subprocess.run(
        cli(run_dir, *options, "--resume", mode=mode), cwd=REPO, env=env, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    full = [learning_metrics(r) for r in read_metrics(full_dir)]
    records = [learning_metrics(r) for r in read_metrics(run_dir)]
    assert [r["version"] for r in records] == [r["version"] for r in full] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, records, strict=True):
        different = sorted(k for k in a if a[k] != b.get(k))
        assert not different, f"step {a['version']}: {different}"
    template = load_policy(load_experiment(SMOKE).model).params
    params = []
    for directory in (full_dir, run_dir):
        with CheckpointManager(directory / "checkpoints", async_save=False) as manager:
            assert manager.latest_step() == 6
            params.append(manager.restore_params(params_template=template))
    for x, y in zip(*(jax.tree.leaves(p) for p in params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    result = audit(run_dir)
    assert result.ok, result.summary()
    assert result.reissued == 0 and (result.restored_held > 0) == (mode == "one_step_off")
    # The held groups are kept for the steps orbax keeps, no others.
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        held = list_steps(run_dir / "checkpoints" / HELD_DIR)
        assert held == (manager.all_steps() if mode == "one_step_off" else [])
