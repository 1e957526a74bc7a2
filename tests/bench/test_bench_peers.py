"""scripts/bench_peers.py at its smallest: this project's sync run and TRL's GRPOTrainer
(the test command's set-up installs TRL, the `peers` extra) on one step of 2 prompts x 2
samples of 4 tokens, and Tunix's row saying it is not installed where this interpreter lacks
it. SmolLM2 from the offline cache: nothing downloads."""

import importlib.util
import json
import sys

import pytest
from helpers.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))

from bench_peers import main  # noqa: E402

SMALLEST = ["--steps", "1", "--warmup", "0", "--prompts", "2", "--samples", "2"]


def test_each_row_is_measured_or_says_why_not(capsys):
    result = main([*SMALLEST, "--new-tokens", "4", "--tunix-python", sys.executable])
    rows = result["rows"]
    assert list(rows) == ["a3po_jax", "tunix", "trl"]
    for name in ("a3po_jax", "trl"):
        row = rows[name]
        assert row["status"] == "ran", row
        assert row["steps"] == 1
        assert 0 < row["generation_s"] and 0 < row["train_s"]
        assert row["generation_s"] + row["train_s"] <= row["step_s"] * 1.001
        assert 0 < row["tokens_per_answer"] <= 4
        assert row["peak_rss_gb"] > 0.1
    assert rows["a3po_jax"]["slots"] == result["workload"]["a3po_slots"] == 2 * 2  # the batch
    if importlib.util.find_spec("tunix") is None:
        assert rows["tunix"]["status"].startswith("not installed")
    ratio = result["ratio_step_a3po_over_peer"]["trl"]
    assert ratio == rows["a3po_jax"]["step_s"] / rows["trl"]["step_s"]
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"machine: {result['machine']['cpu']}")
    assert "| | step s | generation s | train s | tokens per answer | peak memory |" in out
    assert "a3po_jax decodes up to 4 samples at once (rollout.num_slots)" in out
    assert rows["a3po_jax"]["compile_s"] >= 0
    assert "JAX rows' compilation caches: cold (empty: " in out[2]
    assert any(line.startswith("a3po_jax compiled for ") for line in out)
    assert any(line.startswith("| TRL 1.16") for line in out)
    if rows["tunix"]["status"] != "ran":
        assert any(line.startswith("| Tunix | not installed") for line in out)
    assert any(line.startswith("a3po_jax step / TRL step: ") for line in out)
    assert json.loads(out[-1]) == json.loads(json.dumps(result))


@pytest.mark.parametrize("slots", ["0", "all", "-2"])
def test_slots_must_name_a_rule_or_a_positive_count(slots, capsys):
    with pytest.raises(SystemExit):
        main([*SMALLEST, "--slots", slots, "--only", "a3po_jax"])
    assert "--slots takes 'batch', 'experiment' or a positive number" in capsys.readouterr().err
