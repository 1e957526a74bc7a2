"""Every table of docs/results.md recomputed from the committed runs in results/, and the
page's separation claims checked against the seeds.

Each table is found on the page by the heading it sits under and read cell by cell; the
same figures are computed from the runs (``results/<experiment>/<run>/metrics.jsonl`` and
``config.json``) with the analysis code that wrote the summaries
(:mod:`a3po_jax.analysis.runs`, ``tables``, ``offpolicy``), and every figure of a cell must
equal the recomputed one at the precision the page prints it with. A failure names the
section, the row, the column, the page's figure and the runs'.

Not checked (`SKIPPED`): the verdicts table, prose that quotes the tables below it (the main
job's table is the README's, recomputed by `test_main_job_table.py`); nor the
tables whose runs are not committed (`UNSOURCED`), each of which says so on the page.
`test_every_table_on_the_page_is_accounted_for` fails on a table that is none of these,
so a new table needs a check here.

The page's rule for verdict words (top of docs/results.md): two methods are said to
separate, or one to be better, best, or to beat or outperform the other, only when every
seed of one lies beyond every seed of the other. `CLAIMS` lists each such statement with
the seeds that back it, and `test_every_verdict_word_on_the_page_is_a_listed_claim` fails on
a new, unlisted one.

Reads files only: no subprocess, no JAX program compiled; a few seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.paths import REPO

pd = pytest.importorskip("pandas")

from a3po_jax.analysis import offpolicy, tables  # noqa: E402
from a3po_jax.analysis.runs import (  # noqa: E402
    EFFECTIVE_STALENESS,
    PHASES,
    REWARD,
    Run,
    final_value,
    last_k_mean,
    last_k_median,
    load_runs,
    mean_over_steps,
    median_over_steps,
)
from a3po_jax.training.config import import_experiment  # noqa: E402

PAGE = REPO / "docs" / "results.md"
RESULTS = REPO / "results"

# Tables not recomputed here, by the heading they sit under.
SKIPPED = {
    "## Verdicts at a glance": "prose: quotes the tables below",
}
# Tables whose runs are not in results/: the page says where they come from, in this phrase.
UNSOURCED = {
    "### Length bias on the SmolLM2 workload": "not committed",
}

# ------------------------------------------------------------------------------------------
# The page: sections, tables, figures.
# ------------------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])[-−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")


@functools.cache
def page_lines() -> tuple[str, ...]:
    return tuple(PAGE.read_text(encoding="utf-8").splitlines())


def headings() -> list[tuple[int, str]]:
    """(line index, heading line) of every markdown heading outside code fences."""
    found, fenced = [], False
    for i, line in enumerate(page_lines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append((i, line.strip()))
    return found


def section(heading: str) -> list[str]:
    """The lines from ``heading`` to the next heading of any level."""
    marks = headings()
    starts = [i for i, (_, line) in enumerate(marks) if line == heading]
    assert len(starts) == 1, f"docs/results.md: {len(starts)} headings {heading!r}"
    k = starts[0]
    end = marks[k + 1][0] if k + 1 < len(marks) else len(page_lines())
    return list(page_lines()[marks[k][0] + 1 : end])


def split_row(line: str) -> list[str]:
    """A table line's cells: split on the pipes that are not escaped (``\\|``)."""
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in cells]


