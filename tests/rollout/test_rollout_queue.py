"""Tests for the host-side rollout queue and the staleness admission rule."""

import threading
import time

import numpy as np
import pytest

from a3po_jax.core.types import Rollout, RolloutGroup, token_staleness
from a3po_jax.rollout.admission import (
    AdmissionError,
    StalenessController,
    minibatch_versions,
    staleness_counts,
    staleness_metrics,
    trained_staleness,
)
from a3po_jax.rollout.queue import QueueClosed, RolloutQueue, RolloutTimeout
from a3po_jax.training.config import staleness_bound

# Long enough that a correct implementation never hits it on a loaded 2-core machine; the
# threaded tests use it only as a guard against hanging forever.
JOIN_S = 20.0


def make_rollout(group_id, sample_index, versions=(0, 0, 0), *, prompt_id=None, **kwargs):
    versions = np.asarray(versions, np.int32)
    num_tokens = versions.shape[0]
    return Rollout(
        prompt_id=f"p{group_id}" if prompt_id is None else prompt_id,
        group_id=group_id,
        sample_index=sample_index,
        prompt_tokens=np.arange(4, dtype=np.int32),
        completion_tokens=np.full((num_tokens,), 100 * group_id + sample_index, np.int32),
        behav_logprobs=np.full((num_tokens,), -0.5, np.float32),
        versions=versions,
        finish_reason=kwargs.pop("finish_reason", "stop"),
        **kwargs,
    )


def put_group(queue, group_id, group_size, versions=(0, 0, 0), order=None, **kwargs):
    for i in order if order is not None else range(group_size):
        queue.put(make_rollout(group_id, i, versions, **kwargs))


# --- Rollout ---------------------------------------------------------------------------------


def test_rollout_converts_dtypes_and_computes_staleness():
    r = Rollout(
        prompt_id="a",
        group_id=0,
        sample_index=0,
        prompt_tokens=[1, 2],
        completion_tokens=np.array([3, 4, 5], np.int64),
        behav_logprobs=np.array([-1.0, -2.0, -3.0], np.float64),
        versions=[3, 4, 5],
        finish_reason="length",
    )
    assert r.completion_tokens.dtype == np.int32 and r.behav_logprobs.dtype == np.float32
    assert r.versions.dtype == np.int32 and r.num_tokens == 3
    np.testing.assert_array_equal(r.staleness(5), [2, 1, 0])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("behav_logprobs", np.zeros((2,), np.float32), "behav_logprobs has length 2"),
        ("versions", np.zeros((4,), np.int32), "versions has length 4"),
        ("versions", np.array([0.0, 1.0, 2.0]), "versions must hold integers"),
        ("versions", np.array([0, -1, 0]), "versions must be >= 0"),
        ("completion_tokens", np.zeros((1, 3), np.int32), "completion_tokens must be 1-D"),
        ("finish_reason", "eos", "finish_reason must be one of"),
    ],
)
def test_rollout_rejects_bad_fields_naming_them(field, value, message):
    kwargs = dict(
        prompt_id="a",
        group_id=0,
        sample_index=0,
        prompt_tokens=np.zeros((2,), np.int32),
        completion_tokens=np.zeros((3,), np.int32),
        behav_logprobs=np.zeros((3,), np.float32),
        versions=np.zeros((3,), np.int32),
        finish_reason="stop",
    )
    kwargs[field] = value
    with pytest.raises(ValueError, match=message):
        Rollout(**kwargs)


def test_group_versions_rewards_and_token_staleness():
    rollouts = [
        make_rollout(7, 0, (2, 3), reward=1.0),
        make_rollout(7, 1, (4,), reward=0.0),
        make_rollout(7, 2, (), reward=0.5),  # an empty completion must not break min/max
    ]
    group = RolloutGroup("p7", 7, rollouts, admitted_at_version=2)
    assert (group.size, group.min_version, group.max_version) == (3, 2, 4)
    np.testing.assert_array_equal(group.rewards, [1.0, 0.0, 0.5])
    # Tokens in group then sample order: versions 2, 3, 4 at trainer version 5.
    np.testing.assert_array_equal(token_staleness([group], 5), [3, 2, 1])
    assert token_staleness([], 5).shape == (0,)
    rollouts[1].reward = None
    with pytest.raises(ValueError, match="unscored samples \\[1\\]"):
        _ = group.rewards


