"""A run checkpointed on N devices resumes on M: killed (SIGKILL) on 4 virtual CPU devices,
resumed on 2 and killed again, resumed on 4 to its last step.

The trainer's mesh follows the device count (``system.mesh.fsdp=-1``: FSDP over every
device), so each leg runs on a mesh of its own and saves its checkpoints laid out on it;
each resume restores them into the new mesh's shardings (orbax reshards). What must hold:

* every checkpoint restores to the same bits on any mesh that holds the model (1, 2 or 4
  devices; FSDP, data x FSDP, FSDP x tensor): params, Adam's moments and its count, the
  step (``tests/helpers/restore_on_meshes.py``, the trainer's own restore);
* the run reaches its last step with one record per version, and its ledger passes the
  exactly-once audit over all three legs (asynchronous mode, groups completing out of order:
  ``tests/helpers/exactly_once_run.py``);
* a mesh that cannot hold the model (a tensor axis that does not divide the KV heads) is
  refused by its config field before anything in the run dir changes;
* a job of another number of processes resumes it too (1 process of 4 devices, then 2
  processes of 1 device each, as a pod slice that lost hosts);
* against an uninterrupted run on the saving mesh, the step redone on the new mesh trains
  the same samples (generated from the restored weights: the same rewards, exactly) to the
  same loss up to float rounding.

Bit-for-bit equality with an uninterrupted run is not asked across meshes: the gradient's
reductions add the same numbers in another order on another mesh (float rounding).
"""

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.paths import REPO
from helpers.processes import cpu_env, free_port
from helpers.trainer_runs import resumed_progress

from a3po_jax.cli.train import latest_checkpoint_step
from a3po_jax.rollout.ledger import audit
from a3po_jax.training.checkpointing import CheckpointManager
from a3po_jax.training.metrics import learning_metrics, read_metrics

pytestmark = pytest.mark.multidevice

STEPS = 8
GROUPS_PER_STEP = 4  # experiments/smoke_tiny.py
# (devices, kill once this many steps are logged; None: run to the end)
LEGS = ((4, 2), (2, 5), (4, None))

# The synchronous runs' settings (with the reproducibility options: docs/reproducibility.md);
# both tests that use them compile the same programs on 4 devices.
SYNC = [
    "experiments/smoke_tiny.py", "checkpoint_every=1", "system.mode=sync", "task.name=letters",
    "task.options={}", "rollout.batch_invariant=true", "system.consume_order=admission",
]  # fmt: skip


def trainer_cmd(run_dir, *extra):
    return [
        sys.executable, str(REPO / "tests" / "helpers" / "exactly_once_run.py"), str(run_dir),
        f"steps={STEPS}", "checkpoint_every=1", "task.name=letters", "task.options={}",
        "rollout.max_new_tokens=6", "system.mode=async", "system.max_staleness=3", *extra,
    ]  # fmt: skip


def saved_mesh(checkpoints, step):
    """The (data, fsdp, tensor) sizes of the mesh the params of ``step`` were saved from."""
    with CheckpointManager(checkpoints, async_save=False) as manager:
        axes = manager.saved_mesh(step)
    return tuple(axes[name] for name in ("data", "fsdp", "tensor"))


def run_leg(run_dir, n, devices, kill_after):
    command = trainer_cmd(run_dir, *(["--resume"] if n else []))
    env = cpu_env(devices)
    if kill_after is None:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if resumed_progress(run_dir, n) >= kill_after:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    proc.kill()  # SIGKILL: a lost slice, no save on the way out
    proc.wait()
    proc.stderr.close()


