"""scripts/bench_modes.py and scripts/bench_weight_push.py on the tiny model: every figure
they print comes from real runs (shared and split placements, a real push and a real
loopback), and the numbers hang together."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a3po_jax.inference.transfer import shared_memory

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_modes import main as bench_modes  # noqa: E402

pytestmark = [
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="split cores need 2 cores"),
]


def test_bench_modes_compares_the_modes_in_both_placements(capsys):
    bench_modes(["--steps", "3", "--warmup", "1", "--modes", "sync,async a3po"])
    out = capsys.readouterr().out
    report = json.loads(out.splitlines()[-1])
    assert set(report["results"]) == {"shared", "split"}
    for placement, by_mode in report["results"].items():
        assert set(by_mode) == {"sync", "async a3po"}
        for mode, r in by_mode.items():
            assert r["steps_per_hour"] > 0 and r["trained_tokens_per_s"] > 0, (placement, mode)
            assert 0 <= r["trainer_busy"] <= 1
            # Staleness as the mode allows: none in sync, at most η = 2 in async.
            assert r["staleness_max"] <= (0 if mode == "sync" else 2)
        assert report["bounds"][placement] >= 1.0
    # A split push is measured until it lands on the host: longer than the trainer is held.
    split_sync = report["results"]["split"]["sync"]
    assert split_sync["push_s"] >= split_sync["push_held_s"] > 0
    assert "bound (G + T + P) / max(G, T + P)" in out and report["machine"]["cpu"]


def test_bench_weight_push_measures_the_push_beside_the_loopback():
    done = subprocess.run(
        [sys.executable, "scripts/bench_weight_push.py", "--model", "tiny", "--repeats", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["wire_bytes"] == report["model_bytes"] > 0
    seconds = report["seconds"]
    (first,) = seconds.pop("first push (fresh memory)")
    assert first > 0
    # An idle host lays out its share of the layers of a shared-memory push itself.
    share = seconds.pop("  host lays out its share")
    assert (min(share) > 0) == shared_memory.SHARED_MEMORY
    assert all(len(v) == 2 and min(v) > 0 for v in seconds.values())
    assert report["push_gbps"] > 0 and report["loopback_gbps"] > 0
    # Over TCP and, where the platform has it, through shared memory, side by side.
    assert min(seconds["push over TCP (call -> serving)"]) > 0 and report["tcp_over_push"] > 0
    shared = shared_memory.SHARED_MEMORY
    assert report["transport"] == ("shared_memory" if shared else "tcp")
    # The push includes the receive it reports: never faster than its own part.
    assert min(seconds["push (call -> serving)"]) >= min(seconds["  host receive"])
    assert report["host_cores"] and report["trainer_cores"]
    assert not set(report["host_cores"]) & set(report["trainer_cores"])


def test_bench_weight_push_between_devices_in_one_process():
    done = subprocess.run(
        [sys.executable, "scripts/bench_weight_push.py", "--placement", "devices"]
        + ["--model", "tiny", "--repeats", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["placement"] == "devices" and len(report["seconds"]) == 2
    assert report["push_gbps"] > 0 and "over 1 other device(s)" in done.stdout
    # From an FSDP trainer on 2 devices, as a run pushes; none of it through host memory.
    assert report["trainer_devices"] == 2 and report["host_memory_bytes"] == 0
