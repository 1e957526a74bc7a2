"""Launch a run on one CPU machine, a multi-GPU node or a TPU pod slice, or start a
standalone inference host. ``--dry-run`` prints the command every host would run.

    python scripts/launch.py cpu EXPERIMENT [overrides...]
    python scripts/launch.py gpu-node EXPERIMENT --trainer-gpus 0 --inference-gpus 1 [overrides...]
    python scripts/launch.py tpu-pod EXPERIMENT --tpu NAME --zone ZONE --workers 4 \\
        --inference-tpu NAME2 --inference-address 10.0.0.7 [overrides...] --dry-run
    python scripts/launch.py inference-host --model smollm2 --port 50051 --devices 1
    python scripts/launch.py join-host EXPERIMENT --port 50061 [the run's overrides]

What works today, and what does not (the launcher does not pretend otherwise):

* ``cpu``: one process, embedded inference host (``a3po-train`` as is).
* ``gpu-node``: the inference host (``python -m a3po_jax.cli.serve``) on its own
  GPUs and the trainer on others, talking over gRPC on localhost with a shared token file.
  The trainer shards the model over all its ``--trainer-gpus`` (``system.mesh.*``; FSDP
  over all of them by default). More inference hosts (other nodes) can be added with
  ``system.placement.inference_hosts=a:50051,b:50051``: the trainer spreads requests over them and
  fails over when one dies (``a3po_jax.inference.remote.pool``).
* ``tpu-pod``: prints and runs (over ``gcloud ... ssh``) the trainer command for every
  worker, with ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
  set (``a3po_jax.parallel.distributed.initialize`` reads them: worker 0 talks to the inference host
  and broadcasts each batch, all workers train on one global mesh), and the inference host
  on its own TPU VM. ``run_dir`` must be a path every worker can write (checkpoints are
  saved by all of them). ``system.mode=periodic`` and ``algo.kl_in_reward`` are
  single-process only. The token file must exist on the inference VM and on worker 0 (copy
  it, or set ``A3PO_HOST_TOKEN``).
* ``inference-host``: a standalone host for any of the above (or for a trainer elsewhere,
  ``system.placement.inference_hosts=ADDRESS:PORT``). Every RPC but Health needs the token.
* ``join-host``: a host that joins a running job, serving what the run's config asks (its
  model, dtype, buckets, update policy) and registering itself in the run's
  ``system.placement.hosts_file`` (``cli.serve --join``); stopping it (SIGTERM, Ctrl-C) makes it
  leave. Give it the run's experiment and overrides, and the run's token file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_PORT = 50051
DEFAULT_TOKEN_FILE = "~/.cache/a3po_jax/host_token"
READY_LINE = "A3PO_HOST_READY"  # printed by grpc_server once it serves


@dataclasses.dataclass(frozen=True)
class HostCommand:
    """What one host runs.

    Attributes:
      role: e.g. "trainer", "trainer worker 2", "inference host".
      env: environment variables set for the command.
      argv: the command.
      ssh: for remote hosts, the ``gcloud`` prefix that runs the command there.
      workdir: for remote hosts, the directory to ``cd`` into first (may start with ~).
    """

    role: str
    env: dict[str, str]
    argv: tuple[str, ...]
    ssh: tuple[str, ...] = ()
    workdir: str = ""

    def local_shell(self) -> str:
        """``[cd DIR &&] ENV=... argv`` as one shell line, as the host itself runs it."""
        quote = _remote_quote if self.ssh else shlex.quote
        words = [f"{k}={quote(v)}" for k, v in self.env.items()] + [quote(a) for a in self.argv]
        line = " ".join(words)
        return f"cd {self.workdir} && {line}" if self.workdir else line

    def shell(self) -> str:
        """The command as one shell line from here (what --dry-run prints)."""
        if not self.ssh:
            return self.local_shell()
        return shlex.join(self.ssh) + " --command " + shlex.quote(self.local_shell())


def _remote_quote(word: str) -> str:
    """Quote for the remote shell, letting ``$HOME`` expand (a leading ``~`` would not be
    expanded inside ``key=~/path`` arguments, and the trainer does not expand it)."""
    if "$HOME/" in word and all(c not in word for c in "\"`'"):
        return f'"{word}"'
    return shlex.quote(word)


def _home(path: str, *, remote: bool) -> str:
    """``~/x`` as ``$HOME/x`` for a remote shell, expanded here for a local command."""
    if not path.startswith("~/"):
        return path
    return "$HOME/" + path[2:] if remote else os.path.expanduser(path)


# --------------------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------------------


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment file with config()")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def _add_host_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="inference host port")
    p.add_argument(
        "--weight-port",
        type=int,
        default=DEFAULT_PORT + 1,
        help="the host's port for weight pushes (open it where the gRPC port is open)",
    )
    p.add_argument(
        "--token-file", default=DEFAULT_TOKEN_FILE, help="shared host token (created if missing)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="target", required=True)

    cpu = sub.add_parser("cpu", help="one process on this machine, embedded inference host")
    _add_run_args(cpu)

    gpu = sub.add_parser(
        "gpu-node",
        help="trainer and inference host on separate GPUs of one node",
        description="The trainer uses the first of --trainer-gpus (single-device jit today).",
    )
    _add_run_args(gpu)
    _add_host_args(gpu)
    gpu.add_argument("--trainer-gpus", default="0", help="CUDA_VISIBLE_DEVICES of the trainer")
    gpu.add_argument(
        "--inference-gpus",
        default="",
        help="CUDA_VISIBLE_DEVICES of the inference host; empty = embedded host in the trainer",
    )

    tpu = sub.add_parser(
        "tpu-pod",
        help="trainer on every worker of a TPU slice, inference host on its own TPU VM",
        description=(
            "Every worker runs the trainer under jax.distributed (JAX_COORDINATOR_ADDRESS, "
            "JAX_NUM_PROCESSES, JAX_PROCESS_ID); worker 0 talks to the inference host."
        ),
    )
    _add_run_args(tpu)
    _add_host_args(tpu)
    tpu.add_argument("--tpu", required=True, help="TPU VM (slice) name of the trainer")
    tpu.add_argument("--zone", required=True, help="GCP zone")
    tpu.add_argument("--project", default=None, help="GCP project (default: gcloud's)")
    tpu.add_argument("--workers", type=int, default=1, help="hosts (workers) in the slice")
    tpu.add_argument(
        "--coordinator-address",
        default=None,
        help="worker 0's internal IP:port (default <worker-0-ip>:8476, a placeholder)",
    )
    tpu.add_argument("--inference-tpu", default="", help="TPU VM running the inference host")
    tpu.add_argument("--inference-zone", default=None, help="its zone (default --zone)")
    tpu.add_argument(
        "--inference-address", default=None, help="its internal IP as the trainer sees it"
    )
    tpu.add_argument("--repo-dir", default="~/a3po_jax", help="checkout on every VM")
    tpu.add_argument("--python", default=".venv/bin/python", help="interpreter on every VM")

    host = sub.add_parser("inference-host", help="start one standalone inference host")
    _add_host_args(host)
    host.add_argument("--model", default="tiny", help="tiny | smollm2 | HF checkpoint dir")
    host.add_argument("--bind", default="127.0.0.1", help="address to bind (0.0.0.0 = all)")
    host.add_argument("--devices", default="", help="CUDA_VISIBLE_DEVICES for the host")
    host.add_argument("--num-slots", type=int, default=32)
    host.add_argument("--prefill-buckets", default="64,128,256")
    host.add_argument("--max-cache-len", type=int, default=None)
    host.add_argument("--update-policy", default="in_flight", choices=["in_flight", "drain"])
    host.add_argument("--init-seed", type=int, default=0, help="params seed for --model tiny")
    host.add_argument("--warmup", action="store_true", help="compile every bucket first")
    host.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    join = sub.add_parser(
        "join-host", help="start a host that joins a running job (its system.placement.hosts_file)"
    )
    join.add_argument("experiment", help="the run's experiment file")
    join.add_argument("overrides", nargs="*", help="the run's section.field=value overrides")
    _add_host_args(join)
    join.add_argument("--bind", default="127.0.0.1", help="address to bind (0.0.0.0 = all)")
    join.add_argument("--advertise", default="", help="address the trainer reaches it at")
    join.add_argument("--devices", default="", help="CUDA_VISIBLE_DEVICES for the host")
    join.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    # Subcommands rule out parse_intermixed_args: overrides after options come back as
    # leftovers and are appended here; anything else left over is an error.
    args, rest = parser.parse_known_args(argv)
    unknown = [r for r in rest if r.startswith("-") or "=" not in r]
    if unknown or (rest and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or rest)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    return args


# --------------------------------------------------------------------------------------
# Plans: the commands each host runs.
# --------------------------------------------------------------------------------------


def _resolve(experiment: str, overrides: list[str]):
    from a3po_jax.training.config import apply_overrides, load_experiment

    return apply_overrides(load_experiment(experiment), overrides)


def _train_argv(python: str, experiment: str, overrides: list[str], resume: bool) -> tuple:
    return (python, "-m", "a3po_jax.cli.train", experiment, *overrides) + (
        ("--resume",) if resume else ()
    )


def _host_argv(
    python: str, cfg, *, port: int, bind: str, token_file: str, weight_port: int
) -> tuple:
    """grpc_server flags that make the host serve exactly what the trainer's config asks."""
    buckets = ",".join(str(b) for b in cfg.rollout.prompt_buckets)
    return (
        python,
        "-m",
        "a3po_jax.cli.serve",
        "--model",
        cfg.model.name,
        "--port",
        str(port),
        "--host",
        bind,
        "--token-file",
        token_file,
        "--num-slots",
        str(cfg.rollout.num_slots),
        "--prefill-buckets",
        buckets,
        "--max-cache-len",
        str(max(cfg.rollout.prompt_buckets) + cfg.rollout.max_new_tokens),
        "--update-policy",
        cfg.system.effective_update_policy,
        "--init-seed",
        str(cfg.model.seed),
        "--param-dtype",
        cfg.system.placement.inference_dtype or cfg.model.param_dtype,
        "--compute-dtype",
        cfg.model.compute_dtype,
        "--weight-port",
        str(weight_port),
        # A restarted or joining host loads the programs the run's cache already holds.
        "--compile-cache-dir",
        cfg.system.run.compile_cache_dir,
    )


