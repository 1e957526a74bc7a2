"""Exactly-once prompt accounting across kill -9 and --resume (issue 18).

A checkpoint records exactly which admitted groups are not trained yet; a resume re-issues
those (same group ids, same request seeds) and continues the prompt order after the newest
admitted prompt. The run's ledger (``run_dir/ledger.jsonl``) logs every admission, trained
group, drop, checkpoint and resume, and :func:`a3po_jax.rollout.ledger.audit` proves from it
that every prompt drawn was trained exactly once or dropped with a reason.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.trainer_runs import resumed_progress

from a3po_jax.cli import ledger as ledger_cli
from a3po_jax.inference.types import ErrorKind, SampleResult, SamplingParams, error_result
from a3po_jax.model.char_tokenizer import char_tokenizer
from a3po_jax.rollout.ledger import Ledger, audit
from a3po_jax.rollout.queue import RolloutTimeout
from a3po_jax.rollout.workers import RolloutWorkers
from a3po_jax.tasks import PromptIterator, RewardConfig, make_task
from a3po_jax.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
GROUP_SIZE = 2
BATCH_GROUPS = 2
FAILING_GROUP = 5  # the fake host fails this group's samples (a "host_error" drop)


class OutOfOrderHost:
    """A fake inference host whose requests finish out of order: groups with an odd id are
    "long responses" that come back several polls after the even ones submitted with them.
    Tokens are a pure function of the request seed; versions are the served version."""

    def __init__(self, *, slow_polls: int = 6):
        self.slow_polls = slow_polls
        self.version = 0
        self._lock = threading.Lock()
        self._ticks = 0
        self._waiting: list[tuple[int, SampleResult]] = []  # (release tick, result)
        self.submitted: list[str] = []
        self.seeds: dict[str, int] = {}

    def submit(self, request):
        group_id = int(request.request_id[1:].split(".")[0])
        with self._lock:
            self.submitted.append(request.request_id)
            self.seeds[request.request_id] = request.seed
            release = self._ticks + (self.slow_polls if group_id % 2 else 1)
            for i in range(request.num_samples):
                if group_id == FAILING_GROUP:
                    result = error_result(request, i, ErrorKind.SAMPLE_FAILED, "injected failure")
                else:
                    n = 2 + (request.seed + i) % 3
                    result = SampleResult(
                        request_id=request.request_id,
                        sample_index=i,
                        prompt_tokens=np.asarray(request.prompt_tokens, np.int32),
                        tokens=np.full((n,), 40 + (request.seed + i) % 20, np.int32),
                        logprobs=np.full((n,), -1.0, np.float32),
                        versions=np.full((n,), self.version, np.int32),
                        finish_reason="stop",
                    )
                self._waiting.append((release, result))

    def poll(self, timeout=None, max_results=None):
        time.sleep(min(timeout or 0.0, 0.002))
        with self._lock:
            self._ticks += 1
            ready = [r for t, r in self._waiting if t <= self._ticks]
            self._waiting = [(t, r) for t, r in self._waiting if t > self._ticks]
        return ready

    def update_weights(self, params, version):
        self.version = int(version)

    def stats(self):
        return {"update_policy": "in_flight", "version": self.version, "live": True}

    def counters(self):
        return {"samples_requested": len(self.submitted) * GROUP_SIZE}

    def close(self):
        pass


def make_workers(task, tokenizer, host, ledger, *, max_staleness=3):
    return RolloutWorkers(
        host=host,
        task=task,
        tokenizer=tokenizer,
        prompts=PromptIterator(task.prompts("train"), batch_size=1, seed=0),
        sampling=SamplingParams(max_new_tokens=4),
        reward_config=RewardConfig(),
        group_size=GROUP_SIZE,
        batch_groups=BATCH_GROUPS,
        max_staleness=max_staleness,
        versions_per_batch=1,
        seed=0,
        ledger=ledger,
    )


def check_sample_counters(queue):
    """Samples and tokens add up like groups: produced = consumed + dropped + held."""
    c = queue.counters()
    held = c["pending_samples"] + c["ready_groups"] * GROUP_SIZE
    assert (
        c["produced_samples"] == c["consumed_samples"] + sum(c["dropped_samples"].values()) + held
    )
    assert c["generated_tokens"] == (
        c["consumed_tokens"] + sum(c["dropped_tokens"].values()) + c["held_tokens"]
    )


def position(entry):
    return (entry["position"]["epoch"], entry["position"]["index"])


def test_restarts_with_out_of_order_completions_train_every_prompt_once(tmp_path):
    """Train, checkpoint, train one more step (lost), throw the workers away, restore into
    new ones, continue; three times. The ledger's audit finds every position trained exactly
    once or dropped with a reason, and the scenario is one the old resume got wrong."""
    task = make_task("letters", train_size=64)
    tokenizer = char_tokenizer()
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.start()
    trained_positions: list[tuple[int, int]] = []  # as the trainer saw them, for the old rule
    positions: dict[int, tuple[int, int]] = {}  # group id -> position, across restarts
    old_rule_retrains = set()
    checkpoint = None  # (state, step, version)
    step = version = 0
    for segment, steps in enumerate((3, 4, 2, 5)):
        host = OutOfOrderHost()
        workers = make_workers(task, tokenizer, host, ledger)
        if checkpoint is not None:
            state, step, version = checkpoint
            ledger.resume(step, version=version)
            workers.restore(json.loads(json.dumps(state)), version=version)
            workers.queue.check_invariant()
            check_sample_counters(workers.queue)
            # Counted against the budget: the groups trained so far and the re-issued ones.
            counted = workers.controller.admitted - workers.controller.released
            assert counted == step * BATCH_GROUPS + len(state["pending_groups"])
            host.version = version
        workers.start()
        try:
            last = segment == 3
            for n in range(steps + (0 if last else 1)):
                groups = workers.get_batch(BATCH_GROUPS, trainer_version=version, timeout=30)
                for g in groups:
                    assert g.admitted_at_version <= version
                with workers._inflight_lock:  # the position each group was drawn at
                    for g in groups:
                        entry = workers._inflight[g.group_id]
                        positions[g.group_id] = (entry[2]["epoch"], entry[2]["index"])
                workers.consumed(groups, step=step + 1, version=version)
                step += 1
                version += 1
                workers.notify_version(version)
                host.update_weights(None, version)
                if n < steps:  # checkpointed; the extra step after the last one is lost
                    trained_positions.extend(positions[g.group_id] for g in groups)
                    with workers._inflight_lock:
                        pending = [
                            (e[2]["epoch"], e[2]["index"]) for e in workers._inflight.values()
                        ]
                    state = workers.state()
                    checkpoint = (state, step, version)
                    workers.queue.check_invariant()
                    # The old resume restarted the prompt order at the oldest pending
                    # position: every trained position after it would be trained again.
                    if pending:
                        old_rule_retrains |= {p for p in trained_positions if p > min(pending)}
            if last:
                workers.queue.check_invariant()
                check_sample_counters(workers.queue)
        finally:
            workers.close()
    ledger.close()

    # The scenario really completes out of order: the old resume would retrain prompts.
    assert old_rule_retrains, "no trained prompt was newer than the oldest pending one"

    result = audit(tmp_path / "ledger.jsonl")
    assert result.ok, result.summary()
    assert result.resumes == 3 and result.reissued > 0 and result.voided_events > 0
    assert not result.trained_twice and not result.drawn_twice and not result.lost
    assert result.trained == (3 + 4 + 2 + 5) * BATCH_GROUPS
    assert result.dropped.get("host_error") == 1
    accounted = result.trained + sum(result.dropped.values()) + len(result.in_flight_at_end)
    assert accounted == result.admitted
    # No gap in the prompt order: positions (0, 0) .. (0, admitted - 1) were drawn.
    assert sorted(result.positions.values()) == [(0, i) for i in range(result.admitted)]
    # The trained positions the ledger reports are the ones the trainer saw, each once.
    assert sorted(set(trained_positions)) == sorted(trained_positions)
    assert len(trained_positions) == result.trained


def checkpoint_after_one_step(task, tokenizer):
    """Train one step with max_staleness 1 on a host whose odd groups never finish, then
    save: (host, the trained groups, the saved state with the odd groups pending)."""
    host = OutOfOrderHost(slow_polls=10_000)  # odd groups never finish
    workers = make_workers(task, tokenizer, host, None, max_staleness=1)
    workers.start()
    groups = workers.get_batch(2, trainer_version=0, timeout=30)  # groups 0 and 2
    workers.consumed(groups, step=1, version=0)
    workers.notify_version(1)
    time.sleep(0.2)
    state = workers.state()
    workers.close()
    return host, groups, state


def test_restore_reissues_the_same_groups_first(tmp_path):
    """The pending groups come back with their group ids (so their request seeds), at the
    resumed version, before any new admission; the next new prompt is the one after the
    newest admitted."""
    task = make_task("letters", train_size=64)
    tokenizer = char_tokenizer()
    host, groups, state = checkpoint_after_one_step(task, tokenizer)
    pending = [e["group_id"] for e in state["pending_groups"]]
    assert sorted(g.group_id for g in groups) == [0, 2]
    assert 1 in pending and 3 in pending
    newest = max(position(e) for e in state["pending_groups"])
    assert (state["prompt_iterator"]["epoch"], state["prompt_iterator"]["index"]) > newest

    host2 = OutOfOrderHost(slow_polls=10_000)
    resumed = make_workers(task, tokenizer, host2, None, max_staleness=1)
    resumed.restore(state, version=1)
    # The re-issued groups fill the budget of version 1: the next admission needs version 2.
    assert resumed.controller.capacity(1) == 0
    resumed.start()
    time.sleep(0.2)
    # The same group ids (so the same request seeds), under wire ids of their own.
    assert host2.submitted == [f"g{g}.re1" for g in pending]
    resumed.notify_version(2)
    deadline = time.monotonic() + 10
    while len(host2.submitted) < len(pending) + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    resumed.close()
    assert host2.submitted[: len(pending)] == [f"g{g}.re1" for g in pending]
    assert all(host2.seeds[f"g{g}.re1"] == host.seeds[f"g{g}"] for g in pending)
    admitted_after = state["controller"]["admitted"]
    assert host2.submitted[len(pending)] == f"g{admitted_after}"
    with resumed._inflight_lock:
        assert resumed._inflight[pending[0]][1] == 1  # admitted at the resumed version


class GatedHost(OutOfOrderHost):
    """Holds every re-issued request's ``submit`` until ``gate`` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def submit(self, request):
        if ".re" in request.request_id:
            self.gate.wait(timeout=30)
        super().submit(request)


