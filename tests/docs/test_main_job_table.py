"""The README's table of the main job is its committed runs' figures (results/quickstart_a3po).

Each row is recomputed from the run's `metrics.jsonl` and `config.json` with the run
report's own functions (`a3po_jax.analysis.run_report`), so a figure in the README that no
committed run backs fails here, and so does a committed seed the README leaves out.
"""

import json
import re
from pathlib import Path

from helpers.run_cells import evaluations, held_out_cell, reward_cell

from a3po_jax.analysis.run_report import load_run_files, report_rows, staleness_counts

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "results" / "quickstart_a3po"
HEADER = "| seed | held-out pass@1, step 0 → 24 [95 % interval] |"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f} %"


def main_job_row(run_dir: Path) -> str:
    """The README's row for one committed seed of the main job."""
    config, records = load_run_files(run_dir)
    first, last = evaluations(records)
    counts = staleness_counts([r for r in records if r["step"] >= 1])
    report = dict(report_rows(records, config))

    def finished(record):
        return f"{_percent(record['eval/finished_frac'])} ({record['eval/finished_accuracy']:.3f})"

    cells = [
        str(config["seed"]),
        held_out_cell(records),
        f"{last['eval/accuracy'] - first['eval/accuracy']:+.3f}",
        f"{finished(first)} → {finished(last)}",
        reward_cell(records),
        _percent(counts[2] / counts.sum()) if len(counts) > 2 else "0 %",
        report["wall time"].split()[0],
        report["peak memory"].split(" resident")[0],
    ]
    return "| " + " | ".join(cells) + " |"


def readme_rows() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_readmes_main_job_table_is_its_committed_runs():
    seeds = sorted(RUNS.glob("seed-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(seeds) >= 3, "the main job's seeds are committed"
    assert readme_rows() == [main_job_row(run) for run in seeds]


def test_every_committed_seed_ran_the_main_jobs_config_and_rose_clear_of_its_interval(
    flat_system_names,  # the committed runs saved their configs before the system sections
):
    from a3po_jax.training.config import config_from_dict, load_experiment

    main_job = load_experiment(ROOT / "experiments" / "quickstart_a3po.py").to_dict()
    for run in sorted(RUNS.glob("seed-*")):
        ran = config_from_dict(json.loads((run / "config.json").read_text())).to_dict()
        assert {**ran, "seed": 0, "run_dir": ""} == {**main_job, "seed": 0, "run_dir": ""}, run
        assert int(re.sub(r"\D", "", run.name)) == ran["seed"]
        _, records = load_run_files(run)
        evals = [r for r in records if "eval/accuracy" in r]
        # The README says the end's interval lies above the start's on every seed.
        assert evals[-1]["eval/ci95_low"] > evals[0]["eval/ci95_high"], run
        assert evals[0]["eval/finished_frac"] >= 0.9, "the untrained model finishes its answers"
