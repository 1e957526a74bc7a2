"""How a run stops on its own: N non-finite steps in a row, SIGTERM / SIGINT (checkpoint,
then stop; a second one exits at once), and a write that fails (one line, the previous
checkpoint kept).

Through the real trainer, queue and embedded host (tiny model, letters task), and through
``a3po-train`` itself (in process, or as a process to send signals to).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers.inference_reference import start_grpc_server, stop_grpc_server
from helpers.trainer_runs import LetterTask, make_cfg

from a3po_jax.cli.train import connect_hosts, latest_checkpoint_step, main
from a3po_jax.rollout.ledger import audit
from a3po_jax.training import host_placement
from a3po_jax.training import trainer as trainer_module
from a3po_jax.training.checkpointing import CheckpointManager
from a3po_jax.training.config import HostsSection, PlacementSection, RunSection
from a3po_jax.training.metrics import MetricsLogger, read_metrics
from a3po_jax.training.stopping import STOP_DEADLINE_S
from a3po_jax.training.trainer import Trainer, load_policy


def test_non_finite_steps_are_skipped_and_n_in_a_row_stop_the_run(tmp_path, caplog):
    base = make_cfg(tmp_path, "nan", mode="sync", steps=6, prox="behav")
    cfg = dataclasses.replace(
        base, system=dataclasses.replace(base.system, run=RunSection(max_nonfinite_steps=2))
    )
    trainer = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    step_fn = trainer._train_step
    calls = []

    def poisoned(state, arrays, ref):
        # Step 1 trains normally; from step 2 on the advantages are NaN, as a reward bug
        # or an overflow would make them: the update must be skipped, not applied.
        calls.append(1)
        if len(calls) >= 2:
            arrays = {**arrays, "advantages": arrays["advantages"] * np.float32("nan")}
        return step_fn(state, arrays, ref)

    trainer._train_step = poisoned
    with caplog.at_level(logging.WARNING, logger="a3po_jax.training.trainer"):
        with pytest.raises(FloatingPointError, match=r"2 non-finite steps in a row.*max_nonfinite"):
            trainer.run()
    assert "update skipped; prompts" in caplog.text  # the offending batch's prompt ids
    assert int(trainer.state.step) == 1  # only the finite step was applied
    records = read_metrics(cfg.run_dir)
    assert [r["step/skipped"] for r in records] == [0.0, 1.0]  # the second record is the skip
    assert records[-1]["step/skipped_total"] == 1
    params = trainer.state.params
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "when", ["after_a_step", "during_a_checkpoint_write", "during_a_weight_push"]
)
def test_sigterm_saves_a_checkpoint_and_stops_the_run(tmp_path, when):
    steps = 4 if when == "during_a_checkpoint_write" else 8
    base = make_cfg(tmp_path, "term", mode="sync", steps=steps, prox="behav")
    # After a step or a push: only the SIGTERM save. During a write: the regular save of step 2.
    every = 2 if when == "during_a_checkpoint_write" else 100
    cfg = dataclasses.replace(base, checkpoint_every=every)
    previous = signal.getsignal(signal.SIGTERM)

    def on_step(step, record):
        if step == 2 and when == "after_a_step":
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler preempting the job

    try:
        trainer = Trainer(
            cfg, load_policy(cfg.model), task=LetterTask(), console=False, on_step=on_step
        )
        if when == "during_a_checkpoint_write":
            save = trainer.checkpoints.save

            def preempted_save(step, **kwargs):
                # The notice lands while step 2's checkpoint is being written: the write
                # completes (the handler only sets a flag), then the run stops. (Every step
                # comes here; the manager's interval skips the others.)
                if step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.2)  # the handler has run: the flag is set mid-write
                    assert trainer.stop_signal == "SIGTERM"
                return save(step, **kwargs)

            trainer.checkpoints.save = preempted_save
        if when == "during_a_weight_push":
            push = trainer.host.update_weights

            def preempted_push(params, version):
                # The notice lands while step 2's weights go to the host: the push
                # completes (the host serves version 2), then the run saves and stops.
                if version == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.2)
                    assert trainer.stop_signal == "SIGTERM"
                return push(params, version)

            trainer.host.update_weights = preempted_push
        trainer.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    records = read_metrics(cfg.run_dir)
    assert [r["version"] for r in records] == [1, 2]  # stopped after the step in progress
    manager = CheckpointManager(tmp_path / "term" / "checkpoints", save_interval_steps=every)
    assert manager.latest_step() == 2 and manager.all_steps() == [2]  # complete, saved once
    # ...and --resume continues from it to the end.
    resumed = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    resumed.run(resume=True)
    assert [r["version"] for r in read_metrics(cfg.run_dir)] == list(range(1, steps + 1))


class FreezableHost:
    """An embedded host behind a switch: once frozen it accepts requests and returns nothing,
    as a host that is down (or a pool whose every host is down) looks to the trainer."""

    in_process = False  # (as a remote host looks to the trainer: it pushes at start)

    def __init__(self, host):
        self._host = host
        self.frozen = False
        self.update_policy = host.update_policy

    def wait_serving(self, version, timeout):
        return self._host.wait_serving(version, timeout)

    def submit(self, request):
        if not self.frozen:
            self._host.submit(request)

    def poll(self, timeout=None, max_results=None):
        if self.frozen:
            time.sleep(timeout or 0.0)
            return []
        return self._host.poll(timeout=timeout, max_results=max_results)

    def update_weights(self, params, version):
        self._host.update_weights(params, version)

    def stats(self):
        return self._host.stats()

    def counters(self):
        return self._host.counters()

    def close(self):
        self._host.close()


# With a frozen remote host, from the notice: the checkpoint is on disk within SAVE_BOUND_S,
# and the trainer has returned within STOP_DEADLINE_S, so a3po-train exits by itself inside
# a 30 s preemption notice (its deadline is the backstop).
SAVE_BOUND_S = 5.0
SERVER_ARGS = ("--num-slots", "8", "--prefill-buckets", "64", "--max-cache-len", "96")
SERVER_ARGS += ("--update-policy", "drain")  # what sync mode needs of its hosts


@pytest.mark.parametrize(
    "mode,signum",
    [("sync", signal.SIGTERM), ("periodic", signal.SIGINT)],
    ids=["sync-SIGTERM", "periodic-SIGINT"],
)
def test_sigterm_while_no_host_answers_saves_and_stops_in_seconds(tmp_path, mode, signum):
    # Every host down: the step waits for rollouts that do not come (rollout_timeout_s is
    # 600 s). A preemption notice gives ~30 s: the run must save and stop well inside it.
    # SIGINT (Ctrl-C) is the same request as SIGTERM.
    base = make_cfg(tmp_path, mode, mode=mode, steps=8, prox="behav")
    cfg = dataclasses.replace(base, checkpoint_every=100)
    policy = load_policy(cfg.model)
    # The embedded host a run of this config starts.
    host = FreezableHost(
        host_placement.embedded_host(cfg, policy.config, policy.params, None, start=True)
    )
    previous = signal.getsignal(signal.SIGTERM)
    sent = {}

    def preempt():
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signum)

    def on_step(step, record):
        if step == 2:  # the hosts go down, then the scheduler's notice comes
            host.frozen = True
            threading.Timer(1.0, preempt).start()

    previous_int = signal.getsignal(signal.SIGINT)
    try:
        trainer = Trainer(cfg, policy, host=host, task=LetterTask(), console=False, on_step=on_step)
        trainer.run()
        stopped = time.monotonic()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    assert trainer.stop_signal == signal.Signals(signum).name
    # Against the 600 s rollout timeout; the stop includes the save, which a loaded 2-core
    # machine has taken over a second for.
    assert stopped - sent["at"] < SAVE_BOUND_S, "the run did not honour SIGTERM while waiting"
    assert [r["version"] for r in read_metrics(cfg.run_dir)] == [1, 2]
    manager = CheckpointManager(tmp_path / mode / "checkpoints", save_interval_steps=100)
    assert manager.latest_step() == 2
    # --resume (hosts back) continues from it, and no prompt was trained twice.
    host.frozen = False
    resumed = Trainer(cfg, policy, task=LetterTask(), console=False)
    resumed.run(resume=True)
    host.close()
    assert [r["version"] for r in read_metrics(cfg.run_dir)] == list(range(1, 9))
    assert audit(cfg.run_dir).ok


def test_sigterm_while_the_only_remote_host_is_frozen_saves_and_stops_within_the_bound(tmp_path):
    """As above with a real gRPC host process behind the pool a3po-train builds: it freezes
    (SIGSTOP: a lost machine, a partition; its calls hang rather than fail), the notice
    comes, and the trainer must save at once and return inside the bound."""
    token_file = tmp_path / "token"
    proc, address = start_grpc_server(token_file, *SERVER_ARGS)
    base = make_cfg(tmp_path, "remote", mode="sync", steps=6, prox="behav")
    cfg = dataclasses.replace(
        base,
        checkpoint_every=100,  # only the SIGTERM save
        system=dataclasses.replace(
            base.system,
            placement=PlacementSection(inference_hosts=address, host_token_file=str(token_file)),
            hosts=HostsSection(timeout_s=5.0, health_interval_s=0.2),
        ),
    )
    policy = load_policy(cfg.model)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    sent = {}

    def preempt():
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    def on_step(step, record):
        if step == 2:
            proc.send_signal(signal.SIGSTOP)
            threading.Timer(1.0, preempt).start()

    try:
        trainer = Trainer(
            cfg, policy, host=connect_hosts(cfg.system), task=LetterTask(), console=False,
            on_step=on_step,
        )  # fmt: skip
        save, saved = trainer.checkpoints.save, {}

        def timed_save(step, **kwargs):
            written = save(step, **kwargs)
            saved["at"] = time.monotonic()
            return written

        trainer.checkpoints.save = timed_save
        trainer.run()
        took = time.monotonic() - sent["at"]
        proc.send_signal(signal.SIGCONT)
        stopped_at = latest_checkpoint_step(cfg.run_dir)
        # The checkpoint first, within seconds; then the rollout threads are let go (one
        # may be stuck handing a request to the frozen host: its join gives up after 10 s).
        assert saved["at"] - sent["at"] < SAVE_BOUND_S
        assert took < STOP_DEADLINE_S, f"stopped {took:.1f} s after SIGTERM"
        assert stopped_at >= 2  # the steps done when the notice came, saved
        assert [r["version"] for r in read_metrics(cfg.run_dir)] == list(range(1, stopped_at + 1))
        # The host is back: --resume finishes the run, and no prompt was trained twice.
        resumed = Trainer(
            cfg, policy, host=connect_hosts(cfg.system), task=LetterTask(), console=False
        )
        resumed.run(resume=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        proc.send_signal(signal.SIGCONT)
        stop_grpc_server(proc)
    assert [r["version"] for r in read_metrics(cfg.run_dir)] == list(range(1, 7))
    assert audit(cfg.run_dir).ok


# --------------------------------------------------------------------------------------
# The whole program: a3po-train's answer to stop signals and to writes that fail.
# --------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke_tiny.py")
# A small sync run: each step is short, and the resume of a sync run is exact.
SMALL = ["system.mode=sync", "rollout.groups_per_step=2", "rollout.max_new_tokens=6"]
# a3po-train's bound from the first stop signal to the end of the process (checkpointing
# included), inside a 30 s preemption notice (training/stopping.py), plus process start-up
# slack on a busy test machine.
STOP_BOUND_S = STOP_DEADLINE_S + 10


@pytest.mark.parametrize(
    "wait_for,signals,code,line",
    [
        # During the model load: nothing to save; the process ends at once.
        (
            "loading model",
            ["SIGTERM"],
            143,
            "a3po-train: SIGTERM before training started: stopping now; no checkpoint could "
            "be made",
        ),
        # While the first step compiles and waits for rollouts: a clean stop, nothing saved
        # (or step 1 saved, should its rollouts have been quicker than the signal).
        ("step 1: compiling", ["SIGTERM"], 0, "a3po-train: stopped by SIGTERM: "),
        # Ctrl-C twice: the second one ends it now.
        (
            "step 1: compiling",
            ["SIGINT", "SIGINT"],
            130,
            "a3po-train: second stop signal (SIGINT after SIGINT): exiting now",
        ),
    ],
)
def test_a3po_train_ends_within_the_bound_on_stop_signals_before_a_checkpoint(
    tmp_path, wait_for, signals, code, line
):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "a3po_jax.cli.train", SMOKE, f"run_dir={run_dir}", *SMALL],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines = []
    for text in proc.stderr:  # up to the phase the signal should land in
        lines.append(text.rstrip("\n"))
        if wait_for in text:
            break
    sent = time.monotonic()
    for name in signals:
        proc.send_signal(getattr(signal, name))
        time.sleep(0.3)
    lines += proc.stderr.read().splitlines()
    assert proc.wait(timeout=120) == code, "\n".join(lines)
    assert time.monotonic() - sent < STOP_BOUND_S
    (said,) = [text for text in lines if text.startswith(line)]
    assert "Traceback" not in "\n".join(lines)
    saved = latest_checkpoint_step(run_dir)
    if code == 0:  # a clean stop says what it saved
        assert saved in (0, 1) and ("no checkpoint could be made" in said) == (saved == 0), said
    else:
        assert saved == 0


def test_failed_writes_stop_the_run_with_one_line_and_resume_works(tmp_path, capsys, monkeypatch):
    """Disk full while a checkpoint is written, a read-only ledger, disk full on
    metrics.jsonl: each stops the run with one line naming the file and exit code 1, the
    previous checkpoint stays the one --resume continues from, and a last --resume
    finishes the run."""
    run_dir = tmp_path / "run"
    argv = [SMOKE, f"run_dir={run_dir}", "steps=3", "checkpoint_every=1", *SMALL]

    def last_line() -> str:
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err.strip().splitlines()[-1]

    # 1. The disk fills while step 2's checkpoint is written.
    save = ocp.CheckpointManager.save

    def disk_full_at_step_2(self, step, *args, **kwargs):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, step, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ocp.CheckpointManager, "save", disk_full_at_step_2)
        assert main(argv) == 1
    assert last_line() == (
        f"a3po-train: stopped: cannot write {run_dir / 'checkpoints' / '2'}: No space left on "
        "device (the checkpoint was not written); the newest complete checkpoint is step 1 "
        "(--resume continues from it)"
    )
    assert latest_checkpoint_step(run_dir) == 1

    # 2. The run dir turned read-only: the ledger cannot be opened for appending.
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "Ledger", read_only)
        assert main([*argv, "--resume"]) == 1
    assert last_line().startswith(
        f"a3po-train: stopped: cannot write {run_dir / 'ledger.jsonl'}: Read-only file system;"
        " the newest complete checkpoint is step 1"
    )

    # 3. The disk fills on metrics.jsonl at step 2 (before its checkpoint).
    write_line = MetricsLogger._write_line

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    def disk_full_on_step_2(self, record):
        if record.get("step") != 2:
            return write_line(self, record)
        real, self._file = self._file, FullDisk()
        try:
            return write_line(self, record)
        finally:
            self._file = real

    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "_write_line", disk_full_on_step_2)
        assert main([*argv, "--resume"]) == 1
    assert last_line().startswith(
        f"a3po-train: stopped: cannot write {run_dir / 'metrics.jsonl'}: No space left on "
        "device; the newest complete checkpoint is step 1"
    )
    assert latest_checkpoint_step(run_dir) == 1

    # 4. Space again: --resume finishes the run from step 1, and every prompt was trained
    # once (the ledger voids what each failed attempt did after its checkpoint).
    assert main([*argv, "--resume"]) == 0
    assert latest_checkpoint_step(run_dir) == 3
    versions = [r["version"] for r in read_metrics(run_dir)]
    assert versions[-2:] == [2, 3]
    assert audit(run_dir).ok
