"""The trainer against a separate-process gRPC inference host (tiny model): weights are
pushed over the wire with their versions and the rollouts come back stamped with them."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_trainer_e2e import LetterTask, make_cfg

from a3po_jax.inference.grpc_client import GrpcInferenceClient
from a3po_jax.inference.grpc_server import READY_LINE
from a3po_jax.metrics_logging import read_metrics
from a3po_jax.trainer import Trainer, load_policy

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def start_server(tmp_path, update_policy):
    token_file = tmp_path / "token"
    cmd = [
        sys.executable, "-m", "a3po_jax.inference.grpc_server", "--model", "tiny", "--port", "0",
        "--token-file", str(token_file), "--num-slots", "8", "--prefill-buckets", "64",
        "--max-cache-len", "96", "--update-policy", update_policy,
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    address = []

    def read_ready():
        for line in proc.stdout:
            if line.startswith(READY_LINE):
                address.append(line.split()[1])
                return

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(timeout=180)
    if not address:
        proc.kill()
        pytest.fail("gRPC server did not start")
    return proc, address[0], token_file.read_text().strip()


def stop(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_async_training_through_a_grpc_host(tmp_path):
    proc, address, token = start_server(tmp_path, "in_flight")
    try:
        cfg = make_cfg(tmp_path, "grpc", mode="async", eta=1, steps=3, prox="a3po")
        client = GrpcInferenceClient(address, token)
        Trainer(cfg, load_policy(cfg.model), host=client, task=LetterTask(), console=False).run()
        records = read_metrics(cfg.run_dir)
        assert [r["version"] for r in records] == [1, 2, 3]
        assert all(r["staleness/max_observed"] <= 1 for r in records)
        check = GrpcInferenceClient(address, token)
        check.wait_until_version(3)  # the last push reached the host
        check.close()
        client.close()
    finally:
        stop(proc)


def test_mode_and_host_update_policy_must_agree(tmp_path):
    proc, address, token = start_server(tmp_path, "in_flight")
    try:
        cfg = make_cfg(tmp_path, "bad", mode="periodic", steps=1)
        client = GrpcInferenceClient(address, token)
        with pytest.raises(ValueError, match="update policy 'drain'"):
            Trainer(cfg, load_policy(cfg.model), host=client, task=LetterTask(), console=False)
        client.close()
    finally:
        stop(proc)