# --- StalenessController: AReaL's capacity rule, numbers checked by hand ----------------------


@pytest.mark.parametrize(
    "eta, admissible_at_v0, admissible_at_v1",
    [
        # (η + v + 1)·B with B = 2. η = 0 is synchronous: one batch per version.
        (0, 2, 2),
        # η = 1: the example from the brief, 4 at v = 0; v = 1 raises the total to 6, i.e.
        # 2 more. A rule counting only groups in flight, (η + 1)·B, would give 4 again here.
        (1, 4, 2),
        (2, 6, 2),
    ],
)
def test_admission_rule_numbers(eta, admissible_at_v0, admissible_at_v1):
    controller = StalenessController(batch_groups=2, max_staleness=eta)
    assert controller.capacity(0) == admissible_at_v0
    ids = [controller.admit(0) for _ in range(admissible_at_v0)]
    assert ids == list(range(admissible_at_v0))  # group ids are the admission count
    assert not controller.can_admit(0)
    with pytest.raises(AdmissionError, match=f"max_staleness {eta}"):
        controller.admit(0)
    assert controller.capacity(1) == admissible_at_v1
    for _ in range(admissible_at_v1):
        controller.admit(1)
    assert not controller.can_admit(1)
    assert controller.can_admit(2)


def test_release_gives_back_capacity_and_restore_drops_in_flight():
    controller = StalenessController(batch_groups=2, max_staleness=1)
    for _ in range(4):
        controller.admit(0)
    controller.release()  # one group dropped as stale: it will never be consumed
    assert controller.capacity(0) == 1
    assert controller.admit(0) == 4  # ids keep counting, never reused
    with pytest.raises(ValueError, match="cannot release 6"):
        controller.release(6)

    state = controller.state()
    assert state == {
        "batch_groups": 2,
        "max_staleness": 1,
        "versions_per_batch": 1,
        "admitted": 5,
        "released": 1,
        "trainer_version": 0,
    }
    resumed = StalenessController(batch_groups=2, max_staleness=1)
    # 2 groups were consumed before the checkpoint; the 2 others in flight are lost.
    resumed.restore(state, consumed_groups=2)
    assert (resumed.admitted, resumed.released) == (5, 3)
    assert resumed.capacity(1) == 6 - 2
    assert resumed.admit(1) == 5
    with pytest.raises(ValueError, match="consumed_groups must be in"):
        resumed.restore(state, consumed_groups=6)


def test_controller_validates_config():
    with pytest.raises(ValueError, match="batch_groups"):
        StalenessController(batch_groups=0, max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessController(batch_groups=1, max_staleness=-1)


def test_wait_admit_blocks_until_next_version_and_close_wakes_it():
    controller = StalenessController(batch_groups=1, max_staleness=0)
    assert controller.wait_admit(timeout=1.0) == (0, 0)
    with pytest.raises(RolloutTimeout, match="no admission capacity"):
        controller.wait_admit(timeout=0.05)

    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", controller.wait_admit()))
    thread.start()
    time.sleep(0.1)
    assert thread.is_alive()  # blocked: version 0 has no capacity left
    controller.notify_version(1)
    thread.join(JOIN_S)
    assert result["r"] == (1, 1)

    errors = []

    def blocked_producer():
        try:
            controller.wait_admit()
        except QueueClosed as e:
            errors.append(str(e))

    thread = threading.Thread(target=blocked_producer)
    thread.start()
    time.sleep(0.1)
    controller.close("trainer finished")
    thread.join(JOIN_S)
    assert not thread.is_alive() and "trainer finished" in errors[0]


def test_wait_submitted_waits_for_a_spent_budget_and_every_submission():
    controller = StalenessController(batch_groups=2, max_staleness=0)
    with pytest.raises(RolloutTimeout, match="0 groups counted, budget 2"):
        controller.wait_submitted(timeout=0.05)  # nothing admitted yet
    controller.wait_admit(timeout=1.0)
    controller.wait_admit(timeout=1.0)
    with pytest.raises(RolloutTimeout, match="2 admitted but not submitted"):
        controller.wait_submitted(timeout=0.05)  # taken, not yet at the host
    controller.submitted()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (controller.wait_submitted(), done.set()))
    thread.start()
    time.sleep(0.1)
    assert not done.is_set()  # one admission still unsubmitted
    controller.submitted()
    thread.join(JOIN_S)
    assert done.is_set()
    with pytest.raises(ValueError, match="without an admission"):
        controller.submitted()
    controller.notify_version(1)  # a new budget: unspent until the producer admits
    with pytest.raises(RolloutTimeout):
        controller.wait_submitted(timeout=0.05)
    controller.close("trainer finished")
    controller.wait_submitted(timeout=0.05)  # a closed controller waits for nothing


