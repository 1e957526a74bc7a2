"""Tests for orbax checkpoints of (params, opt_state, extra) and the SIGTERM flag."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from a3po_jax.training.checkpointing import (
    COMMIT_MARKER,
    CheckpointManager,
    check_json_roundtrip,
    install_sigterm_handler,
)

ROOT = Path(__file__).resolve().parents[2]


def make_state(seed):
    """bfloat16 and float32 params and a chained AdamW state after two real updates, so
    every moment is non-zero and the state nests NamedTuples inside a tuple."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "embed": jax.random.normal(k1, (8, 4), jnp.float32).astype(jnp.bfloat16),
        "layer": {"w": jax.random.normal(k2, (4, 4)), "b": jnp.zeros((4,))},
    }
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt_state = optimizer.init(params)
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state, optimizer


def assert_trees_identical(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


EXTRA = {
    "version": 7,
    "step": 7,
    "data_iterator": {"epoch": 1, "position": 42, "order_seed": 3},
    "prng_key": [0, 4294967295],  # jax.random.key_data(key).tolist(): uint32 as ints
    "queue": {"consumed_groups": 14, "dropped_groups": {"stale": 2}},
    "last_loss": 0.125,
    "note": None,
    "flags": [True, False],
}


def test_round_trip_adamw_state_bfloat16_params_and_extra(tmp_path):
    params, opt_state, optimizer = make_state(0)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.latest_step() is None
        assert manager.save(7, params=params, opt_state=opt_state, extra=EXTRA)
        manager.wait_until_finished()
        assert manager.latest_step() == 7

    # A fresh process would build its templates from a new init: different values.
    fresh_params, _, _ = make_state(1)
    template_state = optimizer.init(fresh_params)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        restored_params, restored_opt, extra = manager.restore(
            params_template=fresh_params, opt_state_template=template_state
        )
    assert restored_params["embed"].dtype == jnp.bfloat16
    assert_trees_identical(restored_params, params)
    assert_trees_identical(restored_opt, opt_state)
    # NamedTuple types survive, so optax can keep using the state.
    assert type(restored_opt[1][0]) is type(opt_state[1][0])
    assert int(restored_opt[1][0].count) == 2
    assert extra == EXTRA
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.read_extra() == EXTRA
    optimizer.update(jax.tree.map(jnp.ones_like, restored_params), restored_opt, restored_params)


def test_restore_from_abstract_templates(tmp_path):
    params, opt_state, optimizer = make_state(0)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, params=params, opt_state=opt_state, extra={"version": 1})
        manager.wait_until_finished()
        abstract_params = jax.eval_shape(lambda: params)
        abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
        restored_params, restored_opt, _ = manager.restore(
            1, params_template=abstract_params, opt_state_template=abstract_opt
        )
    assert_trees_identical(restored_params, params)
    assert_trees_identical(restored_opt, opt_state)


def test_async_save_survives_donating_the_saved_buffers(tmp_path):
    """The train step donates params right after a save: the save must already hold its own
    host copy when ``save`` returns."""
    params = {"w": jnp.arange(4096, dtype=jnp.float32)}
    expected = np.asarray(params["w"]).copy()
    opt_state = optax.adamw(1e-3).init(params)
    overwrite = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.0 - 1.0, p), donate_argnums=0)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, params=params, opt_state=opt_state, extra={}, force=True)
        new_params = overwrite(params)
        manager.wait_until_finished()
        restored, _, _ = manager.restore(
            1, params_template=new_params, opt_state_template=opt_state
        )
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected)


def test_keeps_the_newest_n_and_honours_the_interval(tmp_path):
    params, opt_state, _ = make_state(0)
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as manager:
        saved = [
            manager.save(step, params=params, opt_state=opt_state, extra={"step": step})
            for step in range(1, 7)
        ]
        assert saved == [False, True, False, True, False, True]
        assert not manager.should_save(7)
        # SIGTERM at an odd step: force writes it anyway.
        assert manager.save(7, params=params, opt_state=opt_state, extra={"step": 7}, force=True)
        manager.wait_until_finished()
        assert manager.all_steps() == [6, 7]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]
        with pytest.raises(FileNotFoundError, match="complete steps: \\[6, 7\\]"):
            manager.restore(2, params_template=params, opt_state_template=opt_state)


