"""The off-policy robustness analysis (analysis/offpolicy.py): rewards read against the
policy version that generated them, final reward / area / KL per (loss, N) over seeds, the
frontier plots, and the committed toy sweep read through them."""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pandas", reason="needs the analysis extra: pip install 'a3po_jax[analysis]'")
pytest.importorskip(
    "matplotlib", reason="needs the analysis extra: pip install 'a3po_jax[analysis]'"
)

from a3po_jax.analysis import results  # noqa: E402
from a3po_jax.training.config import (  # noqa: E402
    AlgoSection,
    RolloutSection,
    SystemSection,
    TrainConfig,
)

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "results" / "offpolicy_robustness_toy"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root, name, *, n, rewards, kls, loss="ppo", advantage="grpo", seed=0):
    """A sync run with N = n minibatches: step i (1-based) ends at version i·n and its
    samples came from version (i - 1)·n."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=2, groups_per_step=2 * n),
        algo=AlgoSection(loss=loss, advantage=advantage, num_minibatches=n, track_ref_kl=True),
        system=SystemSection(mode="sync", max_staleness=0),
        seed=seed,
        steps=len(rewards),
        run_dir=str(run_dir),
    )
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    records = [
        {
            "step": i + 1,
            "wall_time": float(i),
            "version": (i + 1) * n,
            "reward/mean": r,
            "kl/ref_k3": k,
        }
        for i, (r, k) in enumerate(zip(rewards, kls, strict=True))
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_generating_versions_window_and_area(tmp_path):
    write_run(tmp_path, "a", n=4, rewards=[0.0, 0.2, 0.4, 0.6, 0.8], kls=[0, 1, 2, 3, 4])
    (run,) = results.load_runs([tmp_path])
    versions, rewards = results.generating_versions(run)
    np.testing.assert_array_equal(versions, [0, 4, 8, 12, 16])
    np.testing.assert_allclose(rewards, [0.0, 0.2, 0.4, 0.6, 0.8])
    # The last 9 versions (8..16) hold the steps generated at 8, 12 and 16.
    assert results.version_window_mean(run, window=8) == pytest.approx(0.6)
    assert results.version_window_mean(run, "kl/ref_k3", window=8) == pytest.approx(3.0)
    # A straight line from 0 to 0.8 over versions 0..16: mean height 0.4.
    assert results.version_area(run) == pytest.approx(0.4)
    assert results.loss_label(run) == "ppo"


def test_generating_versions_refuses_an_async_run(tmp_path):
    run_dir = write_run(tmp_path, "a", n=1, rewards=[0.1, 0.2], kls=[0, 1])
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["system"]["mode"] = "async"
    (run_dir / "config.json").write_text(json.dumps(cfg))
    (run,) = results.load_runs([tmp_path])
    with pytest.raises(ValueError, match="not a system.mode=sync run"):
        results.generating_versions(run)


def test_table_over_seeds_and_the_frontier_plots(tmp_path):
    # N = 1: 9 steps, rewards 0..0.8; N = 8: 2 steps. Two losses, two seeds each.
    for seed, shift in ((0, 0.0), (1, 0.1)):
        for loss, advantage, label in (("dpo", "grpo", "dpo"), ("ppo", "rloo", "rloo")):
            write_run(
                tmp_path,
                f"{label}_n1_s{seed}",
                n=1,
                loss=loss,
                advantage=advantage,
                seed=seed,
                rewards=[0.1 * i + shift for i in range(9)],
                kls=[0.0] * 9,
            )
            write_run(
                tmp_path,
                f"{label}_n8_s{seed}",
                n=8,
                loss=loss,
                advantage=advantage,
                seed=seed,
                rewards=[0.0 + shift, 0.4 + shift],
                kls=[0.0, 1.0],
            )
    runs = results.load_runs([tmp_path])
    assert results.is_offpolicy_sweep(runs)
    table = results.offpolicy_table(runs)
    assert list(zip(table["N"], table["loss"], strict=True)) == [
        (1, "dpo"),
        (1, "rloo"),
        (8, "dpo"),
        (8, "rloo"),
    ]
    assert (table["seeds"] == 2).all()
    n1 = table[(table["N"] == 1) & (table["loss"] == "dpo")].iloc[0]
    # Seed 0: mean of 0..0.8 = 0.4; seed 1: 0.5. Area: same (linear). Std of (0.4, 0.5).
    assert n1["reward_final_mean"] == pytest.approx(0.45)
    assert n1["reward_final_std"] == pytest.approx(np.std([0.4, 0.5], ddof=1))
    assert n1["reward_area_mean"] == pytest.approx(0.45)
    n8 = table[(table["N"] == 8) & (table["loss"] == "rloo")].iloc[0]
    assert n8["reward_final_mean"] == pytest.approx(0.25)  # versions 0 and 8 both in window
    assert n8["KL_mean"] == pytest.approx(0.5)
    text = results.offpolicy_markdown(table)
    assert "| 8 | rloo | 2 | 0.250 ± 0.071 |" in text
    for fig in (results.plot_reward_by_version(runs), results.plot_reward_kl_frontier(runs)):
        assert len(fig.axes) == 2  # one panel per N
    out = tmp_path / "out"
    path = results.write_summary(runs, out)
    assert "## Off-policy robustness" in path.read_text()
    for png in ("frontier.png", "reward_by_version.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC


def test_the_committed_toy_sweep():
    # 3 losses x N in {1, 2, 4, 8} x 3 seeds, every run at 32 updates, KL logged.
    runs = results.load_runs([COMMITTED])
    assert len(runs) == 36 and results.is_offpolicy_sweep(runs)
    for run in runs:
        versions, _ = results.generating_versions(run)
        assert versions[0] == 0 and versions[-1] == 32, run.name
    table = results.offpolicy_table(runs)
    assert (table["seeds"] == 3).all() and len(table) == 12
    assert np.isfinite(table["KL_mean"]).all()


def write_lab_run(root, name, *, prox, seed, rewards, kls, clip, ess, mode="async"):
    """An asynchronous run of the off-policy lab: per step reward, KL to init, clip
    fraction and ESS."""
    run_dir = write_run(root, name, n=2, rewards=rewards, kls=kls, seed=seed)
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["system"]["mode"] = mode
    cfg["system"]["max_staleness"] = 3
    cfg["algo"]["prox"] = prox
    (run_dir / "config.json").write_text(json.dumps(cfg))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record, c, e in zip(records, clip, ess, strict=True):
        record.update({"loss/clipfrac": c, "mismatch/ess": e})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_lab_table_per_method_over_seeds(tmp_path):
    write_lab_run(
        tmp_path,
        "naive0",
        prox="behav",
        seed=0,
        rewards=[0.1, 0.1, 0.0],
        kls=[0, 1, 3],
        clip=[0.2, 0.4, 0.6],
        ess=[1.0, 0.5, 0.6],
    )
    write_lab_run(
        tmp_path,
        "naive1",
        prox="behav",
        seed=1,
        rewards=[0.1, 0.3, 0.2],
        kls=[0, 1, 5],
        clip=[0.0, 0.2, 0.4],
        ess=[1.0, 0.7, 0.8],
    )
    write_lab_run(
        tmp_path,
        "rec0",
        prox="recompute",
        seed=0,
        rewards=[0.1, 0.5, 0.9],
        kls=[0, 1, 2],
        clip=[0.0, 0.1, 0.2],
        ess=[1.0, 0.9, 0.8],
    )
    runs = results.load_runs([tmp_path])
    assert results.is_lab_sweep(runs) and not results.is_offpolicy_sweep(runs)
    table = results.lab_table(runs, last_k=2).set_index("prox")
    naive, rec = table.loc["behav"], table.loc["recompute"]
    assert naive["seeds"] == 2 and rec["seeds"] == 1
    # Final = mean of the last 2 steps: seed 0 0.05, seed 1 0.25 -> 0.150 ± 0.141.
    assert naive["reward final"] == "0.150 ± 0.141"
    # Area = mean over every step: 0.0667 and 0.2 -> 0.133 ± 0.094.
    assert naive["reward area"] == "0.133 ± 0.094"
    assert naive["KL to init"] == "2.500 ± 0.707"  # last 2 steps: (1 + 3) / 2, (1 + 5) / 2
    assert naive["clip frac"] == "0.300 ± 0.141"
    assert rec["reward final"] == "0.700" and rec["ESS"] == "0.900"
    assert "masked frac" not in table  # no run logged it
    assert "held-out end" not in table  # no run evaluated
    assert "gold final" not in table  # no run trained against a reward model
    # Held-out pass@1 logged at step 0 and at the end: the table takes the last.
    for name, end in (("naive0", 0.25), ("naive1", 0.75)):
        path = tmp_path / name / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        records[0]["eval/accuracy"], records[-1]["eval/accuracy"] = 0.5, end
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg_path = tmp_path / "rec0" / "config.json"  # a learning rate of its own
    cfg = json.loads(cfg_path.read_text())
    cfg["optim"]["learning_rate"] = 3e-5
    cfg_path.write_text(json.dumps(cfg))
    table = results.lab_table(results.load_runs([tmp_path]), last_k=2).set_index("prox")
    assert table.loc["behav", "held-out end"] == "0.500 ± 0.354"
    assert table.loc["recompute", "held-out end"] == "n/a"  # this run did not evaluate
    assert table.loc["recompute", "learning_rate"] == "3e-05"  # a config value, not 0.000
    # Against a reward model, the gold scorer's reward on the same samples sits beside it.
    path = tmp_path / "rec0" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record, gold in zip(records, [0.1, 0.2, 0.4], strict=True):
        record["reward/gold_score_mean"] = gold
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = results.lab_table(results.load_runs([tmp_path]), last_k=2).set_index("prox")
    assert table.loc["recompute", "gold final"] == "0.300"  # (0.2 + 0.4) / 2
    assert table.loc["behav", "gold final"] == "n/a"
    (tmp_path / "naive1" / "metrics.jsonl").write_text(
        "".join(
            json.dumps({k: v for k, v in json.loads(line).items() if k != "mismatch/ess"}) + "\n"
            for line in (tmp_path / "naive1" / "metrics.jsonl").read_text().splitlines()
        )
    )
    (tmp_path / "naive0").rename(tmp_path / "elsewhere")  # naive1 alone: no ESS logged
    runs = [r for r in results.load_runs([tmp_path]) if r.name != "elsewhere"]
    assert results.lab_table(runs, last_k=2).set_index("prox").loc["behav", "ESS"] == "n/a"
    text = Path(results.write_summary(runs, tmp_path / "out")).read_text()
    assert "## Methods on stale data" in text


def write_gold_run(root, name, *, loss, mode, seed, proxy, gold, kls, held_out):
    """A run against a learned reward: per step the proxy reward, the gold scorer's on the
    same samples and the KL to init; the held-out gold pass@1 at the start (0.3) and end."""
    run_dir = write_run(root, name, n=1, rewards=proxy, kls=kls, loss=loss, seed=seed)
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["system"]["mode"] = mode
    (run_dir / "config.json").write_text(json.dumps(cfg))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record, g in zip(records, gold, strict=True):
        record["reward/gold_score_mean"] = g
    records[0]["eval/accuracy"], records[-1]["eval/accuracy"] = 0.3, held_out
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_gold_against_kl_and_proxy_against_gold(tmp_path):
    for seed, shift in ((0, 0.0), (1, 0.2)):
        write_gold_run(
            tmp_path,
            f"dpo_sync_s{seed}",
            loss="dpo",
            mode="sync",
            seed=seed,
            proxy=[0.0, 1.0, 2.0],
            gold=[0.1, 0.2, 0.3 + shift],
            kls=[0.0, 0.5, 1.0 + shift],
            held_out=0.4 + shift,
        )
        write_gold_run(
            tmp_path,
            f"ppo_async_s{seed}",
            loss="ppo",
            mode="async",
            seed=seed,
            proxy=[0.0, 2.0, 4.0],
            gold=[0.1, 0.1, 0.1],
            kls=[0.0, 2.0, 4.0],
            held_out=0.2,
        )
    runs = results.load_runs([tmp_path])
    assert results.has_gold(runs)
    fig = results.plot_gold_against_kl(runs, last_k=2)
    held, proxy = fig.axes
    points = {
        (ax.get_title()[:4], c.get_label().split()[0]): tuple(c.lines[0].get_xydata()[0])
        for ax in (held, proxy)
        for c in ax.containers
    }
    # dpo: KL over the last 2 steps (0.5 + 1.0) / 2 and (0.5 + 1.2) / 2 -> 0.8; held-out at
    # the end 0.4 and 0.6 -> 0.5. Proxy (1 + 2) / 2 = 1.5 against gold 0.25 and 0.35 -> 0.3.
    np.testing.assert_allclose(points[("gold", "loss=dpo")], (0.8, 0.5))
    np.testing.assert_allclose(points[("prox", "loss=dpo")], (0.3, 1.5))
    np.testing.assert_allclose(points[("gold", "loss=ppo")], (3.0, 0.2))
    np.testing.assert_allclose(points[("prox", "loss=ppo")], (0.1, 3.0))
    (dashed,) = held.get_lines()[-1:]
    np.testing.assert_allclose(dashed.get_ydata(), [0.3, 0.3])  # the untrained policy
    out = tmp_path / "out"
    results.write_summary(runs, out)
    assert (out / "gold.png").read_bytes()[:8] == PNG_MAGIC
    # Runs that log the reward model's own, unshaped, score: that against the gold.
    for run_dir in tmp_path.iterdir():
        path = run_dir / "metrics.jsonl"
        if not path.exists():
            continue
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for record in records:
            record["reward/proxy_score_mean"] = record["reward/mean"] / 10
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = results.load_runs([tmp_path])
    proxy = results.plot_gold_against_kl(runs, last_k=2).axes[1]
    assert "reward/proxy_score_mean" in proxy.get_ylabel()
    means = {c.get_label().split()[0]: c.lines[0].get_xydata()[0] for c in proxy.containers}
    np.testing.assert_allclose(means["loss=dpo"], (0.3, 0.15))
    table = results.lab_table(runs, last_k=2).set_index("loss")
    assert table.loc["dpo", "proxy score final"] == "0.150 ± 0.000"
    # A run scored by the verifier alone has no gold column: no such figure.
    (tmp_path / "verifier").mkdir()
    write_run(tmp_path / "verifier", "v", n=1, rewards=[0.1, 0.2], kls=[0.0, 0.1])
    assert not results.has_gold(results.load_runs([tmp_path]))


def test_last_k_median_ignores_one_spiking_step(tmp_path):
    # One step's k3 estimate at 23 among KLs near 0.3: the median stays, the mean does not.
    write_run(tmp_path, "a", n=1, rewards=[0.0] * 4, kls=[9.0, 0.2, 23.0, 0.3])
    (run,) = results.load_runs([tmp_path])
    assert results.last_k_median(run, "kl/ref_k3", 3) == pytest.approx(0.3)
    assert results.last_k_mean(run, "kl/ref_k3", 3) == pytest.approx(23.5 / 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        results.last_k_median(run, "kl/ref_k3", 0)