# --- RolloutQueue ----------------------------------------------------------------------------


def test_only_whole_groups_are_returned_in_completion_order():
    queue = RolloutQueue(group_size=3, capacity_groups=4, max_staleness=None)
    put_group(queue, 0, 2)  # samples 0, 1 of group 0: incomplete
    put_group(queue, 1, 3, order=[2, 0, 1])  # complete, arrived out of order
    put_group(queue, 2, 3)
    assert queue.counters()["ready_groups"] == 2 and queue.counters()["pending_groups"] == 1
    with pytest.raises(RolloutTimeout, match="pending_groups=1.*ready_groups=2"):
        queue.get_batch(3, trainer_version=0, timeout=0.05)
    assert len(queue) == 2  # a timed-out get takes nothing
    queue.put(make_rollout(0, 2))  # group 0 completes last
    batch = queue.get_batch(3, trainer_version=0, timeout=1.0)
    assert [g.group_id for g in batch] == [1, 2, 0]  # by completion, not by id
    for group in batch:
        assert [r.sample_index for r in group.rollouts] == [0, 1, 2]
        assert {r.group_id for r in group.rollouts} == {group.group_id}
    counters = queue.counters()
    assert counters["consumed_groups"] == 3 and counters["consumed_samples"] == 9
    queue.check_invariant()


def test_put_rejects_bad_samples():
    queue = RolloutQueue(group_size=2, capacity_groups=2, max_staleness=None)
    with pytest.raises(ValueError, match="outside \\[0, group_size=2\\)"):
        queue.put(make_rollout(0, 2))
    queue.put(make_rollout(0, 0))
    with pytest.raises(ValueError, match="duplicate sample_index 0 for group 0"):
        queue.put(make_rollout(0, 0))
    with pytest.raises(ValueError, match="mixes prompt_id"):
        queue.put(make_rollout(0, 1, prompt_id="other"))
    with pytest.raises(ValueError, match="mixes admitted_at_version"):
        queue.put(make_rollout(0, 1, admitted_at_version=3))
    queue.put(make_rollout(0, 1))
    with pytest.raises(ValueError, match="already complete"):
        queue.put(make_rollout(0, 1))
    with pytest.raises(ValueError, match="num_groups must be in"):
        queue.get_batch(3, trainer_version=0, timeout=0.0)
    queue.check_invariant()


def test_stale_groups_are_dropped_and_counted():
    dropped = []
    queue = RolloutQueue(
        group_size=2,
        capacity_groups=8,
        max_staleness=1,
        on_drop=lambda gid, reason: dropped.append((gid, reason)),
    )
    # At trainer version 3 with η = 1: staleness 3 - 1 = 2 > 1 is dropped; a group whose
    # *oldest* token is version 2 (staleness exactly η) is kept, even though its mean
    # staleness would be higher than group 2's.
    put_group(queue, 0, 2, versions=(1, 3))  # one stale token is enough to drop
    put_group(queue, 1, 2, versions=(2, 2))  # d = 1 = η: kept
    put_group(queue, 2, 2, versions=(3, 3))  # d = 0: kept
    queue.put(make_rollout(3, 0, (0,)))  # incomplete and already stale: dropped early
    batch = queue.get_batch(2, trainer_version=3, timeout=1.0)
    assert [g.group_id for g in batch] == [1, 2]
    assert sorted(dropped) == [(0, "stale"), (3, "stale")]
    queue.put(make_rollout(3, 1, (3,)))  # the late sample of a dropped group is discarded
    counters = queue.counters()
    assert counters["dropped_groups"] == {"stale": 2}
    assert counters["discarded_samples"] == 1 and counters["pending_groups"] == 0
    assert max(token_staleness(batch, 3)) <= 1
    queue.check_invariant()


