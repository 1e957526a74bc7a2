"""Benchmark: a weight push from the trainer's call to the host serving the new weights,
beside the raw TCP bandwidth of the same loopback between the same cores, in one run.

    python scripts/bench_weight_push.py                      # SmolLM2-135M, float32, split cores
    python scripts/bench_weight_push.py --dtype bfloat16     # the host serves bfloat16
    python scripts/bench_weight_push.py --placement devices  # in-process, device to device
    python scripts/bench_weight_push.py --model tiny --repeats 3

``--placement cores`` (split cores, as `system.placement.inference_cores` places them): a local host
process (`LocalHostProcess`) on the first ``--host-cores`` cores, this process on the rest.
Measured:

* ``loopback``: a plain socket sending the model's bytes to a sink process on the host's
  cores (the link's own limit);
* ``push over TCP``: `GrpcInferenceClient.update_weights` of the trainer's float32 weights
  (cast to the host's dtype and laid out in its serving layout on the way) through the
  host's TCP weight port, until the host reports the new version;
* ``push``: the same as a trainer on the host's machine pushes, through shared memory (the
  pusher lays its layers out straight into the host's buffers, an idle host lays out its
  share of the layers itself); with the host's receive and install seconds and each side's
  layout seconds, and the first push alone (its buffers are fresh memory);
* ``background``: the same through a `HostPool(background_push=True)`, as the trainer pushes
  to local and remote hosts: the seconds the trainer is held (the staging copy) and the
  seconds until the host serves.

``--placement devices`` (split devices, as `system.placement.inference_devices` places them): the
trainer's weights FSDP-sharded over the first ``--trainer-devices`` (as a run holds them),
an embedded host tensor-parallel over the next ``--host-devices`` (`InferenceHost` with a
mesh of its own); a push is ``update_weights`` (resharded on the trainer's devices, copied
device to device, then laid out in the serving layout) until the host serves it. One more
push runs with every host transfer refused (`sharding.no_host_transfers`): its passing is
the "0 bytes through host memory" reported. On a CPU the devices are virtual
(``--xla_force_host_platform_device_count``, set here), so this is a copy in one memory.

Figures are the median (min-max) over ``--repeats`` pushes after ``--warmup`` pushes (3: they
allocate the host's reusable sets, serving, staged and receiving; a run pushes at every
step, so what follows is its steady state). Prints a table, then one JSON line with the
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
from bench_common import describe_machine  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient
from a3po_jax.inference.remote.local_process import LocalHostProcess
from a3po_jax.inference.remote.pool import HostPool
from a3po_jax.model.loader import load_model
from a3po_jax.training import host_placement

SINK = """
import socket, sys, numpy as np
n = int(sys.argv[1]); srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
buf = np.empty(n, np.uint8); buf[:] = 0; view = memoryview(buf)
while True:
    conn, _ = srv.accept(); got = 0
    while got < n:
        k = conn.recv_into(view[got:], min(n - got, 16 << 20))
        if not k: break
        got += k
    conn.sendall(b"k"); conn.close()
