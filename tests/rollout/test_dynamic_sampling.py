"""DAPO's dynamic sampling and overlong filtering (rollout.dynamic_sampling,
rollout.max_extra_groups, rollout.overlong_filter; arXiv 2503.14476).

A group whose samples all got the same reward never reaches a batch: the queue filters it
(its own counter, the ledger's ``filter`` event with reason ``zero_variance``), and the
producer draws a fresh prompt in its place while the step's budget lasts; past it the
step trains a short batch and says so. Truncated samples get loss mask 0.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from a3po_jax.cli import ledger as ledger_cli
from a3po_jax.core import objectives, row_masks
from a3po_jax.core.batch_plan import BatchPlan, make_batch
from a3po_jax.core.types import Rollout
from a3po_jax.inference.types import SampleResult, SamplingParams
from a3po_jax.model.char_tokenizer import char_tokenizer
from a3po_jax.rollout.ledger import Ledger, audit
from a3po_jax.rollout.queue import RolloutQueue
from a3po_jax.rollout.workers import RolloutWorkers
from a3po_jax.tasks import PromptIterator, RewardConfig, make_task
from a3po_jax.training.config import ConfigError, RolloutSection, TrainConfig, apply_overrides
from a3po_jax.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
G = 2  # samples per group


def sample(group_id, index, reward, *, n=3, finish="stop", version=0):
    return Rollout(
        prompt_id=f"p{group_id}",
        group_id=group_id,
        sample_index=index,
        prompt_tokens=np.array([5, 6, 7], np.int32),
        completion_tokens=np.full((n,), 9, np.int32),
        behav_logprobs=np.full((n,), -1.0, np.float32),
        versions=np.full((n,), version, np.int32),
        finish_reason=finish,
        reward=reward,
        admitted_at_version=version,
    )


def put_group(queue, group_id, rewards, **kwargs):
    for i, r in enumerate(rewards):
        queue.put(sample(group_id, i, r, **kwargs))


# ---------------------------------------------------------------------------------------
# The queue, with hand-made groups.


def test_queue_never_hands_out_a_zero_variance_group():
    calls = []
    queue = RolloutQueue(
        group_size=G,
        capacity_groups=8,
        max_staleness=None,
        filter_zero_variance=True,
        on_filter=lambda gid, refilled: calls.append((gid, refilled)),
    )
    put_group(queue, 0, [1.0, 1.0])  # all correct: every advantage 0
    put_group(queue, 1, [0.0, 1.0])
    put_group(queue, 2, [0.0, 0.0])  # all wrong
    (group,) = queue.get_batch(1, trainer_version=0, timeout=1)
    assert group.group_id == 1
    assert calls == [(0, True), (2, True)]  # no budget given: every one refilled
    c = queue.counters()
    assert (c["filtered_groups"], c["refilled_groups"], c["empty_slots"]) == (2, 2, 0)
    assert c["filtered_samples"] == 2 * G and c["filtered_tokens"] == 2 * G * 3
    assert c["dropped_total"] == 0  # filtered is not dropped: a counter of its own
    queue.check_invariant()


def test_queue_without_filtering_keeps_uniform_groups():
    queue = RolloutQueue(group_size=G, capacity_groups=4, max_staleness=None)
    put_group(queue, 0, [1.0, 1.0])
    assert [g.group_id for g in queue.get_batch(1, trainer_version=0, timeout=1)] == [0]


def test_past_the_refill_budget_a_filtered_group_leaves_its_slot_empty():
    """max_refills=1: the first uniform group of a version is refilled, the second keeps
    its admission and becomes an empty slot, so get_batch(2) returns one group; the next
    step opens a new window."""
    calls = []
    queue = RolloutQueue(
        group_size=G,
        capacity_groups=8,
        max_staleness=None,
        filter_zero_variance=True,
        max_refills=1,
        on_filter=lambda gid, refilled: calls.append((gid, refilled)),
    )
    put_group(queue, 0, [0.0, 0.0])
    put_group(queue, 1, [0.0, 0.0])
    put_group(queue, 2, [0.0, 0.5])
    assert len(queue) == 1  # the empty slot is not a group
    groups = queue.get_batch(2, trainer_version=0, timeout=1)
    assert [g.group_id for g in groups] == [2]  # short by the empty slot
    assert calls == [(0, True), (1, False)]
    c = queue.counters()
    assert (c["filtered_groups"], c["refilled_groups"], c["empty_slots"]) == (2, 1, 1)
    assert c["consumed_groups"] == 1
    queue.check_invariant()
    queue.new_refill_window()
    put_group(queue, 3, [1.0, 1.0], version=1)
    assert calls[-1] == (3, True)
    queue.check_invariant()


def test_empty_slots_keep_admission_order():
    """consume_order="admission": an empty slot takes its admission's place in the order."""
    queue = RolloutQueue(
        group_size=G,
        capacity_groups=8,
        max_staleness=None,
        consume_order="admission",
        filter_zero_variance=True,
        max_refills=0,
    )
    put_group(queue, 1, [0.0, 1.0])
    put_group(queue, 0, [0.0, 0.0])  # oldest, filtered: an empty slot
    put_group(queue, 2, [0.0, 1.0])
    assert queue.get_batch(1, trainer_version=0, timeout=1) == []  # slot 0: empty
    assert [g.group_id for g in queue.get_batch(2, trainer_version=0, timeout=1)] == [1, 2]
    queue.check_invariant()