def test_wait_submitted_waits_for_the_reissued_groups_and_wakes_when_they_go():
    """`wait_submitted` (one_step_off, before each push) returns only once every group
    pending at the checkpoint is at the host again, and promptly after the last one."""
    task = make_task("letters", train_size=64)
    tokenizer = char_tokenizer()
    _, _, state = checkpoint_after_one_step(task, tokenizer)
    pending = [e["group_id"] for e in state["pending_groups"]]
    assert len(pending) >= 2

    host2 = GatedHost(slow_polls=10_000)
    resumed = make_workers(task, tokenizer, host2, None, max_staleness=1)
    resumed.restore(state, version=1)
    resumed.start()
    try:
        with pytest.raises(RolloutTimeout, match=f"{len(pending)} re-issued groups not submitted"):
            resumed.wait_submitted(timeout=0.2)
        waited: list[float] = []

        def wait():
            resumed.wait_submitted(timeout=30)
            waited.append(time.monotonic())

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.1)
        assert not waited  # still held at the gate
        opened = time.monotonic()
        host2.gate.set()
        thread.join(10)
        assert waited and waited[0] - opened < 1.0  # generous: woken, not timed out
        assert host2.submitted == [f"g{g}.re1" for g in pending]
    finally:
        resumed.close()


def test_restore_puts_the_held_groups_back_and_reissues_the_rest(tmp_path):
    """The one_step_off checkpoint: wait for the groups admitted at older versions
    (`settle`), save the complete pending ones (`snapshot(hold=True)`); the resume puts them
    back as they were, re-issues only the others, and the ledger's audit agrees."""
    task = make_task("letters", train_size=64)
    tokenizer = char_tokenizer()
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.start()
    host = OutOfOrderHost()
    workers = make_workers(task, tokenizer, host, ledger, max_staleness=1)
    workers.start()
    groups = workers.get_batch(2, trainer_version=0, timeout=30)
    workers.consumed(groups, step=1, version=0)
    host.update_weights(None, 1)
    assert workers.settle(older_than=1, timeout=30)  # the slow odd groups, from version 0
    assert {1, 3} <= workers.queue.ready_ids()
    host.slow_polls = 10_000  # what is admitted now never finishes
    workers.notify_version(1)
    deadline = time.monotonic() + 10
    while len(host.submitted) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    workers.queue.wait_complete(lambda: [4], timeout=10)
    state, held = workers.snapshot(hold=True)
    workers.close()
    state = json.loads(json.dumps(state))
    pending = sorted(e["group_id"] for e in state["pending_groups"])
    assert pending == [1, 3, 4, 5]
    assert state["held_groups"] == [g.group_id for g in held]
    assert sorted(state["held_groups"]) == [1, 3, 4]

    ledger.resume(1, version=1)
    host2 = OutOfOrderHost(slow_polls=10_000)
    resumed = make_workers(task, tokenizer, host2, ledger, max_staleness=1)
    with pytest.raises(ValueError, match="saved beside it"):
        resumed.restore(state, version=1)  # the held groups are needed
    resumed = make_workers(task, tokenizer, host2, ledger, max_staleness=1)
    resumed.restore(state, version=1, held=held)
    resumed.queue.check_invariant()
    check_sample_counters(resumed.queue)
    counted = resumed.controller.admitted - resumed.controller.released
    assert counted == 2 + len(pending)
    resumed.start()
    batch = resumed.get_batch(2, trainer_version=1, timeout=30)
    time.sleep(0.1)
    resumed.close()
    ledger.close()
    assert host2.submitted == ["g5.re1"]  # only the incomplete one is generated again
    by_id = {g.group_id: g for g in held}
    assert [g.group_id for g in batch] == [1, 3]  # the held order: as they completed
    for group in batch:
        assert group.admitted_at_version == 0  # as admitted, not the resumed version
        original = by_id[group.group_id]
        for a, b in zip(group.rollouts, original.rollouts, strict=True):
            np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
            np.testing.assert_array_equal(a.versions, b.versions)
    result = audit(tmp_path)
    assert result.ok, result.summary()
    assert (result.restored_held, result.reissued) == (3, 1)