def test_half_written_checkpoints_are_ignored_and_logged(tmp_path, caplog):
    params, opt_state, optimizer = make_state(0)
    later_params, later_opt, _ = make_state(5)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, params=params, opt_state=opt_state, extra={"version": 1})
        manager.save(2, params=params, opt_state=opt_state, extra={"version": 2})
        manager.wait_until_finished()
        assert all((tmp_path / s / COMMIT_MARKER).exists() for s in ("1", "2"))
    # A crash mid-save leaves a tmp dir; a partial copy leaves a step dir with files but no
    # commit marker. Both are newer than step 2 and must not be picked.
    (tmp_path / "3.orbax-checkpoint-tmp-1700000000").mkdir()
    (tmp_path / "3.orbax-checkpoint-tmp-1700000000" / "params").mkdir()
    partial = tmp_path / "4"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "_METADATA").write_text("{")
    with caplog.at_level(logging.WARNING, logger="a3po_jax.training.checkpointing"):
        manager = CheckpointManager(tmp_path)
    assert (
        "ignoring unfinished checkpoint" in caplog.text and "3.orbax-checkpoint-tmp" in caplog.text
    )
    assert "ignoring checkpoint step 4" in caplog.text
    assert manager.latest_step() == 2
    restored_params, _, extra = manager.restore(
        params_template=later_params, opt_state_template=later_opt
    )
    assert extra == {"version": 2}
    assert_trees_identical(restored_params, params)
    # The bad step was moved aside, not deleted, and step 4 can be written again.
    assert len(list(tmp_path.glob("4.incomplete-*"))) == 1
    assert manager.save(4, params=later_params, opt_state=later_opt, extra={"version": 4})
    manager.wait_until_finished()
    assert manager.latest_step() == 4
    manager.close()
    assert not (tmp_path / "3.orbax-checkpoint-tmp-1700000000").exists()  # orbax cleaned up


def test_restore_without_checkpoint_raises(tmp_path):
    params, opt_state, _ = make_state(0)
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            manager.restore(params_template=params, opt_state_template=opt_state)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"key": (1, 2)}, "extra\\['key'\\] has type tuple.*use a list"),
        ({"loss": np.float32(0.5)}, "extra\\['loss'\\] has type float32"),
        ({"queue": {1: 2}}, "extra\\['queue'\\] has key 1 of type int"),
        ({"key": [1, jnp.ones(())]}, "extra\\['key'\\]\\[1\\] has type"),
    ],
)
def test_extra_must_round_trip_through_json(tmp_path, extra, message):
    with pytest.raises(TypeError, match=message):
        check_json_roundtrip(extra, "extra")
    params, opt_state, _ = make_state(0)
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(TypeError, match=message):
            manager.save(1, params=params, opt_state=opt_state, extra=extra)
        assert manager.all_steps() == []


def test_sigterm_sets_a_flag_instead_of_exiting():
    calls = []
    flag = install_sigterm_handler(calls.append)
    try:
        assert not flag.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.wait(5.0)  # the handler runs in the main thread, right after the kill
        assert flag.signum == signal.SIGTERM and calls == [signal.SIGTERM]
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_second_signal_goes_to_the_previous_handler():
    previous_calls = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: previous_calls.append(signum))
    try:
        flag = install_sigterm_handler(signals=(signal.SIGUSR1,))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.wait(5.0) and previous_calls == []
        os.kill(os.getpid(), signal.SIGUSR1)  # impatient: forward to the old behaviour
        for _ in range(100):
            if previous_calls:
                break
            time.sleep(0.01)
        assert previous_calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_restore_params_only(tmp_path):
    # Evaluation restores just the params of a run, without an optimizer state template.
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}
    opt_state = optax.adamw(1e-3).init(params)
    manager = CheckpointManager(tmp_path / "ckpt", async_save=False)
    manager.save(4, params=params, opt_state=opt_state, extra={"version": 4}, force=True)
    manager.wait_until_finished()
    restored = manager.restore_params(params_template=jax.tree.map(jnp.zeros_like, params))
    np.testing.assert_array_equal(restored["w"], params["w"])
    assert restored["b"].dtype == jnp.bfloat16
    manager.close()


