"""The held-out evaluation of a run (step 0, the end, resumes), its 95 % interval, and the
end-of-run report: rows, report.md and its PNGs, from the trainer's CLI and the results CLI."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from a3po_jax.analysis.evaluation import Z_95, accuracy_interval, accuracy_with_stderr
from a3po_jax.analysis.run_report import FIGURES, REPORT_FILE, report_rows, write_run_report
from a3po_jax.inference.host_metrics import LOOP_PARTS
from a3po_jax.training.config import ConfigError, RolloutSection, TaskSection, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke_tiny.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- the 95 % interval -----------------------------------------------------------------------


def test_wilson_interval_of_none_correct_is_not_a_point():
    # 0 of 4 correct: Wilson's interval is [0, z²/(n + z²)] = [0, 3.8415/7.8415] = [0, 0.4899].
    # The normal interval p ± z·sqrt(p(1-p)/n) would be [0, 0]: "certainly never right"
    # after 4 tries, which is what separates the two.
    low, high = accuracy_interval(np.zeros((4, 1)))
    assert low == 0.0
    assert high == pytest.approx(Z_95**2 / (4 + Z_95**2), abs=1e-12)
    assert high == pytest.approx(0.48990, abs=1e-5)


def test_wilson_interval_of_half_correct_by_hand():
    # 32 of 64: centre (0.5 + z²/128) / (1 + z²/64) = 0.5 by symmetry; half-width
    # z·sqrt(0.25/64 + z²/16384) / (1 + z²/64) = 1.95996·0.064348 / 1.060023 = 0.118979
    # (the normal interval's 1.95996·0.0625 = 0.122498 is wider here).
    scores = np.array([[1.0]] * 32 + [[0.0]] * 32)
    low, high = accuracy_interval(scores)
    assert (low, high) == pytest.approx((0.5 - 0.118979, 0.5 + 0.118979), abs=1e-6)
    # jit-free numpy either way: the same numbers from the closed form.
    z2, n = Z_95**2, 64
    half = Z_95 * math.sqrt(0.25 / n + z2 / (4 * n * n)) / (1 + z2 / n)
    assert high - 0.5 == pytest.approx(half, abs=1e-12)


def test_partial_scores_and_mean_at_k_use_the_normal_interval_over_prompts_clipped():
    # mean@2 over 4 prompts: per-prompt means 1, 0.5, 0.5, 0 -> accuracy 0.5, stderr
    # sqrt(mean((0.5, 0, 0, 0.5)²) / 4) = sqrt(0.125 / 4) = 0.176777; ± 1.95996 · that.
    scores = np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    accuracy, stderr = accuracy_with_stderr(scores)
    assert (accuracy, stderr) == pytest.approx((0.5, 0.176777), abs=1e-6)
    assert accuracy_interval(scores) == pytest.approx(
        (0.5 - Z_95 * 0.176777, 0.5 + Z_95 * 0.176777), abs=1e-5
    )
    # Partial credit near 1 is clipped to [0, 1].
    assert accuracy_interval(np.array([[1.0], [0.5]]))[1] == 1.0


# --- config -----------------------------------------------------------------------------------


def test_evaluation_is_on_with_evaluate_or_eval_every_and_never_on_the_training_split():
    assert not TrainConfig().evaluates
    assert TrainConfig(evaluate=True).evaluates and TrainConfig(eval_every=5).evaluates
    with pytest.raises(ConfigError, match="task.split='test' trains on the held-out split"):
        TrainConfig(evaluate=True, task=TaskSection(split="test"))
    with pytest.raises(ConfigError, match="eval_samples must be > 0"):
        TrainConfig(eval_samples=0)


def test_the_evaluation_budget_defaults_to_the_rollouts_and_sizes_the_hosts_cache():
    rollout = RolloutSection(max_new_tokens=40, prompt_buckets=(64, 128))
    cfg = TrainConfig(rollout=rollout, evaluate=True)
    assert cfg.eval_budget == 40 and cfg.host_cache_len == 128 + 40
    longer = TrainConfig(rollout=rollout, evaluate=True, eval_max_new_tokens=96)
    assert longer.eval_budget == 96 and longer.host_cache_len == 128 + 96
    # A shorter evaluation budget, or none evaluated, leaves the rollouts' cache as it is.
    assert TrainConfig(rollout=rollout, evaluate=True, eval_max_new_tokens=8).host_cache_len == 168
    assert TrainConfig(rollout=rollout, eval_max_new_tokens=96).host_cache_len == 168
    with pytest.raises(ConfigError, match="eval_max_new_tokens must be >= 0"):
        TrainConfig(eval_max_new_tokens=-1)


# --- the report's rows from records ----------------------------------------------------------


def records_of_a_run():
    """Step 0: evaluation only; steps 1-6 with rewards 0.1 .. 0.6; the end evaluation."""
    records = [
        {"step": 0, "wall_time": 1000.0, "eval/accuracy": 0.25, "eval/ci95_low": 0.1,
         "eval/ci95_high": 0.5, "eval/num_prompts": 8.0, "time/eval_s": 4.0},
    ]  # fmt: skip
    for step in range(1, 7):
        records.append(
            {
                "step": step,
                "wall_time": 1000.0 + 10 * step,
                "time/step_s": 10.0,
                "reward/mean": step / 10,
                "policy/entropy": 2.0 - step / 10,
                "staleness/counts": [30, 10],
                "staleness/mean": 0.25,
                "staleness/max": 1.0,
                "mem/peak_rss_gb": 1.0 + step / 10,
                "queue/dropped_total": 2,
                "queue/dropped_groups/stale": 2,
            }
        )
    records[-1].update({"eval/accuracy": 0.75, "eval/ci95_low": 0.4, "eval/ci95_high": 0.9,
                        "eval/num_prompts": 8.0, "time/eval_s": 6.0})  # fmt: skip
    records[0].update({"eval/finished_frac": 0.5, "eval/finished_accuracy": 0.5})
    records[-1].update({"eval/finished_frac": 1.0, "eval/finished_accuracy": 0.75})
    return records


CONFIG = {
    "steps": 6,
    "model": {"name": "tiny"},
    "task": {"name": "letters"},
    "system": {"mode": "async", "max_staleness": 1},
    "algo": {"loss": "ppo", "prox": "a3po", "num_minibatches": 1},
}


def test_report_rows_by_hand():
    rows = dict(report_rows(records_of_a_run(), CONFIG, ledger={"ok": True, "reissued": 1}))
    assert rows["held-out pass@1 [95% CI]"] == (
        "0.250 [0.100, 0.500] at step 0 -> 0.750 [0.400, 0.900] at step 6 (+0.500, 8 test prompts)"
    )
    # 6 steps: the first and last 2 (a third of the run): (0.1 + 0.2) / 2 and (0.5 + 0.6) / 2.
    # What the rise is made of: half the answers finished at step 0, half of them right.
    assert rows["held-out answers finished"] == (
        "50% (0.500 of them right) -> 100% (0.750 of them right)"
    )
    assert rows["training reward/mean"] == "0.150 (steps 1-2) -> 0.550 (steps 5-6)"
    assert rows["steps"] == "6 of 6"
    # From the start of the step-0 evaluation (1000 - 4) to the last record (1060): 64 s.
    assert rows["wall time"] == "1:04 (held-out evaluation 0:10)"
    assert rows["peak memory"] == "1.60 GiB resident (process)"
    # A run that recorded its compiling: every step's time/compile_s, added (20 + 5 x 2 s).
    compiled = [
        {**r, "time/compile_s": 20.0 if r["step"] == 1 else 2.0} if "time/step_s" in r else r
        for r in records_of_a_run()
    ]
    wall = dict(report_rows(compiled, CONFIG, ledger=None))["wall time"]
    assert wall == "1:04 (held-out evaluation 0:10, compiling 0:30)"
    # Six steps of [30, 10] tokens at d = 0, 1: mean 10/40.
    assert rows["staleness of trained tokens"] == (
        "max 1 (bound η = 1), mean 0.25; at d = 0..1: 75% 25%"
    )
    assert rows["groups dropped / re-issued"] == (
        "2 dropped (stale 2); 1 re-issued after a resume; exactly-once ledger audit OK"
    )
    # Remote hosts: requests re-issued after a failure, and handed back by a host that left.
    records = records_of_a_run()
    records[-1].update({"hosts/reissued_requests": 0, "hosts/reissued_on_leave": 3})
    rows = dict(report_rows(records, CONFIG, ledger={"ok": True, "reissued": 0}))
    assert rows["groups dropped / re-issued"] == (
        "2 dropped (stale 2); 0 re-issued after a resume, 0 after a host failure, 3 handed "
        "back by a host that left; exactly-once ledger audit OK"
    )


@pytest.mark.parametrize(
    "mode,wait,busy,reading",
    [
        (
            "async",
            0.5,
            0.95,
            "trainer waited 50 % of its steps, host served 95 %: generation-bound",
        ),
        ("async", 0.05, 0.4, "trainer waited 5 % of its steps, host served 40 %: training-bound"),
        ("async", 0.05, 0.9, "trainer waited 5 % of its steps, host served 90 %: both busy"),
        ("sync", 0.5, 0.5, "trainer waited 50 % of its steps, host served 50 % (sync: each side"),
    ],
)
def test_which_side_waited_is_read_from_the_medians_after_step_1(mode, wait, busy, reading):
    records = records_of_a_run()
    for r in records[1:]:
        r.update({"time/wait_frac": wait, "host/busy_frac": busy})
    # Step 1 compiles: its figures do not count.
    records[1].update({"time/wait_frac": 0.99, "host/busy_frac": 0.01})
    config = {**CONFIG, "system": {**CONFIG["system"], "mode": mode}}
    assert dict(report_rows(records, config))["which side waited"].startswith(reading)
    # Without the figures (a replay, older runs): no row.
    assert "which side waited" not in dict(report_rows(records_of_a_run(), CONFIG))


def test_the_hosts_time_is_the_mean_by_part_after_step_1_largest_first():
    records = records_of_a_run()
    for r in records[1:]:
        r.update({"host/decode_wait_s": 3.0, "host/admit_s": 0.5, "host/idle_s": 0.5})
    # Step 1 compiles: its figures do not count.
    records[1].update({"host/decode_wait_s": 100.0, "host/admit_s": 0.0})
    row = dict(report_rows(records, CONFIG))["host's time per step"]
    assert row.startswith("decode_wait 3 s (75 %), ")
    assert "admit 0.5 s (12 %)" in row and "idle 0.5 s (12 %)" in row
    assert "decode steps" not in row  # a host that does not count them
    # The decode steps say what one step's wait was, whatever the answers' lengths.
    for r in records[2:]:
        r["host/decode_steps"] = 60
    records[1]["host/decode_steps"] = 1
    row = dict(report_rows(records, CONFIG))["host's time per step"]
    assert row.endswith("; 60 decode steps, decode_wait 50 ms each")
    # Without the figures (a replay, older runs): no row.
    assert "host's time per step" not in dict(report_rows(records_of_a_run(), CONFIG))


def test_a_run_without_evaluation_says_how_to_turn_it_on():
    records = [r for r in records_of_a_run() if r["step"] > 0]
    for r in records:
        r.pop("eval/accuracy", None)
    rows = dict(report_rows(records, CONFIG))
    assert rows["held-out accuracy"].startswith("not evaluated (evaluate=true")


def test_report_md_and_pngs_from_the_results_cli_on_a_run_dir(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the report's plots need matplotlib")
    from a3po_jax.cli import results as results_cli

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(CONFIG))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records_of_a_run())
    )
    assert results_cli.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "held-out pass@1 [95% CI]" in out and f"tensorboard --logdir {run_dir}" in out
    text = (run_dir / REPORT_FILE).read_text()
    assert "| held-out pass@1 [95% CI] | 0.250 [0.100, 0.500] at step 0 -> 0.750" in text
    for file in FIGURES:
        assert f"]({file})" in text
        assert (run_dir / file).read_bytes()[:8] == PNG_MAGIC
    # Without matplotlib's plots: the same table, and one line saying why there are none.
    report = write_run_report(run_dir, plots=False)
    assert report.figures == () and "no plots" in report.terminal()
    # Several runs (or a folder of runs) still need --out.
    with pytest.raises(SystemExit):
        results_cli.main([str(tmp_path)])


# --- a tiny run end to end ---------------------------------------------------------------------


def eval_lines(run_dir: Path) -> list[dict]:
    """Every record of metrics.jsonl with eval/* as written (resumes not resolved)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if "eval/accuracy" in r]


@pytest.mark.e2e
def test_a_tiny_run_evaluates_at_step_0_and_the_end_once_and_prints_its_report(
    tmp_path, capsys, monkeypatch
):
    """The CLI on the tiny model with evaluate=true: eval/* at step 0 (before training) and
    after the last step in metrics.jsonl, the report on stdout and report.md with its PNGs;
    --resume to more steps does not redo step 0 and evaluates the new end once; resuming a
    finished run evaluates nothing again; the results CLI makes the same report; with
    A3PO_REPORT_PLOTS=0 the report is written without its plots."""
    from a3po_jax.cli import results as results_cli
    from a3po_jax.cli.train import main

    monkeypatch.setenv("A3PO_REPORT_PLOTS", "1")  # the suite's runs skip them (conftest.py)

    run_dir = tmp_path / "run"
    # The evaluation's own budget, twice the rollouts' 12 tokens (the host's cache holds it).
    common = [SMOKE, f"run_dir={run_dir}", "checkpoint_every=1", "system.mode=sync",
              "evaluate=true", "eval_prompts=4", "eval_max_new_tokens=24"]  # fmt: skip
    assert main([*common, "steps=2"]) == 0
    out = capsys.readouterr().out
    assert [r["step"] for r in eval_lines(run_dir)] == [0, 2]
    start, end = eval_lines(run_dir)
    # The random model seldom ends an answer: its answers run past the rollouts' budget.
    assert all(12 < r["eval/completion_tokens"] <= 24 for r in eval_lines(run_dir))
    assert start["eval/version"] == 0 and end["eval/version"] == 2
    assert start["eval/num_prompts"] == 4 and start["time/eval_s"] > 0
    assert 0 <= start["eval/ci95_low"] <= start["eval/accuracy"] <= start["eval/ci95_high"] <= 1
    assert "held-out pass@1 [95% CI]" in out and "at step 0 ->" in out and "2 of 2" in out
    # Which side waited: every step's share of waiting; the host's from the second record.
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r.get("step", 0) >= 1]
    assert all(0 <= r["time/wait_frac"] <= 1 for r in steps)
    assert "host/busy_frac" not in steps[0] and steps[1]["host/busy_frac"] >= 0
    # Where the host's time went: from the second record on, parts that split the seconds
    # between the two records (the step's wall time and what the trainer did after it).
    parts = [f"host/{p}_s" for p in (*LOOP_PARTS, "idle")]
    assert not any(k in steps[0] for k in parts)
    assert all(steps[1][k] >= 0 for k in parts) and steps[1]["host/decode_wait_s"] > 0
    assert sum(steps[1][k] for k in parts) >= steps[1]["time/step_s"]
    # Each step's answers take at least their longest one's decode steps, less the token
    # the prefill makes.
    for r in steps[1:]:
        assert r["host/decode_steps"] >= r["response/length_max"] - 1
    assert "host's time per step" in out and " decode steps, decode_wait " in out
    assert "(sync: each side waits for the other by design)" in out
    assert '"final"' not in out  # the report replaced the raw JSON line
    for file in (REPORT_FILE, *FIGURES):
        assert (run_dir / file).is_file(), file

    monkeypatch.setenv("A3PO_REPORT_PLOTS", "0")
    for file in FIGURES:
        (run_dir / file).unlink()
    assert main([*common, "steps=2", "--resume"]) == 0  # nothing left to train
    assert "(no plots: not asked for)" in capsys.readouterr().out
    assert not any((run_dir / file).exists() for file in FIGURES)
    monkeypatch.setenv("A3PO_REPORT_PLOTS", "1")
    assert [r["step"] for r in eval_lines(run_dir)] == [0, 2]
    assert main([*common, "steps=3", "--resume"]) == 0
    assert [r["step"] for r in eval_lines(run_dir)] == [0, 2, 3]
    capsys.readouterr()

    report = (run_dir / REPORT_FILE).read_text()
    assert results_cli.main([str(run_dir)]) == 0
    assert "3 of 3" in capsys.readouterr().out
    assert (run_dir / REPORT_FILE).read_text() == report
