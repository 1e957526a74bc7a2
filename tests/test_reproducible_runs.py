"""Same seed, same machine, same numbers: with ``rollout.batch_invariant`` and
``system.consume_order=admission`` a run is a function of its configuration in the modes whose
weight updates reach the host at batch boundaries (sync, periodic, one_step_off): every
learning metric of every step and the final parameters are bitwise equal across two runs,
and a run resumed from a checkpoint equals the uninterrupted one bit for bit
(`tests/test_trainer_kill_resume.py` does it after kill -9). So do two lockstep async runs
(``system.lockstep_decode_steps``), resumed or not, and a recorded one replays (``--replay``,
no host) to its own losses and parameters bit for bit. In one_step_off and lockstep async the
checkpoint lets the groups in flight that the saved weights could not regenerate complete
and saves them beside it; the resume puts them back instead of regenerating them.

Not yet: async runs with η > 0 without lockstep, whose in-flight weight updates land at
decode steps set by timing.

Without the options a sample's behaviour log-probs depend on the prompts prefilled with it
and on its neighbours' lengths (`tests/test_batch_invariance.py` shows the difference), and
the groups of a batch are trained in the order they finished, so the same runs differ in
the last bits of the loss after a few steps.
"""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from a3po_jax.cli.train import main as train_main
from a3po_jax.inference import InferenceHost
from a3po_jax.rollout.ledger import audit, ledger_path, read_events
from a3po_jax.tasks.toy import LetterTask
from a3po_jax.training import recording
from a3po_jax.training.checkpointing import CheckpointManager
from a3po_jax.training.config import (
    AlgoSection,
    ModelSection,
    RolloutSection,
    SystemSection,
    TaskSection,
    TrainConfig,
)
from a3po_jax.training.metrics import learning_metrics, read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

pytestmark = pytest.mark.slow


def reproducible_cfg(tmp_path, name, *, mode, steps=4, checkpoint_every=0):
    return TrainConfig(
        model=ModelSection(name="tiny"),
        task=TaskSection(name="letters"),
        rollout=RolloutSection(
            group_size=4,
            groups_per_step=3,
            max_new_tokens=8,
            num_slots=8,  # fewer than the groups' samples: slots are reused within a batch
            prompt_buckets=(32, 64),
            batch_invariant=True,
        ),
        algo=AlgoSection(prox="a3po"),
        system=SystemSection(
            mode=mode,
            max_staleness=0,
            consume_order="admission",
        ),
        steps=steps,
        seed=3,
        run_dir=str(tmp_path / name),
        checkpoint_every=checkpoint_every,
    )


def run(cfg, *, resume=False):
    """The run's records (snapshots left out) and its final parameters; its queue's counts
    add up."""
    trainer = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    trainer.run(resume=resume)
    trainer.queue.check_invariant()
    c = trainer.queue.counters()
    held = c["pending_samples"] + c["ready_groups"] * cfg.rollout.group_size
    finished = c["consumed_samples"] + sum(c["dropped_samples"].values()) + c["filtered_samples"]
    assert c["produced_samples"] == finished + held, c
    params = jax.tree.map(np.asarray, jax.device_get(trainer.state.params))
    records = [learning_metrics(r) for r in read_metrics(cfg.run_dir)]
    return records, params


def assert_bitwise_equal(a, b, what):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b, what
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=what)


@pytest.mark.parametrize("mode", ["sync", "periodic", "one_step_off"])
def test_two_runs_with_one_seed_are_bitwise_equal(tmp_path, mode):
    first, params_1 = run(reproducible_cfg(tmp_path, "first", mode=mode))
    second, params_2 = run(reproducible_cfg(tmp_path, "second", mode=mode))
    assert [r["version"] for r in first] == [1, 2, 3, 4]
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        different = sorted(k for k in a if a[k] != b[k])
        assert not different, f"step {a['version']}: {different}"
    assert first[-1]["loss/total"] != first[0]["loss/total"]  # it trained
    assert_bitwise_equal(params_1, params_2, f"{mode}: final parameters")


def assert_resumed_is_uninterrupted(full, resumed, full_params, resumed_params, after):
    """Every record after step ``after`` (by step) and the final parameters are equal."""
    by_step = {r["step"]: r for r in resumed}
    compared = [r for r in full if r["step"] > after]
    assert compared
    for r in compared:
        other = by_step[r["step"]]
        different = sorted(k for k in r if r[k] != other.get(k))
        assert not different, f"step {r['step']}: {different}"
    assert_bitwise_equal(full_params, resumed_params, "resumed vs uninterrupted parameters")


def held_groups_restored(run_dir):
    """Groups a resume put back into the queue from the checkpoint's held file."""
    return sum(1 for e in read_events(ledger_path(run_dir)) if e["event"] == "restore_held")