def test_no_staleness_limit_keeps_old_groups_but_rejects_future_tokens():
    queue = RolloutQueue(group_size=1, capacity_groups=2, max_staleness=None)
    queue.put(make_rollout(0, 0, (0,)))
    assert queue.get_batch(1, trainer_version=100, timeout=1.0)[0].group_id == 0
    queue.put(make_rollout(1, 0, (5,)))
    with pytest.raises(ValueError, match="version 5 but the trainer is at version 4"):
        queue.get_batch(1, trainer_version=4, timeout=1.0)


def test_drop_group_aborted_and_unknown_groups():
    dropped = []
    queue = RolloutQueue(
        group_size=3,
        capacity_groups=4,
        max_staleness=None,
        on_drop=lambda gid, reason: dropped.append((gid, reason)),
    )
    put_group(queue, 0, 1)  # host dies after one sample of group 0
    assert queue.drop_group(0, "aborted")
    assert not queue.drop_group(0, "aborted")  # already dropped: not counted twice
    put_group(queue, 0, 2, order=[1, 2])  # its remaining samples trickle in: discarded
    assert queue.drop_group(9, "host_lost")  # a group no sample of which ever arrived
    queue.put(make_rollout(1, 0))
    queue.put(make_rollout(1, 1, finish_reason="aborted"))  # aborted sample drops group 1
    queue.put(make_rollout(1, 2))
    put_group(queue, 2, 3)
    assert queue.drop_group(2, "filtered")  # a complete group can be dropped too
    counters = queue.counters()
    assert counters["dropped_groups"] == {"aborted": 2, "host_lost": 1, "filtered": 1}
    assert counters["discarded_samples"] == 3
    assert counters["produced_groups"] == 4 and counters["ready_groups"] == 0
    assert dropped == [(0, "aborted"), (9, "host_lost"), (1, "aborted"), (2, "filtered")]
    queue.check_invariant()

    keep = RolloutQueue(group_size=2, capacity_groups=2, max_staleness=None, drop_aborted=False)
    keep.put(make_rollout(0, 0, finish_reason="aborted"))
    keep.put(make_rollout(0, 1))
    assert keep.get_batch(1, trainer_version=0, timeout=1.0)[0].rollouts[0].finish_reason == (
        "aborted"
    )


def test_producer_blocks_when_full_and_memory_stays_bounded():
    group_size, capacity, num_groups = 2, 3, 12
    queue = RolloutQueue(group_size=group_size, capacity_groups=capacity, max_staleness=None)
    max_held = []
    errors = []

    def producer():
        try:
            for gid in range(num_groups):
                put_group(queue, gid, group_size, order=[1, 0])
                c = queue.counters()
                max_held.append(c["pending_groups"] + c["ready_groups"])
        except Exception as e:  # surfaced below: a thread's exception is otherwise lost
            errors.append(e)

    thread = threading.Thread(target=producer)
    thread.start()
    deadline = time.monotonic() + JOIN_S
    while queue.counters()["produced_groups"] < capacity and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    # Full: the producer is blocked opening group `capacity` and nothing more got in.
    assert thread.is_alive()
    assert queue.counters()["produced_groups"] == capacity
    with pytest.raises(RolloutTimeout, match="found no room"):
        queue.put(make_rollout(99, 0), timeout=0.05)

    consumed = []
    while len(consumed) < num_groups:
        consumed += queue.get_batch(1, trainer_version=0, timeout=JOIN_S)
    thread.join(JOIN_S)
    assert not errors and not thread.is_alive()
    assert [g.group_id for g in consumed] == list(range(num_groups))
    assert max(max_held) <= capacity
    queue.check_invariant()


