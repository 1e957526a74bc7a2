"""kill -9 the trainer mid-run, then --resume: it continues from the newest complete
checkpoint, nothing is corrupted, and the run reaches its last step."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from a3po_jax.training.checkpointing import CheckpointManager
from a3po_jax.training.metrics import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def cli(run_dir, *extra):
    return [
        sys.executable, "-m", "a3po_jax.cli.train", "experiments/smoke_tiny.py",
        f"run_dir={run_dir}", "steps=6", "checkpoint_every=1", "system.mode=sync",
        "task.name=letters", "task.options={}", *extra,
    ]  # fmt: skip


def test_kill_9_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        cli(run_dir), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()

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