def test_settle_waits_for_older_groups_only_and_stops_when_asked():
    task = make_task("letters", train_size=64)
    host = OutOfOrderHost(slow_polls=10_000)  # odd groups never finish
    workers = make_workers(task, char_tokenizer(), host, None, max_staleness=1)
    workers.start()
    try:
        deadline = time.monotonic() + 10
        while len(host.submitted) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert workers.settle(older_than=0, timeout=0.1)  # none admitted before version 0
        with pytest.raises(RolloutTimeout, match=r"groups \[1, 3\] not complete"):
            workers.settle(older_than=1, timeout=0.3)
        t0 = time.monotonic()
        assert not workers.settle(older_than=1, timeout=30, interrupted=lambda: True)
        assert time.monotonic() - t0 < 1.0  # a stop request does not wait
    finally:
        workers.close()


def test_audit_catches_a_restored_group_the_checkpoint_did_not_hold(tmp_path):
    path = tmp_path / "ledger.jsonl"
    restored = {"event": "restore_held", "group": 1, "prompt": "p1", "pos": [0, 1], "version": 0}
    write_ledger(
        path,
        [
            admit(0, 0), admit(1, 1),
            train(0, 1),
            {"event": "checkpoint", "step": 1, "pending": [1], "held": []},
            {"event": "resume", "step": 1},
            restored,
        ],
    )  # fmt: skip
    result = audit(path)
    assert not result.ok
    assert any("did not hold it" in a for a in result.anomalies), result.anomalies


