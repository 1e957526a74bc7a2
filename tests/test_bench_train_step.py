"""scripts/bench_train_step.py on a small model: the FLOPs its compiled programs run
(`bench_common.dot_flops`, read from the optimised HLO) against its analytical count."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_train_step import main  # noqa: E402


def test_the_programs_run_the_matmuls_the_benchmark_counts(capsys):
    args = ["--batch", "8", "--prompt-len", "24", "--response-len", "16", "--repeats", "1"]
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
    assert "in the FLOPs the two programs run" in capsys.readouterr().out
