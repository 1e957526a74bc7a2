"""End-to-end: the real embedded inference host, rollout queue, staleness control and
jitted step, on a tiny random model and a toy task, in every mode and with every loss."""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from helpers.trainer_runs import LetterTask, make_cfg, run

from a3po_jax.training.config import BatchSection, ConfigError, PlacementSection
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy


@pytest.mark.parametrize(
    "mode,expected",
    # one_step_off: the first batch has nothing to overlap with (d = 0), then exactly 1.
    [("sync", {0}), ("periodic", {0}), ("one_step_off", {0, 1}), ("async", {0, 1, 2})],
)
def test_modes_bound_staleness(tmp_path, mode, expected):
    records = run(make_cfg(tmp_path, mode, mode=mode, eta=2, steps=4, prox="a3po"))
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    for i, r in enumerate(records):
        assert np.isfinite(r["loss/total"])
        assert r["staleness/max"] <= max(expected)
        tokens = r["staleness/tokens"]  # exact histogram: one bin per staleness value
        assert {v for v, c in zip(tokens["values"], tokens["counts"], strict=True) if c} <= expected
        if mode == "one_step_off" and i >= 1:
            # Batch t+1 is submitted while batch t trains, and under "drain" the host finishes
            # requests submitted before a push on the old weights, so every token is exactly
            # 1 old, even a group that only reached a slot after the next push.
            assert {v for v, c in zip(tokens["values"], tokens["counts"], strict=True) if c} == {1}
        if mode in ("sync", "periodic"):
            assert r["staleness/max"] == 0
    last = records[-1]
    assert last["queue/produced_groups"] >= last["queue/consumed_groups"] == 8


@pytest.mark.parametrize(
    "algo",
    [
        dict(prox="recompute"),
        dict(prox="behav"),
        dict(prox="a3po", a3po_zero_staleness="behav", dual_clip=3.0, behav_weight_cap=5.0),
        dict(loss="dpo"),
        dict(prox="a3po", kl_coef=0.05, kl_kind="k3"),
        dict(prox="a3po", kl_coef=0.05, kl_kind="k1", kl_in_reward=True, advantage="rloo"),
    ],
    ids=["recompute", "naive", "a3po-areal-dual-cap", "dpo", "kl-loss", "kl-reward-rloo"],
)
def test_every_loss_runs_through_the_pipeline(tmp_path, algo):
    records = run(make_cfg(tmp_path, "loss", steps=2, **algo))
    assert len(records) == 2
    for r in records:
        assert np.isfinite(r["loss/total"]) and r["step/skipped"] == 0
        assert r["staleness/max_observed"] <= 2


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    # sync mode is deterministic given the seed: sampling keys depend only on
    # (seed, group id, sample, step), and a checkpoint is taken at a step boundary.
    full = run(
        dataclasses.replace(make_cfg(tmp_path, "full", mode="sync", steps=4), checkpoint_every=2)
    )
    part_cfg = dataclasses.replace(
        make_cfg(tmp_path, "part", mode="sync", steps=2), checkpoint_every=2
    )
    run(part_cfg)
    resumed = run(dataclasses.replace(part_cfg, steps=4), resume=True)
    by_version = {r["version"]: r for r in resumed}
    for r in full[2:]:
        other = by_version[r["version"]]
        assert other["reward/mean"] == pytest.approx(r["reward/mean"], abs=1e-6)
        assert other["loss/total"] == pytest.approx(r["loss/total"], rel=1e-4, abs=1e-6)
        assert other["optim/param_norm"] == pytest.approx(r["optim/param_norm"], rel=1e-5)


@pytest.mark.parametrize("mode", ["periodic", "async"])
def test_packed_prompts_and_one_pass_old_through_the_pipeline(tmp_path, mode):
    # Periodic Asynchrony's system recipe: shared-prompt rows and the old policy's log-probs
    # from the same pass (prox=recompute, one optimizer step per batch).
    cfg = make_cfg(tmp_path, f"packed_{mode}", mode=mode, steps=2, prox="recompute")
    cfg = dataclasses.replace(
        cfg,
        system=dataclasses.replace(
            cfg.system, batch=BatchSection(packed_prompts=True, one_pass_old=True)
        ),
    )
    records = run(cfg)
    assert [r["version"] for r in records] == [1, 2]
    for r in records:
        assert np.isfinite(r["loss/total"]) and r["step/skipped"] == 0
        if mode == "periodic":
            assert r["staleness/max"] == 0


def test_a_second_fresh_run_into_a_used_run_dir_is_refused(tmp_path):
    cfg = dataclasses.replace(make_cfg(tmp_path, "again", mode="sync", steps=1), checkpoint_every=1)
    run(cfg)
    with pytest.raises(FileExistsError, match="pass --resume"):
        run(cfg)
    # --resume at the last step has nothing left to do and is fine.
    assert [r["version"] for r in run(cfg, resume=True)] == [1]