def plan_cpu(args: argparse.Namespace) -> list[HostCommand]:
    _resolve(args.experiment, args.overrides)  # fail on a bad config before anything runs
    argv = _train_argv(sys.executable, args.experiment, args.overrides, args.resume)
    return [HostCommand("trainer (embedded inference host)", {"JAX_PLATFORMS": "cpu"}, argv)]


def plan_gpu_node(args: argparse.Namespace) -> list[HostCommand]:
    cfg = _resolve(args.experiment, args.overrides)
    trainer_gpus = args.trainer_gpus.split(",")
    if args.inference_gpus and set(args.inference_gpus.split(",")) & set(trainer_gpus):
        raise SystemExit("launch.py: --trainer-gpus and --inference-gpus must not overlap")
    env = {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": ",".join(trainer_gpus)}
    if not args.inference_gpus:
        argv = _train_argv(sys.executable, args.experiment, args.overrides, args.resume)
        return [HostCommand("trainer (embedded inference host)", env, argv)]
    token = _home(args.token_file, remote=False)
    host = HostCommand(
        "inference host",
        {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": args.inference_gpus},
        _host_argv(
            sys.executable,
            cfg,
            port=args.port,
            bind="127.0.0.1",
            token_file=token,
            weight_port=args.weight_port,
        ),
    )
    remote = [
        f"system.placement.inference_hosts=127.0.0.1:{args.port}",
        f"system.placement.host_token_file={token}",
    ]
    trainer = HostCommand(
        "trainer",
        env,
        _train_argv(sys.executable, args.experiment, [*args.overrides, *remote], args.resume),
    )
    return [host, trainer]


def plan_tpu_pod(args: argparse.Namespace) -> list[HostCommand]:
    cfg = _resolve(args.experiment, args.overrides)
    if args.workers < 1:
        raise SystemExit(f"launch.py: --workers must be >= 1, got {args.workers}")

    def ssh(tpu: str, zone: str, worker: int) -> tuple[str, ...]:
        base = ("gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}")
        project = (f"--project={args.project}",) if args.project else ()
        return base + project + (f"--worker={worker}",)

    commands = []
    overrides = list(args.overrides)
    token = _home(args.token_file, remote=True)
    if args.inference_tpu:
        address = args.inference_address or "<inference-vm-internal-ip>"
        host_argv = _host_argv(
            args.python,
            cfg,
            port=args.port,
            bind="0.0.0.0",
            token_file=token,
            weight_port=args.weight_port,
        )
        commands.append(
            HostCommand(
                "inference host",
                {"JAX_PLATFORMS": "tpu"},
                host_argv,
                ssh(args.inference_tpu, args.inference_zone or args.zone, 0),
                args.repo_dir,
            )
        )
        overrides += [
            f"system.placement.inference_hosts={address}:{args.port}",
            f"system.placement.host_token_file={token}",
        ]
    coordinator = args.coordinator_address or "<worker-0-internal-ip>:8476"
    for worker in range(args.workers):
        env = {"JAX_PLATFORMS": "tpu"}
        if args.workers > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=coordinator,
                JAX_NUM_PROCESSES=str(args.workers),
                JAX_PROCESS_ID=str(worker),
            )
        argv = _train_argv(args.python, args.experiment, overrides, args.resume)
        commands.append(
            HostCommand(
                f"trainer worker {worker}",
                env,
                argv,
                ssh(args.tpu, args.zone, worker),
                args.repo_dir,
            )
        )
    return commands


def plan_inference_host(args: argparse.Namespace) -> list[HostCommand]:
    argv = (
        sys.executable,
        "-m",
        "a3po_jax.cli.serve",
        "--model",
        args.model,
        "--port",
        str(args.port),
        "--host",
        args.bind,
        "--token-file",
        _home(args.token_file, remote=False),
        "--num-slots",
        str(args.num_slots),
        "--prefill-buckets",
        args.prefill_buckets,
        "--update-policy",
        args.update_policy,
        "--init-seed",
        str(args.init_seed),
        "--weight-port",
        str(args.weight_port),
    )
    if args.max_cache_len is not None:
        argv += ("--max-cache-len", str(args.max_cache_len))
    if args.warmup:
        argv += ("--warmup",)
    env = {"CUDA_VISIBLE_DEVICES": args.devices} if args.devices else {}
    return [HostCommand("inference host", env, argv)]


def plan_join_host(args: argparse.Namespace) -> list[HostCommand]:
    """A host serving what the run's config asks, joining it through its membership file
    (``cli.serve --join``): SIGTERM (Ctrl-C here) makes it leave."""
    cfg = _resolve(args.experiment, args.overrides)
    if not cfg.system.placement.hosts_file:
        raise SystemExit(
            "launch.py join-host: the run's config sets no system.placement.hosts_file; pass "
            "the run's own overrides (system.placement.inference_hosts=... "
            "system.placement.hosts_file=PATH)"
        )
    token = _home(args.token_file, remote=False)
    if not args.dry_run and not Path(token).is_file():
        raise SystemExit(f"launch.py join-host: no token file {token}: copy the run's")
    argv = _host_argv(
        sys.executable,
        cfg,
        port=args.port,
        bind=args.bind,
        token_file=token,
        weight_port=args.weight_port,
    ) + ("--join", cfg.system.placement.hosts_file)
    if args.advertise:
        argv += ("--advertise", args.advertise)
    env = {"CUDA_VISIBLE_DEVICES": args.devices} if args.devices else {}
    return [HostCommand("inference host", env, argv)]


PLANS = {
    "cpu": plan_cpu,
    "gpu-node": plan_gpu_node,
    "tpu-pod": plan_tpu_pod,
    "inference-host": plan_inference_host,
    "join-host": plan_join_host,
}


# --------------------------------------------------------------------------------------
# Running.
# --------------------------------------------------------------------------------------


def ensure_token_file(path: str) -> Path:
    """Create the shared host token (mode 0600) if it does not exist yet, so the host and
    the trainer read the same one and neither races the other to write it."""
    file = Path(path).expanduser()
    if not file.exists():
        file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return file


def _popen(command: HostCommand, **kwargs) -> subprocess.Popen:
    if command.ssh:
        return subprocess.Popen([*command.ssh, "--command", command.local_shell()], **kwargs)
    return subprocess.Popen(list(command.argv), env={**os.environ, **command.env}, **kwargs)


def _wait_ready(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait for the host's ready line on its stdout (echoing what it prints)."""
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        print(f"[inference host] {line}", end="", flush=True)
        if line.startswith(READY_LINE):
            return
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"launch.py: the inference host did not become ready (status {proc.poll()})")


def run(commands: list[HostCommand], *, host_timeout_s: float = 1800.0) -> int:
    """Start the inference host (if any) and wait until it serves, run the trainer(s) to
    the end, then stop the host."""
    host = next((c for c in commands if c.role == "inference host"), None)
    trainers = [c for c in commands if c is not host]
    host_proc = None
    try:
        if host is not None:
            host_proc = _popen(host, stdout=subprocess.PIPE, text=True)
            if trainers:
                _wait_ready(host_proc, host_timeout_s)
        if not trainers:
            return host_proc.wait()
        procs = [_popen(c) for c in trainers]
        return max(p.wait() for p in procs)
    finally:
        if host_proc is not None and host_proc.poll() is None:
            host_proc.terminate()
            host_proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from a3po_jax.training.config import ConfigError

    try:
        commands = PLANS[args.target](args)
    except ConfigError as err:
        print(f"launch.py: config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        for command in commands:
            print(f"# {command.role}")
            print(command.shell())
        return 0
    if any(c.role == "inference host" for c in commands) and not any(c.ssh for c in commands):
        ensure_token_file(args.token_file)
    return run(commands)


if __name__ == "__main__":
    sys.exit(main())
