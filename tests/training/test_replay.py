"""Recorded rollouts and replay (``system.run.record_rollouts``, ``a3po-train --replay``): the
step files round-trip exactly and are written atomically; an asynchronous run (whose
samples depend on timing) replayed without an inference host reproduces its per-step losses
and its final parameters; so does a periodic-mode run (groups folded one by one), replayed in
two parts with a --resume between them."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from a3po_jax.cli.train import main
from a3po_jax.core.types import Rollout, RolloutGroup
from a3po_jax.training import recording
from a3po_jax.training.checkpointing import CheckpointManager
from a3po_jax.training.config import apply_overrides, load_experiment
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke_tiny.py")


def sample(group_id, index, *, n_prompt, n_tokens, finish="stop", reward=0.5, info=None, v=3):
    rng = np.random.default_rng(1000 * group_id + index)
    return Rollout(
        prompt_id=f"p{group_id}",
        group_id=group_id,
        sample_index=index,
        prompt_tokens=rng.integers(0, 50_000, n_prompt),
        completion_tokens=rng.integers(0, 50_000, n_tokens),
        behav_logprobs=rng.normal(size=n_tokens).astype(np.float32) - 2.0,
        versions=rng.integers(v - 2, v + 1, n_tokens),
        finish_reason=finish,
        reward=reward,
        info={} if info is None else info,
        admitted_at_version=v - 2,
    )


def groups_fixture() -> list[RolloutGroup]:
    g7 = [
        sample(7, 0, n_prompt=5, n_tokens=4, reward=0.1 + 1e-12, info={"correct": 1, "x": 0.3}),
        sample(7, 1, n_prompt=5, n_tokens=0, finish="length", reward=-1.0),  # no tokens
        sample(7, 2, n_prompt=5, n_tokens=9, finish="length", reward=None, info={}),
    ]
    g3 = [
        sample(3, i, n_prompt=2, n_tokens=3 + i, info={"num_tokens": 3 + i, "ok": True, "s": "é"})
        for i in range(3)
    ]
    return [
        RolloutGroup(prompt_id="p7", group_id=7, rollouts=g7, admitted_at_version=1),
        # consumption order is kept: group 3 after group 7
        RolloutGroup(prompt_id="p3", group_id=3, rollouts=g3, admitted_at_version=0),
    ]


def assert_groups_equal(got: list[RolloutGroup], want: list[RolloutGroup]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.prompt_id, g.group_id, g.admitted_at_version) == (
            w.prompt_id,
            w.group_id,
            w.admitted_at_version,
        )
        assert len(g.rollouts) == len(w.rollouts)
        for a, b in zip(g.rollouts, w.rollouts, strict=True):
            for field in dataclasses.fields(Rollout):
                x, y = getattr(a, field.name), getattr(b, field.name)
                if isinstance(y, np.ndarray):
                    assert x.dtype == y.dtype and x.shape == y.shape, field.name
                    np.testing.assert_array_equal(x, y, err_msg=field.name)
                else:
                    assert type(x) is type(y) and x == y, (field.name, x, y)


def test_step_file_round_trip_is_exact(tmp_path):
    groups = groups_fixture()
    path = recording.write_step(tmp_path, 12, groups, trainer_version=5)
    assert path.name == "step_000012.npz"
    got, meta = recording.read_step(path)
    assert_groups_equal(got, groups)
    assert meta["step"] == 12 and meta["trainer_version"] == 5
    # Nothing pickled: every array loads with allow_pickle=False and none is an object array.
    with np.load(path, allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
        assert z["completion_tokens"].dtype == np.int32
        assert z["behav_logprobs"].dtype == np.float32
    # An empty step (no groups) round-trips too.
    empty = recording.write_step(tmp_path, 13, [], trainer_version=6)
    assert recording.read_step(empty)[0] == []


def test_leftover_temporary_files_are_ignored_and_gaps_refused(tmp_path):
    rollouts = tmp_path / recording.ROLLOUTS_DIR
    recording.write_step(rollouts, 1, groups_fixture(), trainer_version=0)
    # What a run killed inside write_step leaves: a hidden temporary file, never a step file.
    (rollouts / ".step_000002.npz.1234.tmp").write_bytes(b"half a zip")
    (rollouts / "step_000002.npz.tmp").write_bytes(b"junk")
    assert recording.list_steps(rollouts) == [1]
    assert recording.recorded_steps(tmp_path) == [1]
    recording.write_step(rollouts, 3, groups_fixture(), trainer_version=2)
    with pytest.raises(recording.ReplayError, match=r"misses steps \[2\]"):
        recording.recorded_steps(tmp_path)
    with pytest.raises(recording.ReplayError, match="system.run.record_rollouts=true"):
        recording.recorded_steps(tmp_path / "elsewhere")


def test_replay_source_hands_out_steps_and_checks_shapes(tmp_path):
    rollouts = tmp_path / recording.ROLLOUTS_DIR
    groups = groups_fixture()
    for step in (1, 2):
        recording.write_step(rollouts, step, groups, trainer_version=step - 1)
    source = recording.ReplaySource(tmp_path, group_size=3, batch_groups=2)
    first = source.get_batch(1, trainer_version=0, timeout=None)  # periodic: one at a time
    second = source.get_batch(1, trainer_version=0, timeout=None)
    assert_groups_equal(first + second, groups)
    source.consumed(first + second, ledger_step=1)  # extra keywords are accepted
    assert source.counters()["consumed_groups"] == 2
    assert_groups_equal(source.get_batch(2, trainer_version=1, timeout=None), groups)
    with pytest.raises(recording.ReplayError, match="set steps= at most"):
        source.get_batch(2, trainer_version=2, timeout=None)

    wrong = recording.ReplaySource(tmp_path, group_size=3, batch_groups=4)
    with pytest.raises(recording.ReplayError, match="rollout.groups_per_step=4"):
        wrong.get_batch(4, trainer_version=0, timeout=None)
    wrong = recording.ReplaySource(tmp_path, group_size=8, batch_groups=2)
    with pytest.raises(recording.ReplayError, match="rollout.group_size=8"):
        wrong.get_batch(2, trainer_version=0, timeout=None)


def record(tmp_path: Path, name: str, *overrides: str):
    """Run the smoke experiment with recording on; returns (config, final params)."""
    cfg = apply_overrides(
        load_experiment(SMOKE),
        [
            f"run_dir={tmp_path / name}",
            "steps=4",
            "system.run.record_rollouts=true",
            "checkpoint_every=100",  # one checkpoint, forced at the last step
            *overrides,
        ],
    )
    trainer = Trainer(cfg, load_policy(cfg.model), console=False)
    trainer.run()
    return cfg, jax.device_get(trainer.state.params)


def assert_params_close(got, want) -> None:
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def assert_losses_equal(recorded_dir, replay_dir) -> None:
    rec, rep = read_metrics(recorded_dir), read_metrics(replay_dir)
    assert [r["step"] for r in rep] == [r["step"] for r in rec] == [1, 2, 3, 4]
    for a, b in zip(rec, rep, strict=True):
        for key in recording.COMPARED_KEYS:
            assert a[key] != 0.0, key  # a real update, not a vacuous comparison
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
        assert b["staleness/tokens"] == a["staleness/tokens"]  # same tokens, same versions
        # What a replay cannot know is absent; what it trained on is counted as recorded.
        assert not any(k.startswith(("host/", "hosts/", "length/generated")) for k in b)
        assert b["queue/consumed_samples"] == a["queue/consumed_samples"]
        if "length/trained_mean" in a:
            assert b["length/trained_mean"] == a["length/trained_mean"]


@pytest.mark.e2e
def test_async_run_replays_to_equal_losses_and_parameters(tmp_path, capsys):
    cfg, params = record(tmp_path, "rec", "system.mode=async", "system.max_staleness=2")
    rec_dir = Path(cfg.run_dir)
    assert recording.recorded_steps(rec_dir) == [1, 2, 3, 4]
    rec_metrics = read_metrics(rec_dir)
    # Asynchronous for real: some trained tokens were generated by an older policy.
    assert max(r["staleness/max"] for r in rec_metrics) > 0

    # Replay through the CLI: no host, default run dir RUN_DIR/replay, match reported.
    assert main(["--replay", str(rec_dir)]) == 0
    err = capsys.readouterr().err
    assert f"replay of {rec_dir}: 4 steps" in err and ": match" in err, err
    replay_dir = rec_dir / "replay"
    check = json.loads((replay_dir / "replay_check.json").read_text())
    assert check["match"] and check["steps"] == 4
    assert_losses_equal(rec_dir, replay_dir)
    manager = CheckpointManager(replay_dir / "checkpoints", save_interval_steps=100)
    assert manager.latest_step() == 4
    replayed = manager.restore_params(params_template=params)
    assert_params_close(replayed, params)
    initial = load_policy(cfg.model).params  # the run trained: the comparison can fail
    assert (
        max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(initial), strict=True)
        )
        > 1e-4
    )

    # Fewer steps on request; a shape-changing override and a run without recording refused.
    assert main(["--replay", str(rec_dir), "steps=2", f"run_dir={tmp_path / 'two'}"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "two")] == [1, 2]
    capsys.readouterr()
    assert main(["--replay", str(rec_dir), "rollout.groups_per_step=2"]) == 2
    assert "rollout.groups_per_step=2 differs from the recording's 4" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text((rec_dir / "config.json").read_text())
    assert main(["--replay", str(tmp_path / "plain")]) == 2
    assert "system.run.record_rollouts=true" in capsys.readouterr().err


@pytest.mark.e2e
def test_periodic_run_replays_in_fold_order_and_resumes(tmp_path):
    cfg, params = record(tmp_path, "rec", "system.mode=periodic", "system.max_staleness=0")
    rec_dir = Path(cfg.run_dir)
    replay_cfg = recording.replay_config(rec_dir)
    assert replay_cfg.run_dir == str(rec_dir / "replay") and replay_cfg.steps == 4
    assert not replay_cfg.system.run.record_rollouts
    # Two steps with a checkpoint, then --resume to the fourth: the replay cursor is in the
    # checkpoint, so the resumed replay continues with recorded step 3.
    first = dataclasses.replace(replay_cfg, steps=2, checkpoint_every=1)
    trainer = Trainer(first, load_policy(first.model), console=False, replay_dir=rec_dir)
    assert trainer.host is None
    trainer.run()
    rest = dataclasses.replace(replay_cfg, checkpoint_every=1)
    trainer = Trainer(rest, load_policy(rest.model), console=False, replay_dir=rec_dir)
    trainer.run(resume=True)
    assert_losses_equal(rec_dir, replay_cfg.run_dir)
    assert_params_close(jax.device_get(trainer.state.params), params)
    assert recording.compare_runs(rec_dir, replay_cfg.run_dir)["match"]


@pytest.mark.parametrize(
    "backend, flags, warns",
    [
        ("cpu", "", False),
        ("tpu", "", False),
        ("gpu", "", True),
        ("gpu", "--xla_gpu_autotune_level=0", True),
        ("gpu", "--xla_gpu_deterministic_ops=false", True),
        ("gpu", "--xla_gpu_deterministic_ops=true", False),
        ("gpu", "--xla_gpu_autotune_level=0  --xla_gpu_deterministic_ops", False),
        ("gpu", "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", True),
    ],
)
def test_nondeterministic_gpu_is_named_with_the_flag_that_fixes_it(backend, flags, warns):
    reason = recording.nondeterminism_warning(backend, flags)
    assert (reason is not None) == warns
    if warns:
        assert recording.GPU_DETERMINISM_FLAG in reason and "GPU" in reason


def test_a_replay_on_a_gpu_without_deterministic_ops_warns(tmp_path, monkeypatch, caplog):
    rollouts = tmp_path / "rec" / recording.ROLLOUTS_DIR
    recording.write_step(rollouts, 1, groups_fixture(), trainer_version=0)
    cfg = apply_overrides(load_experiment(SMOKE), [f"run_dir={tmp_path / 'replay'}", "steps=1"])
    policy = load_policy(cfg.model)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    for backend, warned in (("cpu", False), ("gpu", True)):
        caplog.clear()
        with monkeypatch.context() as m:
            m.setattr(jax, "default_backend", lambda b=backend: b)
            # Closed at once: an open Trainer leaves its heap-trimmer thread and its SIGTERM
            # handler to the tests that follow.
            Trainer(cfg, policy, console=False, replay_dir=tmp_path / "rec").close()
        messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(recording.GPU_DETERMINISM_FLAG in msg for msg in messages) == warned, messages