"""


def loopback_gbps(nbytes: int, cores: list[int], repeats: int) -> list[float]:
    """Seconds to send `nbytes` to a sink process pinned to `cores`, `repeats` times (after a
    warm-up), over 127.0.0.1."""
    sink = subprocess.Popen(
        ["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c", SINK, str(nbytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(sink.stdout.readline())
        payload = np.ones(nbytes, np.uint8)
        view = memoryview(payload)
        seconds = []
        for _ in range(repeats + 1):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                t0 = time.perf_counter()
                for i in range(0, nbytes, 16 << 20):
                    conn.sendall(view[i : i + (16 << 20)])
                conn.recv(1)
                seconds.append(time.perf_counter() - t0)
        return seconds[1:]
    finally:
        sink.kill()


def timed_pushes(
    client: GrpcInferenceClient, params, first_version: int, repeats: int, warmup: int
):
    """(seconds until serving, host reports) of `repeats` pushes after `warmup` pushes, and
    the seconds of the first push."""
    out, reports, first = [], [], 0.0
    for i in range(repeats + warmup):
        version = first_version + i
        t0 = time.perf_counter()
        client.update_weights(params, version)
        client.wait_until_version(version, timeout=600)
        if i == 0:
            first = time.perf_counter() - t0
        if i >= warmup:
            out.append(time.perf_counter() - t0)
            reports.append(dict(client.last_push))
    return out, reports, first


def background_pushes(
    pool: HostPool, client, params, first_version: int, repeats: int, warmup: int
):
    """(seconds the caller was held, seconds until serving) of `repeats` pool pushes after
    `warmup` pushes."""
    held, serving = [], []
    for i in range(repeats + warmup):
        version = first_version + i
        t0 = time.perf_counter()
        pool.update_weights(params, version)
        t1 = time.perf_counter()
        pool.wait_pushed()
        client.wait_until_version(version, timeout=600)
        if i >= warmup:
            held.append(t1 - t0)
            serving.append(time.perf_counter() - t0)
    return held, serving


def device_pushes(
    model: str, trainer_devices: int, host_devices: int, repeats: int
) -> tuple[dict, int, list[float], bool]:
    """(machine, bytes, seconds, whether a push passes with host transfers refused) of
    `repeats` in-process pushes (after a warm-up) from a trainer holding the weights as a
    run does (FSDP over the first `trainer_devices`) to a host on the next `host_devices`
    (tensor-parallel over them)."""
    from a3po_jax.inference.host import InferenceHost
    from a3po_jax.parallel import sharding
    from a3po_jax.parallel.sharding import make_mesh

    loaded = load_model(model)
    devices = jax.devices()
    trainer = make_mesh(1, trainer_devices, 1, devices=devices[:trainer_devices])
    params = jax.device_put(
        loaded.params, sharding.param_shardings(loaded.params, trainer, sharding.TRAIN_RULES)
    )
    mesh = make_mesh(
        1, 1, host_devices, devices=devices[trainer_devices : trainer_devices + host_devices]
    )
    host = InferenceHost(loaded.config, params, num_slots=2 * host_devices, mesh=mesh).start()
    seconds = []
    try:
        for version in range(1, repeats + 2):
            t0 = time.perf_counter()
            host.update_weights(params, version)
            assert host.wait_serving(version, timeout=600)
            if version > 1:
                seconds.append(time.perf_counter() - t0)
        try:  # one more, with every host transfer refused: none of its bytes pass there
            with sharding.no_host_transfers():
                host.update_weights(params, repeats + 2)
            device_to_device = True
        except Exception as err:  # the guard's refusal (a JaxRuntimeError)
            print(f"a push with host transfers refused failed: {str(err)[:200]}")
            device_to_device = False
    finally:
        host.close()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return describe_machine(), nbytes, seconds, device_to_device


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="tiny | smollm2 | checkpoint path")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="served")
    p.add_argument("--host-cores", type=int, default=1, help="cores of the host process")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed pushes first: the host's three reusable sets are allocated by them",
    )
    p.add_argument("--placement", default="cores", choices=("cores", "devices"))
    p.add_argument("--host-devices", type=int, default=1, help="devices: the host's (tensor)")
    p.add_argument(
        "--trainer-devices", type=int, default=2, help="devices: the trainer's (FSDP), first"
    )
    args = p.parse_args(argv)
    if args.placement == "devices":
        return main_devices(args)

    host_cores, trainer_cores = host_placement.split_cores(args.host_cores)
    host_placement.pin_trainer(args.host_cores)
    machine = describe_machine()
    params = load_model(args.model).params  # the trainer's float32 weights
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    wire_bytes = model_bytes // 2 if args.dtype == "bfloat16" else model_bytes

    loop = loopback_gbps(wire_bytes, host_cores, args.repeats)
    host = LocalHostProcess(
        model=args.model, cores=host_cores, update_policy="in_flight", param_dtype=args.dtype
    ).start()
    try:
        client = GrpcInferenceClient(host.address, host.token)
        tcp = GrpcInferenceClient(host.address, host.token, shared_memory=False)
        over_tcp, tcp_reports, _ = timed_pushes(tcp, params, 1, args.repeats, args.warmup)
        tcp.close()
        push, reports, first = timed_pushes(client, params, 50, args.repeats, args.warmup)
        pool = HostPool([GrpcInferenceClient(host.address, host.token)], background_push=True)
        held, serving = background_pushes(pool, client, params, 100, args.repeats, args.warmup)
        pool.close()
        client.close()
    finally:
        host.close()

    gb = wire_bytes / 1e9
    rows = {
        "loopback": loop,
        "push over TCP (call -> serving)": over_tcp,
        "  pusher lays out (beside the wire)": [r.get("layout_s", 0.0) for r in tcp_reports],
        "first push (fresh memory)": [first],
        "push (call -> serving)": push,  # shared memory where the platform has it
        "  host receive": [r["receive_s"] for r in reports],
        "  host install": [r["install_s"] for r in reports],
        "  pusher lays out": [r.get("layout_s", 0.0) for r in reports],
        "  host lays out its share": [r.get("host_layout_s", 0.0) for r in reports],
        "background: caller held": held,
        "background: call -> serving": serving,
    }
    print(
        f"{args.model}: {model_bytes / 1e9:.3f} GB float32, {gb:.3f} GB on the wire "
        f"({args.dtype}); host on cores {host_cores}, trainer on {trainer_cores}; "
        f"{machine['cpu']} ({', '.join(machine['isa'])}); transport "
        f"{reports[-1].get('transport', 'tcp')}"
    )
    print(f"{'':<38}{'seconds':>24}{'GB/s (wire bytes)':>20}")
    for name, values in rows.items():
        gbps = gb / statistics.median(values) if statistics.median(values) else float("inf")
        print(f"{name:<38}{summary(values):>24}{gbps:>20.2f}")
    ratio = statistics.median(loop) / statistics.median(push)
    print(f"push / loopback bandwidth: {ratio:.2f}")
    speedup = statistics.median(over_tcp) / statistics.median(push)
    print(f"push over TCP / push: {speedup:.2f}x")
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "model_bytes": model_bytes,
                "wire_bytes": wire_bytes,
                "seconds": rows,
                "push_gbps": gb / statistics.median(push),
                "loopback_gbps": gb / statistics.median(loop),
                "push_over_loopback": ratio,
                "tcp_over_push": speedup,
                "transport": reports[-1].get("transport", "tcp"),
                "host_cores": host_cores,
                "trainer_cores": trainer_cores,
                "machine": machine,
            }
        )
    )


def main_devices(args) -> None:
    """--placement devices: the in-process device-to-device push from an FSDP trainer."""
    count = args.trainer_devices + args.host_devices
    if jax.config.jax_platforms in (None, "", "cpu") and "device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):  # virtual CPU devices; read when the backend starts, which it has not yet
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
        )
    machine, nbytes, seconds, device_to_device = device_pushes(
        args.model, args.trainer_devices, args.host_devices, args.repeats
    )
    gb = nbytes / 1e9
    print(
        f"{args.model}: {gb:.3f} GB; trainer FSDP over {args.trainer_devices} device(s), host "
        f"tensor-parallel over {args.host_devices} other device(s); {machine['device']}, "
        f"{machine['cpu']}"
    )
    gbps = gb / statistics.median(seconds)
    print(f"{'push (call -> serving)':<30}{summary(seconds):>24}{gbps:>12.2f} GB/s")
    through_host = "0 (a push with host transfers refused passed)" if device_to_device else "some"
    print(f"{'bytes through host memory':<30}{through_host:>24}")
    print(
        json.dumps(
            {
                "model": args.model,
                "bytes": nbytes,
                "seconds": seconds,
                "push_gbps": gb / statistics.median(seconds),
                "trainer_devices": args.trainer_devices,
                "host_devices": args.host_devices,
                "host_memory_bytes": 0 if device_to_device else None,
                "machine": machine,
                "placement": "devices",
            }
        )
    )


if __name__ == "__main__":
    main()
