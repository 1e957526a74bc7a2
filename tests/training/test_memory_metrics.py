"""Memory as a reported figure (issue 15): every step record carries the process's peak
resident memory (``mem/peak_rss_gb``), and ``mem/device_peak_gb`` where the backend has
device memory statistics."""

import dataclasses
import resource
import signal
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from a3po_jax.core.types import Rollout, RolloutGroup
from a3po_jax.training.metrics import peak_memory, step_record


def test_peak_rss_is_getrusage_in_gib_and_sees_a_new_allocation():
    before = peak_memory()["mem/peak_rss_gb"]
    # 512 MiB written page by page: resident, so the peak must rise by about that much
    # unless an earlier peak of this process was already higher (then it cannot fall).
    block = np.ones(2**27, np.float32)
    after = peak_memory()["mem/peak_rss_gb"]
    assert after == pytest.approx(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    assert after >= max(before, block.nbytes / 2**30)
    has_device_stats = any(d.memory_stats() for d in jax.local_devices())
    assert ("mem/device_peak_gb" in peak_memory()) == has_device_stats


def test_step_record_logs_peak_memory():
    rollout = Rollout(
        prompt_id="p0",
        group_id=0,
        sample_index=0,
        prompt_tokens=np.arange(2, dtype=np.int32),
        completion_tokens=np.arange(2, dtype=np.int32),
        behav_logprobs=np.zeros(2, np.float32),
        versions=np.zeros(2, np.int32),
        finish_reason="stop",
        reward=1.0,
        info={},
    )
    versions = np.zeros((1, 2), np.int32)
    record = step_record(
        groups=[RolloutGroup("p0", 0, [rollout], 0)],
        batch=SimpleNamespace(versions=versions, loss_mask=np.ones_like(versions), rewards=[1.0]),
        start_version=0,
        num_minibatches=1,
        step_metrics={},
        timings={"time/train_s": 1.0},
        version=1,
        host_stats={},
        counters={},
        skipped_total=0,
    )
    assert record["mem/peak_rss_gb"] > 0.0


def tiny_run_config(tmp_path, **fields):
    """A tiny model learning `letters`, 2 groups of 2 per step, no checkpoints."""
    from a3po_jax.training.config import ModelSection, RolloutSection, TaskSection, TrainConfig

    return TrainConfig(
        model=ModelSection(name="tiny"),
        task=TaskSection(name="letters"),
        rollout=RolloutSection(
            group_size=2, groups_per_step=2, max_new_tokens=4, num_slots=4, prompt_buckets=(64,)
        ),
        run_dir=str(tmp_path / "run"),
        checkpoint_every=0,
        **fields,
    )


@pytest.mark.e2e  # a whole run of the trainer
def test_the_trainer_keeps_no_reference_to_the_loaded_weights(tmp_path):
    """The state and the embedded host hold copies of the initial params, so once the caller
    drops the loaded policy (as the CLI does) its arrays are freed: one whole copy of the
    weights less for the run (issue 15's memory)."""
    import gc
    import weakref

    from a3po_jax.tasks.toy import LetterTask
    from a3po_jax.training.trainer import Trainer, load_policy

    cfg = tiny_run_config(tmp_path, steps=1)
    policy = load_policy(cfg.model)
    loaded = [weakref.ref(x) for x in jax.tree.leaves(policy.params)]
    trainer = Trainer(cfg, policy, task=LetterTask(), console=False)
    try:
        assert trainer.policy.params is None
        assert trainer.policy.config is policy.config
        del policy
        gc.collect()
        alive = [r for r in loaded if r() is not None]
        assert not alive, f"{len(alive)} of {len(loaded)} loaded param arrays still referenced"
        trainer.run()  # and the run still works without them
    finally:
        trainer.close()


@pytest.mark.e2e  # a whole run of the trainer
@pytest.mark.parametrize("every", [0.05, 0.0])
def test_the_trainer_trims_the_heap_while_it_runs(tmp_path, every):
    """`system.run.trim_heap_every_s` > 0 runs a heap trimmer (training/heap.py) from the trainer's
    start to its close, with the run's mmap threshold; 0 runs none; a negative period is
    refused, naming the field."""
    from a3po_jax.tasks.toy import LetterTask
    from a3po_jax.training.config import ConfigError, RunSection, SystemSection
    from a3po_jax.training.trainer import Trainer, load_policy

    run = RunSection(trim_heap_every_s=every, mmap_threshold_mib=4)
    cfg = tiny_run_config(tmp_path, steps=2, system=SystemSection(run=run))
    trainer = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    trimmer = trainer._trimmer
    try:
        trainer.run()
        if every:
            assert trimmer is not None and trimmer.period_s == every
            assert trimmer.mmap_threshold_mib == 4  # the run's system.run.mmap_threshold_mib
            assert trimmer.trims >= 1  # the run lasts well over 50 ms
        else:
            assert trimmer is None
    finally:
        trainer.close()
    if every:
        assert not trimmer._thread.is_alive()
    with pytest.raises(ConfigError, match="system.run.trim_heap_every_s"):
        RunSection(trim_heap_every_s=-1.0)


@pytest.mark.e2e  # a whole run of the trainer
@pytest.mark.parametrize(
    ("mode", "every", "trims_at_push"),
    [("async", 3600.0, True), ("sync", 3600.0, False), ("async", 0.0, False)],
)
def test_a_weight_push_trims_once_the_embedded_host_serves_it(
    tmp_path, monkeypatch, mode, every, trims_at_push
):
    """The embedded host frees its replaced weights at the swap; glibc keeps those pages until
    a trim, so each push waits for the swap and trims then, before the next step's
    temporaries stack on top (design §6). Not under "drain" (the swap waits for older
    requests) and not with trimming off (`system.run.trim_heap_every_s=0`)."""
    from a3po_jax.tasks.toy import LetterTask
    from a3po_jax.training import heap
    from a3po_jax.training.config import RunSection, SystemSection
    from a3po_jax.training.trainer import Trainer, load_policy

    cfg = tiny_run_config(
        tmp_path, steps=2, system=SystemSection(mode=mode, run=RunSection(trim_heap_every_s=every))
    )
    trainer = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    seen = []  # (host's serving version, trainer's version) at each trim by the trainer

    def trim():  # (a trimmer thread another test left running may trim too: not counted)
        if threading.current_thread() is threading.main_thread():
            seen.append((trainer.host.version, int(trainer.state.step)))

    monkeypatch.setattr(heap, "trim", trim)
    try:
        trainer.run()
    finally:
        trainer.close()
    if trims_at_push:  # one per step's push (the 1-hour trimmer never fires)
        assert seen == [(1, 1), (2, 2)]
    else:
        assert seen == []


@pytest.mark.e2e  # a whole run of the trainer
def test_a_cpu_trainer_saves_checkpoints_in_place_and_trims_after(tmp_path, monkeypatch):
    """On a CPU an asynchronous save holds the state's buffers while the next step donates
    them, so that step copies the whole state (checkpointing.async_save_pays): the trainer
    saves in place instead, complete when `_checkpoint` returns, and trims the write's
    buffers before the next step."""
    from a3po_jax.tasks.toy import LetterTask
    from a3po_jax.training import heap
    from a3po_jax.training.config import RunSection, SystemSection
    from a3po_jax.training.trainer import Trainer, load_policy

    if jax.default_backend() != "cpu":
        pytest.skip("accelerators save asynchronously")
    cfg = tiny_run_config(
        tmp_path, steps=1, system=SystemSection(run=RunSection(trim_heap_every_s=3600.0))
    )
    cfg = dataclasses.replace(cfg, checkpoint_every=1)
    handler_before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    trims = []
    monkeypatch.setattr(
        heap,
        "trim",
        lambda: (
            threading.current_thread() is threading.main_thread()
            and trims.append(trainer.checkpoints.latest_step())
        ),
    )
    try:
        assert trainer.checkpoints.async_save is False
        trainer._checkpoint(1, force=True)
        assert trainer.checkpoints.latest_step() == 1  # on disk, no wait
        assert trims == [1]
    finally:
        trainer.close()
    # A closed trainer puts back the SIGTERM handler it replaced.
    assert signal.getsignal(signal.SIGTERM) is handler_before