def test_threaded_producers_and_consumer_see_every_sample_once():
    group_size, num_groups, batch = 4, 30, 3
    queue = RolloutQueue(group_size=group_size, capacity_groups=5, max_staleness=None)
    rng = np.random.default_rng(0)
    # Two producer threads deliver the samples of each group in a shuffled interleaving,
    # as a continuous-batching engine finishes them.
    work = [(gid, i) for gid in range(num_groups) for i in rng.permutation(group_size)]
    halves = [work[0::2], work[1::2]]
    errors = []

    def producer(items):
        try:
            for gid, i in items:
                queue.put(make_rollout(gid, int(i)), timeout=JOIN_S)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(h,)) for h in halves]
    for t in threads:
        t.start()
    seen = []
    for _ in range(num_groups // batch):
        for group in queue.get_batch(batch, trainer_version=0, timeout=JOIN_S):
            assert group.size == group_size
            seen += [(r.group_id, r.sample_index) for r in group.rollouts]
    for t in threads:
        t.join(JOIN_S)
    assert not errors
    assert sorted(seen) == sorted((gid, int(i)) for gid, i in work)
    counters = queue.counters()
    assert counters["produced_samples"] == num_groups * group_size
    assert counters["consumed_groups"] == num_groups
    queue.check_invariant()


def test_close_wakes_blocked_consumer_and_producer():
    # Capacity 1 held by an incomplete group: a producer opening another group blocks
    # (full) while the consumer blocks too (nothing complete). close() must wake both.
    queue = RolloutQueue(group_size=2, capacity_groups=1, max_staleness=None)
    queue.put(make_rollout(0, 0))
    errors = []

    def blocked(fn):
        try:
            fn()
        except QueueClosed as e:
            errors.append(str(e))

    threads = [
        threading.Thread(target=blocked, args=(lambda: queue.put(make_rollout(1, 0)),)),
        threading.Thread(
            target=blocked, args=(lambda: queue.get_batch(1, trainer_version=0, timeout=None),)
        ),
    ]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert all(t.is_alive() for t in threads)
    queue.close("producer crashed: boom")
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all("producer crashed: boom" in e for e in errors)
    with pytest.raises(QueueClosed, match="boom"):
        queue.put(make_rollout(0, 1))
    with pytest.raises(QueueClosed):
        queue.get_batch(1, trainer_version=0, timeout=0.0)
    assert queue.closed


def test_restore_puts_held_groups_back_as_they_were():
    """Complete groups saved with a checkpoint come back ready, in their order, with their
    tokens and versions, still counted as produced; the pending one is re-issued."""
    queue = RolloutQueue(group_size=2, capacity_groups=4, max_staleness=1)
    put_group(queue, 0, 2)
    put_group(queue, 2, 2, versions=(1, 1))
    put_group(queue, 1, 2, versions=(0, 1))
    put_group(queue, 3, 1)  # in flight at the checkpoint: re-issued
    state, ready = queue.snapshot()
    assert [g.group_id for g in ready] == [0, 2, 1]
    held = ready[1:]  # the trainer holds 2 and 1 (say 0 was not pending any more)
    resumed = RolloutQueue(group_size=2, capacity_groups=4, max_staleness=1)
    resumed.restore(state, regenerated=True, held=held)
    resumed.check_invariant()
    c = resumed.counters()
    assert (c["produced_groups"], c["ready_groups"], c["pending_groups"]) == (2, 2, 0)
    assert c["produced_samples"] == c["consumed_samples"] + 4
    assert c["held_tokens"] == c["generated_tokens"] - c["consumed_tokens"] == 8
    assert resumed.ready_ids() == {1, 2}
    batch = resumed.get_batch(2, trainer_version=1, timeout=0)
    assert [g.group_id for g in batch] == [2, 1]  # completion order kept
    np.testing.assert_array_equal(batch[1].rollouts[1].versions, [0, 1])
    with pytest.raises(ValueError, match="regenerated=True"):
        RolloutQueue(group_size=2, capacity_groups=4, max_staleness=1).restore(state, held=held)


def test_wait_complete_waits_for_the_listed_groups_only():
    queue = RolloutQueue(group_size=2, capacity_groups=4, max_staleness=None)
    put_group(queue, 0, 2)
    put_group(queue, 1, 1)
    queue.wait_complete(lambda: [0], timeout=0)
    with pytest.raises(RolloutTimeout, match=r"groups \[1\] not complete"):
        queue.wait_complete(lambda: [0, 1], timeout=0.1)
    threading.Timer(0.1, lambda: queue.put(make_rollout(1, 1))).start()
    queue.wait_complete(lambda: [0, 1], timeout=JOIN_S)


def test_state_restore_counts_lost_groups_as_restart():
    queue = RolloutQueue(group_size=2, capacity_groups=4, max_staleness=0)
    put_group(queue, 0, 2)
    put_group(queue, 1, 2, versions=(0,))
    queue.get_batch(1, trainer_version=0, timeout=1.0)
    put_group(queue, 2, 1)  # in flight at the checkpoint
    state = queue.state()
    resumed = RolloutQueue(group_size=2, capacity_groups=4, max_staleness=0)
    resumed.restore(state)
    counters = resumed.counters()
    assert counters["consumed_groups"] == 1 and counters["produced_groups"] == 3
    assert counters["dropped_groups"] == {"restart": 2}
    resumed.check_invariant()
    with pytest.raises(ValueError, match="fresh, empty queue"):
        queue.restore(state)
    with pytest.raises(ValueError, match="group_size"):
        RolloutQueue(group_size=3, capacity_groups=4, max_staleness=0).restore(state)


def test_async_pipeline_never_trains_on_tokens_staler_than_eta():
    """Producer thread + trainer loop wired as in the module docstring, with the inference
    host one weight push behind the trainer; every consumed token must have d <= η."""
    batch, group_size, eta, steps = 2, 2, 1, 8
    controller = StalenessController(batch_groups=batch, max_staleness=eta)
    queue = RolloutQueue(
        group_size=group_size,
        capacity_groups=(eta + 1) * batch,
        max_staleness=eta,
        on_drop=lambda gid, reason: controller.release(),
    )
    weights_version = [0]  # what the inference host has; the trainer pushes after each step
    errors = []

    def producer():
        try:
            while True:
                group_id, admitted = controller.wait_admit()
                for i in range(group_size):
                    # A sample spans the weights it saw while generating (in-flight update).
                    v = weights_version[0]
                    queue.put(
                        make_rollout(
                            group_id, i, (v, v, weights_version[0]), admitted_at_version=admitted
                        )
                    )
        except QueueClosed:
            pass
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=producer)
    thread.start()
    staleness = []
    for version in range(steps):
        groups = queue.get_batch(batch, trainer_version=version, timeout=JOIN_S)
        staleness.append(token_staleness(groups, version))
        for g in groups:
            assert g.admitted_at_version >= version - eta
        weights_version[0] = version + 1  # weight push, then the version the producer sees
        controller.notify_version(version + 1)
    controller.close("done")
    queue.close("done")
    thread.join(JOIN_S)
    assert not errors and not thread.is_alive()
    staleness = np.concatenate(staleness)
    assert staleness.min() >= 0 and staleness.max() <= eta
    assert staleness.max() == eta  # the pipeline really overlapped: some tokens were stale
    queue.check_invariant()