def test_held_empty_slots_are_given_back_at_a_restart():
    queue = RolloutQueue(
        group_size=G, capacity_groups=4, max_staleness=None, filter_zero_variance=True,
        max_refills=0,
    )  # fmt: skip
    put_group(queue, 0, [0.0, 0.0])
    state = queue.state()
    assert state["held_empty_slots"] == 1 and state["ready_groups"] == 0
    fresh = RolloutQueue(group_size=G, capacity_groups=4, max_staleness=None)
    fresh.restore(state, regenerated=True)
    c = fresh.counters()
    assert (c["filtered_groups"], c["refilled_groups"], c["held_empty_slots"]) == (1, 1, 0)
    fresh.check_invariant()


# ---------------------------------------------------------------------------------------
# Short batches and overlong samples in the step's arrays.


def test_overlong_samples_and_filler_rows_get_loss_mask_0():
    plan = BatchPlan(group_size=G, groups=3, length_bucket=8)
    groups = []
    for gid in range(2):
        q = RolloutQueue(group_size=G, capacity_groups=2, max_staleness=None)
        q.put(sample(gid, 0, 0.0, n=4, finish="length"))  # truncated: no EOS
        q.put(sample(gid, 1, 1.0, n=2))
        groups.extend(q.get_batch(1, trainer_version=0, timeout=1))
    filled = row_masks.fill_short_batch(groups, plan.groups)
    assert [g.group_id for g in filled] == [0, 1, -1]
    made = make_batch(filled, plan, overlong_filter=True)
    assert (made.filler_rows, made.overlong_masked) == (G, 2)
    rows = made.batch.loss_mask.sum(axis=1)
    # Row order: group 0 (sample 0 truncated, 1), group 1 (same), the filler's 2 rows.
    np.testing.assert_array_equal(rows, [0, 2, 0, 2, 0, 0])
    assert made.arrays["loss_mask"] is made.batch.loss_mask
    assert not made.arrays["advantages"][rows == 0].any()
    with pytest.raises(dataclasses.FrozenInstanceError):  # final: stages return new batches
        made.batch.loss_mask = None
    # Without the filter only the filler is masked.
    made = make_batch(filled, plan)
    assert (made.filler_rows, made.overlong_masked) == (G, 0)
    np.testing.assert_array_equal(made.batch.loss_mask.sum(axis=1), [4, 2, 4, 2, 0, 0])


def test_reward_shaping_sees_every_completion_and_the_masks_come_last():
    """KL-in-reward's stage reads every row's completion tokens (a truncated sample's KL
    still shapes its own reward, hence its group's baseline); the masks then zero the
    shaped advantages of the rows that do not train."""
    plan = BatchPlan(group_size=G, groups=2, length_bucket=8)
    q = RolloutQueue(group_size=G, capacity_groups=2, max_staleness=None)
    q.put(sample(0, 0, 0.0, n=4, finish="length"))
    q.put(sample(0, 1, 1.0, n=2))
    filled = row_masks.fill_short_batch(q.get_batch(1, trainer_version=0, timeout=1), 2)
    seen = {}

    def shape(arrays, rewards):
        seen["completion"] = arrays["loss_mask"].sum(axis=1)
        return rewards - 0.5, 3.0 * arrays["loss_mask"]

    made = make_batch(filled, plan, overlong_filter=True, shape_rewards=shape)
    np.testing.assert_array_equal(seen["completion"], [4, 2, 4, 2])
    np.testing.assert_array_equal(made.batch.rewards, [-0.5, 0.5, -0.5, 0.5])
    np.testing.assert_array_equal(made.arrays["advantages"].sum(axis=1), [0, 6, 0, 0])
    assert made.arrays["advantages"] is made.batch.advantages


