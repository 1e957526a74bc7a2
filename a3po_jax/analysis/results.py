"""From run directories to the tables and plots the docs and the notebooks show: one
namespace over the analysis modules, for notebooks and scripts.

Analysis layer (host side, never jitted); needs the ``analysis`` extra (pandas, matplotlib).

``from a3po_jax.analysis import results`` gives every public name of

* :mod:`a3po_jax.analysis.runs`: loading run directories (:func:`load_runs`,
  :class:`Run`), config differences, per-run reductions, seeds merged for plots;
* :mod:`a3po_jax.analysis.tables`: per-run, per-seed, length-bias, phase-time and sweep
  tables (:func:`summary_table`, :func:`seed_table`, :func:`pivot`) and
  :func:`markdown_table`;
* :mod:`a3po_jax.analysis.plots`: reward curves, diagnostics, the mismatch dashboard,
  phase times, staleness histograms, the sweep plot;
* :mod:`a3po_jax.analysis.offpolicy`: the off-policy robustness study (reward by
  generating version, the reward-vs-KL frontier; gold against KL and proxy against gold
  under a learned reward);
* :mod:`a3po_jax.analysis.report`: :func:`write_summary`, the ``summary.md`` that
  ``python -m a3po_jax.cli.results`` writes.

New code may import the module it needs directly; this namespace stays for the notebooks.
"""

from __future__ import annotations

from a3po_jax.analysis.offpolicy import (
    KL_REF,
    OFFPOLICY_N,
    generating_versions,
    has_gold,
    is_lab_sweep,
    is_offpolicy_sweep,
    lab_table,
    loss_label,
    offpolicy_markdown,
    offpolicy_table,
    plot_gold_against_kl,
    plot_reward_by_version,
    plot_reward_kl_frontier,
    version_area,
    version_window_mean,
)
from a3po_jax.analysis.plots import (
    MISMATCH_FRACS,
    MISMATCH_FRESH,
    MISMATCH_IW,
    MISMATCH_IW_TAILS,
    MISMATCH_KL,
    has_mismatch,
    plot_curves,
    plot_diagnostics,
    plot_mismatch,
    plot_phase_times,
    plot_reward,
    plot_staleness,
    plot_sweep,
)
from a3po_jax.analysis.report import sweep_axes, write_summary
from a3po_jax.analysis.runs import (
    CONFIG_FILE,
    EFFECTIVE_STALENESS,
    IGNORED_CONFIG_KEYS,
    PHASES,
    REWARD,
    STALENESS_COUNTS,
    Run,
    config_differences,
    config_frame,
    final_value,
    find_run_dirs,
    flatten_config,
    last_k_mean,
    last_k_median,
    load_run,
    load_runs,
    max_over_steps,
    mean_over_steps,
    median_over_steps,
    merge_seeds,
    run_label,
    staleness_distribution,
)
from a3po_jax.analysis.tables import (
    LENGTH_GENERATED,
    Pivot,
    has_length,
    length_table,
    markdown_table,
    paired_step_difference,
    phase_time_ratio,
    pivot,
    seed_table,
    speed_table,
    summary_table,
    time_to_reward,
)

__all__ = [
    "CONFIG_FILE",
    "EFFECTIVE_STALENESS",
    "IGNORED_CONFIG_KEYS",
    "KL_REF",
    "LENGTH_GENERATED",
    "MISMATCH_FRACS",
    "MISMATCH_FRESH",
    "MISMATCH_IW",
    "MISMATCH_IW_TAILS",
    "MISMATCH_KL",
    "OFFPOLICY_N",
    "PHASES",
    "REWARD",
    "STALENESS_COUNTS",
    "Pivot",
    "Run",
    "config_differences",
    "config_frame",
    "final_value",
    "find_run_dirs",
    "flatten_config",
    "generating_versions",
    "has_gold",
    "has_length",
    "has_mismatch",
    "is_lab_sweep",
    "is_offpolicy_sweep",
    "lab_table",
    "last_k_mean",
    "last_k_median",
    "length_table",
    "load_run",
    "load_runs",
    "loss_label",
    "markdown_table",
    "max_over_steps",
    "mean_over_steps",
    "median_over_steps",
    "merge_seeds",
    "offpolicy_markdown",
    "offpolicy_table",
    "paired_step_difference",
    "phase_time_ratio",
    "pivot",
    "plot_curves",
    "plot_diagnostics",
    "plot_gold_against_kl",
    "plot_mismatch",
    "plot_phase_times",
    "plot_reward",
    "plot_reward_by_version",
    "plot_reward_kl_frontier",
    "plot_staleness",
    "plot_sweep",
    "run_label",
    "seed_table",
    "speed_table",
    "staleness_distribution",
    "summary_table",
    "sweep_axes",
    "time_to_reward",
    "version_area",
    "version_window_mean",
    "write_summary",
]