def tables_in(lines: Sequence[str]) -> list[list[dict[str, str]]]:
    """The markdown tables among ``lines``, each a list of rows {header: cell}."""
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = split_row(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = split_row(lines[i])
                assert len(cells) == len(header), f"ragged table row: {lines[i]!r}"
                rows.append(dict(zip(header, cells, strict=True)))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def table(heading: str, index: int = 0) -> list[dict[str, str]]:
    found = tables_in(section(heading))
    assert len(found) > index, f"docs/results.md: no table {index + 1} under {heading!r}"
    return found[index]


def figures(text: str) -> list[str]:
    """The numbers a cell or a sentence prints, as written."""
    return [t.replace("−", "-") for t in NUMBER.findall(text.replace("**", ""))]


def printed_as(token: str, value: float) -> bool:
    """Whether ``value`` prints as ``token`` at the token's precision (decimals, or the
    mantissa's decimals in scientific notation)."""
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    spec = f".{decimals}{'e' if exponent else 'f'}"
    return float(format(value, spec)) == float(token)


# ------------------------------------------------------------------------------------------
# Comparing a page table with recomputed figures.
# ------------------------------------------------------------------------------------------

Values = Sequence[float] | None  # None: the page must print no figure there (n/a)


@dataclasses.dataclass
class Mismatches:
    """The disagreements of one section, reported together."""

    section: str
    found: list[str] = dataclasses.field(default_factory=list)

    def cell(self, row: str, column: str, cell: str, values: Values) -> None:
        tokens = figures(cell)
        where = f"{self.section}: row {row!r}, column {column!r}"
        if values is None:
            if tokens:
                self.found.append(f"{where}: page {cell!r}, the runs have no such figure")
            return
        shown = ", ".join(f"{v:.6g}" for v in values)
        if len(tokens) != len(values):
            self.found.append(f"{where}: page {cell!r}, runs {shown}")
            return
        for token, value in zip(tokens, values, strict=True):
            if not printed_as(token, value):
                self.found.append(f"{where}: page {token} (cell {cell!r}), runs {value:.6g}")

    def check(self) -> None:
        assert not self.found, "docs/results.md disagrees with results/:\n" + "\n".join(self.found)


def compare(
    heading: str,
    rows: list[dict[str, str]],
    label: Callable[[dict[str, str]], str],
    expected: dict[str, dict[str, Values]],
    labels: Sequence[str],
) -> None:
    """Every non-label cell of ``rows`` against ``expected[label(row)][column]``; the page
    must have exactly the rows ``expected`` has. ``labels``: the columns naming a row."""
    mismatches = Mismatches(heading)
    seen = [label(row) for row in rows]
    assert sorted(seen) == sorted(expected), (
        f"{heading}: the page's rows {seen} are not the runs' {list(expected)}"
    )
    for key, row in zip(seen, rows, strict=True):
        for column, cell in row.items():
            if column in labels:
                continue
            assert column in expected[key], f"{heading}: column {column!r} is not recomputed"
            mismatches.cell(key, column, cell, expected[key][column])
    mismatches.check()


def mean_std(values: Sequence[float]) -> list[float]:
    """Mean and sample std (as the summaries print them); just the value for one run."""
    values = np.asarray(values, np.float64)
    if values.size == 1:
        return [float(values[0])]
    return [float(values.mean()), float(values.std(ddof=1))]


def parsed(cell: str) -> list[float]:
    """The figures of a string the analysis code formatted (``"185 ± 25"``, ``"0.6%"``)."""
    return [float(t) for t in figures(cell)]


# ------------------------------------------------------------------------------------------
# The runs.
# ------------------------------------------------------------------------------------------


@functools.cache
def runs(experiment: str) -> tuple[Run, ...]:
    return tuple(load_runs([RESULTS / experiment]))


def by_seed(members: Sequence[Run]) -> list[Run]:
    return sorted(members, key=lambda r: r.config["seed"])


def select(experiment: str, **config: Any) -> list[Run]:
    """The runs of ``experiment`` whose config has these values (``algo__prox`` for
    ``algo.prox``), by seed."""
    want = {k.replace("__", "."): v for k, v in config.items()}
    found = [r for r in runs(experiment) if all(r.config.get(k) == v for k, v in want.items())]
    assert found, f"results/{experiment}: no run with {want}"
    return by_seed(found)


def steps_per_hour(run: Run) -> float:
    """Steps after the first over the wall-clock time they took, as
    :func:`a3po_jax.analysis.tables.speed_table` counts them."""
    return 3600.0 * (run.num_steps - 1) / run.elapsed_s()[-1]


# The off-policy lab's methods: the page's row label starts with the second field; the
# config values select the runs.
LAB_METHODS = {
    "sync": ("sync, prox = recompute", {"system.mode": "sync"}),
    "naive": ("naive async PPO", {"system.mode": "async", "algo.prox": "behav"}),
    "recompute": (
        "recompute (decoupled PPO)",
        {"system.mode": "async", "algo.loss": "ppo", "algo.prox": "recompute"},
    ),
    "A-3PO": (
        "A-3PO, d in training steps",
        {"algo.loss": "ppo", "algo.prox": "a3po", "algo.a3po_staleness_unit": "step"},
    ),
    "A-3PO, d in updates": (
        "A-3PO, d in optimizer updates",
        {"algo.a3po_staleness_unit": "update"},
    ),
    "M2PO": ("M2PO", {"algo.loss": "m2po"}),
    "GSPO": ("GSPO", {"algo.loss": "gspo"}),
    "IcePop": ("IcePop", {"algo.loss": "icepop"}),
    "Online DPO": ("Online DPO", {"algo.loss": "dpo"}),
}
LAB_LR = {"offpolicy_lab_toy": 1e-2, "offpolicy_lab_smollm2": 3e-5}


def lab_groups(experiment: str) -> dict[str, list[Run]]:
    """The lab's runs at its main learning rate, by method (each run in exactly one)."""
    groups: dict[str, list[Run]] = {}
    for run in runs(experiment):
        if run.config["optim.learning_rate"] != LAB_LR[experiment]:
            continue
        names = [
            name
            for name, (_, want) in LAB_METHODS.items()
            if all(run.config.get(k) == v for k, v in want.items())
        ]
        assert len(names) == 1, f"{run.name}: matches lab methods {names}"
        groups.setdefault(names[0], []).append(run)
    return {name: by_seed(members) for name, members in groups.items()}


def lab_row(row: dict[str, str]) -> str:
    text = row["method"]
    names = [n for n, (prefix, _) in LAB_METHODS.items() if text.startswith(prefix)]
    assert len(names) == 1, f"lab row {text!r} names methods {names}"
    return names[0]


LAB_SCORES: dict[str, Callable[[Run], float]] = {
    "final": lambda r: last_k_mean(r, REWARD, 5),
    "area": lambda r: mean_over_steps(r, REWARD),
    "held-out": lambda r: final_value(r, offpolicy.EVAL_ACCURACY),
    "KL": lambda r: last_k_mean(r, offpolicy.KL_REF, 5),
    "clip": lambda r: mean_over_steps(r, "loss/clipfrac"),
    "masked": lambda r: mean_over_steps(r, "mismatch/masked_frac"),
    "ESS": lambda r: mean_over_steps(r, "mismatch/ess"),
    "staleness": lambda r: mean_over_steps(r, "staleness/mean"),
}


def lab_stat(members: Sequence[Run], score: str, *, with_std: bool = True) -> Values:
    """Mean (± std) over the seeds of a lab score, as :func:`offpolicy.lab_table` takes it;
    None where no run logged it (DPO has no clip fraction)."""
    values = np.array([LAB_SCORES[score](r) for r in members], np.float64)
    values = values[np.isfinite(values)]
    if not values.size:
        return None
    return mean_std(values) if with_std else [float(values.mean())]


# ------------------------------------------------------------------------------------------
# One test per table.
# ------------------------------------------------------------------------------------------


def test_off_policy_robustness_toy():
    heading = "### Off-policy robustness, toy scale"
    stats = offpolicy.offpolicy_table(runs("offpolicy_robustness_toy"))
    expected = {}
    for n, rows in stats.groupby("N"):
        cell = {r.loss: r for r in rows.itertuples()}
        expected[str(n)] = {
            f"{name} {what}": [
                getattr(cell[loss], f"reward_{what}_mean"),
                getattr(cell[loss], f"reward_{what}_std"),
            ]
            for what in ("final", "area")
            for name, loss in (("Online DPO", "dpo"), ("PPO", "ppo"), ("RLOO", "rloo"))
        }
        expected[str(n)]["KL to init: DPO / PPO / RLOO"] = [
            cell[loss].KL_mean for loss in ("dpo", "ppo", "rloo")
        ]
    compare(heading, table(heading), lambda r: r["N"], expected, labels=["N"])


def test_off_policy_robustness_smollm2():
    heading = "### Off-policy robustness, SmolLM2-135M scale, 3 seeds"
    experiment = "offpolicy_robustness_smollm2"
    stats = offpolicy.offpolicy_table(runs(experiment))
    names = {"dpo": "Online DPO", "ppo": "PPO (recomputed prox)", "rloo": "RLOO"}
    expected = {}
    for r in stats.itertuples():
        members = [
            run
            for run in runs(experiment)
            if offpolicy.loss_label(run) == r.loss and run.config[offpolicy.OFFPOLICY_N] == r.N
        ]
        clip = [mean_over_steps(run, "loss/clipfrac") for run in members]
        expected[f"{r.N} {names[r.loss]}"] = {
            "reward final": [r.reward_final_mean, r.reward_final_std],
            "reward area": [r.reward_area_mean, r.reward_area_std],
            "KL to init (k3)": [r.KL_mean, r.KL_std],
            "clip fraction": None if r.loss == "dpo" else [float(np.mean(clip))],
        }
    compare(
        heading,
        table(heading),
        lambda row: f"{row['N']} {row['loss']}",
        expected,
        labels=["N", "loss"],
    )


def test_one_step_off_vs_sync():
    heading = "### One-step-off vs synchronous, SmolLM2-135M"
    expected = {}
    for mode in ("sync", "one_step_off"):
        members = select("one_step_off_vs_sync", system__mode=mode)
        expected[mode] = {
            "seeds": [len(members)],
            "reward last 5": mean_std([last_k_mean(r) for r in members]),
            "reward all-steps mean": mean_std([mean_over_steps(r, REWARD) for r in members]),
            "staleness mean": [np.mean([mean_over_steps(r, "staleness/mean") for r in members])],
            "s/step (steps 2-24), seeds 0 / 1 / 2": [
                mean_over_steps(r, "time/step_s", skip_first=1) for r in members
            ],
        }
    compare(heading, table(heading), lambda r: r["mode"], expected, labels=["mode"])


RLHF = "### RLHF in miniature: a learned proxy reward, judged by the gold scorer, SmolLM2-135M"
RLHF_LOSSES = {"Online DPO": "dpo", "PPO": "ppo", "RLOO": "rloo"}
RLHF_MODES = {"sync": "sync", "one-step-off": "one_step_off", "async, η = 4": "async"}
RLHF_SCORES: dict[str, Callable[[Run], float]] = {
    "held-out gold pass@1, end": lambda r: final_value(r, offpolicy.EVAL_ACCURACY),
    "gold reward, last 5": lambda r: last_k_mean(r, offpolicy.GOLD_REWARD, 5),
    # Medians: one step's k3 estimate (and so the KL-shaped reward) can spike.
    "proxy reward maximised, median last 5": lambda r: last_k_median(r, REWARD, 5),
    "KL to init, median last 5": lambda r: last_k_median(r, offpolicy.KL_REF, 5),
    "steps/hour": steps_per_hour,
}


@functools.cache
def rlhf_groups() -> dict[str, tuple[Run, ...]]:
    """The miniature's runs by ``"<loss> <mode>"`` (``"dpo one_step_off"``), by seed."""
    groups: dict[str, list[Run]] = {}
    for run in by_seed(runs("rlhf_miniature_smollm2")):
        groups.setdefault(f"{offpolicy.loss_label(run)} {run.config['system.mode']}", []).append(
            run
        )
    return {name: tuple(members) for name, members in groups.items()}


def rlhf_seeds(score: str) -> dict[str, list[float]]:
    return {
        name: [RLHF_SCORES[score](r) for r in members] for name, members in rlhf_groups().items()
    }


def test_rlhf_miniature_runs_are_the_whole_grid_against_the_proxy():
    """3 losses x 3 modes x 3 seeds, each 24 steps scored by the proxy reward model and
    evaluated by the gold scorer at the start and the end."""
    groups = rlhf_groups()
    assert sorted(groups) == sorted(
        f"{loss} {mode}" for loss in RLHF_LOSSES.values() for mode in RLHF_MODES.values()
    )
    for name, members in groups.items():
        assert [r.config["seed"] for r in members] == [0, 1, 2], name
        for run in members:
            assert run.num_steps == 24, run.name
            assert run.config["task.reward"].startswith("model:"), run.name
            assert run.series(offpolicy.EVAL_ACCURACY).size == 2, run.name
            assert not run.series(offpolicy.GOLD_REWARD).empty, run.name


def test_rlhf_miniature():
    expected = {
        name: {
            "seeds": [len(members)],
            **{column: mean_std([f(r) for r in members]) for column, f in RLHF_SCORES.items()},
        }
        for name, members in rlhf_groups().items()
    }
    compare(
        RLHF,
        table(RLHF),
        lambda row: f"{RLHF_LOSSES[row['loss']]} {RLHF_MODES[row['mode']]}",
        expected,
        labels=["loss", "mode"],
    )


def test_rlhf_miniature_over_optimisation_figures():
    """The prose's count of runs whose held-out gold ended below the untrained policy's,
    and its rank correlations over the 27 runs, recomputed."""
    text = re.sub(r"\s+", " ", " ".join(section(RLHF)))
    every = [r for members in rlhf_groups().values() for r in members]
    start = {float(r.series(offpolicy.EVAL_ACCURACY).iloc[0]) for r in every}
    assert len(start) == 1, f"the runs start from different held-out pass@1s {start}"
    (start,) = start
    held = RLHF_SCORES["held-out gold pass@1, end"]
    below = re.search(
        r"ended below the untrained policy's (\S+) in (\d+) of the 27 runs"
        r" \(Online DPO (\d+) of 9, PPO (\d+), RLOO (\d+)\)",
        text,
    )
    assert below, f"{RLHF}: the sentence counting the runs below the start is gone"
    assert printed_as(below.group(1), start)
    counts = {
        loss: sum(held(r) < start for r in every if offpolicy.loss_label(r) == loss)
        for loss in ("dpo", "ppo", "rloo")
    }
    assert [int(g) for g in below.groups()[1:]] == [sum(counts.values()), *counts.values()]
    quoted = re.findall(r"ρ = ([-−]?\d\.\d\d)", text)
    heldout = pd.Series([held(r) for r in every])
    expected = [
        pd.Series([RLHF_SCORES[column](r) for r in every]).corr(heldout, method="spearman")
        for column in (
            "proxy reward maximised, median last 5",
            "gold reward, last 5",
            "KL to init, median last 5",
        )
    ]
    assert len(quoted) == 3, f"{RLHF}: quotes {quoted}, not the three rank correlations"
    for token, value in zip(quoted, expected, strict=True):
        assert printed_as(token.replace("−", "-"), value), (token, value)


A3PO = "### A-3PO vs recompute vs naive vs sync, SmolLM2-135M, 3 seeds"


def test_a3po_vs_recompute_smollm2():
    groups: dict[str, list[Run]] = {}
    for run in by_seed(runs("a3po_vs_recompute_smollm2")):
        c = run.config
        groups.setdefault(
            f"{c['algo.prox']} {c[EFFECTIVE_STALENESS]} {c['system.mode']}", []
        ).append(run)
    expected = {
        name: {
            "seeds": [len(members)],
            "reward/mean last-5": mean_std([last_k_mean(r) for r in members]),
            "reward/mean all-steps mean": mean_std([mean_over_steps(r, REWARD) for r in members]),
            "staleness mean": [np.mean([mean_over_steps(r, "staleness/mean") for r in members])],
            "clipfrac mean": [np.mean([mean_over_steps(r, "loss/clipfrac") for r in members])],
            "train s/step": mean_std(
                [median_over_steps(r, "time/train_s", skip_first=1) for r in members]
            ),
        }
        for name, members in groups.items()
    }
    compare(
        A3PO,
        table(A3PO),
        lambda r: f"{r['prox']} {r['eta']} {r['mode']}",
        expected,
        labels=["prox", "eta", "mode"],
    )


def test_a3po_train_phase_ratio():
    ratio = tables.phase_time_ratio(list(runs("a3po_vs_recompute_smollm2")))
    expected = {
        str(r["eta"]): {
            "seeds": [r["seeds"]],
            "a3po s": [r["a3po s"]],
            "recompute s": [r["recompute s"]],
            "a3po / recompute": parsed(r["a3po / recompute"]),
        }
        for r in ratio.to_dict("records")
    }
    compare(A3PO, table(A3PO, 1), lambda r: r["eta"], expected, labels=["eta"])


PERIODIC = "### Periodic vs sync, SmolLM2-135M, 3 seeds"


def periodic_and_sync() -> list[Run]:
    """The periodic runs and their synchronous twins, the A-3PO sweep's sync runs."""
    return [
        *runs("periodic_vs_sync_smollm2"),
        *select("a3po_vs_recompute_smollm2", system__mode="sync"),
    ]


def test_periodic_vs_sync():
    expected = {}
    for mode in ("periodic", "sync"):
        members = by_seed([r for r in periodic_and_sync() if r.config["system.mode"] == mode])
        medians = [median_over_steps(r, "time/step_s", skip_first=1) for r in members]
        expected[mode] = {
            "seeds": [len(members)],
            "reward last 5": mean_std([last_k_mean(r) for r in members]),
            "reward all steps": mean_std([mean_over_steps(r, REWARD) for r in members]),
            "staleness": [np.mean([mean_over_steps(r, "staleness/mean") for r in members])],
            "s/step (median, steps 2..)": [float(np.mean(medians)), *medians],
        }
    compare(PERIODIC, table(PERIODIC), lambda r: r["mode"], expected, labels=["mode"])


def test_periodic_step_by_step_difference():
    paired = tables.paired_step_difference(periodic_and_sync())
    expected = {
        str(r["seed"]): {
            "max |Δ reward|": [r["max |Δ reward/mean|"]],
            "max |Δ loss|": [r["max |Δ loss/total|"]],
            "max |Δ grad norm|": [r["max |Δ optim/grad_norm|"]],
        }
        for r in paired.to_dict("records")
    }
    compare(PERIODIC, table(PERIODIC, 1), lambda r: r["seed"], expected, labels=["seed"])


LAB_TOY = "## The off-policy lab: methods on stale data, toy scale"
LAB_SMOLLM2 = "### The same regime on SmolLM2-135M"


def test_off_policy_lab_toy():
    groups = lab_groups("offpolicy_lab_toy")
    expected = {
        name: {
            "reward final": lab_stat(members, "final"),
            "reward area": lab_stat(members, "area"),
            "KL to init": lab_stat(members, "KL"),
            "clip frac": lab_stat(members, "clip", with_std=False),
            "masked frac": lab_stat(members, "masked", with_std=False),
            "ESS": lab_stat(members, "ESS", with_std=False),
        }
        for name, members in groups.items()
    }
    rows = table(LAB_TOY)
    compare(LAB_TOY, rows, lab_row, expected, labels=["method"])
    check_sync_staleness(LAB_TOY, rows, groups["sync"])


def test_off_policy_lab_smollm2():
    groups = lab_groups("offpolicy_lab_smollm2")
    expected = {}
    for name, members in groups.items():
        ess = lab_stat(members, "ESS", with_std=False)
        masked = lab_stat(members, "masked", with_std=False)
        if ess is not None and masked is not None and masked[0] > 0:
            ess = [*ess, *masked]  # "0.772 (masked 0.201)"
        expected[name] = {
            "seeds": [len(members)],
            "reward final": lab_stat(members, "final"),
            "reward area": lab_stat(members, "area"),
            "held-out end": lab_stat(members, "held-out"),
            "KL to init": lab_stat(members, "KL"),
            "clip frac": lab_stat(members, "clip", with_std=False),
            "ESS": ess,
        }
    rows = table(LAB_SMOLLM2)
    compare(LAB_SMOLLM2, rows, lab_row, expected, labels=["method"])
    check_sync_staleness(LAB_SMOLLM2, rows, groups["sync"])


def check_sync_staleness(heading: str, rows: list[dict[str, str]], sync: list[Run]) -> None:
    """The sync row's label quotes its mean staleness ("fresh data, staleness 1.6")."""
    label = next(r["method"] for r in rows if lab_row(r) == "sync")
    quoted = re.search(r"staleness (\d+\.\d+)", label)
    assert quoted, f"{heading}: the sync row {label!r} quotes no staleness"
    mismatches = Mismatches(heading)
    mismatches.cell("sync", "method", quoted.group(0), lab_stat(sync, "staleness")[:1])
    mismatches.check()


PER_SEED = re.compile(
    r"Per seed \(0, 1, 2\), held-out end: (?P<held>.*?)\. Reward area: (?P<area>.*?)\.(?!\d)"
)


def quoted_seeds(kind: str) -> dict[str, str]:
    """The per-seed figures the SmolLM2 lab quotes under its table: {method: "a, b, c"}."""
    text = " ".join(section(LAB_SMOLLM2))
    found = PER_SEED.search(text)
    assert found, f"{LAB_SMOLLM2}: no 'Per seed (0, 1, 2), held-out end: ...' paragraph"
    quoted = {}
    for part in found.group(kind).split(";"):
        name, values = re.fullmatch(r"(.+?) (\d.*)", part.strip()).groups()
        quoted[name] = values
    return quoted


@pytest.mark.parametrize(("kind", "score"), [("held", "held-out"), ("area", "area")])
def test_off_policy_lab_smollm2_per_seed(kind, score):
    groups = lab_groups("offpolicy_lab_smollm2")
    mismatches = Mismatches(f"{LAB_SMOLLM2}, per seed")
    for name, cell in quoted_seeds(kind).items():
        assert name in groups, f"{LAB_SMOLLM2}: per-seed figures of unknown method {name!r}"
        values = [LAB_SCORES[score](r) for r in groups[name]]
        mismatches.cell(name, score, cell, values)
    mismatches.check()


CORES = "## Generation on cores of its own"
# The disaggregation sweep's rows: (system.mode, algo.prox) -> the page's mode label.
CORE_MODES = {
    ("sync", "behav"): "sync",
    ("periodic", "behav"): "periodic",
    ("one_step_off", "a3po"): "one_step_off",
    ("async", "a3po"): "async, A-3PO",
    ("async", "recompute"): "async, recompute",
}
PLACEMENTS = {1: "split", 0: "shared"}


def cores_runs(placement: int, mode: str, prox: str) -> list[Run]:
    return select(
        "disaggregation_smollm2",
        system__inference_cores=placement,
        system__mode=mode,
        algo__prox=prox,
    )


def test_generation_on_cores_of_its_own():
    every = list(runs("disaggregation_smollm2"))
    speed, _ = tables.speed_table(every, level=0.65)
    expected = {}
    for r in speed.to_dict("records"):
        placement, mode, prox = r["inference_cores"], r["mode"], r["prox"]
        members = cores_runs(placement, mode, prox)
        sync = cores_runs(placement, "sync", "behav")
        ratios = [steps_per_hour(a) / steps_per_hour(s) for a, s in zip(members, sync, strict=True)]
        expected[f"{PLACEMENTS[placement]} {CORE_MODES[mode, prox]}"] = {
            "seeds": [len(members)],
            "steps/hour": parsed(r["steps/hour"]),
            "× sync": [1.0] if mode == "sync" else mean_std(ratios),
            "s to reward 0.65": parsed(r["s to reward/mean 0.65"]),
            "held by push": parsed(r["held by push"]),
            "waiting for rollouts": parsed(r["waiting for rollouts"]),
            "reward last 5": mean_std([last_k_mean(run) for run in members]),
        }
    compare(
        CORES,
        table(CORES),
        lambda row: f"{row['placement']} {row['mode']}",
        expected,
        labels=["placement", "mode"],
    )


def overlap_bound(sync: Run) -> tuple[list[float], float]:
    """The sync run's median phases G, T, P (steps 2..) and (G + T + P) / max(G, T + P)."""
    g, t, p = (median_over_steps(sync, phase, skip_first=1) for phase in PHASES)
    return [g, t, p], (g + t + p) / max(g, t + p)


def test_generation_on_cores_of_its_own_seed_by_seed():
    sync = cores_runs(1, "sync", "behav")
    one_step_off = cores_runs(1, "one_step_off", "a3po")
    a3po = cores_runs(1, "async", "a3po")
    expected = {}
    for s, o, a in zip(sync, one_step_off, a3po, strict=True):
        base = steps_per_hour(s)
        phases, bound = overlap_bound(s)
        expected[str(s.config["seed"])] = {
            "sync": [base],
            "one_step_off": [steps_per_hour(o), steps_per_hour(o) / base],
            "async, A-3PO": [steps_per_hour(a), steps_per_hour(a) / base],
            "sync G / T / P, s": phases,
            "bound": [bound],
            "one_step_off / bound": [steps_per_hour(o) / base / bound],
            "async / bound": [steps_per_hour(a) / base / bound],
        }
    compare(CORES, table(CORES, 1), lambda r: r["seed"], expected, labels=["seed"])


EDGE = "### The edge on SmolLM2-135M: pilots on a held-out test"


def edge_row(point: str, run_dir: Path) -> dict[str, str]:
    """One pilot run's row of the edge table, from its metrics with the run report's own
    reductions (`a3po_jax.analysis.run_report`)."""
    from helpers.run_cells import evaluations, held_out_cell, reward_cell

    from a3po_jax.analysis.run_report import load_run_files

    _, records = load_run_files(run_dir)
    first, last = evaluations(records)
    below = last["eval/ci95_high"] < first["eval/accuracy"]
    return {
        "point": point,
        "run": run_dir.name,
        "held-out pass@1, step 0 → 24 [95 % interval]": held_out_cell(records),
        "finished at 24": f"{100 * last['eval/finished_frac']:.0f} %",
        "training reward, steps 1-5 → 20-24": reward_cell(records),
        "end below the start": "yes" if last["eval/accuracy"] < first["eval/accuracy"] else "no",
        "interval below the start": "yes" if below else "no",
    }


def edge_learning_rate(point: Path) -> float:
    """A ladder point's learning rate, read from the config of one of its runs."""
    config = next(point.glob("*/config.json"))
    return float(json.loads(config.read_text())["optim"]["learning_rate"])


EDGE_METHODS = {  # run-name prefix -> the method's name in the table, in the table's order
    "mode-sync_max_staleness-0_prox-recompute": "sync (d ≤ 3)",
    "prox-behav": "naive PPO",
    "prox-recompute": "recompute",
    "prox-a3po": "A-3PO with d in training steps",
    "prox-a3po_a3po_staleness_unit-update": "A-3PO with d in optimizer updates",
    "loss-dpo": "Online DPO",
    "loss-m2po": "M2PO, all_tokens_mask",
    "loss-m2po_reading-clip_side_mask": "M2PO, clip_side_mask",
    "loss-m2po_reading-derived_clip": "M2PO, derived_clip",
    "loss-gspo_prox-recompute": "GSPO",
    "loss-icepop_prox-recompute": "IcePop",
}


def edge_points() -> list[Path]:
    """The committed ladder points, in the ladder's order."""
    root = RESULTS / "offpolicy_edge_smollm2"
    return sorted((p for p in root.iterdir() if p.is_dir()), key=edge_learning_rate)


def edge_runs(point: Path) -> list[Path]:
    return sorted(p for p in point.iterdir() if (p / "metrics.jsonl").is_file())


def edge_end(run_dir: Path) -> dict[str, float]:
    """A run's held-out figures at the start and at its last evaluation."""
    from helpers.run_cells import evaluations

    from a3po_jax.analysis.run_report import load_run_files

    first, last = evaluations(load_run_files(run_dir)[1])
    return {
        "start": first["eval/accuracy"],
        "end": last["eval/accuracy"],
        "finished": last["eval/finished_frac"],
    }


def edge_chosen_point() -> Path:
    """The first committed point where the file's rule holds: naive PPO ends below the
    untrained model on every pilot seed, with at least FINISHED_AT_END of its answers
    finishing (the later condition; it holds at every point the rule was read at)."""
    edge = import_experiment(REPO / "experiments" / "offpolicy_edge_smollm2.py")
    for point in edge_points():
        pilots = [point / name for name in edge.PILOT]
        if not all((p / "metrics.jsonl").is_file() for p in pilots):
            continue
        ends = [edge_end(p) for p in pilots]
        if all(e["end"] < e["start"] and e["finished"] >= edge.FINISHED_AT_END for e in ends):
            return point
    raise AssertionError("no committed point meets the edge rule")


def edge_method_rows(point: Path) -> list[dict[str, str]]:
    """The chosen point's table: each method's seeds, and the verdict words of the report's
    rule (`a3po_jax.analysis.verdicts.separation`) against naive PPO and recompute."""
    from a3po_jax.analysis.verdicts import separation

    by_method: dict[str, list[dict[str, float]]] = {}
    for run in edge_runs(point):
        prefix, seed = run.name.rsplit("_seed-", 1)
        assert prefix in EDGE_METHODS, f"{run}: a method the edge table does not name"
        by_method.setdefault(prefix, []).append({"seed": int(seed), **edge_end(run)})
    ends = {
        m: [r["end"] for r in sorted(rs, key=lambda r: r["seed"])] for m, rs in by_method.items()
    }
    rows = []
    for prefix, label in EDGE_METHODS.items():
        if prefix not in by_method:
            continue
        seeds = sorted(by_method[prefix], key=lambda r: r["seed"])
        row = {
            "method": label,
            "seeds": ", ".join(str(r["seed"]) for r in seeds),
            "held-out pass@1 at 24, by seed": ", ".join(f"{r['end']:.3f}" for r in seeds),
            "finished at 24, by seed": ", ".join(f"{100 * r['finished']:.0f} %" for r in seeds),
        }
        for other, column in (
            ("prox-behav", "against naive PPO"),
            ("prox-recompute", "against recompute"),
        ):
            row[column] = "—" if other == prefix else separation(ends[prefix], ends[other])
        rows.append(row)
    return rows


def test_off_policy_edge_pilots():
    """Every pilot run committed under results/offpolicy_edge_smollm2/<point>/ is a row of
    the runs' table, and every row is a committed run's figures."""
    expected = [edge_row(point.name, run) for point in edge_points() for run in edge_runs(point)]
    assert expected, "no committed pilot runs"
    assert table(EDGE, 1) == expected


def test_off_policy_edge_methods_at_the_chosen_point():
    """The rule, read from the committed pilots, chooses the point the page names, and the
    page's table by method there is the runs' figures with the rule's verdict words."""
    point = edge_chosen_point()
    text = " ".join(section(EDGE))
    assert f"The rule chooses `{point.name}`" in text
    assert table(EDGE, 0) == edge_method_rows(point)
    # The prose names every pair the rule separates, in bold, and no other.
    named = set(re.findall(r"\*\*([^*]+?) (below|above) (naive PPO|recompute)\*\*", text))
    assert named == edge_separated_pairs()


def edge_separated_pairs() -> set[tuple[str, str, str]]:
    """(method, "below" | "above", naive PPO | recompute) for each pair the rule separates
    at the chosen point."""
    columns = (("against naive PPO", "naive PPO"), ("against recompute", "recompute"))
    return {
        (row["method"], "below" if row[column].endswith("lower") else "above", other)
        for row in edge_method_rows(edge_chosen_point())
        for column, other in columns
        if row[column].startswith("separates")
    }


def test_every_table_on_the_page_is_accounted_for():
    """A table is recomputed above, skipped for a stated reason, or says on the page that
    its runs are not committed."""
    checked = {
        "### Off-policy robustness, toy scale": 1,
        "### Off-policy robustness, SmolLM2-135M scale, 3 seeds": 1,
        "### One-step-off vs synchronous, SmolLM2-135M": 1,
        RLHF: 1,
        A3PO: 2,
        PERIODIC: 2,
        LAB_TOY: 1,
        LAB_SMOLLM2: 1,
        CORES: 2,
        EDGE: 2,
    }
    on_page = {line: len(tables_in(section(line))) for _, line in headings()}
    on_page = {heading: n for heading, n in on_page.items() if n}
    accounted = {**checked, **dict.fromkeys([*SKIPPED, *UNSOURCED], 1)}
    assert on_page == accounted, (
        "docs/results.md: tables by heading differ from those this test knows"
        f" (page {on_page}, test {accounted})"
    )
    for heading, phrase in UNSOURCED.items():
        assert phrase in " ".join(section(heading)), (
            f"{heading}: its table's runs are not in results/, and the page does not say"
            f" so ({phrase!r})"
        )


# ------------------------------------------------------------------------------------------
# Verdict words against the seeds.
# ------------------------------------------------------------------------------------------


def separated(a: Sequence[float], b: Sequence[float]) -> bool:
    """Every seed of one beyond every seed of the other."""
    return min(a) > max(b) or min(b) > max(a)


def lab_seeds(experiment: str, score: str) -> dict[str, list[float]]:
    return {
        name: [LAB_SCORES[score](r) for r in members]
        for name, members in lab_groups(experiment).items()
    }


def a3po_seeds(score: Callable[[Run], float]) -> dict[str, list[float]]:
    """The A-3PO sweep's rewards by seed: {"sync", "a3po 2", "behav 4", ...}."""
    groups: dict[str, list[float]] = {}
    for run in by_seed(runs("a3po_vs_recompute_smollm2")):
        c = run.config
        name = (
            "sync"
            if c["system.mode"] == "sync"
            else f"{c['algo.prox']} {c['system.max_staleness']}"
        )
        groups.setdefault(name, []).append(score(run))
    return groups


def robustness_seeds(experiment: str, n: int) -> dict[str, list[float]]:
    """An off-policy robustness sweep's final reward by seed at N = n, by loss."""
    groups: dict[str, list[float]] = {}
    for run in by_seed(runs(experiment)):
        if run.config[offpolicy.OFFPOLICY_N] == n:
            groups.setdefault(offpolicy.loss_label(run), []).append(
                offpolicy.version_window_mean(run)
            )
    return groups


def mode_seeds(score: Callable[[Run], float]) -> dict[str, list[float]]:
    return {
        mode: [score(r) for r in select("one_step_off_vs_sync", system__mode=mode)]
        for mode in ("sync", "one_step_off")
    }


def separating_pairs(seeds: dict[str, list[float]]) -> set[tuple[str, str]]:
    """The pairs (higher, lower) of methods whose seeds separate."""
    return {
        (a, b) if min(seeds[a]) > max(seeds[b]) else (b, a)
        for a, b in itertools.combinations(sorted(seeds), 2)
        if separated(seeds[a], seeds[b])
    }


@dataclasses.dataclass(frozen=True)
class Claim:
    """A statement of the page (``text``, as printed, whitespace aside) about which
    methods the seeds separate: ``holds`` recomputes it from the runs."""

    text: str
    holds: Callable[[], bool]


def beyond_all(seeds: dict[str, list[float]], name: str) -> bool:
    """Every seed of ``name`` beyond every seed of every other method, on one side."""
    others = [v for other, values in seeds.items() if other != name for v in values]
    return min(seeds[name]) > max(others) or max(seeds[name]) < min(others)


def only_naive_over_a3po_at_eta_4() -> bool:
    """In the A-3PO sweep the seeds separate one pair: naive PPO's last-5 reward above
    A-3PO's at η = 4; no pair on the all-steps mean."""
    return separating_pairs(a3po_seeds(last_k_mean)) == {("behav 4", "a3po 4")} and not (
        separating_pairs(a3po_seeds(lambda r: mean_over_steps(r, REWARD)))
    )


def lab_separate(experiment: str, score: str, a: str, b: str) -> bool:
    seeds = lab_seeds(experiment, score)
    return separated(seeds[a], seeds[b])


TOY_LAB, SMOLLM2_LAB = "offpolicy_lab_toy", "offpolicy_lab_smollm2"
CLAIMS = [
    Claim(
        "Naive asynchronous PPO separates from recompute",
        lambda: lab_separate(TOY_LAB, "final", "naive", "recompute"),
    ),
    Claim(
        "naive separates from recompute",
        lambda: lab_separate(TOY_LAB, "final", "naive", "recompute"),
    ),
    Claim(
        "Online DPO is the most robust**: 0.868 ± 0.027, above every PPO variant and sync",
        lambda: beyond_all(lab_seeds(TOY_LAB, "final"), "Online DPO"),
    ),
    Claim(
        "From N = 4 on, DPO is ahead of both",
        lambda: all(
            ("dpo", other) in separating_pairs(robustness_seeds("offpolicy_robustness_toy", n))
            for n in (4, 8)
            for other in ("ppo", "rloo")
        ),
    ),
    Claim(
        "every recompute seed above every naive seed",
        lambda: lab_separate(SMOLLM2_LAB, "area", "recompute", "naive"),
    ),
    Claim(
        "training reward below recompute on every seed, held-out not separable",
        lambda: (
            lab_separate(SMOLLM2_LAB, "area", "recompute", "naive")
            and not lab_separate(SMOLLM2_LAB, "held-out", "recompute", "naive")
        ),
    ),
    Claim(
        "0.655 ± 0.018, below on every seed",
        lambda: lab_separate(SMOLLM2_LAB, "area", "A-3PO", "recompute"),
    ),
    Claim(
        "GSPO has the highest held-out mean, not separable from naive PPO's",
        lambda: not lab_separate(SMOLLM2_LAB, "held-out", "GSPO", "naive"),
    ),
    Claim(
        "GSPO's held-out mean is the highest but **not separable** from naive PPO's",
        lambda: not lab_separate(SMOLLM2_LAB, "held-out", "GSPO", "naive"),
    ),
    Claim(
        "below every seed of every other method",
        lambda: beyond_all(lab_seeds(SMOLLM2_LAB, "held-out"), "M2PO"),
    ),
    Claim(
        "**Sync is not better than the asynchronous runs here**",
        lambda: (
            not any(
                lab_separate(SMOLLM2_LAB, "held-out", "sync", other)
                for other in ("naive", "recompute", "A-3PO")
            )
        ),
    ),
    Claim(
        "the lowest mean, not separable from M2PO's",
        lambda: not lab_separate(SMOLLM2_LAB, "final", "Online DPO", "M2PO"),
    ),
    Claim(
        "**The seeds do not separate the losses at either N.**",
        lambda: (
            not any(
                separating_pairs(robustness_seeds("offpolicy_robustness_smollm2", n))
                for n in (1, 4)
            )
        ),
    ),
    Claim(
        "the seeds do not separate the two modes' rewards",
        lambda: (
            not separating_pairs(mode_seeds(last_k_mean))
            and not separating_pairs(mode_seeds(lambda r: mean_over_steps(r, REWARD)))
        ),
    ),
    Claim(
        "do not separate A-3PO from recompute or sync at η = 2 or 4",
        lambda: (
            not any(
                separated(seeds[f"a3po {eta}"], seeds[other])
                for score in (last_k_mean, lambda r: mean_over_steps(r, REWARD))
                for seeds in [a3po_seeds(score)]
                for eta in (2, 4)
                for other in (f"recompute {eta}", "sync")
            )
        ),
    ),
    Claim(
        "The one pair the rule separates is **A-3PO with d in optimizer updates below recompute**",
        lambda: (
            edge_separated_pairs() == {("A-3PO with d in optimizer updates", "below", "recompute")}
        ),
    ),
    *(
        Claim(text, only_naive_over_a3po_at_eta_4)
        for text in (
            "the seeds separate one pair only: naive PPO above A-3PO at η = 4",
            "the one pair that separates has naive PPO, the loss staleness should hurt most, ahead",
            "naive PPO ends above A-3PO at η = 4 on every seed, the one pair that separates",
        )
    ),
]
RLHF_HELD, RLHF_KL, RLHF_SPEED = (
    "held-out gold pass@1, end",
    "KL to init, median last 5",
    "steps/hour",
)


def rlhf_separated(score: str, a: str, b: str) -> bool:
    seeds = rlhf_seeds(score)
    return separated(seeds[a], seeds[b])


def rlhf_no_loss_pair_separates_in_any_mode() -> bool:
    return not any(
        rlhf_separated(RLHF_HELD, f"{a} {mode}", f"{b} {mode}")
        for mode in RLHF_MODES.values()
        for a, b in itertools.combinations(RLHF_LOSSES.values(), 2)
    )


def rlhf_above(score: str, high: str, low: str) -> bool:
    seeds = rlhf_seeds(score)
    return min(seeds[high]) > max(seeds[low])


RLHF_CLAIMS = [
    Claim(
        "The seeds do not separate the three losses' held-out gold pass@1 in any mode",
        rlhf_no_loss_pair_separates_in_any_mode,
    ),
    Claim(
        "the seeds do not separate the losses' held-out gold in any mode",
        rlhf_no_loss_pair_separates_in_any_mode,
    ),
    Claim(
        "lies above every seed of every other row",
        lambda: all(
            rlhf_above(RLHF_KL, "dpo async", other)
            for other in rlhf_groups()
            if other != "dpo async"
        ),
    ),
    Claim(
        "ran fewer steps per hour than sync and one-step-off on every seed of every loss",
        lambda: all(
            rlhf_above(RLHF_SPEED, f"{loss} {mode}", f"{loss} async")
            for loss in RLHF_LOSSES.values()
            for mode in ("sync", "one_step_off")
        ),
    ),
]


def rlhf_separating_pairs(score: str) -> int:
    """How many of the miniature's 36 pairs of rows the seeds separate on ``score``."""
    seeds = rlhf_seeds(score)
    return sum(separated(seeds[a], seeds[b]) for a, b in itertools.combinations(seeds, 2))


RLHF_CLAIMS += [
    Claim(
        "for RLOO every one-step-off seed lies above every sync seed",
        lambda: rlhf_above(RLHF_HELD, "rloo one_step_off", "rloo sync"),
    ),
    Claim(
        "for Online DPO and PPO the seeds do not separate the two",
        lambda: (
            not any(
                rlhf_separated(RLHF_HELD, f"{loss} one_step_off", f"{loss} sync")
                for loss in ("dpo", "ppo")
            )
        ),
    ),
    Claim(
        "6 of the 36 pairs of rows separate on held-out gold",
        lambda: rlhf_separating_pairs(RLHF_HELD) == 6,
    ),
]
CLAIMS += RLHF_CLAIMS
# Uses of the verdict words that compare no methods.
NOT_CLAIMS = (
    "best/worst selection",
    "recompute's best 0.859",
    "generalises no better",
    "a single pair that separates is weak evidence",
)
VERDICT_WORDS = re.compile(r"\b(separates|separated|better|best|beats|outperforms?)\b")
NEGATION = re.compile(r"\b(not|no|nor|never)\b|n't")


def prose() -> str:
    """The page outside code blocks, as one line (so a sentence broken across lines reads
    as one)."""
    keep, fenced = [], False
    for line in page_lines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            keep.append(line)
    return re.sub(r"\s+", " ", " ".join(keep))


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.text[:40])
def test_separation_claims_hold_on_the_seeds(claim):
    assert claim.text in prose(), f"docs/results.md no longer says {claim.text!r}"
    assert claim.holds(), f"docs/results.md says {claim.text!r}; the seeds do not"


