"""The results pipeline on run directories written here (config.json + metrics.jsonl)."""

import dataclasses
import json
import math

import numpy as np
import pytest

# The analysis extra: without it these tests skip with the reason.
pytest.importorskip("pandas", reason="needs the analysis extra: pip install 'a3po_jax[analysis]'")
pytest.importorskip(
    "matplotlib", reason="needs the analysis extra: pip install 'a3po_jax[analysis]'"
)

from a3po_jax.analysis import results  # noqa: E402
from a3po_jax.cli import results as results_cli  # noqa: E402
from a3po_jax.training.config import AlgoSection, SystemSection, TrainConfig  # noqa: E402
from a3po_jax.training.metrics import MetricsLogger  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(
    root,
    name,
    rewards,
    *,
    prox="a3po",
    eta=2,
    mode="async",
    seed=0,
    step_s=None,
    extra=None,
):
    """A run dir whose step i has reward rewards[i], wall time 100 + 10·i, and (optional)
    per-step extra fields from ``extra[key][i]``."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = TrainConfig(
        algo=AlgoSection(prox=prox),
        system=SystemSection(mode=mode, max_staleness=eta),
        seed=seed,
        run_dir=str(run_dir),
    )
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    lines = []
    for i, reward in enumerate(rewards):
        record = {"step": i + 1, "wall_time": 100.0 + 10.0 * i, "reward/mean": reward}
        if step_s is not None:
            record["time/step_s"] = step_s[i]
        for key, values in (extra or {}).items():
            record[key] = values[i]
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


# --- loading -------------------------------------------------------------------------------


def test_flatten_config_and_effective_staleness(tmp_path):
    write_run(tmp_path, "sync", [0.1], mode="sync", eta=2)
    write_run(tmp_path, "osf", [0.1], mode="one_step_off", eta=2)
    write_run(tmp_path, "async", [0.1], mode="async", eta=8)
    runs = {r.name: r for r in results.load_runs([tmp_path])}
    assert runs["sync"].config["algo.prox"] == "a3po"
    assert runs["sync"].config["rollout.prompt_buckets"] == (64, 128, 256)  # list -> tuple
    # η the producer was held to, whatever max_staleness says (sync ignores its 2).
    assert [runs[n].config["system.effective_staleness"] for n in ("sync", "osf", "async")] == [
        0,
        1,
        8,
    ]


def test_load_runs_finds_nested_runs_and_names_them_relative(tmp_path):
    write_run(tmp_path / "sweep", "a", [0.1, 0.2])
    write_run(tmp_path / "sweep" / "deeper", "b", [0.3])
    (tmp_path / "sweep" / "empty").mkdir()
    (tmp_path / "sweep" / "empty" / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    (tmp_path / "sweep" / "empty" / "metrics.jsonl").write_text("")
    runs = results.load_runs([tmp_path / "sweep"])
    # The run with no records yet is skipped; names are relative to the common parent.
    assert sorted(r.name for r in runs) == ["a", "deeper/b"]
    single = results.load_runs([tmp_path / "sweep" / "a"])
    assert [r.name for r in single] == ["a"] and single[0].num_steps == 2


def test_missing_files_are_named(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        results.load_run(tmp_path / "half")
    with pytest.raises(FileNotFoundError, match="neither a run directory"):
        results.find_run_dirs([tmp_path / "nope"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="no run directories"):
        results.load_runs([tmp_path / "empty_dir"])


def test_elapsed_counts_from_the_end_of_the_first_step(tmp_path):
    run = results.load_run(write_run(tmp_path, "r", [0.0, 0.1, 0.2]))
    np.testing.assert_allclose(run.elapsed_s(), [0.0, 10.0, 20.0])


# --- tables --------------------------------------------------------------------------------


def test_config_differences_ignore_run_dir_and_prefer_eta(tmp_path):
    write_run(tmp_path, "a", [0.1], prox="a3po", eta=2)
    write_run(tmp_path, "b", [0.1], prox="behav", eta=4)
    write_run(tmp_path, "c", [0.1], prox="behav", mode="sync", eta=2)
    runs = results.load_runs([tmp_path])
    # run_dir differs everywhere but names a place, not a setting; max_staleness is
    # replaced by the effective η (the sync run's max_staleness=2 is ignored by the mode).
    assert results.config_differences(runs) == [
        "algo.prox",
        "system.effective_staleness",
        "system.mode",
    ]
    assert results.run_label(runs[0], ["algo.prox", "system.effective_staleness"]) == (
        "prox=a3po eta=2"
    )


def test_last_k_mean_golden(tmp_path):
    run = results.load_run(write_run(tmp_path, "r", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]))
    assert results.last_k_mean(run, k=3) == pytest.approx(0.8)  # (0.6 + 0.8 + 1.0) / 3
    assert results.last_k_mean(run, k=100) == pytest.approx(0.5)  # all six
    assert math.isnan(results.last_k_mean(run, "no/such", k=3))
    with pytest.raises(ValueError, match="k must be >= 1"):
        results.last_k_mean(run, k=0)


def test_summary_table_golden(tmp_path):
    write_run(tmp_path, "a", [0.0, 0.5, 1.0], prox="a3po", step_s=[30.0, 1.0, 2.0])
    write_run(tmp_path, "b", [0.2, 0.2, 0.2], prox="behav", step_s=[40.0, 3.0, 3.0])
    table = results.summary_table(results.load_runs([tmp_path]), last_k=2)
    rows = {r["run"]: r for r in table.to_dict("records")}
    a = rows["a"]
    assert a["prox"] == "a3po" and a["steps"] == 3
    assert a["reward/mean final"] == 1.0
    assert a["reward/mean last-2"] == pytest.approx(0.75)
    assert a["reward/mean all-steps mean"] == pytest.approx(0.5)
    # The first (compiling) step is left out: (1 + 2) / 2, not (30 + 1 + 2) / 3 = 11.
    assert a["s/step"] == pytest.approx(1.5)
    assert math.isnan(a["clipfrac mean"])  # not logged: nan, not 0
    assert rows["b"]["s/step"] == pytest.approx(3.0)


def test_seed_table_golden(tmp_path):
    # time/train_s: the first (compiling) step is left out, then the median per run.
    write_run(
        tmp_path,
        "a0",
        [0.0, 0.8, 0.8],
        prox="a3po",
        seed=0,
        extra={"time/train_s": [50.0, 2.0, 4.0]},
    )
    write_run(
        tmp_path,
        "a1",
        [0.0, 0.6, 0.6],
        prox="a3po",
        seed=1,
        extra={"time/train_s": [50.0, 5.0, 5.0]},
    )
    write_run(tmp_path, "b0", [0.0, 0.1, 0.1], prox="behav", seed=0)
    rows = results.seed_table(results.load_runs([tmp_path]), last_k=1).to_dict("records")
    assert [(r["prox"], r["seeds"]) for r in rows] == [("a3po", 2), ("behav", 1)]
    # mean 0.7, sample std sqrt(((0.1)^2 + (0.1)^2) / 1) = 0.1414.
    assert rows[0]["reward/mean last-1"] == "0.700 ± 0.141"
    assert rows[0]["reward/mean all-steps mean"] == "0.467 ± 0.094"
    assert rows[1]["reward/mean last-1"] == "0.100"
    # medians 3.0 and 5.0: mean 4.0, sample std sqrt(2) = 1.414; nan where not logged.
    assert rows[0]["train s/step"] == "4.00 ± 1.41"
    assert rows[1]["train s/step"] == "nan"
    unique = results.load_runs([tmp_path / "a0", tmp_path / "b0"])
    assert results.seed_table(unique).empty  # nothing shares a configuration


def test_time_to_reward_and_speed_table_golden(tmp_path):
    # Wall time 100 + 10·i: elapsed 0, 10, 20, 30 s after step 1. The 2-step moving average
    # of [0, 0.2, 0.6, 0.6] is [0, 0.1, 0.4, 0.6]: it reaches 0.4 at step 3 (20 s); the raw
    # reward would have reached it at step 3 too, a level of 0.3 at step 3 (not step 2).
    push = {"time/weight_push_s": [9.0, 1.0, 1.0, 1.0], "time/wait_rollouts_s": [0, 2, 2, 2]}
    steps = [50.0, 10.0, 10.0, 10.0]
    fast = write_run(tmp_path, "f0", [0, 0.2, 0.6, 0.6], seed=0, step_s=steps, extra=push)
    write_run(tmp_path, "f1", [0, 0.6, 0.6, 0.6], seed=1, step_s=steps, extra=push)
    write_run(tmp_path, "s0", [0, 0.0, 0.1, 0.5], prox="behav", seed=0, step_s=steps, extra=push)
    write_run(tmp_path, "s1", [0, 0.0, 0.1, 0.5], prox="behav", seed=1, step_s=steps, extra=push)
    run = results.load_run(fast)
    assert results.time_to_reward(run, 0.4, smooth=2) == 20.0
    assert results.time_to_reward(run, 0.3, smooth=2) == 20.0
    assert math.isnan(results.time_to_reward(run, 0.9, smooth=2))
    rows, level = results.speed_table(results.load_runs([tmp_path]), last_k=1, smooth=1)
    # 0.8 x the lowest configuration's mean last-1 reward (behav: 0.5).
    assert level == pytest.approx(0.4)
    rows = rows.to_dict("records")
    assert [(r["prox"], r["seeds"]) for r in rows] == [("a3po", 2), ("behav", 2)]
    # 3 steps in 30 s after the first: 360 steps per hour.
    assert rows[0]["steps/hour"] == "360 ± 0"
    key = "s to reward/mean 0.4"
    assert rows[0][key] == "15 ± 7" and rows[1][key] == "30 ± 0"  # (20, 10) and (30, 30)
    # Steps 2..: 3 s of pushes and 6 s of waiting in 30 s.
    assert rows[0]["held by push"] == "10.0%" and rows[0]["waiting for rollouts"] == "20.0%"


def test_phase_time_ratio_golden(tmp_path):
    # Medians over steps 2..: a3po 3.0 / 6.0 (seeds 0 / 1), recompute 4.0 / 6.0.
    for name, prox, seed, times in (
        ("a0", "a3po", 0, [90.0, 2.0, 4.0]),
        ("a1", "a3po", 1, [90.0, 6.0, 6.0]),
        ("r0", "recompute", 0, [90.0, 4.0, 4.0]),
        ("r1", "recompute", 1, [90.0, 5.0, 7.0]),
        ("b0", "behav", 0, [90.0, 1.0, 1.0]),  # not part of the ratio
        ("a_eta4", "a3po", 0, [90.0, 1.0, 1.0]),  # no recompute twin at eta 4: no row
    ):
        eta = 4 if name == "a_eta4" else 2
        write_run(
            tmp_path, name, [0.0] * 3, prox=prox, eta=eta, seed=seed, extra={"time/train_s": times}
        )
    table = results.phase_time_ratio(results.load_runs([tmp_path]))
    rows = table.to_dict("records")
    assert len(rows) == 1
    row = rows[0]
    assert (row["eta"], row["seeds"]) == (2, 2)
    assert row["a3po s"] == pytest.approx(4.5) and row["recompute s"] == pytest.approx(5.0)
    # ratios 0.75 and 1.0: mean 0.875, sample std 0.177
    assert row["a3po / recompute"] == "0.875 ± 0.177"
    assert results.phase_time_ratio(results.load_runs([tmp_path / "b0"])).empty


def test_paired_step_difference_golden(tmp_path):
    # Seed 0: periodic and sync agree but for step 2 (reward 0.25 off) and a loss 1e-6 off;
    # seed 1 has no sync twin: no row.
    write_run(
        tmp_path,
        "p0",
        [0.5, 0.75, 1.0],
        mode="periodic",
        eta=0,
        prox="behav",
        seed=0,
        step_s=[50.0, 3.0, 5.0],
        extra={"loss/total": [0.1, 0.2, 0.3]},
    )
    write_run(
        tmp_path,
        "s0",
        [0.5, 0.5, 1.0],
        mode="sync",
        eta=0,
        prox="behav",
        seed=0,
        step_s=[50.0, 4.0, 6.0],
        extra={"loss/total": [0.1, 0.2, 0.300001]},
    )
    write_run(tmp_path, "p1", [0.5], mode="periodic", eta=0, prox="behav", seed=1)
    rows = results.paired_step_difference(results.load_runs([tmp_path])).to_dict("records")
    assert len(rows) == 1
    row = rows[0]
    assert (row["seed"], row["steps"]) == (0, 3)
    assert row["max |Δ reward/mean|"] == pytest.approx(0.25)
    assert row["max |Δ loss/total|"] == pytest.approx(1e-6, rel=1e-3)
    assert math.isnan(row["max |Δ optim/grad_norm|"])  # neither run logged it
    # medians of time/step_s over steps 2..: 4.0 and 5.0
    assert row["periodic s/step"] == pytest.approx(4.0)
    assert row["sync s/step"] == pytest.approx(5.0)
    # The summary gets the section when both modes are there.
    text = results.write_summary(results.load_runs([tmp_path]), tmp_path / "out").read_text()
    assert "## Periodic vs sync, step by step (same seed)" in text
    assert "| 0 | 3 | 0.25 | 1e-06 | nan | 4 | 5 |" in text


def test_markdown_table_format():
    import pandas as pd

    rows = [{"run": "a", "x": 0.12345, "n": 3}, {"run": "b", "x": float("nan"), "n": None}]
    assert results.markdown_table(rows) == (
        "| run | x | n |\n|---|---|---|\n| a | 0.123 | 3 |\n| b | nan | None |"
    )
    assert results.markdown_table([]) == ""
    # A DataFrame renders the same as its records.
    assert results.markdown_table(pd.DataFrame(rows[:1])) == (
        "| run | x | n |\n|---|---|---|\n| a | 0.123 | 3 |"
    )


def test_pivot_averages_repeats_and_leaves_gaps(tmp_path):
    write_run(tmp_path, "a2s0", [0.8], prox="a3po", eta=2, seed=0)
    write_run(tmp_path, "a2s1", [0.6], prox="a3po", eta=2, seed=1)
    write_run(tmp_path, "b2", [0.5], prox="behav", eta=2)
    write_run(tmp_path, "b8", [0.1], prox="behav", eta=8)
    grid = results.pivot(
        results.load_runs([tmp_path]), row_key="system.effective_staleness", col_key="algo.prox"
    )
    assert grid.rows == (2, 8) and grid.cols == ("a3po", "behav")
    assert grid.cell(2, "a3po") == pytest.approx(0.7)
    assert grid.counts.tolist() == [[2, 1], [0, 1]]
    assert math.isnan(grid.cell(8, "a3po"))  # never run: a gap, not a zero
    assert grid.stds[0, 0] == pytest.approx(0.1414, abs=1e-4)
    table = grid.to_markdown()
    assert "| eta \\ prox | a3po | behav |" in table
    assert "| 2 | 0.700 ± 0.141 (2) | 0.500 |" in table
    assert "| 8 | nan | 0.100 |" in table
    with pytest.raises(ValueError, match="reduce='median'"):
        results.pivot(
            results.load_runs([tmp_path]), row_key="seed", col_key="algo.prox", reduce="median"
        )


# --- staleness -----------------------------------------------------------------------------


def test_staleness_from_the_exact_per_step_counts(tmp_path):
    # `staleness/counts` (the trainer's exact histogram: counts[d] = the step's trained
    # tokens at staleness d) is summed as is. The step means logged beside it (0.8 and
    # 0.2, tokens 6 and 5) would give the approximate [5, 6]; an older summary in the same
    # records must not be read either.
    run = results.load_run(
        write_run(
            tmp_path,
            "r",
            [0.1, 0.2],
            extra={
                "staleness/counts": [[1, 2, 3], [4, 1]],
                "staleness/mean": [0.8, 0.2],
                "loss/num_tokens": [6.0, 5.0],
                "staleness/tokens": [{"values": [7], "counts": [9]}] * 2,
            },
        )
    )
    d, counts, exact = results.staleness_distribution(run)
    assert exact and d.tolist() == [0, 1, 2] and counts.tolist() == [5, 3, 3]


def test_merge_seeds_sums_the_staleness_counts(tmp_path):
    write_run(tmp_path, "s0", [0.0], seed=0, extra={"staleness/counts": [[1, 1]]})
    write_run(tmp_path, "s1", [0.2], seed=1, extra={"staleness/counts": [[0, 2, 1]]})
    (merged,) = results.merge_seeds(results.load_runs([tmp_path]))
    assert merged.records[0]["staleness/counts"] == [1, 3, 1]
    d, counts, exact = results.staleness_distribution(merged)
    assert exact and counts.tolist() == [1, 3, 1]


def test_staleness_from_per_token_summaries_is_exact(tmp_path):
    run_dir = write_run(tmp_path, "r", [0.1, 0.2])
    (run_dir / "metrics.jsonl").unlink()
    # Written by the real logger: an integer array is summarised with one bin per value.
    with MetricsLogger(run_dir, tensorboard=False, console=False) as logger:
        logger.log(1, {"reward/mean": 0.1, "staleness/tokens": np.array([0, 0, 1, 2, 2, 2])})
        logger.log(2, {"reward/mean": 0.2, "staleness/tokens": np.array([1, 1, 3])})
    d, counts, exact = results.staleness_distribution(results.load_run(run_dir))
    assert exact and d.tolist() == [0, 1, 2, 3] and counts.tolist() == [2, 3, 3, 1]


def test_staleness_from_a_plain_count_list_is_exact(tmp_path):
    run = results.load_run(
        write_run(tmp_path, "r", [0.1, 0.2], extra={"staleness/hist": [[5, 1], [0, 2, 3]]})
    )
    d, counts, exact = results.staleness_distribution(run)
    assert exact and counts.tolist() == [5, 3, 3]


def test_staleness_falls_back_to_token_weighted_step_means(tmp_path):
    # The trainer's bincount array logged through the logger becomes a summary *of the
    # counts*, which no longer says which d each count belongs to: it must not be read
    # as a per-d histogram. The fallback bins each step's mean staleness, weighted by the
    # step's token count.
    run_dir = write_run(tmp_path, "r", [0.1])
    (run_dir / "metrics.jsonl").unlink()
    with MetricsLogger(run_dir, tensorboard=False, console=False) as logger:
        for step, (mean, tokens) in enumerate([(0.0, 100), (1.4, 50), (2.6, 30)], start=1):
            logger.log(
                step,
                {
                    "staleness/hist": np.bincount([int(mean)] * 3, minlength=16),
                    "staleness/mean": mean,
                    "loss/num_tokens": float(tokens),
                },
            )
    d, counts, exact = results.staleness_distribution(results.load_run(run_dir))
    assert not exact
    assert d.tolist() == [0, 1, 2, 3] and counts.tolist() == [100, 50, 0, 30]


# --- merging seeds -------------------------------------------------------------------------


def test_merge_seeds_averages_stepwise(tmp_path):
    write_run(tmp_path, "s0", [0.0, 0.4, 0.8], seed=0, extra={"staleness/mean": [0, 1, 2]})
    write_run(tmp_path, "s1", [0.2, 0.6], seed=1, extra={"staleness/mean": [0, 3]})
    write_run(tmp_path, "other", [1.0], prox="behav", seed=0)
    merged = {r.config["algo.prox"]: r for r in results.merge_seeds(results.load_runs([tmp_path]))}
    both = merged["a3po"]
    assert both.config["seed"] == "0+1"
    # Step 3 exists only in one seed: dropped, so the curve is never a one-seed average.
    assert [r["step"] for r in both.records] == [1, 2]
    np.testing.assert_allclose(both.scalar("reward/mean")[1], [0.1, 0.5])
    np.testing.assert_allclose(both.scalar("staleness/mean")[1], [0.0, 2.0])
    assert merged["behav"].name == "other"  # no twin: unchanged


# --- plots and the report ------------------------------------------------------------------


def sweep_dir(tmp_path):
    root = tmp_path / "sweep"
    for eta, rewards in ((0, {"behav": 0.9, "a3po": 0.9}), (8, {"behav": 0.2, "a3po": 0.8})):
        for prox, final in rewards.items():
            for seed in (0, 1):
                curve = list(np.linspace(0.0, final + 0.02 * seed, 6))
                write_run(
                    root,
                    f"{prox}_{eta}_{seed}",
                    curve,
                    prox=prox,
                    eta=eta,
                    seed=seed,
                    step_s=[20.0] + [0.5] * 5,
                    extra={
                        "time/wait_rollouts_s": [0.0] + [0.1] * 5,
                        "time/train_s": [19.0] + [0.35] * 5,
                        "time/weight_push_s": [1.0] + [0.05] * 5,
                        "loss/clipfrac": [0.1 * (prox == "behav") * eta / 8] * 6,
                        "is/weight_max": [1.0 + eta * (prox == "a3po")] * 6,
                        "is/weight_mean": [1.0] * 6,
                        "staleness/mean": [eta * 0.75] * 6,
                        "loss/num_tokens": [100.0] * 6,
                    },
                )
    return root


def test_plots_draw_one_line_per_run(tmp_path):
    runs = results.load_runs([sweep_dir(tmp_path)])
    fig = results.plot_curves(runs, "reward/mean")
    assert len(fig.axes[0].lines) == len(runs) == 8
    fig = results.plot_reward(results.merge_seeds(runs))
    assert [len(ax.lines) for ax in fig.axes] == [4, 4]
    fig = results.plot_sweep(runs, last_k=1)
    # One line per prox on each of the three metric panels, one point per η; the reward
    # point is the final reward averaged over the seeds (finals f and f + 0.02).
    assert [len(ax.lines) for ax in fig.axes] == [2, 2, 2]
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [0.91, 0.81])  # a3po
    with pytest.raises(ValueError, match="x must be 'step' or 'wall'"):
        results.plot_curves(runs, "reward/mean", x="time")


def test_phase_bars_exclude_the_first_step(tmp_path):
    runs = results.load_runs([sweep_dir(tmp_path)])[:2]
    fig = results.plot_phase_times(runs)
    heights = sorted({round(p.get_height(), 6) for p in fig.axes[0].patches})
    assert heights == [0.05, 0.1, 0.35]  # not the 19 s compile step


def test_write_summary_and_cli(tmp_path):
    root = sweep_dir(tmp_path)
    out = tmp_path / "out"
    assert results_cli.main([str(root), "--out", str(out), "--last-k", "2"]) == 0
    text = (out / "summary.md").read_text()
    for png in ("reward", "phase_times", "staleness", "diagnostics", "sweep"):
        data = (out / f"{png}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000
        assert f"]({png}.png)" in text
    assert "## Mean ± std over seeds" in text
    assert "## reward/mean last-2 by eta × prox" in text
    assert "Periodic vs sync" not in text  # no periodic runs

    # η = 8: each cell is the mean ± std over seeds 0 and 1 of the last two steps of the
    # curves 0..final and 0..final+0.02.
    def cell(final):
        last2 = [np.mean(np.linspace(0.0, f, 6)[-2:]) for f in (final, final + 0.02)]
        return f"{np.mean(last2):.3f} ± {np.std(last2, ddof=1):.3f} (2)"

    assert f"| 8 | {cell(0.8)} | {cell(0.2)} |" in text
    assert "`algo.loss=ppo`" in text  # shared settings listed
    assert "run_dir" not in text.split("## Settings shared by all runs")[1]
    assert results_cli.main([str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_plots_work_inline_without_pyplot(tmp_path):
    # The functions build Figures directly: no global pyplot state is created, so a
    # notebook's inline backend and a script's file output see the same objects.
    import sys

    runs = results.load_runs([sweep_dir(tmp_path)])
    fig = results.plot_staleness(results.merge_seeds(runs))
    assert fig.__class__.__name__ == "Figure"
    assert dataclasses.is_dataclass(runs[0])
    if "matplotlib.pyplot" in sys.modules:
        import matplotlib.pyplot as plt

        assert fig not in [plt.figure(n) for n in plt.get_fignums()]


def test_the_summary_has_the_speed_table_with_one_seed_per_configuration(tmp_path):
    steps = [50.0, 10.0, 10.0, 10.0]
    write_run(tmp_path, "a", [0, 0.2, 0.6, 0.6], seed=0, step_s=steps)
    write_run(tmp_path, "b", [0, 0.0, 0.1, 0.5], prox="behav", seed=0, step_s=steps)
    runs = results.load_runs([tmp_path])
    text = results.write_summary(runs, tmp_path / "out", level=0.4).read_text()
    assert "## Mean ± std over seeds" not in text  # no configuration has two seeds
    assert "## Speed: steps per hour and time to a reward level" in text
    assert "to `reward/mean` 0.4" in text
    # One seed: the mean alone; a 3-step average reaches 0.4 only in the first run (step 4).
    assert "| 360 | 30 |" in text and "| not reached |" in text
