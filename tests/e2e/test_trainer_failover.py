"""Inference-host loss under a real training run: two gRPC host processes behind a HostPool.

During one asynchronous run (tiny model, letters task) host A is killed with SIGKILL, later
restarted on the same port, and host B is frozen with SIGSTOP, later resumed. The run must
finish every step with nothing trained twice or half-used, each host must be noticed down
within the health timeout and taken back with the trainer's current weights, and the
counters must add up: groups produced = consumed + dropped (+ still queued), samples
requested = delivered + lost (+ outstanding).
"""

from __future__ import annotations

import dataclasses
import signal
import time

import pytest
from helpers.inference_reference import start_grpc_server, stop_grpc_server
from helpers.trainer_runs import LetterTask, make_cfg

from a3po_jax.cli.train import connect_hosts
from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient
from a3po_jax.training.config import HostsSection, PlacementSection
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

SERVER_ARGS = ("--num-slots", "8", "--prefill-buckets", "64", "--max-cache-len", "96")
HOST_TIMEOUT_S = 5.0  # stats deadline: a frozen host is down after this long
# No-progress ("hung") timeout: longer than a fresh host's first compile on a busy 2-core
# CPU, which generates nothing for a while (a hung-but-answering host is covered by
# tests/inference/test_inference_pool.py).
HANG_TIMEOUT_S = 120.0
STEPS = 12


def wait_for(condition, what: str, timeout: float) -> float:
    """Seconds until `condition()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_training_survives_a_killed_and_a_frozen_host(tmp_path):
    token_file = tmp_path / "token"  # one token for both hosts (the second reads the file)
    proc_a, addr_a = start_grpc_server(token_file, *SERVER_ARGS)
    proc_b, addr_b = start_grpc_server(token_file, *SERVER_ARGS)
    procs = {"a": proc_a, "b": proc_b}
    base = make_cfg(tmp_path, "failover", mode="async", eta=1, steps=STEPS, prox="a3po")
    cfg = dataclasses.replace(
        base,
        system=dataclasses.replace(
            base.system,
            placement=PlacementSection(
                inference_hosts=f"{addr_a},{addr_b}", host_token_file=str(token_file)
            ),
            hosts=HostsSection(
                timeout_s=HOST_TIMEOUT_S,
                hang_timeout_s=HANG_TIMEOUT_S,
                health_interval_s=0.2,
                rollout_timeout_s=300.0,
            ),
        ),
    )
    pool = connect_hosts(cfg.system)  # what a3po-train builds from the same config
    timeline: dict[str, float] = {}

    def healthy(address: str) -> bool:
        return pool.stats()["hosts"][address]["healthy"]

    def returns(address: str) -> int:
        return pool.counters()["host_returns"][address]

    def on_step(step: int, record: dict) -> None:
        if step == 2:  # A dies
            procs["a"].send_signal(signal.SIGKILL)
            procs["a"].wait()
            timeline["a_down_s"] = wait_for(lambda: not healthy(addr_a), "A marked down", 60)
        elif step == 4:  # A comes back on the same address, with weights of its own
            port = addr_a.rsplit(":", 1)[1]
            procs["a"], _ = start_grpc_server(token_file, *SERVER_ARGS, "--port", port)
            wait_for(lambda: returns(addr_a) >= 1, "A taken back", 120)
            with GrpcInferenceClient(addr_a, token_file.read_text().strip()) as check:
                timeline["a_version_on_return"] = check.version
            timeline["a_expected_version"] = record["version"]
        elif step == 7:  # B freezes: its calls time out
            procs["b"].send_signal(signal.SIGSTOP)
            timeline["b_down_s"] = wait_for(lambda: not healthy(addr_b), "B marked down", 60)
        elif step == 9:  # B wakes up with its old work, which must not be used
            procs["b"].send_signal(signal.SIGCONT)
            wait_for(lambda: returns(addr_b) >= 1, "B taken back", 60)

    try:
        trainer = Trainer(
            cfg,
            load_policy(cfg.model),
            host=pool,
            task=LetterTask(),
            console=False,
            on_step=on_step,
        )
        trainer.run()
        records = read_metrics(cfg.run_dir)

        # Every step ran, on whole groups, within the staleness bound.
        assert [r["version"] for r in records] == list(range(1, STEPS + 1))
        assert all(r["staleness/max_observed"] <= 1 for r in records)
        queue = trainer.queue.counters()
        assert queue["consumed_groups"] == STEPS * cfg.rollout.groups_per_step
        trainer.queue.check_invariant()  # produced = consumed + dropped + still queued

        # Each failure was noticed within the health timeout (plus scheduling slack), and
        # the returning host was given the trainer's weights before any work.
        assert timeline["a_down_s"] < 2 * HOST_TIMEOUT_S
        assert timeline["b_down_s"] < 3 * HOST_TIMEOUT_S
        assert timeline["a_version_on_return"] == timeline["a_expected_version"]

        hosts = pool.counters()
        pool.check_invariant()  # requested = delivered + lost + outstanding
        assert hosts["host_failures"] == {addr_a: 1, addr_b: 1}
        assert hosts["host_returns"] == {addr_a: 1, addr_b: 1}
        assert hosts["samples_delivered"] + hosts["samples_lost"] > 0
        stats = pool.stats()
        assert stats["hosts_healthy"] == 2 and stats["version"] == STEPS
        # The counters are in the run's metrics, per host.
        last = records[-1]
        assert last[f"hosts/host_failures/{addr_a}"] == 1
        assert "hosts/reissued_requests" in last and "queue/dropped_total" in last
        # Dropped groups (if any) carry the reason the host gave.
        dropped = {k for k, v in last.items() if k.startswith("queue/dropped_groups/") and v}
        assert dropped <= {"queue/dropped_groups/host_lost", "queue/dropped_groups/stale"}
    finally:
        pool.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                stop_grpc_server(proc)