def test_a_skipped_step_drops_its_groups_with_a_reason(tmp_path):
    """A non-finite step's groups are dropped ("nonfinite_step") and given back: after a
    resume they neither count against the budget nor come back."""
    task = make_task("letters", train_size=64)
    tokenizer = char_tokenizer()
    ledger = Ledger(tmp_path / "ledger.jsonl")
    workers = make_workers(task, tokenizer, OutOfOrderHost(), ledger)
    workers.start()
    skipped = workers.get_batch(BATCH_GROUPS, trainer_version=0, timeout=30)
    workers.consumed(skipped, step=1, version=0, skipped=True)
    workers.discard(len(skipped))
    trained = workers.get_batch(BATCH_GROUPS, trainer_version=0, timeout=30)
    workers.consumed(trained, step=2, version=0)
    workers.notify_version(1)
    state = workers.state()
    workers.close()
    resumed = make_workers(task, tokenizer, OutOfOrderHost(), ledger)
    ledger.resume(2, version=1)
    resumed.restore(state, version=1)
    ledger.close()
    counted = resumed.controller.admitted - resumed.controller.released
    assert counted == BATCH_GROUPS + len(state["pending_groups"])
    reissued = {e["group_id"] for e in state["pending_groups"]}
    assert not reissued & {g.group_id for g in skipped + trained}
    result = audit(tmp_path)
    assert result.ok, result.summary()
    assert result.dropped == {"nonfinite_step": BATCH_GROUPS}
    assert result.trained == BATCH_GROUPS