def test_train_state_round_trip_with_version_and_extra(tmp_path):
    from a3po_jax.core.optim import TrainState
    from a3po_jax.training.checkpointing import restore_train_state, save_train_state

    params, opt_state, optimizer = make_state(0)
    state = TrainState(params, opt_state, jnp.int32(6))
    with CheckpointManager(tmp_path, async_save=False) as manager:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            restore_train_state(manager, state)
        extra = {"queue": {"consumed_groups": 4}, "skipped_steps": 1}
        assert save_train_state(manager, 3, state, extra=extra)
        # A fresh state of the same structure is the template: version 0, other params.
        other, other_opt, _ = make_state(1)
        template = TrainState(other, other_opt, jnp.int32(0))
        restored, got_extra, step = restore_train_state(manager, template)
    assert step == 3
    # The version (optimizer steps, 2 per step with two minibatches) is saved, not the step.
    assert int(restored.step) == 6 and got_extra["version"] == 6 and got_extra["step"] == 3
    assert got_extra["queue"] == {"consumed_groups": 4} and got_extra["skipped_steps"] == 1
    assert_trees_identical(restored.params, params)
    assert_trees_identical(restored.opt_state, opt_state)


def test_the_saved_mesh_is_recorded_and_a_restore_onto_another_is_logged(tmp_path, caplog):
    """The mesh a state was saved from is only a record: the restore lays it out on the
    template's mesh, and says so when the two differ (tests/e2e/test_resume_on_another_mesh.py
    does it across device counts)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from a3po_jax.core.optim import TrainState
    from a3po_jax.parallel.sharding import make_mesh
    from a3po_jax.training.checkpointing import restore_train_state, save_train_state

    def placed(mesh, seed):
        params, opt_state, _ = make_state(seed)
        state = TrainState(params, opt_state, jnp.int32(2))
        return jax.device_put(state, NamedSharding(mesh, PartitionSpec()))

    saved = placed(make_mesh(), 0)
    with CheckpointManager(tmp_path / "on_mesh", async_save=False) as manager:
        save_train_state(manager, 1, saved, extra={})
        assert manager.saved_mesh() == {"data": 1, "fsdp": 1, "tensor": 1}
        other = Mesh(np.asarray(jax.devices()[:1]), ("x",))
        with caplog.at_level(logging.INFO, logger="a3po_jax.training.checkpointing"):
            restored, _, _ = restore_train_state(manager, placed(other, 1))
    assert "saved on a mesh of data 1 x fsdp 1 x tensor 1 (1 device)" in caplog.text
    assert "restoring it onto x 1 (1 device)" in caplog.text
    assert all(leaf.sharding.mesh == other for leaf in jax.tree.leaves(restored))
    assert_trees_identical(restored.params, saved.params)
    assert_trees_identical(restored.opt_state, saved.opt_state)
    with CheckpointManager(tmp_path / "plain", async_save=False) as manager:
        params, opt_state, _ = make_state(0)  # arrays on one device, no mesh
        save_train_state(manager, 1, TrainState(params, opt_state, jnp.int32(2)), extra={})
        assert manager.saved_mesh() is None


def test_async_saves_pay_on_accelerators_only():
    from types import SimpleNamespace

    from a3po_jax.training.checkpointing import async_save_pays

    dev = lambda platform: SimpleNamespace(platform=platform)  # noqa: E731
    assert not async_save_pays([dev("cpu")])
    assert not async_save_pays([dev("cpu"), dev("cpu")])
    assert async_save_pays([dev("gpu")])
    assert async_save_pays([dev("tpu"), dev("tpu")])
    assert async_save_pays(jax.devices()) == (jax.default_backend() != "cpu")


def test_writes_arrays_unencoded_and_reads_compressed_checkpoints(tmp_path):
    """Saves write the arrays' bytes without zstd (float weights barely compress, and a
    compressing write buffered the whole encoded state: design §6). A checkpoint from
    before, written by orbax's StandardCheckpointHandler with its default compression,
    still restores."""
    import orbax.checkpoint as ocp

    params, opt_state, _ = make_state(0)
    old_dir = tmp_path / "old"
    with ocp.CheckpointManager(
        old_dir, item_names=("params", "opt_state", "extra")
    ) as old:  # the layout and handlers this module used until 2026-11-26
        old.save(
            3,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                extra=ocp.args.JsonSave({"version": 3}),
            ),
        )
        old.wait_until_finished()
    with CheckpointManager(old_dir) as manager:
        got_params, got_opt, extra = manager.restore(
            3, params_template=params, opt_state_template=opt_state
        )
    assert extra == {"version": 3}
    assert_trees_identical(got_params, params)
    assert_trees_identical(got_opt, opt_state)

    def disk_bytes(directory):
        return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())

    zeros = {"w": jnp.zeros((512, 512), jnp.float32)}  # 1 MiB that zstd makes ~nothing of
    with CheckpointManager(tmp_path / "new") as manager:
        manager.save(1, params=zeros, opt_state={"n": jnp.zeros(())}, extra={}, force=True)
        manager.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ref", item_names=("params",)) as reference:
        reference.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(zeros)))
        reference.wait_until_finished()
    assert disk_bytes(tmp_path / "ref") < 2**18, "orbax's default should compress zeros"
    assert disk_bytes(tmp_path / "new") >= 2**20  # the bytes as they are


def run_snippet(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """``code`` in a fresh Python (signals end processes); its result and how long it ran."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    return proc, time.monotonic() - t0


