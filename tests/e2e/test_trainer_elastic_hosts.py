"""Inference hosts joining and leaving a running job through its membership file.

A run starts on one gRPC host process (A) with ``system.placement.hosts_file``; mid-run a
second host (B) is started with ``cli.serve --join`` and appends its own line: the pool checks its
settings, pushes it the trainer's current weights, and only then routes requests to it, so
both serve. Later B is sent SIGTERM: it removes its line, takes no new request, finishes
what it holds and stops by itself, without counting as a failure, and A serves on. The run
finishes every step within the staleness bound, the ledger's audit finds every prompt
trained exactly once or dropped with a reason, and a host asked to join once the run has
ended is refused by name. (Editing the file by hand does the same: the pool's unit tests.)
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time

import pytest
from helpers.inference_reference import start_grpc_server, stop_grpc_server
from helpers.trainer_runs import LetterTask, make_cfg

from a3po_jax.cli.train import connect_hosts
from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient
from a3po_jax.inference.remote.membership_file import read_hosts_file
from a3po_jax.inference.types import InferenceError
from a3po_jax.rollout.ledger import audit
from a3po_jax.training.config import HostsSection, PlacementSection
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

SERVER_ARGS = ("--num-slots", "8", "--prefill-buckets", "64", "--max-cache-len", "96")
STEPS = 9
JOIN_AT, LEAVE_AT = 2, 6  # steps after which B joins and leaves


def wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def test_a_host_joins_a_running_job_and_leaves_it_on_sigterm(tmp_path):
    token_file = tmp_path / "token"
    proc_a, addr_a = start_grpc_server(token_file, *SERVER_ARGS)
    procs = [proc_a]
    hosts_file = tmp_path / "hosts"
    join_args = (*SERVER_ARGS, "--join", str(hosts_file), "--leave-quiet-s", "1")
    base = make_cfg(tmp_path, "elastic", mode="async", eta=1, steps=STEPS, prox="a3po")
    cfg = dataclasses.replace(
        base,
        system=dataclasses.replace(
            base.system,
            placement=PlacementSection(
                inference_hosts=addr_a,
                hosts_file=str(hosts_file),
                host_token_file=str(token_file),
            ),
            hosts=HostsSection(
                health_interval_s=0.2, hang_timeout_s=120.0, rollout_timeout_s=300.0
            ),
        ),
    )
    pool = connect_hosts(cfg.system)  # what a3po-train builds from the same config
    assert hosts_file.read_text() == f"{addr_a}\n"  # written with the starting host
    seen: dict[str, object] = {}

    def on_step(step: int, record: dict) -> None:
        if step == JOIN_AT:  # B starts and joins by itself
            proc_b, addr_b = start_grpc_server(token_file, *join_args)
            procs.append(proc_b)
            seen["b"] = addr_b
            wait_for(lambda: pool.counters()["joined"] == 1, "B joined", 60)
            assert read_hosts_file(hosts_file) == [addr_a, addr_b]
            with GrpcInferenceClient(addr_b, token_file.read_text().strip()) as check:
                seen["b_version_on_join"] = check.version  # the trainer's, before any work
            seen["version_at_join"] = record["version"]
        elif step == LEAVE_AT:  # once B has served (its first requests compile), it leaves
            addr_b, proc_b = seen["b"], procs[1]
            wait_for(lambda: pool.counters()["served"][addr_b] > 0, "B served", 90)
            seen["served_before_leave"] = dict(pool.counters()["served"])
            proc_b.send_signal(signal.SIGTERM)
            wait_for(lambda: pool.counters()["left"] == 1, "B left", 90)
            assert proc_b.wait(timeout=90) == 0  # it stopped by itself, once idle
            assert read_hosts_file(hosts_file) == [addr_a]

    try:
        trainer = Trainer(
            cfg, load_policy(cfg.model), host=pool, task=LetterTask(), console=False,
            on_step=on_step,
        )  # fmt: skip
        trainer.run()
        records = read_metrics(cfg.run_dir)
        addr_b = seen["b"]

        # Every step ran, every trained token within the staleness bound.
        assert [r["version"] for r in records] == list(range(1, STEPS + 1))
        assert all(r["staleness/max_observed"] <= 1 for r in records)
        # B got the trainer's weights before it served, both hosts served while both were
        # in the pool, and A served on after B left (the step record counts per host).
        assert seen["b_version_on_join"] == seen["version_at_join"]
        before = seen["served_before_leave"]
        assert before[addr_a] > 0 and before[addr_b] > 0
        last = records[-1]
        assert last[f"hosts/served/{addr_b}"] > 0
        assert last[f"hosts/served/{addr_a}"] > before[addr_a]
        # Joining and leaving are not failures.
        assert last["hosts/joined"] == 1 and last["hosts/left"] == 1
        hosts = pool.counters()
        assert hosts["host_failures"] == {addr_a: 0, addr_b: 0}
        assert hosts["host_returns"] == {addr_a: 0, addr_b: 0}
        assert hosts["samples_lost"] == 0
        pool.check_invariant()
        stats = pool.stats()
        assert stats["hosts_total"] == 1 and stats["hosts"][addr_b]["state"] == "left"
        trainer.queue.check_invariant()
        result = audit(cfg.run_dir)
        assert result.ok, result.summary()
        assert result.trained == STEPS * cfg.rollout.groups_per_step
    finally:
        pool.close()
        for proc in procs:
            stop_grpc_server(proc)
    # The run has ended: a host asked to join it is refused by name, before its model loads.
    late = subprocess.run(
        [sys.executable, "-m", "a3po_jax.cli.serve", "--port", "0", "--join", str(hosts_file)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert late.returncode != 0
    assert "the run that watched this file has ended" in late.stderr


def test_hosts_that_cannot_join_are_refused_by_name(tmp_path, caplog):
    """A host with another token, or serving in another dtype, is named and kept out; a
    join to a pool that has closed (the run ended) is refused."""
    token_file = tmp_path / "token"
    proc_a, addr_a = start_grpc_server(token_file, *SERVER_ARGS)
    proc_c, addr_c = start_grpc_server(tmp_path / "other_token", *SERVER_ARGS)
    proc_d, addr_d = start_grpc_server(token_file, *SERVER_ARGS, "--param-dtype", "bfloat16")
    hosts_file = tmp_path / "hosts"
    base = make_cfg(tmp_path, "refused")
    system = dataclasses.replace(
        base.system,
        placement=PlacementSection(
            inference_hosts=addr_a, hosts_file=str(hosts_file), host_token_file=str(token_file)
        ),
        hosts=HostsSection(health_interval_s=0.2),
    )
    pool = connect_hosts(system)
    try:
        with caplog.at_level("WARNING", logger="a3po_jax.inference.remote"):
            pool.update_weights(load_policy(base.model).params, 1)
            with hosts_file.open("a") as f:
                f.write(f"{addr_c}\n{addr_d}\n")
            token_refused = f"host {addr_c} cannot join: it refused the token"
            wait_for(lambda: token_refused in caplog.text, "the wrong token refused", 60)
            dtype_refused = f"host {addr_d} cannot join the run: it serves "
            wait_for(lambda: dtype_refused in caplog.text, "the other dtype refused", 60)
            assert "in bfloat16, the run's hosts in float32" in caplog.text
        assert pool.stats()["hosts_total"] == 1 and pool.counters()["joined"] == 0
    finally:
        pool.close()
    token = token_file.read_text().strip()
    with pytest.raises(InferenceError, match=f"host {addr_d} cannot join: the host pool is closed"):
        pool.add_host(GrpcInferenceClient(addr_d, token), addr_d)
    for proc in (proc_a, proc_c, proc_d):
        stop_grpc_server(proc)