def test_packed_rows_and_dpo_pairs_are_masked_through_the_row_order():
    """Packed with balanced rows the groups are reordered: the masks follow
    ``batch.group_ids``. With DPO pairs a pair with a truncated row loses its preference."""
    plan = BatchPlan(group_size=G, groups=4, packed=True, groups_per_row=2, length_bucket=8)
    groups = []
    for gid, n in enumerate((2, 6, 3)):
        q = RolloutQueue(group_size=G, capacity_groups=2, max_staleness=None)
        q.put(sample(gid, 0, 0.0, n=n, finish="length" if gid == 1 else "stop"))
        q.put(sample(gid, 1, 1.0, n=n))
        groups.extend(q.get_batch(1, trainer_version=0, timeout=1))
    filled = row_masks.fill_short_batch(groups, plan.groups)
    made = make_batch(filled, plan, overlong_filter=True)
    assert made.arrays["loss_mask"] is made.batch.loss_mask
    assert (made.filler_rows, made.overlong_masked) == (G, 1)
    trained = made.batch.loss_mask.sum(axis=1)
    for row, gid in enumerate(made.batch.group_ids):
        masked = gid < 0 or (gid == 1 and row % G == 0)
        assert (trained[row] == 0) == masked, (row, gid)

    pair_plan = dataclasses.replace(plan, packed=False, groups_per_row=1, groups=3)
    pair_plan = dataclasses.replace(pair_plan, layout=objectives.get("dpo").layout)
    assert make_batch(groups, pair_plan).batch.pair_mask.tolist() == [1.0] * 6  # all preferred
    made = make_batch(groups, pair_plan, overlong_filter=True)
    np.testing.assert_array_equal(made.batch.pair_mask, [1, 1, 0, 0, 1, 1])
    assert made.arrays["pair_mask"] is made.batch.pair_mask


def test_dynamic_sampling_refuses_what_it_cannot_run_yet(tmp_path):
    from a3po_jax.training.trainer import refuse_unsupported

    cfg = apply_overrides(TrainConfig(), ["rollout.dynamic_sampling=true"])
    refuse_unsupported(cfg, processes=1, host=None, replay_dir=None)
    with pytest.raises(ValueError, match="rollout.dynamic_sampling=true.*one process so far"):
        refuse_unsupported(cfg, processes=2, host=None, replay_dir=None)
    recorded = apply_overrides(cfg, ["system.run.record_rollouts=true"])
    with pytest.raises(ValueError, match="system.run.record_rollouts=false"):
        refuse_unsupported(recorded, processes=1, host=None, replay_dir=None)
    with pytest.raises(ValueError, match="cannot replay"):
        refuse_unsupported(cfg, processes=1, host=None, replay_dir=tmp_path)


def test_config_fields_and_overrides():
    cfg = apply_overrides(
        TrainConfig(),
        ["rollout.dynamic_sampling=true", "rollout.max_extra_groups=3",
         "rollout.overlong_filter=on"],
    )  # fmt: skip
    assert cfg.rollout.dynamic_sampling and cfg.rollout.overlong_filter
    assert cfg.rollout.extra_groups_budget == 3
    assert RolloutSection(groups_per_step=5).extra_groups_budget == 5  # -1: one batch
    with pytest.raises(ConfigError, match="rollout.max_extra_groups"):
        RolloutSection(max_extra_groups=-2)
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling"):
        RolloutSection(dynamic_sampling="yes")


# ---------------------------------------------------------------------------------------
# The rollout workers over a fake host: drawing, the budget, the ledger, a resume.


class LengthTask:
    """Reward = completion length / 10: a group of identical samples has zero variance."""

    def score(self, prompt, text):
        return len(text) / 10

    def format_ok(self, text):
        return True


