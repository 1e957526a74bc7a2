"""scripts/bench_reproducible.py on the tiny model: one off/on pair of real runs, the ratio
printed is the ratio of the figures it reports."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_reproducible import main as bench_reproducible  # noqa: E402

pytestmark = pytest.mark.slow


def test_bench_reproducible_times_both_settings_in_turn(capsys):
    report = bench_reproducible(
        ["--experiment", "experiments/smoke_tiny.py", "--steps", "3", "--warmup", "1",
         "--rounds", "1", "system.mode=sync"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[-1])["ratios"] == report["ratios"]
    (pair,) = report["pairs"]
    off, on = pair["off"]["steps_per_hour"], pair["on"]["steps_per_hour"]
    assert off > 0 and on > 0
    assert report["ratios"] == [pytest.approx(on / off)]
    assert f"median on / off: {on / off:.2f}" in out and report["machine"]["cpu"]
    with pytest.raises(SystemExit):
        bench_reproducible(["--steps", "2", "--warmup", "2"])
