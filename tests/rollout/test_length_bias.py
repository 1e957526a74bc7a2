"""Length bias: the queue's length counters (generated / trained / dropped samples and their
tokens), the ``length/*`` metrics built from them, and admission-order consumption
(``system.consume_order="admission"``) with the staleness bound intact; plus one real run
that logs ``length/*`` and the ``mismatch/*`` dashboard."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from a3po_jax.core.types import Rollout
from a3po_jax.rollout.admission import StalenessController
from a3po_jax.rollout.queue import RolloutQueue, RolloutTimeout
from a3po_jax.training.config import ConfigError, SystemSection, apply_overrides, load_experiment
from a3po_jax.training.metrics import length_metrics

ROOT = Path(__file__).resolve().parents[2]


def sample(group_id, index, length, version=0, *, finish_reason="stop", versions=None):
    if versions is None:
        versions = np.full((length,), version, np.int32)
    return Rollout(
        prompt_id=f"p{group_id}",
        group_id=group_id,
        sample_index=index,
        prompt_tokens=np.arange(3, dtype=np.int32),
        completion_tokens=np.full((length,), 7, np.int32),
        behav_logprobs=np.full((length,), -0.5, np.float32),
        versions=versions,
        finish_reason=finish_reason,
    )


def put_group(queue, group_id, lengths, version=0):
    for i, n in enumerate(lengths):
        queue.put(sample(group_id, i, n, version))


def ids(groups):
    return [g.group_id for g in groups]


def take(queue, n, version=0):
    return ids(queue.get_batch(n, trainer_version=version, timeout=0))


def samples_add_up(c, group_size):
    """Every filed sample is trained, dropped or still held (samples and tokens)."""
    held = c["pending_samples"] + c["ready_groups"] * group_size
    assert c["produced_samples"] == (
        c["consumed_samples"] + sum(c["dropped_samples"].values()) + held
    )
    assert c["generated_tokens"] == (
        c["consumed_tokens"] + sum(c["dropped_tokens"].values()) + c["held_tokens"]
    )


# --- order ---------------------------------------------------------------------------------


def out_of_order(order):
    """Group 0 (long) has 1 of 2 samples while groups 1 and 2 (short) complete."""
    q = RolloutQueue(group_size=2, capacity_groups=8, max_staleness=None, consume_order=order)
    q.put(sample(0, 0, 9))
    put_group(q, 1, [2, 2])
    put_group(q, 2, [3, 3])
    return q


def test_completion_order_lets_short_groups_overtake():
    q = out_of_order("completion")
    assert take(q, 2) == [1, 2]
    assert q.counters()["overtaking_groups"] == 2  # both jumped group 0
    q.put(sample(0, 1, 9))
    assert take(q, 1) == [0]
    assert q.counters()["overtaking_groups"] == 2


def test_admission_order_waits_for_the_oldest_group():
    q = out_of_order("admission")
    with pytest.raises(RolloutTimeout):  # groups 1 and 2 are ready, but group 0 is older
        q.get_batch(1, trainer_version=0, timeout=0.05)
    assert len(q) == 2  # nothing was taken
    q.put(sample(0, 1, 9))
    assert take(q, 2) == [0, 1]  # strictly the oldest two, not 0 and whichever came first
    assert take(q, 1) == [2]
    c = q.counters()
    assert (c["consumed_samples"], c["consumed_tokens"]) == (6, 18 + 4 + 6)
    assert c["overtaking_groups"] == 0


def test_admission_order_one_group_at_a_time_as_periodic_mode_takes_them():
    q = RolloutQueue(group_size=1, capacity_groups=8, max_staleness=0, consume_order="admission")
    for gid in (3, 1, 2, 0):  # completed newest first
        q.put(sample(gid, 0, 4))
    assert [take(q, 1)[0] for _ in range(4)] == [0, 1, 2, 3]


def test_admitted_groups_without_a_sample_block_until_done_or_dropped():
    inflight = {0, 1, 2}  # what RolloutWorkers passes: admitted, not yet consumed
    q = RolloutQueue(
        group_size=2,
        capacity_groups=8,
        max_staleness=None,
        consume_order="admission",
        admitted_ids=lambda: set(inflight),
    )
    put_group(q, 1, [2, 2])
    with pytest.raises(RolloutTimeout):  # group 0 has not sent a sample yet
        q.get_batch(1, trainer_version=0, timeout=0.05)
    q.drop_group(0, "host_error")  # a dropped group no longer blocks
    assert take(q, 1) == [1]
    # Group 1 is consumed but still listed until the trainer forgets it: it must not block.
    put_group(q, 2, [5, 5])
    assert take(q, 1) == [2]
    inflight.clear()  # the trainer forgot 0, 1 and 2
    put_group(q, 3, [1, 1])
    assert take(q, 1) == [3]
    assert q._finished == set()  # finished ids are remembered only while the callable lists them


def test_completion_order_is_the_default_and_bad_orders_are_refused():
    assert RolloutQueue(group_size=1, capacity_groups=1, max_staleness=0).consume_order == (
        "completion"
    )
    with pytest.raises(ValueError, match="consume_order"):
        RolloutQueue(group_size=1, capacity_groups=1, max_staleness=0, consume_order="lifo")


# --- the length counters, by hand ------------------------------------------------------------


def golden_queue(order):
    """G = 2, η = 1. Trained: group 0 (3 + 5 tokens) and group 2 (2 + 2). Dropped: group 1
    (incomplete, 1 sample of 7, stale), group 3 (aborted sample of 4), group 4 (6 + 6, stale);
    a late sample of group 1 (11 tokens) is discarded, not generated."""
    q = RolloutQueue(group_size=2, capacity_groups=8, max_staleness=1, consume_order=order)
    put_group(q, 0, [3, 5])
    assert take(q, 1, version=0) == [0]
    q.put(sample(1, 0, 7, version=0))
    put_group(q, 2, [2, 2], version=1)
    q.put(sample(3, 0, 4, version=1, finish_reason="aborted"))
    put_group(q, 4, [6, 6], version=0)
    # At version 2 groups 1 and 4 (tokens of version 0) are 2 > η old: dropped; in admission
    # order group 1 (the oldest) no longer blocks group 2 once dropped.
    assert take(q, 1, version=2) == [2]
    q.put(sample(1, 1, 11, version=0))  # late: discarded
    return q


@pytest.mark.parametrize("order", ["completion", "admission"])
def test_length_counters_golden_values(order):
    q = golden_queue(order)
    c = q.counters()
    assert c["produced_samples"] == 8 and c["generated_tokens"] == 3 + 5 + 7 + 2 + 2 + 4 + 6 + 6
    assert c["consumed_samples"] == 4 and c["consumed_tokens"] == 3 + 5 + 2 + 2
    assert c["dropped_groups"] == {"stale": 2, "aborted": 1}
    assert c["dropped_samples"] == {"stale": 3, "aborted": 1}
    assert c["dropped_tokens"] == {"stale": 7 + 12, "aborted": 4}
    assert c["discarded_samples"] == 1 and c["held_tokens"] == 0
    samples_add_up(c, 2)
    q.check_invariant()
    m = length_metrics(c)
    assert m["length/generated_mean"] == pytest.approx(35 / 8)
    assert m["length/trained_mean"] == pytest.approx(12 / 4)
    assert m["length/dropped_samples"] == 4
    assert m["length/dropped_mean"] == pytest.approx(23 / 4)
    assert m["length/trained_minus_generated"] == pytest.approx(3 - 35 / 8)


def test_length_metrics_before_anything_happened_are_nan_not_errors():
    m = length_metrics(RolloutQueue(group_size=2, capacity_groups=2, max_staleness=0).counters())
    assert m["length/dropped_samples"] == 0
    assert m["length/dropped_mean"] is None  # no drops: null in the JSONL, no TensorBoard point
    for key in ("generated_mean", "trained_mean", "trained_minus_generated"):
        assert math.isnan(m[f"length/{key}"])


def test_length_counters_survive_state_and_restore():
    q = golden_queue("completion")
    q.put(sample(5, 0, 9, version=2))  # held (incomplete) at checkpoint time
    put_group(q, 7, [3, 3], version=2)
    assert take(q, 1, version=2) == [7]  # overtakes group 5
    put_group(q, 6, [1, 4], version=2)  # held (complete)
    before = q.counters()
    samples_add_up(before, 2)
    assert before["held_tokens"] == 14 and before["overtaking_groups"] == 1
    state = json.loads(json.dumps(q.state()))  # what a checkpoint stores

    fresh = RolloutQueue(group_size=2, capacity_groups=8, max_staleness=1)
    fresh.restore(state)
    after = fresh.counters()
    keys = ("produced_samples", "generated_tokens", "consumed_samples", "consumed_tokens")
    for key in (*keys, "overtaking_groups"):
        assert after[key] == before[key], key
    # The groups held at save time are lost with the process: counted as dropped "restart",
    # with the samples and tokens they held.
    assert after["dropped_samples"] == {**before["dropped_samples"], "restart": 3}
    assert after["dropped_tokens"] == {**before["dropped_tokens"], "restart": 14}
    assert after["held_tokens"] == 0
    samples_add_up(after, 2)
    fresh.check_invariant()

    # A checkpoint from before the length counters still loads (they start at 0).
    old = {k: v for k, v in state.items() if "tokens" not in k and k != "dropped_samples"}
    older = RolloutQueue(group_size=2, capacity_groups=8, max_staleness=1)
    older.restore(old)
    assert older.counters()["generated_tokens"] == 0
    older.check_invariant()


# --- the staleness bound in admission order ----------------------------------------------------


def simulate(order, *, eta=1, k=1, batch=2, group_size=2, steps=40, seed=0):
    """One producer under the StalenessController, a host that writes one token per sample
    per tick with in-flight weight updates (a token's version is the trainer's version when
    it is written), response lengths 1..12 (long ones finish later), the trainer taking a
    batch whenever the queue gives one. As in RolloutWorkers, a group stays in the
    producer's table (``admitted_ids``) until consumed, a dropped one until its last sample
    is written (then discarded by the queue). Returns (trained token staleness, consumed
    ids, counters)."""
    rng = np.random.default_rng(seed)
    controller = StalenessController(batch_groups=batch, max_staleness=eta, versions_per_batch=k)
    table: dict[int, list] = {}  # group id -> per sample (length, versions written so far)
    dropped: set[int] = set()
    queue = RolloutQueue(
        group_size=group_size,
        capacity_groups=controller.max_in_flight,
        max_staleness=eta,
        versions_per_batch=k,
        on_drop=lambda gid, reason: (controller.release(), dropped.add(gid)),
        consume_order=order,
        admitted_ids=lambda: set(table),
    )
    version, staleness, consumed = 0, [], []
    for _tick in range(5000):
        while controller.can_admit(version):
            gid = controller.admit(version)
            table[gid] = [(int(rng.integers(1, 13)), []) for _ in range(group_size)]
        for gid, group in list(table.items()):
            for i, (length, versions) in enumerate(group):
                if len(versions) < length:
                    versions.append(version)
                    if len(versions) == length:
                        queue.put(sample(gid, i, length, versions=versions))
            if gid in dropped and all(len(v) == n for n, v in group):
                del table[gid]  # dropped earlier; its last samples were just discarded
        try:
            groups = queue.get_batch(batch, trainer_version=version, timeout=0)
        except RolloutTimeout:
            continue
        last = version + k - 1
        for g in groups:
            consumed.append(g.group_id)
            table.pop(g.group_id, None)
            staleness.extend(int(last - v) for r in g.rollouts for v in r.versions)
        version += k
        controller.notify_version(version)
        if version >= steps * k:
            break
    return np.asarray(staleness), consumed, queue.counters()


@pytest.mark.parametrize("eta,k", [(1, 1), (2, 1), (3, 2)])
def test_every_trained_token_stays_within_eta_in_admission_order(eta, k):
    staleness, consumed, c = simulate("admission", eta=eta, k=k)
    assert len(consumed) >= 40, "the simulation must train, not stall"
    assert staleness.min() >= 0 and staleness.max() <= eta
    assert consumed == sorted(consumed)  # strictly oldest admitted first
    samples_add_up(c, 2)


def test_completion_order_is_biased_short_and_admission_order_is_not():
    """The effect the option removes: same workload, completion order trains shorter answers
    than were generated (long ones are overtaken and go stale), admission order does not."""
    s_c, consumed_c, c = simulate("completion", eta=1, steps=60)
    s_a, consumed_a, a = simulate("admission", eta=1, steps=60)
    assert s_c.max() <= 1 and s_a.max() <= 1
    mc, ma = length_metrics(c), length_metrics(a)
    assert consumed_c != sorted(consumed_c)  # completion order really overtook
    assert mc["length/dropped_samples"] > 0
    assert mc["length/dropped_mean"] > mc["length/generated_mean"]
    assert mc["length/trained_minus_generated"] < ma["length/trained_minus_generated"]
    assert c["overtaking_groups"] > 0 and a["overtaking_groups"] == 0
    assert a["dropped_groups"].get("stale", 0) < c["dropped_groups"]["stale"]


# --- config ------------------------------------------------------------------------------------


def test_config_validates_consume_order_naming_the_field_and_choices():
    assert SystemSection().consume_order == "completion"
    assert SystemSection(consume_order="admission").consume_order == "admission"
    with pytest.raises(ConfigError, match=r"system\.consume_order.*completion, admission"):
        SystemSection(consume_order="oldest")
    cfg = load_experiment(ROOT / "experiments" / "smoke_tiny.py")
    assert apply_overrides(cfg, ["system.consume_order=admission"]).system.consume_order == (
        "admission"
    )
    with pytest.raises(ConfigError, match=r"system\.consume_order"):
        apply_overrides(cfg, ["system.consume_order=fifo"])


# --- a real run ----------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("order", ["completion", "admission"])
def test_real_run_logs_length_and_mismatch_dashboard(tmp_path, order):
    from a3po_jax.tasks.toy import LetterTask
    from a3po_jax.training.metrics import read_metrics
    from a3po_jax.training.trainer import Trainer, load_policy

    cfg = load_experiment(ROOT / "experiments" / "smoke_tiny.py")
    cfg = dataclasses.replace(
        apply_overrides(cfg, [f"system.consume_order={order}", "system.mode=async"]),
        steps=3,
        run_dir=str(tmp_path / order),
        checkpoint_every=0,
    )
    trainer = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    assert trainer.queue.consume_order == order  # threaded from the config
    trainer.run()
    records = read_metrics(cfg.run_dir)
    assert [r["version"] for r in records] == [1, 2, 3]
    group = cfg.rollout.group_size
    max_new = cfg.rollout.max_new_tokens
    for r in records:
        # length/*: cumulative means within [1, max_new_tokens], consistent with the queue.
        gen, trained = r["length/generated_mean"], r["length/trained_mean"]
        assert 1 <= gen <= max_new and 1 <= trained <= max_new
        assert r["length/trained_minus_generated"] == pytest.approx(trained - gen)
        assert r["queue/consumed_samples"] == r["queue/consumed_groups"] * group
        assert trained == pytest.approx(r["queue/consumed_tokens"] / r["queue/consumed_samples"])
        dropped = r["length/dropped_samples"]
        assert dropped == sum(v for k, v in r.items() if k.startswith("queue/dropped_samples/"))
        assert (dropped == 0) == (r["length/dropped_mean"] is None)
        assert r["length/dropped_samples"] <= r["queue/produced_samples"]
        # mismatch/*: finite, fractions in [0, 1], fresh tokens = the d = 0 trained tokens.
        mism = {k: v for k, v in r.items() if k.startswith("mismatch/")}
        for key in (
            "mismatch/k3_kl_fresh",
            "mismatch/fresh_tokens",
            "mismatch/masked_frac",
            "mismatch/truncated_frac",
            "mismatch/seq_masked_frac",
            "mismatch/seq_truncated_frac",
            "mismatch/iw_min",
            "mismatch/iw_max",
        ):
            assert key in mism, (key, sorted(mism))
            assert np.isfinite(mism[key]), key
        for key, value in mism.items():
            if key.endswith("_frac"):
                assert 0.0 <= value <= 1.0, (key, value)
        assert mism["mismatch/k3_kl_fresh"] >= -1e-6  # k3 >= 0 up to rounding
        assert 0 < mism["mismatch/iw_min"] <= mism["mismatch/iw_max"]
        assert mism["mismatch/fresh_tokens"] == r["staleness/counts"][0]
        assert r["staleness/max"] <= cfg.staleness_bound
    last = records[-1]
    assert last["queue/consumed_groups"] == 3 * cfg.rollout.groups_per_step
    if order == "admission":
        assert last["queue/overtaking_groups"] == 0  # nothing jumped an older group


# --- the results table -------------------------------------------------------------------------


def test_results_length_table_reads_the_last_cumulative_values():
    from a3po_jax.analysis.runs import Run
    from a3po_jax.analysis.tables import has_length, length_table

    def run(order, dropped_mean, step_s):
        records = [
            {
                "step": step,
                "length/generated_mean": 10.0 + step,
                "length/trained_mean": 9.0 + step,
                "length/trained_minus_generated": -1.0,
                "length/dropped_samples": 0 if dropped_mean is None else step,
                "length/dropped_mean": dropped_mean,
                "staleness/mean": 0.5 * step,
                "reward/mean": 0.1 * step,
                "time/step_s": step_s * step,
            }
            for step in (1, 2, 3)
        ]
        return Run(order, Path(order), {"system.consume_order": order, "seed": 0}, records)

    runs = [run("completion", 14.5, 2.0), run("admission", None, 1.0)]
    assert has_length(runs) and not has_length([Run("old", Path("old"), {}, [{"step": 1}])])
    table = length_table(runs).set_index("run")
    assert table.loc["completion", "consume_order"] == "completion"
    assert table.loc["completion", "generated len"] == 13.0
    assert table.loc["completion", "trained len"] == 12.0
    assert table.loc["completion", "dropped samples"] == 3
    assert table.loc["completion", "dropped len"] == 14.5
    assert math.isnan(table.loc["admission", "dropped len"])  # null: nothing dropped
    assert table.loc["completion", "staleness mean"] == pytest.approx(1.0)
    assert table.loc["completion", "reward/mean all-steps mean"] == pytest.approx(0.2)
    assert table.loc["completion", "s/step"] == pytest.approx(5.0)  # steps 2 and 3
