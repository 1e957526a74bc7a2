"""Table cells of a committed run, as the docs print them, from its records with the run
report's own reductions (`a3po_jax.analysis.run_report`): the README's main-job table and
the reproduction report's edge table share them."""

from a3po_jax.analysis.run_report import REWARD, reward_window, series


def evaluations(records):
    """The first and the last held-out evaluation records."""
    evals = [r for r in records if "eval/accuracy" in r]
    return evals[0], evals[-1]


def held_out_cell(records) -> str:
    """``0.305 → 0.562 [0.476, 0.645]``: pass@1 at the start, at the end and its interval."""
    first, last = evaluations(records)
    return (
        f"{first['eval/accuracy']:.3f} → {last['eval/accuracy']:.3f} "
        f"[{last['eval/ci95_low']:.3f}, {last['eval/ci95_high']:.3f}]"
    )


def reward_cell(records) -> str:
    """``0.329 → 0.657``: training reward over the first and the last report window."""
    _, reward = series([r for r in records if r["step"] >= 1], REWARD)
    k = reward_window(len(reward))
    return f"{reward[:k].mean():.3f} → {reward[-k:].mean():.3f}"