class UniformGroupsHost:
    """Fake host: every sample of group ``g`` is identical (a uniform group) when
    ``uniform(g)``, else sample i has i + 2 tokens; tokens carry the served version."""

    def __init__(self, uniform):
        self.uniform = uniform
        self.version = 0
        self.submitted: list[str] = []
        self._lock = threading.Lock()
        self._out: list[SampleResult] = []

    def submit(self, request):
        group_id = int(request.request_id[1:].split(".")[0])
        with self._lock:
            self.submitted.append(request.request_id)
            for i in range(request.num_samples):
                n = 3 if self.uniform(group_id) else i + 2
                self._out.append(
                    SampleResult(
                        request_id=request.request_id,
                        sample_index=i,
                        prompt_tokens=np.asarray(request.prompt_tokens, np.int32),
                        tokens=np.full((n,), 40, np.int32),
                        logprobs=np.full((n,), -1.0, np.float32),
                        versions=np.full((n,), self.version, np.int32),
                        finish_reason="stop",
                    )
                )

    def poll(self, timeout=None, max_results=None):
        time.sleep(0.002)
        with self._lock:
            out, self._out = self._out, []
        return out

    def update_weights(self, params, version):
        self.version = int(version)

    def stats(self):
        return {"update_policy": "in_flight", "version": self.version}

    def close(self):
        pass


def make_workers(host, ledger=None, *, batch_groups=2, eta=0, extra=4):
    return RolloutWorkers(
        host=host,
        task=LengthTask(),
        tokenizer=char_tokenizer(),
        prompts=PromptIterator(
            make_task("letters", train_size=64).prompts("train"), batch_size=1, seed=0
        ),
        sampling=SamplingParams(max_new_tokens=4),
        reward_config=RewardConfig(),
        group_size=G,
        batch_groups=batch_groups,
        max_staleness=eta,
        versions_per_batch=1,
        seed=0,
        ledger=ledger,
        dynamic_sampling=True,
        max_extra_groups=extra,
    )


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_workers_draw_fresh_prompts_and_the_ledger_names_the_reason(tmp_path, capsys):
    """Sync-like (η = 0): groups 0, 3, 6, ... are uniform; the producer keeps drawing
    until each batch holds B real groups; each filtered group is a ledger ``filter`` event
    with reason zero_variance, and the ledger CLI shows it."""
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.start()
    host = UniformGroupsHost(lambda g: g % 3 == 0)
    workers = make_workers(host, ledger)
    workers.start()
    try:
        for step in range(3):
            groups = workers.get_batch(2, trainer_version=step, timeout=10)
            assert len(groups) == 2
            assert all(g.group_id % 3 for g in groups)  # never a uniform one
            assert all(np.ptp(g.rewards) > 0 for g in groups)
            workers.consumed(groups, step=step + 1, version=step)
            workers.notify_version(step + 1)
            host.update_weights(None, step + 1)
        workers.state()  # the checkpoint event of step 3
    finally:
        workers.close()
        ledger.close()
    workers.queue.check_invariant()
    result = audit(tmp_path)
    assert result.ok, result.summary()
    assert result.trained == 6
    assert result.filtered == {"zero_variance": workers.queue.counters()["filtered_groups"]}
    assert result.filtered["zero_variance"] >= 3  # groups 0, 3, 6 at least
    assert "filtered" not in str(result.dropped)
    assert ledger_cli.main([str(tmp_path)]) == 0
    assert "zero_variance" in capsys.readouterr().out


def test_the_producer_stops_drawing_at_the_budget():
    """Every group but 1 is uniform, B = 2, budget 1 extra prompt per step (η = 0): the
    producer draws groups 0, 1 and one refill (2), then stops; the batch is [group 1],
    short by one slot, and after the step (one more version) a fresh window opens."""
    host = UniformGroupsHost(lambda g: g != 1)
    workers = make_workers(host, extra=1)
    workers.start()
    try:
        groups = workers.get_batch(2, trainer_version=0, timeout=10)
        assert [g.group_id for g in groups] == [1]
        time.sleep(0.3)  # time the producer would need to draw more
        assert host.submitted == ["g0", "g1", "g2"]
        c = workers.queue.counters()
        assert (c["filtered_groups"], c["refilled_groups"], c["empty_slots"]) == (2, 1, 1)
        # Counted against version 0's budget of B = 2: the trained group and the empty slot.
        assert workers.controller.admitted - workers.controller.released == 2
        workers.consumed(groups, step=1, version=0)
        workers.notify_version(1)
        # Version 1: two fresh prompts (3, 4) plus one refill (5); both uniform remainders
        # leave empty slots: an all-empty batch, nothing handed out.
        assert wait_for(lambda: len(host.submitted) == 6)
        assert workers.get_batch(2, trainer_version=1, timeout=10) == []
        workers.discard(2)  # what the trainer does with an all-empty batch
        workers.queue.check_invariant()
    finally:
        workers.close()