# --- several minibatches: staleness counted in optimizer versions (issue 16 item 2) ----------


def test_staleness_bound_per_mode_in_versions():
    # k = 1: the familiar 0 / 1 / η.
    assert [staleness_bound(m, 3, 1) for m in ("sync", "one_step_off", "async")] == [
        0,
        1,
        3,
    ]
    # k = 2: the last minibatch trains 1 version after the first, so sync's bound is 1 and
    # one_step_off's 3 (generated at v0 - 2, trained up to v0 + 1).
    assert staleness_bound("sync", 0, 2) == 1
    assert staleness_bound("periodic", 0, 2) == 1
    assert staleness_bound("one_step_off", 0, 2) == 3
    assert staleness_bound("async", 3, 2) == 3
    # async η < k - 1 cannot hold for the last minibatch: refused, naming both fields.
    with pytest.raises(ValueError, match=r"system.max_staleness=1 with algo.num_minibatches=3"):
        staleness_bound("async", 1, 3)


@pytest.mark.parametrize(
    "eta, k, capacities",
    [
        # B = 2. Budget floor((η + v + 1)/k)·B; v advances by k per batch.
        # sync with k = 2 (η = 1): exactly one batch per batch trained: 2 at v = 0, 2 more at
        # v = 2. The per-batch rule (η + v + 1)·B would give 4 at v = 0 and 4 more at v = 2.
        (1, 2, [2, 2, 2]),
        # k = 2, η = 3 (one batch of overlap, like one_step_off): 4 at v = 0, then 2 per batch.
        (3, 2, [4, 2, 2]),
        # k = 3, η = 2 (sync): one batch per 3 versions.
        (2, 3, [2, 2, 2]),
    ],
)
def test_admission_rule_counts_versions(eta, k, capacities):
    controller = StalenessController(batch_groups=2, max_staleness=eta, versions_per_batch=k)
    for batch, capacity in enumerate(capacities):
        version = batch * k
        assert controller.capacity(version) == capacity
        for _ in range(capacity):
            controller.admit(version)
        # Versions inside the batch (the minibatches' own) add nothing.
        assert not controller.can_admit(version + k - 1)
    assert controller.max_in_flight == capacities[0]
    with pytest.raises(ValueError, match="versions_per_batch - 1 = 2"):
        StalenessController(batch_groups=2, max_staleness=1, versions_per_batch=3)


