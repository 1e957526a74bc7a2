"""scripts/bench_reproducible.py on the tiny model: one round of real runs in each setting;
the ratios printed are the ratios of the figures it reports, and the lockstep run kept its
asynchrony."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_reproducible import main as bench_reproducible  # noqa: E402


def test_bench_reproducible_times_every_setting_in_turn(capsys):
    report = bench_reproducible(
        ["--experiment", "experiments/smoke_tiny.py", "--steps", "4", "--warmup", "1",
         "--rounds", "1", "--lockstep-steps", "2"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[-1])["summary"] == report["summary"]
    (results,) = report["rounds"]
    base = results["timed"]["steps_per_hour"]
    for label in ("timed", "invariant", "lockstep"):
        rate = results[label]["steps_per_hour"]
        assert rate > 0
        assert report["summary"][label]["median_ratio"] == pytest.approx(rate / base)
        assert f"{label}: median {rate / base:.2f} x timed" in out
    # smoke_tiny is async with η = 2: the lockstep run trained stale tokens, none past η.
    staleness = {int(v) for v, c in report["summary"]["lockstep"]["staleness"].items() if c}
    assert staleness and max(staleness) <= 2
    assert report["machine"]["cpu"]
    with pytest.raises(SystemExit):
        bench_reproducible(["--steps", "2", "--warmup", "2"])
