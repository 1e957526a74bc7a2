"""Command line (cli): serve an inference host over gRPC.

CLI layer (entry points): nothing in the package imports it.

    python -m a3po_jax.cli.serve --model tiny --port 50051 \\
        --host 127.0.0.1 --token-file ~/.a3po_host_token [--update-policy drain]

Prints ``A3PO_HOST_READY host:port`` once it serves (`scripts/launch.py` and the tests wait
for that line). SIGTERM stops it cleanly (a second one at once); with ``--exit-with-parent
PID`` it also stops when process PID is gone (a trainer that started it and was killed, even
with SIGKILL); SIGUSR1 prints every thread's stack to stderr (a host that seems stuck).

With ``--join PATH`` it joins a running job: PATH is the run's membership file
(``system.placement.hosts_file``). Once it serves, the host appends its own line (the trainer then
checks it, pushes it the newest weights and routes requests to it); on SIGTERM it leaves:
removes its line, finishes what the pool still gives it, and stops once it has been idle
for ``--leave-quiet-s`` (at most ``--leave-wait-s``). A file that is missing, or whose run
has ended, is refused before the model loads.

What `--model` accepts, how the token is chosen and what the server checks is in
`a3po_jax.inference.remote.grpc_server`; the update policies are in `a3po_jax.inference.host`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time

from a3po_jax.inference.host import InferenceHost
from a3po_jax.inference.remote import grpc_server, membership_file
from a3po_jax.inference.remote.grpc_messages import TOKEN_ENV
from a3po_jax.inference.update_policy import UPDATE_POLICIES
from a3po_jax.training import compilation

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny | smollm2 | HF checkpoint dir | .gguf file"
    )
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--compute-dtype", default="float32", choices=("float32", "bfloat16"), help="matmul dtype"
    )
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--token-file", default=None)
    parser.add_argument("--num-slots", type=int, default=8)
    parser.add_argument("--prefill-buckets", default="32,64,128,256")
    parser.add_argument("--max-cache-len", type=int, default=None)
    parser.add_argument("--update-policy", default="in_flight", choices=list(UPDATE_POLICIES))
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a sample's numbers never depend on the samples beside it (reproducible runs)",
    )
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="host seed mixed into requests")
    parser.add_argument("--init-seed", type=int, default=0, help="params seed for --model tiny")
    parser.add_argument("--max-streams", type=int, default=512)
    parser.add_argument("--warmup", action="store_true", help="compile every bucket first")
    parser.add_argument(
        "--compile-cache-dir",
        default=compilation.DEFAULT_DIR,
        help="JAX's persistent compilation cache: a restarted or joining host loads what an "
        "earlier one compiled ('' = none; JAX_COMPILATION_CACHE_DIR wins); default %(default)s",
    )
    parser.add_argument(
        "--weight-port", type=int, default=0, help="TCP port for weight pushes (0: any free)"
    )
    parser.add_argument(
        "--exit-with-parent",
        type=int,
        default=0,
        metavar="PID",
        help="stop serving once process PID has exited (the trainer that started this host)",
    )
    parser.add_argument(
        "--cores", default="", help="comma-separated CPU ids to run on (default: all allowed)"
    )
    parser.add_argument(
        "--join", default="", metavar="PATH", help="a running job's membership file to join"
    )
    parser.add_argument(
        "--advertise",
        default="",
        metavar="HOST",
        help="the address the trainer reaches this host at, for --join (default: --host)",
    )
    parser.add_argument(
        "--leave-quiet-s", type=float, default=5.0, help="--join: idle this long, then stop"
    )
    parser.add_argument(
        "--leave-wait-s", type=float, default=60.0, help="--join: stop this long after SIGTERM"
    )
    args = parser.parse_args(argv)
    if args.join and not args.advertise and args.host in ("0.0.0.0", "::", ""):
        parser.error(
            f"--join with --host {args.host} needs --advertise (how the trainer reaches it)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cores:  # before JAX starts, so that XLA sizes its thread pool to them
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    if args.join:  # before the model loads: a file no run watches is refused at once
        try:
            membership_file.check_joinable(args.join)
        except membership_file.MembershipError as err:
            sys.exit(f"a3po-serve: {err}")
    stop, now = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: (now if stop.is_set() else stop).set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.exit_with_parent:
        die_with_parent(args.exit_with_parent)
        _watch_parent(args.exit_with_parent, stop)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        # Before the first program compiles.
        compilation.enable(args.compile_cache_dir, setting="--compile-cache-dir")
    except ValueError as err:
        sys.exit(f"a3po-serve: {err}")

    token, token_path = grpc_server.resolve_token(args.token_file)
    config, params = grpc_server.load_model(
        args.model,
        init_seed=args.init_seed,
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
    )
    host = InferenceHost(
        config,
        params,
        num_slots=args.num_slots,
        prefill_buckets=tuple(int(b) for b in args.prefill_buckets.split(",")),
        max_cache_len=args.max_cache_len,
        version=args.version,
        update_policy=args.update_policy,
        seed=args.seed,
        batch_invariant=args.batch_invariant,
    )
    if args.warmup:
        host.warmup()
    host.start()
    server, servicer, port = grpc_server.serve(
        host,
        token,
        port=args.port,
        bind=args.host,
        max_streams=args.max_streams,
        weight_port=args.weight_port,
    )
    where = f"token file {token_path}" if token_path else f"${TOKEN_ENV}"
    log.info("serving %s on %s:%d (token from %s)", args.model, args.host, port, where)
    print(f"{grpc_server.READY_LINE} {args.host}:{port}", flush=True)
    address = f"{args.advertise or args.host}:{port}"
    try:
        if args.join:
            membership_file.join(args.join, address)
            log.info("joined the run of %s as %s", args.join, address)
        stop.wait()
        if args.join:
            _leave(args, address, host, now)
    except KeyboardInterrupt:
        pass
    except membership_file.MembershipError as err:
        log.error("%s", err)
        raise SystemExit(1) from None
    finally:
        server.stop(grace=2).wait()
        servicer.close()
        host.close()


def _leave(args: argparse.Namespace, address: str, host: InferenceHost, now: threading.Event):
    """Takes the host's line out of the membership file, then serves what the pool still
    sends until the host has been idle for ``--leave-quiet-s`` (the pool has seen the file
    and re-issues nothing to it), at most ``--leave-wait-s``, or a second SIGTERM."""
    if not membership_file.leave(args.join, address):
        log.warning("%s was not in %s: stopping", address, args.join)
        return
    log.info("left the run of %s: finishing what it holds", args.join)
    deadline = time.monotonic() + args.leave_wait_s
    idle_since = time.monotonic()
    while not now.wait(0.1) and time.monotonic() < deadline:
        stats = host.stats()
        if stats["slots_busy"] or stats["queue_depth"]:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= args.leave_quiet_s:
            return
    log.warning("stopping with work in hand: the pool re-issues it to the others")


def die_with_parent(pid: int) -> None:
    """Linux, when `pid` is this process's parent: SIGKILL this process when the parent dies
    (even killed with SIGKILL). Otherwise (or had it died before this) `_watch_parent` acts."""
    if os.getppid() != pid:
        return
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _watch_parent(pid: int, stop: threading.Event, interval_s: float = 0.5) -> None:
    """Sets `stop` once process `pid` no longer exists (or this process was re-parented)."""

    def watch() -> None:
        while not stop.wait(interval_s):
            if os.getppid() != pid:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    log.warning("process %d is gone: stopping", pid)
                    stop.set()
                except PermissionError:
                    pass  # exists, owned by someone else

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
