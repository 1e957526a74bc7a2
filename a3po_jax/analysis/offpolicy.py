"""The off-policy robustness study (Asynchronous RLHF, arXiv 2410.18252): reward against
the policy version that generated it, and reward against the KL to the initial policy.

Analysis layer (host side, never jitted); needs the ``analysis`` extra (pandas, matplotlib).

For a synchronous sweep over ``algo.num_minibatches`` N that logs ``kl/ref_k3``: final
reward / area / KL per (loss, N) with their spread over seeds (:func:`offpolicy_table`),
reward by generating version (:func:`plot_reward_by_version`) and the reward-vs-KL
frontier per N (:func:`plot_reward_kl_frontier`). For the off-policy lab (methods compared
on stale data, ``experiments/offpolicy_lab_toy.py``): :func:`lab_table`, per method the
reward, KL and the diagnostics of its corrections, mean ± std over seeds. For runs trained
against a learned reward model and judged by the gold scorer
(``experiments/rlhf_miniature_smollm2.py``): :func:`plot_gold_against_kl`, the paper's gold
reward against KL and the proxy reward against the gold one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from a3po_jax.analysis.plots import new_figure
from a3po_jax.analysis.runs import (
    REWARD,
    Run,
    final_value,
    last_k_mean,
    last_k_median,
    mean_over_steps,
    run_label,
    seed_groups,
    short_key,
)
from a3po_jax.analysis.tables import mean_std

EVAL_ACCURACY = "eval/accuracy"  # held-out greedy pass@1 (logged at step 0 and the end)
KL_REF = "kl/ref_k3"  # k3 KL(π_θ ‖ π_init) on the trained tokens (algo.track_ref_kl)
GOLD_REWARD = "reward/gold_score_mean"  # the verifier's score under a reward model
PROXY_SCORE = "reward/proxy_score_mean"  # the reward model's own score, before any shaping
OFFPOLICY_N = "algo.num_minibatches"


def loss_label(run: Run) -> str:
    """``dpo`` (Online DPO), ``rloo`` (clipped loss, leave-one-out advantages) or ``ppo``
    (clipped loss, group-normalised advantages), from the run's config."""
    if run.config.get("algo.loss") == "dpo":
        return "dpo"
    return "rloo" if run.config.get("algo.advantage") == "rloo" else "ppo"


def generating_versions(run: Run, key: str = REWARD) -> tuple[np.ndarray, np.ndarray]:
    """(versions, values) of ``key``: each step's value against the policy version that
    generated the step's samples. In synchronous generation (``system.mode=sync``) that is
    the version before the step's N = ``algo.num_minibatches`` updates, so runs with
    different N line up by policy, not by step.

    Raises:
      ValueError: for a run that is not synchronous (there a step mixes versions).
    """
    if run.config.get("system.mode") != "sync":
        raise ValueError(f"generating_versions: {run.name} is not a system.mode=sync run")
    n = int(run.config.get(OFFPOLICY_N, 1))
    frame = run.frame
    if key not in frame or "version" not in frame:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    rows = frame[["version", key]].dropna()
    return (rows["version"].to_numpy() - n).astype(np.int64), rows[key].to_numpy(np.float64)


def version_window_mean(run: Run, key: str = REWARD, *, window: int = 8) -> float:
    """Mean of ``key`` over the steps whose samples came from the last ``window`` + 1
    policy versions (generating version ≥ the run's last one − ``window``)."""
    versions, values = generating_versions(run, key)
    if not versions.size:
        return float("nan")
    return float(values[versions >= versions.max() - window].mean())


def version_area(run: Run, key: str = REWARD) -> float:
    """Area under ``key`` against the generating version (trapezoids), divided by the
    version span: the mean reward over training, the same weight per policy version."""
    versions, values = generating_versions(run, key)
    if versions.size < 2:
        return float(values[0]) if values.size else float("nan")
    heights = (values[1:] + values[:-1]) / 2
    return float(np.sum(heights * np.diff(versions)) / (versions[-1] - versions[0]))