def test_staleness_bound_holds_for_everything_that_trains_under_async():
    """η = 2 with a third of the groups filtered and a budget of one refill per version:
    every trained token obeys d <= η, and admissions net of refills never pass the
    controller's budget (the extra draws are admitted under it, not beside it)."""
    eta, b = 2, 2
    host = UniformGroupsHost(lambda g: g % 3 == 0)
    workers = make_workers(host, batch_groups=b, eta=eta, extra=1)
    workers.start()
    try:
        for version in range(8):
            groups = workers.get_batch(b, trainer_version=version, timeout=10)
            for g in groups:
                assert version - g.min_version <= eta
                assert np.ptp(g.rewards) > 0
            counted = workers.controller.admitted - workers.controller.released
            assert counted <= workers.controller.budget(version)
            workers.consumed(groups, step=version + 1, version=version)
            host.update_weights(None, version + 1)
            workers.notify_version(version + 1)
        c = workers.queue.counters()
        assert c["filtered_groups"] > 0 and c["dropped_groups"].get("stale", 0) == 0
    finally:
        workers.close()


def test_a_resume_does_not_reissue_or_redraw_filtered_groups(tmp_path):
    """Filtered before the checkpoint: finished (not pending), never re-issued, its
    position not drawn again; the controller counts trained groups, empty slots and the
    re-issued pending ones."""
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.start()
    host = UniformGroupsHost(lambda g: g % 2 == 0)
    workers = make_workers(host, ledger, eta=1, extra=1)
    workers.start()
    try:
        groups = workers.get_batch(2, trainer_version=0, timeout=10)
        workers.consumed(groups, step=1, version=0)
        workers.notify_version(1)
        time.sleep(0.2)
        state = workers.state()
    finally:
        workers.close()
    filtered_ids = {gid for gid in range(state["controller"]["admitted"]) if gid % 2 == 0} - {
        e["group_id"] for e in state["pending_groups"]
    }
    assert filtered_ids and not filtered_ids & {e["group_id"] for e in state["pending_groups"]}
    resumed = make_workers(UniformGroupsHost(lambda g: g % 2 == 0), ledger, eta=1, extra=1)
    ledger.resume(1, version=1)
    resumed.restore(state, version=1)
    counted = resumed.controller.admitted - resumed.controller.released
    q = state["queue"]
    assert counted == q["consumed_groups"] + q["empty_slots"] + len(state["pending_groups"])
    resumed.queue.check_invariant()
    ledger.close()
    result = audit(tmp_path)
    assert result.ok, result.summary()
    assert result.filtered.get("zero_variance", 0) >= 1


# ---------------------------------------------------------------------------------------
# End to end on the tiny model (the letters task: a group whose samples hold no target
# letter at all scores 0 everywhere, a uniform group).


def tiny_cfg(tmp_path, *overrides):
    from a3po_jax.training.config import load_experiment

    cfg = load_experiment(REPO / "experiments" / "smoke_tiny.py")
    return apply_overrides(
        cfg,
        [
            f"run_dir={tmp_path / 'run'}", "steps=3", "checkpoint_every=0",
            "rollout.groups_per_step=2",
            "rollout.dynamic_sampling=true", "rollout.max_extra_groups=2",
            "rollout.overlong_filter=true", *overrides,
        ],
    )  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["sync", "periodic", "one_step_off", "async"])