def test_killed_on_4_devices_resumes_on_2_and_again_on_4(tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    snapshots = []
    for n, (devices, kill_after) in enumerate(LEGS):
        run_leg(run_dir, n, devices, kill_after)
        step = latest_checkpoint_step(run_dir)
        assert step >= 1
        # Each leg saved from its own mesh: FSDP over its devices.
        assert saved_mesh(checkpoints, step) == (1, devices, 1), (n, step)
        if kill_after is not None:  # what the next leg resumes from, kept for the check below
            snapshot = tmp_path / f"leg{n}_step{step}"
            shutil.copytree(checkpoints, snapshot, ignore=shutil.ignore_patterns("held"))
            snapshots.append((snapshot, step))
    assert latest_checkpoint_step(run_dir) == STEPS

    # The run: one record per version, each prompt trained once over the three legs.
    assert [r["version"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    result = audit(run_dir)
    assert result.ok, result.summary()
    assert result.resumes == 2
    assert result.trained == STEPS * GROUPS_PER_STEP

    # What each leg resumed from (saved on 4, then on 2 devices) and the end (on 4) restore
    # to the same bits on every mesh, Adam's count and the version going on from the step.
    checked = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "restore_on_meshes.py"),
         str(run_dir / "config.json"), *(str(s) for s, _ in snapshots), str(checkpoints)],
        cwd=REPO, env=cpu_env(4), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr[-3000:]
    summaries = [json.loads(line) for line in checked.stdout.splitlines()]
    assert [s["step"] for s in summaries] == [step for _, step in snapshots] + [STEPS]
    for summary in summaries:
        assert summary["version"] == summary["adam_count"] == summary["step"], summary
        assert len(summary["meshes"]) == 5

    # A mesh that cannot hold the model is refused by name (before the model loads); the run
    # dir stays as it was.
    # So is one that does not divide the batch's rows (4 prompts x 8 samples over 3).
    before = {p: p.read_bytes() for p in (run_dir / "ledger.jsonl", run_dir / "config.json")}
    for devices, settings, named in (
        (4, ["system.mesh.tensor=4"], ["system.mesh.tensor=4", "n_kv_heads=2"]),
        (3, ["system.mesh.data=3", "system.mesh.fsdp=1"], ["32 sequences", "system.mesh.data=3"]),
    ):
        refused = subprocess.run(
            [sys.executable, "-m", "a3po_jax.cli.train", "experiments/smoke_tiny.py",
             f"run_dir={run_dir}", f"steps={STEPS}", *settings, "--resume"],
            cwd=REPO, env=cpu_env(devices), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr[-3000:]
        message = refused.stderr.strip().splitlines()[-1]
        assert all(part in message for part in named), message
        assert all(p.read_bytes() == data for p, data in before.items())
    assert latest_checkpoint_step(run_dir) == STEPS


def test_the_step_redone_on_2_devices_trains_what_the_uninterrupted_run_on_4_did(tmp_path):
    """Sync mode with the reproducibility options: a run on 4 devices, and the same run that
    lost its step-3 checkpoint (died between the step's record and its save) resumed from
    step 2 on 2 devices. Step 3's samples come from the restored weights, so its rewards
    are the uninterrupted run's exactly; the update itself is computed on another mesh, so
    its loss and the other learning metrics agree to float rounding only."""
    settings = [*SYNC, "steps=3"]
    full, run = tmp_path / "full", tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "a3po_jax.cli.train", *settings, f"run_dir={full}"],
        cwd=REPO, env=cpu_env(4), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(full, run)
    shutil.rmtree(run / "checkpoints" / "3")
    resumed = subprocess.run(
        [sys.executable, "-m", "a3po_jax.cli.train", *settings, f"run_dir={run}", "--resume",
         "--log-level", "INFO"],
        cwd=REPO, env=cpu_env(2), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "checkpoint step 2 was saved on a mesh of data 1 x fsdp 4 x tensor 1 (4 devices); "
        "restoring it onto data 1 x fsdp 2 x tensor 1 (2 devices)" in resumed.stderr
    )
    assert saved_mesh(run / "checkpoints", 3) == (1, 2, 1)

    expected = [learning_metrics(r) for r in read_metrics(full)]
    records = [learning_metrics(r) for r in read_metrics(run)]
    assert [r["version"] for r in records] == [r["version"] for r in expected] == [1, 2, 3]
    assert records[:2] == expected[:2]  # before the checkpoint: the records as they were
    redone, reference = records[2], expected[2]
    assert sorted(redone) == sorted(reference)
    # What the samples decide (rewards, tokens and their staleness) is equal; what the
    # update computes, close.
    samples = sorted(k for k in reference if k.startswith(("reward/", "staleness/")))
    assert samples and all(redone[k] == reference[k] for k in samples), samples
    for key, value in reference.items():
        if isinstance(value, (int, float)):
            np.testing.assert_allclose(redone[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
        else:
            assert redone[key] == value, key
    result = audit(run)
    assert result.ok and result.resumes == 1, result.summary()


def test_a_checkpoint_of_one_process_on_4_devices_resumes_as_two_processes(tmp_path):
    """Saved by one process with 4 devices, resumed by a job of two processes with one
    device each (process 0 restores and serves, both hold shards of the state)."""
    run_dir = tmp_path / "run"
    settings = [sys.executable, "-m", "a3po_jax.cli.train", *SYNC, f"run_dir={run_dir}"]
    first = subprocess.run(
        [*settings, "steps=2"], cwd=REPO, env=cpu_env(4), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    port = free_port()
    procs = [
        subprocess.Popen(
            [*settings, "steps=3", "--resume", "--log-level", "INFO"],
            cwd=REPO,
            env=cpu_env(
                1,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(pid),
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "(4 devices); restoring it onto data 1 x fsdp 2 x tensor 1 (2 devices)" in err
    assert [r["version"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert saved_mesh(run_dir / "checkpoints", 3) == (1, 2, 1)
    result = audit(run_dir)
    assert result.ok and result.resumes == 1, result.summary()