def offpolicy_table(runs: Sequence[Run], *, window: int = 8) -> pd.DataFrame:
    """One row per (loss, N): the seeds, and mean ± std over them of the final reward
    (:func:`version_window_mean` over the last ``window`` + 1 versions), the area under
    the reward curve (:func:`version_area`) and the KL to the initial policy over the same
    window. Rows by N then loss; numbers as floats (``reward_final_mean``,
    ``reward_final_std``, ``reward_area_mean``, ..., ``KL_std``)."""
    rows = [
        {
            "loss": loss_label(r),
            "N": int(r.config.get(OFFPOLICY_N, 1)),
            "final": version_window_mean(r, REWARD, window=window),
            "area": version_area(r, REWARD),
            "kl": version_window_mean(r, KL_REF, window=window),
        }
        for r in runs
    ]
    frame = pd.DataFrame(rows)
    stats = frame.groupby(["N", "loss"]).agg(["mean", "std", "count"])
    table = pd.DataFrame(
        {"N": [n for n, _ in stats.index], "loss": [loss for _, loss in stats.index]}
    )
    table["seeds"] = stats[("final", "count")].to_numpy()
    for column, name in (("final", "reward_final"), ("area", "reward_area"), ("kl", "KL")):
        table[f"{name}_mean"] = stats[(column, "mean")].to_numpy()
        table[f"{name}_std"] = stats[(column, "std")].to_numpy()
    return table


