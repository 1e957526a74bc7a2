"""scripts/bench_elastic.py at its smallest: a real run on one host process, a second that
joins with --join and leaves on SIGTERM; the table has a row per phase, every host in a
phase served in it, and every process the benchmark started has stopped (timings are not
checked: they are the machine's)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_elastic import main as bench_elastic  # noqa: E402

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="hosts on their own cores, stopped with their parent: Linux"
)


def test_bench_elastic_grows_and_shrinks_a_real_run(capsys, tmp_path):
    out = tmp_path / "elastic.json"
    args = ["--steps-per-phase", "2", "--max-hosts", "2", "--timeout-s", "600"]
    report = bench_elastic([*args, "--out", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(printed.splitlines()[-1]) == json.loads(out.read_text()) == report
    phases = report["phases"]
    assert [(p["phase"], p["hosts"]) for p in phases] == [
        ("1 host", 1), ("2 hosts", 2), ("back to 1", 1)
    ]  # fmt: skip
    for p in phases:
        assert p["steps"] >= 2 and p["median_step_s"] > 0
        assert p["steps_per_hour"] == pytest.approx(3600 / p["median_step_s"])
        # Every host of the phase delivered samples in it (a leaver may still deliver what
        # it held once the pool no longer counts it); B none before it joined.
        assert ({"A", "B"} if p["hosts"] == 2 else {"A"}) <= set(p["served"]), p
        assert list(p["served"]) == sorted(p["served"])  # A, B, C: in the order they started
        assert p["bound"] in ("generation", "training", "both busy")
    assert "B" not in phases[0]["served"]
    assert report["joined"] == 1 and report["left"] == 1 and report["host_failures"] == 0
    # The trainer stopped on SIGTERM after saving, B left by itself, A stopped last.
    assert report["exit_codes"] == {"trainer": 0, "A": 0, "B": 0}
    lines = printed.splitlines()
    head = lines.index(
        "| phase | steps | median s/step | steps/hour | samples served per host "
        "| which side waited |"
    )
    rows = lines[head + 2 : head + 2 + len(phases)]
    assert [row.split(" | ")[0] for row in rows] == [f"| {p['phase']}" for p in phases]
    assert report["machine"]["cpu"] and report["machine"]["cpu"] in printed
