"""RLHF's whole pipeline offline, on the tiny model: a gold scorer (the letters task's
verifier) labels pairs of the policy's own samples (``make_preferences``), a proxy reward
model trains on them (``train_reward``), and a run trains against that proxy
(``task.reward=model:PATH``), with the gold score kept beside the proxy's in its record."""

import dataclasses
import json

import numpy as np
import pytest
from helpers.trainer_runs import make_cfg, run

from a3po_jax.cli import make_preferences, train_reward

pytestmark = pytest.mark.e2e  # a host sampling, a reward model training, a whole run


def test_gold_pairs_train_a_proxy_that_a_run_trains_against(tmp_path, capsys):
    pairs, rm = tmp_path / "pairs.jsonl", tmp_path / "rm"
    argv = ["--task", "letters", "--task-options", '{"train_size": 32}', "--model", "tiny"]
    argv += ["--prompts", "32", "--samples", "4", "--max-new-tokens", "12", "--num-slots", "16"]
    assert make_preferences.main([*argv, "--out", str(pairs)]) == 0
    lines = [json.loads(line) for line in pairs.read_text().splitlines()]
    assert len(lines) >= 8, "too few untied pairs to train on"
    assert all(p["chosen_score"] > p["rejected_score"] for p in lines)

    argv = ["--pairs", str(pairs), "--model", "tiny", "--out", str(rm), "--steps", "20"]
    argv += ["--batch-size", "8", "--lr", "1e-3", "--holdout-fraction", "0.25"]
    assert train_reward.main([*argv, "--max-length", "128", "--log-every", "10"]) == 0
    info = json.loads((rm / "reward_model.json").read_text())
    assert info["pairs"] == len(lines) and info["steps"] == 20

    cfg = make_cfg(tmp_path, "rlhf", mode="one_step_off", steps=2)
    task = dataclasses.replace(cfg.task, reward=f"model:{rm}", no_eos_penalty=0.5)
    records = run(dataclasses.replace(cfg, task=task))
    assert [r["version"] for r in records] == [1, 2]
    for r in records:
        # The proxy scored the run (its weights' version recorded); the gold score beside it.
        assert r["reward/scorer"] == f"model:{rm}@{info['version']}"
        assert np.isfinite(r["reward/mean"]) and 0 <= r["reward/gold_score_mean"] <= 1
        assert np.isfinite(r["reward/proxy_score_mean"])  # the proxy's own, unshaped