def test_minibatch_versions_and_trained_staleness_golden():
    # 4 rows, k = 2: rows 0-1 train at v0 = 5, rows 2-3 at 6.
    np.testing.assert_array_equal(minibatch_versions(4, 5, 2), [5, 5, 6, 6])
    versions = np.array([[5, 5, 0], [4, 5, 5], [5, 5, 0], [4, 4, 6]])
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    d = trained_staleness(versions, mask, 5, 2)
    # Row-major; measured against the row's own minibatch version. Against the step's
    # starting version (5) the last row would read [1, 1, -1]: a negative staleness.
    np.testing.assert_array_equal(d, [0, 0, 1, 0, 0, 1, 1, 2, 2, 0])
    assert staleness_counts(d) == [5, 3, 2]
    m = staleness_metrics(d)
    assert m["staleness/counts"] == [5, 3, 2]
    assert m["staleness/max"] == m["staleness/max_observed"] == 2.0
    assert m["staleness/mean"] == pytest.approx(7 / 10)
    with pytest.raises(ValueError, match="negative staleness"):
        staleness_counts(np.array([0, -1]))


def run_pipeline(*, mode, eta_cfg, k, batch, group_size, steps, host_lag):
    """Producer thread + a trainer loop that advances k versions per batch, as the trainer
    does; the host serves the weights ``host_lag`` batches behind (0: drain, pushed before
    the next admission). Returns (staleness of every trained token, queue counters)."""
    eta = staleness_bound(mode, eta_cfg, k)
    controller = StalenessController(batch_groups=batch, max_staleness=eta, versions_per_batch=k)
    queue = RolloutQueue(
        group_size=group_size,
        capacity_groups=controller.max_in_flight,
        max_staleness=eta,
        versions_per_batch=k,
        on_drop=lambda gid, reason: controller.release(),
    )
    pushed = [0]
    errors = []

    def producer():
        try:
            while True:
                group_id, admitted = controller.wait_admit()
                for i in range(group_size):
                    v = max(admitted, pushed[0] - host_lag * k)
                    queue.put(make_rollout(group_id, i, (v, v, v), admitted_at_version=admitted))
        except QueueClosed:
            pass
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=producer)
    thread.start()
    staleness = []
    for step in range(steps):
        version = step * k
        groups = queue.get_batch(batch, trainer_version=version, timeout=JOIN_S)
        # Rows in batch order, as the batch builder lays them out (all samples 3 tokens).
        versions = np.stack([r.versions for g in groups for r in g.rollouts])
        staleness.append(trained_staleness(versions, np.ones_like(versions), version, k))
        pushed[0] = version + k
        controller.notify_version(version + k)
    controller.close("done")
    queue.close("done")
    thread.join(JOIN_S)
    assert not errors and not thread.is_alive()
    queue.check_invariant()
    return np.concatenate(staleness), queue.counters()


def test_sync_with_two_minibatches_drops_nothing_and_produces_what_it_trains():
    # Before staleness was counted in versions, the budget grew by B per version (2B per
    # batch) while the queue dropped groups whose version lagged the step's by more than
    # η = 0: groups were over-generated and dropped as stale, more every step.
    staleness, counters = run_pipeline(
        mode="sync", eta_cfg=0, k=2, batch=2, group_size=2, steps=6, host_lag=0
    )
    assert counters["dropped_total"] == 0
    assert counters["consumed_groups"] == 12
    # At most the batch admitted after the last step is still in flight.
    assert counters["produced_groups"] <= counters["consumed_groups"] + 2
    # Minibatch 0 trains at d = 0, minibatch 1 at d = 1 = k - 1: every token obeys the bound.
    assert staleness_counts(staleness) == [staleness.size // 2, staleness.size // 2]


@pytest.mark.parametrize("mode, eta_cfg, k", [("one_step_off", 0, 2), ("async", 5, 3)])
def test_every_token_of_every_minibatch_obeys_the_bound(mode, eta_cfg, k):
    eta = staleness_bound(mode, eta_cfg, k)
    staleness, counters = run_pipeline(
        mode=mode, eta_cfg=eta_cfg, k=k, batch=3, group_size=2, steps=8, host_lag=1
    )
    assert staleness.min() >= 0 and staleness.max() <= eta
    assert staleness.max() >= k  # the pipeline really overlapped batches
    assert counters["dropped_total"] == 0