def test_tiny_model_trains_no_uniform_group(tmp_path, caplog, mode):
    """Every mode: no trained group is uniform, the records count the filtered groups and
    the short slots as the queue does, truncated samples are masked, the ledger audits.
    In sync mode no refills at all (max_extra_groups=0): the batches come out short, and
    the step says so."""
    from a3po_jax.training.trainer import Trainer, load_policy

    eta = "system.max_staleness=2" if mode == "async" else "system.max_staleness=0"
    budget = "rollout.max_extra_groups=0" if mode == "sync" else "rollout.max_extra_groups=2"
    cfg = tiny_cfg(tmp_path, f"system.mode={mode}", eta, budget)
    trainer = Trainer(cfg, load_policy(cfg.model), console=False)
    trained = []
    consumed = trainer.workers.consumed

    def spy(groups, **kwargs):
        trained.extend(groups)
        return consumed(groups, **kwargs)

    trainer.workers.consumed = spy
    trainer.run()
    records = read_metrics(cfg.run_dir)
    assert trained and all(np.ptp(g.rewards) > 0 for g in trained)
    assert len(records) == 3
    filtered = sum(r["rollout/filtered_groups"] for r in records)
    short = sum(r["rollout/batch_short"] for r in records)
    assert filtered > 0, "the letters task should give some all-zero groups"
    assert filtered == records[-1]["queue/filtered_groups"]
    assert short == records[-1]["queue/empty_slots"]
    if mode == "sync":  # the seed's run has uniform groups in its first batches
        assert short > 0 and records[-1]["queue/refilled_groups"] == 0
        assert "slots left empty by groups with zero reward variance" in caplog.text or (
            "no update this step" in caplog.text
        )
    # 6 tokens at most: the random model rarely stops, so most samples are truncated.
    assert sum(r["rollout/overlong_masked"] for r in records) > 0
    result = audit(cfg.run_dir)
    assert result.ok, result.summary()
    # The producer draws ahead of the last step (until the workers close): the ledger may
    # name groups filtered after the last record.
    assert result.filtered.get("zero_variance", 0) >= filtered


@pytest.mark.e2e
def test_step_records_count_filtered_groups_from_one_snapshot(tmp_path):
    """The collector files groups while the trainer writes a record: a queue that filters
    one more group between any two reads of its counters still gives records whose
    per-step ``rollout/filtered_groups`` add up to the last ``queue/filtered_groups``."""
    from a3po_jax.training.trainer import Trainer, load_policy

    cfg = tiny_cfg(tmp_path, "system.mode=async", "system.max_staleness=2")
    trainer = Trainer(cfg, load_policy(cfg.model), console=False)
    real = trainer.queue.counters
    reads = []

    def counters():  # one more filtered group at every read, as a busy collector may file
        reads.append(1)
        c = real()
        return {**c, "filtered_groups": c["filtered_groups"] + len(reads)}

    trainer.queue.counters = counters
    trainer.run()
    records = read_metrics(cfg.run_dir)
    filtered = sum(r["rollout/filtered_groups"] for r in records)
    assert filtered == records[-1]["queue/filtered_groups"]


# ---------------------------------------------------------------------------------------
# kill -9, --resume: every prompt trained at most once with dynamic sampling on.


@pytest.mark.e2e
def test_kill_9_then_resume_with_dynamic_sampling(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=os.environ.get(
            "JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache")
        ),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    cmd = [
        sys.executable, str(REPO / "tests" / "helpers" / "exactly_once_run.py"), str(run_dir),
        "steps=6", "checkpoint_every=1", "task.name=letters", "task.options={}",
        "rollout.max_new_tokens=6", "system.mode=async", "system.max_staleness=2",
        "rollout.dynamic_sampling=true", "rollout.max_extra_groups=2",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(read_metrics(run_dir)) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    final = subprocess.run(
        [*cmd, "--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert final.returncode == 0, final.stderr[-3000:]
    result = audit(run_dir)
    print(result.summary())
    assert result.ok, result.summary()
    assert result.resumes == 1 and not result.trained_twice and not result.drawn_twice
    assert result.filtered.get("zero_variance", 0) > 0
    assert len(read_metrics(run_dir)) == 6


def test_filler_groups_are_copies_with_negative_ids():
    queue = RolloutQueue(group_size=G, capacity_groups=2, max_staleness=None)
    put_group(queue, 7, [0.0, 1.0])
    groups = queue.get_batch(1, trainer_version=0, timeout=1)
    filled = row_masks.fill_short_batch(groups, 3)
    assert [g.group_id for g in filled] == [7, -1, -2]
    assert all(r.group_id == -1 for r in filled[1].rollouts)
    np.testing.assert_array_equal(filled[2].rewards, groups[0].rewards)
    with pytest.raises(ValueError):
        row_masks.fill_short_batch([], 2)