@pytest.mark.parametrize("mode", ["sync", "periodic", "one_step_off"])
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, mode):
    """sync and periodic checkpoints leave no group in flight (the next batch is admitted
    after the save); a one_step_off checkpoint waits for the next batch, generated by the
    weights before the saved ones, and saves it beside the checkpoint."""
    full, full_params = run(reproducible_cfg(tmp_path, "full", mode=mode, checkpoint_every=2))
    part = reproducible_cfg(tmp_path, "part", mode=mode, steps=2, checkpoint_every=2)
    run(part)
    resumed, resumed_params = run(dataclasses.replace(part, steps=4), resume=True)
    assert_resumed_is_uninterrupted(full, resumed, full_params, resumed_params, after=2)
    # one_step_off: the batch in flight at the save comes back as it was (3 groups).
    assert held_groups_restored(part.run_dir) == (3 if mode == "one_step_off" else 0)
    result = audit(part.run_dir)
    assert result.ok, result.summary()
    assert result.reissued == 0


def lockstep_cfg(tmp_path, name, **system):
    cfg = reproducible_cfg(tmp_path, name, mode="async")
    return dataclasses.replace(
        cfg,
        # Lockstep alone fixes every admission and swap, so neither option is needed.
        rollout=dataclasses.replace(cfg.rollout, batch_invariant=False),
        system=dataclasses.replace(
            cfg.system, max_staleness=2, consume_order="completion", **system
        ),
        evaluate=True,  # the held-out evaluation drives the host too
        eval_prompts=4,
    )


def test_two_lockstep_async_runs_are_bitwise_equal_and_stale(tmp_path):
    first, params_1 = run(lockstep_cfg(tmp_path, "first", lockstep_decode_steps=3))
    second, params_2 = run(lockstep_cfg(tmp_path, "second", lockstep_decode_steps=3))
    assert [r["version"] for r in first if "loss/total" in r] == [1, 2, 3, 4]
    for a, b in zip(first, second, strict=True):
        different = sorted(k for k in a if a[k] != b.get(k))
        assert not different, f"step {a['version']}: {different}"
    assert_bitwise_equal(params_1, params_2, "lockstep async: final parameters")
    # It is asynchronous: stale tokens are trained, none staler than η = 2.
    maxima = [r["staleness/max"] for r in first if "staleness/max" in r]
    assert 1 <= max(maxima) <= 2, maxima
    assert "eval/accuracy" in first[-1]


def test_lockstep_drives_only_a_host_the_trainer_starts(tmp_path):
    cfg = lockstep_cfg(tmp_path, "given", lockstep_decode_steps=3)
    policy = load_policy(cfg.model)
    with InferenceHost(policy.config, policy.params, num_slots=8) as host:
        with pytest.raises(ValueError, match="lockstep_decode_steps drives a host this trainer"):
            Trainer(cfg, policy, host=host, task=LetterTask(), console=False)


def test_a_resumed_lockstep_async_run_is_the_uninterrupted_run_bit_for_bit(tmp_path):
    """A lockstep checkpoint drives the host (admitting nothing) until every group in flight
    is complete, and saves them beside it: the resumed run regenerates nothing."""

    def cfg(name, steps):
        c = lockstep_cfg(tmp_path, name, lockstep_decode_steps=3)
        # No evaluation: the one at the part run's last step would finish what is in flight.
        return dataclasses.replace(c, steps=steps, checkpoint_every=2, evaluate=False)

    full, full_params = run(cfg("full", 4))
    part = cfg("part", 2)
    run(part)
    resumed, resumed_params = run(dataclasses.replace(part, steps=4), resume=True)
    assert_resumed_is_uninterrupted(full, resumed, full_params, resumed_params, after=2)
    assert held_groups_restored(part.run_dir) > 0
    result = audit(part.run_dir)
    assert result.ok, result.summary()
    assert result.reissued == 0
    maxima = [r["staleness/max"] for r in full if "staleness/max" in r]
    assert 1 <= max(maxima) <= 2, maxima


def test_a_recorded_lockstep_async_run_replays_to_the_same_parameters_bit_for_bit(tmp_path):
    """`--replay` re-trains the recorded groups without a host: from a deterministic run it
    gives the run's own losses and parameters exactly, not only to a tolerance."""
    cfg = lockstep_cfg(tmp_path, "rec", lockstep_decode_steps=3)
    cfg = dataclasses.replace(
        cfg,
        evaluate=False,
        checkpoint_every=100,  # one checkpoint, forced at the last step
        system=dataclasses.replace(cfg.system, record_rollouts=True),
    )
    recorded, params = run(cfg)
    assert train_main(["--replay", cfg.run_dir]) == 0
    replay_dir = Path(cfg.run_dir) / "replay"
    replayed = read_metrics(replay_dir)
    assert [r["version"] for r in replayed] == [r["version"] for r in recorded] == [1, 2, 3, 4]
    for a, b in zip(recorded, replayed, strict=True):
        different = sorted(k for k in recording.COMPARED_KEYS if a[k] != b[k])
        assert not different, f"step {a['version']}: {different}"
    manager = CheckpointManager(replay_dir / "checkpoints", save_interval_steps=100)
    got = jax.tree.map(np.asarray, manager.restore_params(params_template=params))
    manager.close()
    assert_bitwise_equal(params, got, "replayed vs recorded parameters")
    assert max(r["staleness/max"] for r in recorded) >= 1  # it was asynchronous
