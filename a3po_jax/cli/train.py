"""Command line: ``a3po-train EXPERIMENT.py [section.field=value ...] [--resume]``.

Examples::

    a3po-train experiments/quickstart_a3po.py
    a3po-train experiments/quickstart_a3po.py algo.prox=recompute steps=10 run_dir=runs/rc
    a3po-train experiments/quickstart_a3po.py --resume          # continue from checkpoints
    a3po-train --print-config experiments/quickstart_a3po.py    # show the resolved config

With ``system.inference_hosts`` empty the inference host is embedded in this process;
otherwise the trainer talks to the gRPC hosts at those addresses (see
``python -m a3po_jax.inference.grpc_server``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from a3po_jax.training.config import ConfigError, apply_overrides, load_experiment


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="a3po-train", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("experiment", help="experiment file with a config() function")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument("--log-level", default="WARNING", help="Python logging level")
    # Intermixed: flags may come before, between or after the key=value overrides.
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = apply_overrides(load_experiment(args.experiment), args.overrides)
    except ConfigError as err:
        print(f"a3po-train: config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0

    # Several processes (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, as
    # scripts/launch.py sets them) join one job before anything touches a device.
    from a3po_jax.parallel import distributed

    try:
        setup = distributed.initialize()
    except ValueError as err:
        print(f"a3po-train: distributed setup: {err}", file=sys.stderr)
        return 2
    leader = setup.process_id == 0

    # Heavy imports only once the config is known to be good.
    from a3po_jax.training.trainer import Trainer, load_policy

    print(
        f"a3po-train[{setup.process_id}/{setup.num_processes}]: mode={cfg.system.mode} "
        f"prox={cfg.algo.prox} loss={cfg.algo.loss} "
        f"model={cfg.model.name} task={cfg.task.name} steps={cfg.steps} -> {cfg.run_dir}",
        file=sys.stderr,
    )
    from a3po_jax.tasks import make_task

    try:  # the task first: a bad task.options fails in a second, not after loading a model
        task = make_task(cfg.task.name, **cfg.task.kwargs)
    except (TypeError, ValueError) as err:
        print(
            f"a3po-train: config error: task.name={cfg.task.name!r} with "
            f"task.options={cfg.task.options}: {err}",
            file=sys.stderr,
        )
        return 2
    policy = load_policy(cfg.model)
    host = None
    if cfg.system.inference_hosts and leader:  # only process 0 talks to the hosts
        host = connect_hosts(cfg.system)
    trainer = Trainer(cfg, policy, host=host, task=task)
    record = trainer.run(resume=args.resume)
    if not leader:
        return 0
    summary = {k: v for k, v in record.items() if isinstance(v, int | float)}
    print(json.dumps({"final": summary}, sort_keys=True))
    return 0


def connect_hosts(system):
    """A `HostPool` over the gRPC hosts of ``system.inference_hosts`` (comma-separated).

    Requests spread over the hosts; one that dies or hangs is taken out and its work
    re-issued to the others, and it is taken back (current weights first) when it answers
    again. Every host must be up at start.
    """
    from a3po_jax.inference.grpc_client import GrpcInferenceClient
    from a3po_jax.inference.pool import HostPool

    token = _read_token(system.host_token_file)
    addresses = [a.strip() for a in system.inference_hosts.split(",") if a.strip()]
    if len(set(addresses)) != len(addresses):
        raise SystemExit(f"a3po-train: system.inference_hosts lists a host twice: {addresses}")
    clients = []
    try:
        for address in addresses:
            clients.append(GrpcInferenceClient(address, token, timeout=system.host_timeout_s))
        return HostPool(
            clients,
            health_interval_s=system.host_health_interval_s,
            hang_timeout_s=system.host_hang_timeout_s,
            max_reissues=system.max_reissues,
        )
    except BaseException:
        for client in clients:
            client.close()
        raise


def _read_token(path: str) -> str:
    if path:
        with open(os.path.expanduser(path)) as f:
            return f.read().strip()
    token = os.environ.get("A3PO_HOST_TOKEN", "")
    if not token:
        raise SystemExit("a3po-train: remote hosts need system.host_token_file or A3PO_HOST_TOKEN")
    return token


if __name__ == "__main__":
    sys.exit(main())
