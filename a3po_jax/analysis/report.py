"""The whole report of a set of runs: ``summary.md`` with its tables and the PNGs it links.

Analysis layer (host side, never jitted); needs the ``analysis`` extra (pandas, matplotlib).
The command line over it is :mod:`a3po_jax.cli.results`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from a3po_jax.analysis import plots
from a3po_jax.analysis.offpolicy import (
    KL_REF,
    has_gold,
    is_lab_sweep,
    is_offpolicy_sweep,
    lab_table,
    offpolicy_markdown,
    offpolicy_table,
    plot_gold_against_kl,
    plot_reward_by_version,
    plot_reward_kl_frontier,
)
from a3po_jax.analysis.runs import (
    EFFECTIVE_STALENESS,
    IGNORED_CONFIG_KEYS,
    REWARD,
    Run,
    config_differences,
    format_cell,
    merge_seeds,
    seed_groups,
    short_key,
)
from a3po_jax.analysis.tables import (
    has_length,
    length_table,
    markdown_table,
    paired_step_difference,
    pivot,
    seed_table,
    speed_table,
    summary_table,
)


def sweep_axes(runs: Sequence[Run]) -> tuple[str, str] | None:
    """(x, hue) keys for a sweep plot when the runs vary η and one other field."""
    keys = [k for k in config_differences(runs) if k != "seed"]
    if EFFECTIVE_STALENESS not in keys:
        return None
    others = [k for k in keys if k != EFFECTIVE_STALENESS]
    return (EFFECTIVE_STALENESS, others[0]) if len(others) == 1 else None


def write_summary(
    runs: Sequence[Run],
    out_dir: str | Path,
    *,
    last_k: int = 5,
    title: str = "Results",
    smooth: int = 5,
    level: float | None = None,
) -> Path:
    """Write ``out_dir/summary.md`` and its PNGs; returns the markdown file's path.
    ``level``: the reward the speed table times each run to (`speed_table`'s default if
    None).

    Runs that differ only by seed are averaged (:func:`merge_seeds`) for the plots; the
    tables show the mean ± std over seeds and every run on its own.
    """
    if not runs:
        raise ValueError("write_summary: no runs")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    aggregate = seed_table(runs, last_k=last_k)
    axes = sweep_axes(runs)
    offpolicy = is_offpolicy_sweep(runs)
    figures = _figures(runs, aggregate.empty, axes, offpolicy, last_k=last_k, smooth=smooth)
    for file, (_, fig) in figures.items():
        fig.savefig(out / file, dpi=110)

    differing = config_differences(runs)
    common = {k: v for k, v in runs[0].config.items() if k not in differing}
    lines = [
        f"# {title}",
        "",
        f"{len(runs)} runs. Reward = `{REWARD}` (mean over the step's samples); `last-{last_k}`"
        f" = mean over the last {last_k} steps; `all-steps mean` = mean over every step (the"
        " area under the reward curve divided by the steps: higher = learned sooner); time"
        " per step excludes the first (compiling) step; ± is the sample std over seeds.",
        "",
    ]
    if not aggregate.empty:
        lines += ["## Mean ± std over seeds", "", markdown_table(aggregate), ""]
    lines += _comparison_sections(runs, axes, offpolicy, last_k=last_k, level=level)
    for file, (caption, _) in figures.items():
        lines += [f"## {caption}", "", f"![{caption}]({file})", ""]
    if has_length(runs):
        lines += [
            "## Length bias (completion lengths in tokens, over the whole run)",
            "",
            markdown_table(length_table(runs)),
            "",
        ]
    lines += ["## Every run", "", markdown_table(summary_table(runs, last_k=last_k)), ""]
    lines += [
        "## Settings shared by all runs",
        "",
        ", ".join(
            # Settings are shown as given (3e-05, 1e-08), not rounded to a table's digits.
            f"`{k}={v if isinstance(v, float) else format_cell(v)}`"
            for k, v in sorted(common.items())
            if k not in IGNORED_CONFIG_KEYS
        ),
        "",
    ]
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def _figures(
    runs: Sequence[Run],
    one_seed_each: bool,
    axes: tuple[str, str] | None,
    offpolicy: bool,
    *,
    last_k: int,
    smooth: int,
) -> dict[str, tuple[str, object]]:
    """The summary's figures, file name -> (caption, figure); runs that differ only by seed
    are averaged unless ``one_seed_each``."""
    shown = merge_seeds(runs) if not one_seed_each else list(runs)
    averaged = " (mean over seeds)" if not one_seed_each else ""
    figures = {
        "reward.png": (
            f"Reward vs step and vs wall-clock time{averaged}",
            plots.plot_reward(shown, smooth=smooth),
        ),
        "phase_times.png": (f"Time per step by phase{averaged}", plots.plot_phase_times(shown)),
        "staleness.png": (f"Staleness histograms{averaged}", plots.plot_staleness(shown)),
        "diagnostics.png": (
            f"Importance weights, clip fraction and staleness{averaged}",
            plots.plot_diagnostics(shown),
        ),
    }
    if plots.has_mismatch(shown):
        figures["mismatch.png"] = (
            f"Train-inference mismatch: KL on fresh tokens, importance weights, masked and "
            f"truncated fractions{averaged}",
            plots.plot_mismatch(shown),
        )
    if axes is not None:
        figures["sweep.png"] = (
            f"Sweep over {short_key(axes[0])} (each point: mean over its runs)",
            plots.plot_sweep(runs, x_key=axes[0], hue_key=axes[1], last_k=last_k),
        )
    if has_gold(runs):
        figures["gold.png"] = (
            f"Gold reward on held-out prompts against KL, and proxy against gold (last {last_k} "
            "steps; per configuration mean ± std over seeds, faint: each seed)",
            plot_gold_against_kl(runs, last_k=last_k),
        )
    if offpolicy:
        figures["reward_by_version.png"] = (
            "Reward by generating policy version, per N (mean ± std over seeds)",
            plot_reward_by_version(runs),
        )
        figures["frontier.png"] = (
            "Reward against KL to the initial policy, per N (final point: mean ± std over seeds)",
            plot_reward_kl_frontier(runs),
        )
    return figures


def _comparison_sections(
    runs: Sequence[Run],
    axes: tuple[str, str] | None,
    offpolicy: bool,
    *,
    last_k: int,
    level: float | None,
) -> list[str]:
    """The summary's sections that compare runs: methods on stale data, speed, the sweep's
    grids, off-policy robustness, periodic vs sync (each only where the runs have it)."""
    lines: list[str] = []
    if is_lab_sweep(runs):
        lines += [
            "## Methods on stale data: reward, KL to the initial policy, corrections",
            "",
            f"Reward final and KL: mean over the last {last_k} steps; the other "
            "columns: mean over every step; ± is the sample std over seeds.",
            "",
            markdown_table(lab_table(runs, last_k=last_k)),
            "",
        ]
    if len(seed_groups(runs, "seed")[1]) > 1:  # several configurations, with one seed or more each
        speed, level = speed_table(runs, level=level, last_k=last_k)
        lines += [
            "## Speed: steps per hour and time to a reward level",
            "",
            f"Wall-clock time from the end of the first (compiling) step to `{REWARD}` {level:.3g}"
            " (a 3-step moving average). Held by push / waiting for rollouts: the trainer's share"
            " of the wall-clock time (steps 2..).",
            "",
            markdown_table(speed),
            "",
        ]
    if axes is not None:
        for metric, reduce in ((REWARD, "last_k"), (REWARD, "mean"), ("loss/clipfrac", "mean")):
            grid = pivot(
                runs,
                row_key=axes[0],
                col_key=axes[1],
                metric=metric,
                last_k=last_k,
                reduce=reduce,
            )
            what = grid.metric.replace(f"{REWARD} mean", f"{REWARD} all-steps mean")
            lines += [f"## {what} by {short_key(axes[0])} × {short_key(axes[1])}", ""]
            lines += [grid.to_markdown(), ""]
    if offpolicy:
        lines += [
            "## Off-policy robustness: final reward, area under the curve, KL (mean ± std)",
            "",
            "Final = mean over the samples generated by the last 9 policy versions; area ="
            " the reward curve's area against the generating version / the version span;"
            f" KL = `{KL_REF}` over the same steps as the final reward.",
            "",
            offpolicy_markdown(offpolicy_table(runs)),
            "",
        ]
    paired = paired_step_difference(runs)
    if not paired.empty:
        lines += [
            "## Periodic vs sync, step by step (same seed)",
            "",
            "The largest difference over the steps between the periodic and the synchronous"
            " run of each seed, and their median seconds per step (steps 2..). The same update"
            " gives differences at float rounding, not sampling noise.",
            "",
            markdown_table(paired, floatfmt=".3g"),
            "",
        ]
    return lines
