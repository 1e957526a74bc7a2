"""scripts/bench_train_step.py on a small model: the FLOPs its compiled programs run
(`bench_common.dot_flops`, read from the optimised HLO) against its analytical count."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_train_step import main, round_ratios  # noqa: E402


def test_the_programs_run_the_matmuls_the_benchmark_counts(capsys):
    args = ["--batch", "8", "--prompt-len", "24", "--response-len", "16", "--repeats", "2"]
    results = main(args)
    counted, ran = results["flops"], results["executed_dot_flops"]
    # A forward pass recomputes nothing: the compiled program's dots are the analytical F
    # exactly (two independent counts, the formula and the HLO's loops and fusions).
    assert ran["forward"] == counted["forward"]
    assert ran["layers"] == counted["layers"]
    # A backward pass runs at least the 2F of its products, plus what it recomputes.
    assert ran["forward_backward"] >= 3 * counted["forward"]
    assert ran["layers_backward"] >= 3 * counted["layers"]
    # The recompute step is the a3po step plus one no-grad forward pass.
    assert ran["recompute"] == ran["a3po"] + ran["forward"]
    ratios = results["executed_dot_flop_ratios"]
    assert ratios["fwd+bwd / fwd"] == ran["forward_backward"] / ran["forward"]
    out = capsys.readouterr().out
    assert "in the FLOPs the two programs run" in out
    assert "a3po / recompute" in out and "(rounds " in out
    # Every ratio comes with its value in each round; the ratio of the fastest runs lies
    # within their range (min a / min b is at least a_j / b_j and at most a_k / b_k).
    per_round, seconds = results["ratio_per_round"], results["seconds"]
    for name, times in results["seconds_per_round"].items():
        assert len(times) == 2 and seconds[name] == min(times)
    for what, value in (
        ("fwd+bwd / fwd", results["fwd_bwd_over_fwd"]),
        ("a3po / recompute", results["a3po_over_recompute"]),
    ):
        assert len(per_round[what]) == 2
        assert min(per_round[what]) <= value <= max(per_round[what])


def test_round_ratios_pair_the_runs_of_one_round():
    rounds = {"a": [2.0, 3.0, 1.0], "b": [4.0, 2.0, 1.0]}
    assert round_ratios(rounds, "a", "b") == [0.5, 1.5, 1.0]