def test_eval_every_scores_the_steps_weights(tmp_path):
    """eval_every=2 over 3 steps: greedy pass@1 on the test split before training (step 0),
    after steps 2 and 3 (the last), on the weights of that step, through the run's own
    host: the last score equals a fresh evaluation of the trained params on a host of its
    own, and a bad eval_prompts is refused by name."""
    from a3po_jax.analysis.evaluation import evaluate, host_generate_fn
    from a3po_jax.inference.host import InferenceHost

    cfg = dataclasses.replace(
        make_cfg(tmp_path, "eval", steps=3, prox="a3po"), eval_every=2, eval_prompts=5
    )
    policy = load_policy(cfg.model)
    trainer = Trainer(cfg, policy, task=LetterTask(), console=False)
    trainer.run()
    records = read_metrics(cfg.run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[0]["eval/version"] == 0 and "reward/mean" not in records[0]
    assert "eval/accuracy" not in records[1]
    for r in records[2:]:
        assert 0.0 <= r["eval/accuracy"] <= 1.0
        assert r["eval/num_prompts"] == 5 and r["eval/version"] == r["version"]
        assert r["time/eval_s"] > 0

    rc = cfg.rollout
    eos = policy.tokenizer.eos_token_id
    with InferenceHost(
        policy.config,
        trainer.state.params,
        num_slots=rc.num_slots,
        prefill_buckets=tuple(rc.prompt_buckets),
        max_cache_len=max(rc.prompt_buckets) + rc.max_new_tokens,
    ) as host:
        fresh = evaluate(
            LetterTask(),
            "test",
            host_generate_fn(host, stop_tokens=() if eos is None else (int(eos),)),
            policy.tokenizer,
            num_prompts=5,
            max_new_tokens=rc.max_new_tokens,
            seed=3,
        )
    assert records[-1]["eval/accuracy"] == pytest.approx(fresh.accuracy, abs=1e-12)

    with pytest.raises(ValueError, match="eval_prompts"):
        dataclasses.replace(cfg, eval_prompts=0)


def test_sync_with_two_minibatches_counts_staleness_in_optimizer_versions(tmp_path):
    """Issue 16 item 2: with algo.num_minibatches = 2 the version advances by 2 per step.
    Admission used to assume one version per batch: sync over-generated and dropped groups
    as stale, and staleness/max (last minibatch) disagreed with the histogram (measured
    from the step's starting version)."""
    records = run(make_cfg(tmp_path, "k2", mode="sync", steps=3, prox="a3po", num_minibatches=2))
    assert [r["version"] for r in records] == [2, 4, 6]
    for r in records:
        counts = r["staleness/counts"]  # counts[d] = trained tokens at staleness d
        # 2 groups of 4 rows: group 0 is minibatch 0 (d = 0), group 1 is minibatch 1, trained
        # one version later (d = 1 = k - 1, sync's bound in versions); nothing staler.
        assert len(counts) == 2 and min(counts) > 0
        assert sum(counts) == r["staleness/tokens"]["count"]
        assert r["staleness/tokens"]["counts"] == counts
        # The step's own metrics (every minibatch) agree with the histogram.
        assert r["staleness/max"] == r["staleness/max_observed"] == 1
        assert r["staleness/mean"] == pytest.approx(counts[1] / sum(counts), rel=1e-6)
    last = records[-1]
    assert last["queue/dropped_total"] == 0
    assert last["queue/consumed_groups"] == 6
    # Produces what it trains: at most the batch admitted after the last step is extra.
    assert last["queue/produced_groups"] <= 6 + 2


def test_async_bound_below_the_minibatches_is_refused_before_anything_is_written(tmp_path):
    # η counts optimizer versions: the last of 2 minibatches trains 1 version after the
    # first, so async with max_staleness = 0 cannot hold for it and is refused when the
    # config is built, before a model loads or a Trainer exists.
    with pytest.raises(ConfigError, match=r"system.max_staleness=0 with algo.num_minibatches=2"):
        make_cfg(tmp_path, "refused", mode="async", eta=0, num_minibatches=2)
    assert not (tmp_path / "refused").exists()


def test_async_with_two_minibatches_keeps_every_token_within_eta_versions(tmp_path):
    # η = 3 versions with k = 2: up to one batch of overlap, and in-flight weight updates.
    records = run(make_cfg(tmp_path, "ak2", mode="async", eta=3, steps=4, num_minibatches=2))
    assert [r["version"] for r in records] == [2, 4, 6, 8]
    for r in records:
        counts = r["staleness/counts"]
        assert 1 <= len(counts) <= 4  # counts[d] for d = 0 .. max, max <= η = 3
        assert r["staleness/max"] == r["staleness/max_observed"] == len(counts) - 1
        # Minibatch 1 always trains at least 1 version after every token was drawn.
        assert sum(counts[1:]) > 0


def test_single_process_features_are_refused_by_name_in_a_multi_process_job():
    from a3po_jax.training.trainer import refuse_unsupported

    base = make_cfg(Path("/tmp"), "refuse", mode="sync")
    cases = {
        "system.mode='periodic'": dataclasses.replace(
            base, system=dataclasses.replace(base.system, mode="periodic")
        ),
        "eval_every": dataclasses.replace(base, eval_every=2),
        "algo.kl_in_reward=True": dataclasses.replace(
            base, algo=dataclasses.replace(base.algo, kl_coef=0.1, kl_in_reward=True)
        ),
        "system.placement.inference_devices": dataclasses.replace(
            base,
            system=dataclasses.replace(
                base.system, placement=PlacementSection(inference_devices=1)
            ),
        ),
    }
    for what, cfg in cases.items():
        refuse_unsupported(cfg, processes=1, host=None, replay_dir=None)  # one process: fine
        with pytest.raises(ValueError, match=rf"{re.escape(what)}.*one process so far.* 2 "):
            refuse_unsupported(cfg, processes=2, host=None, replay_dir=None)
    with pytest.raises(ValueError, match="a replay runs in one process without an inference"):
        refuse_unsupported(base, processes=1, host=object(), replay_dir=Path("/tmp/rec"))
    refuse_unsupported(base, processes=1, host=None, replay_dir=Path("/tmp/rec"))