def test_checkpoint_without_pending_groups_resumes_the_old_way(caplog):
    task = make_task("letters", train_size=64)
    workers = make_workers(task, char_tokenizer(), OutOfOrderHost(), None)
    state = workers.state()
    del state["pending_groups"]
    state["prompt_iterator"] = {"epoch": 0, "index": 5, "seed": 0}
    with caplog.at_level(logging.WARNING, logger="a3po_jax.rollout.workers"):
        workers.restore(state, version=0)
    assert "without pending_groups" in caplog.text
    assert workers.prompts.state()["index"] == 5
    workers.queue.check_invariant()


def write_ledger(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def admit(g, i, v=0):
    return {"event": "admit", "group": g, "prompt": f"p{i}", "pos": [0, i], "version": v}


def train(g, step):
    return {"event": "train", "group": g, "step": step}


def test_audit_rolls_back_what_a_resume_redoes(tmp_path):
    path = tmp_path / "ledger.jsonl"
    events = [
        {"event": "start"},
        admit(0, 0), admit(1, 1), admit(2, 2),
        train(0, 1), train(2, 1),
        {"event": "checkpoint", "step": 1, "pending": [1]},
        admit(3, 3),  # after the snapshot: voided, drawn again
        train(1, 2), train(3, 2),  # step 2 was never checkpointed: voided
        {"event": "drop", "group": 4, "reason": "stale"},  # never admitted: ignored
        {"event": "resume", "step": 1},
        {"event": "reissue", "group": 1, "prompt": "p1", "pos": [0, 1], "version": 1},
        admit(3, 3, 1), admit(4, 4, 1),
        train(1, 2), train(3, 2),
        {"event": "drop", "group": 4, "reason": "stale"},
        admit(5, 5, 2),
    ]  # fmt: skip
    write_ledger(path, events)
    with path.open("a") as f:
        f.write('{"event": "adm')  # a line torn by kill -9
    result = audit(path)
    assert result.ok, result.summary()
    assert (result.admitted, result.trained, result.dropped) == (6, 4, {"stale": 1})
    assert result.in_flight_at_end == [(0, 5)]
    assert result.voided_events == 4 and result.reissued == 1


def test_audit_catches_the_old_resume(tmp_path):
    """What the old resume did: restart the prompt order at the oldest pending position,
    under new group ids, so a prompt trained before the checkpoint is trained again; and a
    pending group that is never re-issued is lost."""
    path = tmp_path / "ledger.jsonl"
    write_ledger(
        path,
        [
            admit(0, 0), admit(1, 1), admit(2, 2),
            train(0, 1), train(2, 1),
            {"event": "checkpoint", "step": 1, "pending": [1]},
            {"event": "resume", "step": 1},
            admit(3, 1), admit(4, 2),  # positions 1 and 2 drawn again
            train(3, 2), train(4, 2),
        ],
    )  # fmt: skip
    result = audit(path)
    assert not result.ok
    assert result.trained_twice == {(0, 2): [1, 2]}
    assert set(result.drawn_twice) == {(0, 1), (0, 2)}
    assert result.lost == [(0, 1)]
    assert "FAILED" in result.summary()
    assert ledger_cli.main([str(tmp_path)]) == 1


def test_audit_cli(tmp_path, capsys):
    write_ledger(tmp_path / "ledger.jsonl", [admit(0, 0), train(0, 1)])
    assert ledger_cli.main([str(tmp_path)]) == 0
    assert "ledger audit: OK" in capsys.readouterr().out
    assert ledger_cli.main([]) == 2 and "usage" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# End to end: a real trainer, killed with SIGKILL three times, resumed each time.


def trainer_cmd(run_dir, *extra):
    return [
        sys.executable, str(REPO / "tests" / "helpers" / "exactly_once_run.py"), str(run_dir),
        "steps=10", "checkpoint_every=1", "task.name=letters", "task.options={}",
        "rollout.max_new_tokens=6", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "mode",
    [
        ("system.mode=async", "system.max_staleness=3"),
        ("system.mode=one_step_off",),
        ("system.mode=periodic", "system.max_staleness=0"),
    ],
)
def test_kill_9_three_times_then_audit(tmp_path, mode):
    run_dir = tmp_path / "run"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        # The four launches compile the same programs: compile once (in the suite's cache
        # where it has one).
        JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR", str(tmp_path)),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    for n, (kill_after, extra_delay) in enumerate(((2, 0.0), (4, 0.15), (6, 0.4))):
        proc = subprocess.Popen(
            trainer_cmd(run_dir, *mode, *(["--resume"] if n else [])),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if resumed_progress(run_dir, n) >= kill_after:
                break
            time.sleep(0.05)
        time.sleep(extra_delay)  # kill at different points of a step
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    final = subprocess.run(
        trainer_cmd(run_dir, *mode, "--resume"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert final.returncode == 0, final.stderr[-3000:]

    result = audit(run_dir)
    print(result.summary())
    assert result.ok, result.summary()
    assert result.resumes == 3
    assert result.trained == 10 * 4  # steps x groups_per_step, each position once
    # Completions really came out of order: some step trained a group newer than one a
    # later step trained; in one_step_off, whose checkpoints (every step here) wait for the
    # next batch before another is admitted, a step took its groups out of admission order.
    steps = sorted(result.steps)
    if "system.mode=one_step_off" in mode:
        assert any(result.steps[s] != sorted(result.steps[s]) for s in steps), result.steps
        assert result.restored_held > 0 and result.reissued == 0
    elif "system.mode=periodic" in mode:
        # Strictly on-policy: every step trains the groups of its own iteration, none of a
        # later one, whatever order they finished in.
        assert all(
            max(result.steps[a]) < min(result.steps[b]) for a in steps for b in steps if b > a
        ), result.steps
    else:
        assert any(
            max(result.steps[a]) > min(result.steps[b]) for a in steps for b in steps if b > a
        ), result.steps
    # The metrics hold one record per version.
    assert [r["version"] for r in read_metrics(run_dir)] == list(range(1, 11))