def offpolicy_markdown(table: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """:func:`offpolicy_table` as markdown, each measurement ``mean ± std``."""
    lines = [
        "| N | loss | seeds | reward final | reward area | KL to init (k3) |",
        "|---|---|---|---|---|---|",
    ]
    for row in table.itertuples(index=False):
        cells = [
            mean_std(getattr(row, f"{name}_mean"), getattr(row, f"{name}_std"), row.seeds, floatfmt)
            for name in ("reward_final", "reward_area", "KL")
        ]
        lines.append(f"| {row.N} | {row.loss} | {row.seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_n_and_loss(runs: Sequence[Run]) -> dict[int, dict[str, list[Run]]]:
    grouped: dict[int, dict[str, list[Run]]] = {}
    for run in runs:
        n = int(run.config.get(OFFPOLICY_N, 1))
        grouped.setdefault(n, {}).setdefault(loss_label(run), []).append(run)
    return {n: dict(sorted(grouped[n].items())) for n in sorted(grouped)}


def _seed_curve(members: Sequence[Run], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(versions, mean, std) over the members of ``key`` by generating version (the
    versions every member logged)."""
    curves = [pd.Series(v, index=x) for x, v in (generating_versions(r, key) for r in members)]
    frame = pd.concat(curves, axis=1).dropna()
    std = frame.std(axis=1, ddof=1) if frame.shape[1] > 1 else frame.iloc[:, 0] * 0
    return frame.index.to_numpy(), frame.mean(axis=1).to_numpy(), std.to_numpy()


def plot_reward_by_version(runs: Sequence[Run]):
    """Reward against the generating policy version, one panel per N, one line per loss:
    the mean over seeds with a ± std band."""
    grouped = _by_n_and_loss(runs)
    fig, axes = new_figure(1, len(grouped), width=3.6, height=3.2)
    for ax, (n, losses_) in zip(axes.flat, grouped.items(), strict=True):
        for loss, members in losses_.items():
            x, mean, std = _seed_curve(members, REWARD)
            (line,) = ax.plot(x, mean, marker=".", label=f"{loss} ({len(members)} seeds)")
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        ax.set_title(f"N = {n}", fontsize=10)
        ax.set_xlabel("generating policy version")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(REWARD)
    axes[0, 0].legend(fontsize=7)
    return fig


def plot_reward_kl_frontier(runs: Sequence[Run], *, window: int = 8):
    """The paper's reward-vs-KL picture, one panel per N: per loss the mean-over-seeds
    path (KL to the initial policy, reward) along training, and its final point (means
    over the last ``window`` + 1 versions) with ± std over seeds on both axes. Up and to
    the left is better (more reward for less drift from the initial policy)."""
    grouped = _by_n_and_loss(runs)
    fig, axes = new_figure(1, len(grouped), width=3.6, height=3.2)
    for ax, (n, losses_) in zip(axes.flat, grouped.items(), strict=True):
        for loss, members in losses_.items():
            _, reward, _ = _seed_curve(members, REWARD)
            _, kl, _ = _seed_curve(members, KL_REF)
            (line,) = ax.plot(kl, reward, alpha=0.45, linewidth=1)
            finals_r = [version_window_mean(r, REWARD, window=window) for r in members]
            finals_kl = [version_window_mean(r, KL_REF, window=window) for r in members]
            ddof = 1 if len(members) > 1 else 0
            ax.errorbar(
                np.mean(finals_kl),
                np.mean(finals_r),
                xerr=np.std(finals_kl, ddof=ddof),
                yerr=np.std(finals_r, ddof=ddof),
                color=line.get_color(),
                marker="o",
                capsize=3,
                label=f"{loss} ({len(members)} seeds)",
            )
        ax.set_title(f"N = {n}", fontsize=10)
        ax.set_xlabel(f"{KL_REF} (KL to the initial policy)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(REWARD)
    axes[0, 0].legend(fontsize=7)
    return fig


def is_offpolicy_sweep(runs: Sequence[Run]) -> bool:
    """Synchronous runs that log :data:`KL_REF` and vary N (the off-policy sweep)."""
    return (
        len(runs) > 1
        and all(r.config.get("system.mode") == "sync" and KL_REF in r.frame for r in runs)
        and len({r.config.get(OFFPOLICY_N) for r in runs}) > 1
    )


# The lab's columns: (metric, how a run is scored, column name). "masked" counts tokens left
# out of the loss by a token or sequence cap or an objective's own mask; ESS is the
# normalised effective sample size of the importance weights.
_LAB_COLUMNS = (
    (REWARD, "last", "reward final"),
    (REWARD, "area", "reward area"),
    # Under a reward model (task.reward=model:PATH) the reward is the proxy's; the gold
    # scorer's on the same samples beside it shows over-optimisation (the gap).
    (GOLD_REWARD, "last", "gold final"),
    (PROXY_SCORE, "last", "proxy score final"),
    (EVAL_ACCURACY, "end", "held-out end"),
    (KL_REF, "last", "KL to init"),
    ("loss/clipfrac", "area", "clip frac"),
    ("mismatch/masked_frac", "area", "masked frac"),
    ("mismatch/ess", "area", "ESS"),
    ("staleness/mean", "area", "staleness"),
)


def is_lab_sweep(runs: Sequence[Run]) -> bool:
    """Several configurations, some asynchronous, all logging :data:`KL_REF`: methods
    compared on stale data (not the synchronous sweep over N, :func:`is_offpolicy_sweep`)."""
    return (
        len(seed_groups(runs, "seed")[1]) > 1
        and any(r.config.get("system.mode") != "sync" for r in runs)
        and all(KL_REF in r.frame for r in runs)
    )


def _config_cell(value):
    return f"{value:g}" if isinstance(value, float) else value


def lab_table(runs: Sequence[Run], *, last_k: int = 5) -> pd.DataFrame:
    """One row per configuration (runs that differ only by seed share one): its differing
    config values, the seeds, and ``mean ± std`` over them of the final reward (mean of
    the last ``last_k`` steps), the reward area (mean over every step), the gold scorer's
    final reward (runs against a reward model), the held-out
    pass@1 at the end (of runs that evaluate), the KL to the
    initial policy over the last ``last_k`` steps, and the means over steps of the clip
    fraction, the masked fraction, the ESS of the importance weights and the staleness.
    A metric no run logged is left out."""
    keys, groups = seed_groups(runs, "seed")
    score = {
        "last": lambda r, key: last_k_mean(r, key, last_k),
        "area": lambda r, key: mean_over_steps(r, key),
        "end": final_value,
    }
    # A float config value as written (3e-05), not with the metrics' 3 decimals.
    table = pd.DataFrame(
        [{short_key(k): _config_cell(g[0].config.get(k)) for k in keys} for g in groups]
    )
    table["seeds"] = [len(g) for g in groups]
    for key, how, name in _LAB_COLUMNS:
        if all(r.series(key).empty for r in runs):
            continue
        cells = []
        for members in groups:
            values = np.array([score[how](r, key) for r in members], np.float64)
            values = values[np.isfinite(values)]
            if not values.size:  # a method without this diagnostic (DPO has no clip)
                cells.append("n/a")
                continue
            std = float(values.std(ddof=1)) if values.size > 1 else float("nan")
            cells.append(mean_std(float(values.mean()), std, values.size))
        table[name] = cells
    return table


def has_gold(runs: Sequence[Run]) -> bool:
    """Every run trained against a reward model (logs :data:`GOLD_REWARD`), evaluated on
    held-out prompts and logging :data:`KL_REF`: what :func:`plot_gold_against_kl` needs."""
    return bool(runs) and all(
        not r.series(key).empty for r in runs for key in (GOLD_REWARD, EVAL_ACCURACY, KL_REF)
    )


_MODE_MARKERS = {"sync": "o", "periodic": "s", "one_step_off": "^", "async": "D"}


def plot_gold_against_kl(runs: Sequence[Run], *, last_k: int = 5):
    """Two panels over runs trained against a learned (proxy) reward (:func:`has_gold`):
    the held-out gold pass@1 at the end against the KL to the initial policy (median of the
    last ``last_k`` steps: one step's k3 estimate can spike), the paper's picture, with the
    untrained policy's pass@1 as a dashed line; and the proxy reward model's own score
    (:data:`PROXY_SCORE`, mean of the last ``last_k`` steps; in runs that did not log it,
    the reward the policy maximised, ``reward/mean`` with any KL shaping, median of the last
    ``last_k`` steps) against the gold scorer's reward on the same samples (mean of the last
    ``last_k`` steps): proxy up while gold stays is over-optimisation. Per configuration
    (runs that differ only by seed) one faint point per seed and the mean with ± std on
    both axes; colour by loss, marker by mode."""
    keys, groups = seed_groups(runs, "seed")
    if all(not r.series(PROXY_SCORE).empty for r in runs):
        proxy_key, proxy_of = PROXY_SCORE, lambda r: last_k_mean(r, PROXY_SCORE, last_k)
    else:
        proxy_key, proxy_of = REWARD, lambda r: last_k_median(r, REWARD, last_k)
    fig, axes = new_figure(1, 2, width=5.0, height=3.8)
    held, proxy = axes[0, 0], axes[0, 1]
    colors: dict[str, str] = {}
    panels = (
        (held, lambda r: last_k_median(r, KL_REF, last_k), lambda r: final_value(r, EVAL_ACCURACY)),
        (
            proxy,
            lambda r: last_k_mean(r, GOLD_REWARD, last_k),
            proxy_of,
        ),
    )
    for members in groups:
        loss = loss_label(members[0])
        color = colors.setdefault(loss, f"C{len(colors)}")
        marker = _MODE_MARKERS.get(members[0].config.get("system.mode"), "o")
        label = f"{run_label(members[0], keys)} ({len(members)} seeds)"
        for ax, x_of, y_of in panels:
            xs = np.array([x_of(r) for r in members], np.float64)
            ys = np.array([y_of(r) for r in members], np.float64)
            ax.scatter(xs, ys, color=color, marker=marker, alpha=0.3, s=14)
            ddof = 1 if len(members) > 1 else 0
            ax.errorbar(
                xs.mean(),
                ys.mean(),
                xerr=xs.std(ddof=ddof),
                yerr=ys.std(ddof=ddof),
                color=color,
                marker=marker,
                capsize=3,
                label=label,
            )
    start = [r.series(EVAL_ACCURACY).iloc[0] for r in runs]
    held.axhline(float(np.mean(start)), color="grey", linestyle="--", linewidth=1)
    held.set_xlabel(f"KL to the initial policy ({KL_REF}, median of last {last_k})")
    held.set_ylabel(f"held-out gold pass@1, end ({EVAL_ACCURACY})")
    held.set_title("gold on held-out prompts vs KL (dashed: untrained)", fontsize=10)
    proxy.set_xlabel(f"gold reward, same samples ({GOLD_REWARD}, last {last_k})")
    what = "proxy score" if proxy_key == PROXY_SCORE else "proxy reward maximised, median"
    proxy.set_ylabel(f"{what} ({proxy_key})")
    proxy.set_title("proxy vs gold on the same samples", fontsize=10)
    for ax in (held, proxy):
        ax.grid(alpha=0.3)
    held.legend(fontsize=6)
    return fig
