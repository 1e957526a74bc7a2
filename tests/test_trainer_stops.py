"""How a run stops on its own: N non-finite steps in a row, and SIGTERM (checkpoint, then stop).

Both through the real trainer, queue and embedded host (tiny model, letters task).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
from test_trainer_e2e import LetterTask, make_cfg

from a3po_jax.rollout.ledger import audit
from a3po_jax.training.checkpointing import CheckpointManager
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

pytestmark = pytest.mark.slow


def test_non_finite_steps_are_skipped_and_n_in_a_row_stop_the_run(tmp_path, caplog):
    base = make_cfg(tmp_path, "nan", mode="sync", steps=6, prox="behav")
    cfg = dataclasses.replace(base, system=dataclasses.replace(base.system, max_nonfinite_steps=2))
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


def test_sigterm_saves_a_checkpoint_and_stops_the_run(tmp_path):
    base = make_cfg(tmp_path, "term", mode="sync", steps=8, prox="behav")
    cfg = dataclasses.replace(base, checkpoint_every=100)  # only the SIGTERM save
    previous = signal.getsignal(signal.SIGTERM)

    def on_step(step, record):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler preempting the job

    try:
        trainer = Trainer(
            cfg, load_policy(cfg.model), task=LetterTask(), console=False, on_step=on_step
        )
        trainer.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    records = read_metrics(cfg.run_dir)
    assert [r["version"] for r in records] == [1, 2]  # stopped after the step in progress
    manager = CheckpointManager(tmp_path / "term" / "checkpoints", save_interval_steps=100)
    assert manager.latest_step() == 2
    # ...and --resume continues from it to the end.
    resumed = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    resumed.run(resume=True)
    assert [r["version"] for r in read_metrics(cfg.run_dir)] == list(range(1, 9))


class FreezableHost:
    """An embedded host behind a switch: once frozen it accepts requests and returns nothing,
    as a host that is down (or a pool whose every host is down) looks to the trainer."""

    def __init__(self, host):
        self._host = host
        self.frozen = False
        self.update_policy = host.update_policy

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


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_sigterm_while_no_host_answers_saves_and_stops_within_a_second(tmp_path, mode):
    # Every host down: the step waits for rollouts that do not come (rollout_timeout_s is
    # 600 s). A preemption notice gives ~30 s: the run must save and stop well inside it.
    base = make_cfg(tmp_path, mode, mode=mode, steps=8, prox="behav")
    cfg = dataclasses.replace(base, checkpoint_every=100)
    policy = load_policy(cfg.model)
    probe = Trainer(cfg, policy, task=LetterTask(), console=False)  # its embedded host
    host = FreezableHost(probe._start_host(policy.params))
    probe.close()
    previous = signal.getsignal(signal.SIGTERM)
    sent = {}

    def preempt():
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    def on_step(step, record):
        if step == 2:  # the hosts go down, then the scheduler's notice comes
            host.frozen = True
            threading.Timer(1.0, preempt).start()

    try:
        trainer = Trainer(cfg, policy, host=host, task=LetterTask(), console=False, on_step=on_step)
        trainer.run()
        stopped = time.monotonic()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped - sent["at"] < 1.0, "the run did not honour SIGTERM while waiting"
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