def test_every_verdict_word_on_the_page_is_a_listed_claim():
    """A verdict word (the page's rule) outside a listed claim fails: the new statement
    needs a `Claim` that checks it against the seeds, or rewording."""
    text = prose()
    rule = re.search(r"\*\*Verdict words\.\*\*.*?(?=\*\*|$)", text)
    assert rule, "docs/results.md: the rule for verdict words is gone from the top of the page"
    covered = [
        (m.start(), m.end())
        for phrase in [*(c.text for c in CLAIMS), *NOT_CLAIMS, rule.group(0)]
        for m in re.finditer(re.escape(phrase), text)
    ]
    unlisted = []
    for word in VERDICT_WORDS.finditer(text):
        if any(a <= word.start() < b for a, b in covered):
            continue
        before = text[max(0, word.start() - 30) : word.start()]
        if NEGATION.search(before.rsplit(",", 1)[-1]):
            continue
        unlisted.append(text[max(0, word.start() - 60) : word.end() + 40])
    assert not unlisted, "verdict words that no listed claim checks:\n" + "\n".join(unlisted)


def test_the_seeds_named_inside_gspos_held_out_range_are_those_of_the_runs():
    """The page names, per method, the seeds whose held-out pass@1 lies inside GSPO's
    range; it must name every one and no other."""
    seeds = lab_seeds("offpolicy_lab_smollm2", "held-out")
    low, high = min(seeds["GSPO"]), max(seeds["GSPO"])
    inside = {
        (name, f"{v:.3f}")
        for name, values in seeds.items()
        if name not in ("GSPO", "naive")
        for v in values
        if low <= v <= high
    }
    sentence = re.search(r"one seed each of (.*?) lies inside its range", prose())
    assert sentence, f"{LAB_SMOLLM2}: the sentence naming the seeds inside GSPO's range is gone"
    named = set(
        re.findall(
            r"(sync|recompute|A-3PO|IcePop|M2PO|Online DPO) \((\d\.\d{3})\)", sentence.group(1)
        )
    )
    assert named == inside, f"the page names {sorted(named)}; inside GSPO's range: {sorted(inside)}"
