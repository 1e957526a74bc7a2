"""Split cores: a local host process on cores of its own (`LocalHostProcess`), started and
ended by the trainer (`system.placement.inference_cores`), and a host that frees the slots
of a client that went away."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers.inference_reference import collect, start_grpc_server, stop_grpc_server

from a3po_jax.inference.remote import local_process
from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient
from a3po_jax.inference.remote.local_process import LocalHostProcess
from a3po_jax.inference.transfer import shared_memory
from a3po_jax.inference.types import GenerateRequest, SamplingParams
from a3po_jax.model.loader import load_model
from a3po_jax.training import host_placement

ROOT = Path(__file__).resolve().parents[2]
CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores to split")


def allowed_cores(pid: int) -> list[int]:
    """The CPU ids process `pid` may run on (Linux)."""
    return sorted(os.sched_getaffinity(pid))


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie has exited: reaped by its parent (here, by init once orphaned)
            if (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.e2e  # starts a host process
def test_local_host_runs_on_its_cores_with_a_private_token_and_ends_at_close():
    host = LocalHostProcess(
        model="tiny", cores=CORES[:1], update_policy="drain", prefill_buckets=(16,)
    ).start()
    try:
        assert allowed_cores(host.pid) == CORES[:1]
        # The child read its token and opened its log before it served: the private folder
        # is gone, and the log is still read through the descriptor the parent holds.
        assert host.log_path is None
        mine = f"{local_process.FOLDER_PREFIX}{os.getpid()}-*"
        assert not list(Path(tempfile.gettempdir()).glob(mine))
        assert "serving" in host.log_tail()
        client = GrpcInferenceClient(host.address, host.token)
        assert client.stats()["update_policy"] == "drain"
        client.submit(
            GenerateRequest("r", (5, 6, 7), sampling=SamplingParams(0.0, max_new_tokens=3))
        )
        assert len(collect(client, 1)[("r", 0)].tokens) == 3
        # A host on the trainer's machine takes its weights through shared memory.
        client.update_weights(load_model("tiny").params, 1)
        client.wait_until_version(1, timeout=60)
        shared = shared_memory.SHARED_MEMORY
        assert bool(client.stats().get("weight_socket")) == shared
        assert client.last_push["transport"] == ("shared_memory" if shared else "tcp")
        client.close()
    finally:
        host.close()
    assert gone(host.pid, 10)


def test_core_split_leaves_the_trainer_a_core():
    with pytest.raises(ValueError, match="inference_cores=.*leave the trainer"):
        host_placement.split_cores(len(CORES))


@two_cores
@pytest.mark.e2e
def test_a_trainer_killed_with_sigkill_leaves_no_host_process(tmp_path):
    run_dir = tmp_path / "run"
    temp = tmp_path / "tmp"  # the trainer's temporary directory: the host's folder goes there
    temp.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(temp))
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "a3po_jax.cli.train",
            "experiments/smoke_tiny.py",
            "system.placement.inference_cores=1",
            f"run_dir={run_dir}",
            "steps=500",
            "checkpoint_every=0",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert trainer.poll() is None, "the trainer exited early"
            assert time.monotonic() < deadline, "no training step in 300 s"
            time.sleep(0.2)
        hosts = [p for p in children(trainer.pid) if b"a3po_jax.cli.serve" in cmdline(p)]
        assert len(hosts) == 1, children(trainer.pid)
        (host,) = hosts
        # Each on its own share of the cores.
        assert allowed_cores(host) == CORES[:1] and allowed_cores(trainer.pid) == CORES[1:]
        record = json.loads(metrics.read_text().splitlines()[-1])
        assert record["hosts/hosts_healthy"] == 1 and record["host/push_s"] > 0
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        assert gone(host, 15), "the host outlived its trainer"
        # Nothing left: the host's folder went as soon as it served.
        assert not list(temp.iterdir())
    finally:
        if trainer.poll() is None:
            trainer.kill()


def cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.e2e  # starts a gRPC server process
def test_a_host_frees_the_slots_of_a_client_that_went_away(tmp_path):
    proc, address = start_grpc_server(
        tmp_path / "token", "--num-slots", "4", "--prefill-buckets", "8", "--max-cache-len", "512"
    )
    try:
        token = (tmp_path / "token").read_text().strip()
        client = GrpcInferenceClient(address, token)
        long = SamplingParams(temperature=1.0, max_new_tokens=500)
        for i in range(3):  # 6 samples for 4 slots: some run, some wait
            client.submit(GenerateRequest(f"long{i}", (5, 6, 7), num_samples=2, sampling=long))
        watcher = GrpcInferenceClient(address, token)
        deadline = time.monotonic() + 60
        while watcher.stats()["slots_busy"] < 4:
            assert time.monotonic() < deadline, "the long requests never filled the slots"
            time.sleep(0.05)
        client.close()  # its streams end with samples owed, as when its process dies
        deadline = time.monotonic() + 20
        while (stats := watcher.stats())["slots_busy"] or stats["queue_depth"]:
            assert time.monotonic() < deadline, f"the dead client's work still runs: {stats}"
            time.sleep(0.1)
        # Nothing of it finished: it was cancelled, not served to the end.
        assert stats["samples_done"] == 0
        watcher.submit(
            GenerateRequest("next", (5, 6), sampling=SamplingParams(0.0, max_new_tokens=2))
        )
        assert len(collect(watcher, 1)[("next", 0)].tokens) == 2
        watcher.close()
    finally:
        stop_grpc_server(proc)


def test_only_the_folders_of_parents_that_no_longer_run_are_removed(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()
    prefix = local_process.FOLDER_PREFIX
    stale = tmp_path / f"{prefix}{finished.pid}-abc"
    live = tmp_path / f"{prefix}{os.getpid()}-def"  # this process runs: kept
    other = tmp_path / f"{prefix}notapid-ghi"  # not a local host's name: kept
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "host.log").write_text("log")
    assert local_process.remove_stale_folders(tmp_path) == [stale]
    assert sorted(tmp_path.iterdir()) == sorted([live, other])