@pytest.mark.parametrize(
    "first,second,code", [("SIGTERM", "SIGINT", 130), ("SIGINT", "SIGTERM", 143)]
)
def test_a_second_stop_signal_exits_at_once_with_its_code_and_a_line(first, second, code):
    # The trainer's handler: the first signal only asks for a checkpoint and a stop; an
    # impatient second one (either kind) ends the process now, with the shell's code.
    proc, _ = run_snippet(
        f"""
        import os, signal, time
        from a3po_jax.training.stopping import STOP_SIGNALS, install_sigterm_handler
        flag = install_sigterm_handler(signals=STOP_SIGNALS, exit_on_second=True)
        os.kill(os.getpid(), signal.{first})
        assert flag.wait(5) and flag.signum == signal.{first}
        print("asked to stop", flush=True)
        os.kill(os.getpid(), signal.{second})
        time.sleep(30)
        print("still running")
        """
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "asked to stop\n"
    assert proc.stderr == (
        f"a3po-train: second stop signal ({second} after {first}): exiting now without "
        "waiting for a checkpoint\n"
    )


def test_the_stop_deadline_ends_a_process_that_does_not_stop_by_itself():
    # A main thread that never looks at the flag (as one inside a long XLA compile or a
    # blocked write): the deadline ends the process with a line saying what it leaves.
    proc, took = run_snippet(
        """
        import os, signal, time
        from a3po_jax.training.stopping import STOP_SIGNALS, arm_stop_deadline
        from a3po_jax.training.stopping import install_sigterm_handler
        install_sigterm_handler(signals=STOP_SIGNALS, exit_on_second=True)
        arm_stop_deadline(lambda: "the newest complete checkpoint is step 7", seconds=1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        """
    )
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr == (
        "a3po-train: SIGTERM 1 s ago and the run has not stopped: exiting now; the newest "
        "complete checkpoint is step 7\n"
    )
    assert took < 15  # 1 s, plus starting Python on a busy machine


def test_a_disarmed_deadline_lets_the_process_run_on():
    proc, _ = run_snippet(
        """
        import os, signal, time
        from a3po_jax.training.stopping import STOP_SIGNALS, arm_stop_deadline
        from a3po_jax.training.stopping import install_sigterm_handler
        flag = install_sigterm_handler(signals=STOP_SIGNALS)
        arm_stop_deadline(lambda: "", seconds=0.2)()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        print("alive", flag.is_set())
        """
    )
    assert (proc.returncode, proc.stdout) == (0, "alive True\n"), proc.stderr


def test_a_checkpoint_write_past_the_file_size_limit_is_named_and_leaves_no_step(tmp_path):
    # A real failed write (not a mock): RLIMIT_FSIZE makes the kernel refuse the bytes past
    # the limit (EFBIG; Python ignores SIGXFSZ). tensorstore reports it inside a ValueError;
    # the save names the step, and step 1 stays the newest complete one.
    proc, _ = run_snippet(
        f"""
        import errno, resource
        import jax.numpy as jnp
        from a3po_jax.training.checkpointing import CheckpointManager
        manager = CheckpointManager({str(tmp_path)!r}, async_save=False)
        small = {{"w": jnp.ones(4)}}
        manager.save(1, params=small, opt_state=small, extra={{}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        big = {{"w": jnp.arange(1_000_000, dtype=jnp.float32)}}
        try:
            manager.save(2, params=big, opt_state=small, extra={{}})
        except OSError as err:
            print(err.errno == errno.EFBIG, err.filename, err.strerror)
        print(manager.latest_step(), manager.all_steps())
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    named, steps = proc.stdout.splitlines()
    assert named == f"True {tmp_path / '2'} File too large (the checkpoint was not written)"
    assert steps == "1 [1]"
