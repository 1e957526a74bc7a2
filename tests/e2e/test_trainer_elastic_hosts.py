"""Inference hosts joining and leaving a running job through its membership file.

A run starts on one gRPC host process (A) with ``system.hosts_file``; mid-run a second host
(B) is started and its address appended to the file: the pool checks its settings, pushes it
the trainer's current weights, and only then routes requests to it, so both serve. Later A's
line is removed: A takes no new request, finishes (or hands back) what it holds, and leaves
without counting as a failure. The run finishes every step within the staleness bound, and
the ledger's audit finds every prompt trained exactly once or dropped with a reason.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from helpers.inference_reference import start_grpc_server, stop_grpc_server
from helpers.trainer_runs import LetterTask, make_cfg

from a3po_jax.cli.train import connect_hosts
from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient
from a3po_jax.inference.types import InferenceError
from a3po_jax.rollout.ledger import audit
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

SERVER_ARGS = ("--num-slots", "8", "--prefill-buckets", "64", "--max-cache-len", "96")
STEPS = 9
JOIN_AT, LEAVE_AT = 2, 6  # steps after which B is added and A removed


def wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def test_a_host_joins_and_another_leaves_a_running_job_through_the_hosts_file(tmp_path):
    token_file = tmp_path / "token"
    proc_a, addr_a = start_grpc_server(token_file, *SERVER_ARGS)
    procs = [proc_a]
    hosts_file = tmp_path / "hosts"
    base = make_cfg(tmp_path, "elastic", mode="async", eta=1, steps=STEPS, prox="a3po")
    cfg = dataclasses.replace(
        base,
        system=dataclasses.replace(
            base.system,
            inference_hosts=addr_a,
            hosts_file=str(hosts_file),
            host_token_file=str(token_file),
            host_health_interval_s=0.2,
            host_hang_timeout_s=120.0,
            rollout_timeout_s=300.0,
        ),
    )
    pool = connect_hosts(cfg.system)  # what a3po-train builds from the same config
    assert hosts_file.read_text() == f"{addr_a}\n"  # written with the starting host
    seen: dict[str, object] = {}

    def on_step(step: int, record: dict) -> None:
        if step == JOIN_AT:  # B starts and is added to the file
            proc_b, addr_b = start_grpc_server(token_file, *SERVER_ARGS)
            procs.append(proc_b)
            seen["b"] = addr_b
            with hosts_file.open("a") as f:
                f.write(f"{addr_b}\n")
            wait_for(lambda: pool.counters()["joined"] == 1, "B joined", 60)
            with GrpcInferenceClient(addr_b, token_file.read_text().strip()) as check:
                seen["b_version_on_join"] = check.version  # the trainer's, before any work
            seen["version_at_join"] = record["version"]
        elif step == LEAVE_AT:  # once B has served (its first requests compile), A is removed
            addr_b = seen["b"]
            wait_for(lambda: pool.counters()["served"][addr_b] > 0, "B served", 90)
            seen["served_before_leave"] = dict(pool.counters()["served"])
            hosts_file.write_text(f"{seen['b']}\n")
            wait_for(lambda: pool.counters()["left"] == 1, "A left", 90)

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
        # in the pool, and B served on after A left (the step record counts per host).
        assert seen["b_version_on_join"] == seen["version_at_join"]
        before = seen["served_before_leave"]
        assert before[addr_a] > 0 and before[addr_b] > 0
        last = records[-1]
        assert last[f"hosts/served/{addr_a}"] > 0
        assert last[f"hosts/served/{addr_b}"] > before[addr_b]
        # Joining and leaving are not failures.
        assert last["hosts/joined"] == 1 and last["hosts/left"] == 1
        hosts = pool.counters()
        assert hosts["host_failures"] == {addr_a: 0, addr_b: 0}
        assert hosts["host_returns"] == {addr_a: 0, addr_b: 0}
        assert hosts["samples_lost"] == 0
        pool.check_invariant()
        stats = pool.stats()
        assert stats["hosts_total"] == 1 and stats["hosts"][addr_a]["state"] == "left"
        trainer.queue.check_invariant()
        result = audit(cfg.run_dir)
        assert result.ok, result.summary()
        assert result.trained == STEPS * cfg.rollout.groups_per_step
    finally:
        pool.close()
        for proc in procs:
            stop_grpc_server(proc)


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
        inference_hosts=addr_a,
        hosts_file=str(hosts_file),
        host_token_file=str(token_file),
        host_health_interval_s=0.2,
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
