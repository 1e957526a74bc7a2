"""The trainer against a separate-process gRPC inference host (tiny model): weights are
pushed over the wire with their versions and the rollouts come back stamped with them."""

import dataclasses

import pytest
from helpers.inference_reference import start_grpc_server, stop_grpc_server
from helpers.trainer_runs import LetterTask, make_cfg

from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy


def start_server(tmp_path, update_policy, *extra):
    """(process, address, token) of a tiny-model host with the given update policy."""
    token_file = tmp_path / "token"
    proc, address = start_grpc_server(
        token_file, "--num-slots", "8", "--prefill-buckets", "64", "--max-cache-len", "96",
        "--update-policy", update_policy, *extra,
    )  # fmt: skip
    return proc, address, token_file.read_text().strip()


def stop(proc):
    stop_grpc_server(proc)


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
        # A reproducible run needs a batch-invariant host: this one is not.
        cfg = make_cfg(tmp_path, "variant", mode="async", steps=1)
        cfg = dataclasses.replace(
            cfg, rollout=dataclasses.replace(cfg.rollout, batch_invariant=True)
        )
        with pytest.raises(ValueError, match="--batch-invariant"):
            Trainer(cfg, load_policy(cfg.model), host=client, task=LetterTask(), console=False)
        client.close()
    finally:
        stop(proc)


def test_a_batch_invariant_host_says_so_over_grpc(tmp_path):
    proc, address, token = start_server(tmp_path, "drain", "--batch-invariant")
    try:
        client = GrpcInferenceClient(address, token)
        assert client.stats()["batch_invariant"] is True
        client.close()
    finally:
        stop(proc)
