"""Multi-process (multi-host) training: ``jax.distributed`` and the host-side protocol.

Parallel layer (core side): meshes, sharding and processes, used by the core and the shell.

Every host of a TPU slice (or every process of a multi-GPU job) runs the trainer. Process 0
alone talks to the inference hosts (producer and collector threads, rollout queue, logging,
checkpoint metadata); every step it sends the batch's numpy arrays to the other processes,
all processes run the same jitted train step over one global mesh, and process 0 fetches
the new weights to push them (design §5). The pieces, all host-side (nothing here enters a
jitted function):

* :func:`initialize` — ``jax.distributed.initialize`` from arguments or the environment
  (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, as
  ``scripts/launch.py`` prints them); a no-op for one process.
* :func:`broadcast_batch` — process 0's ``dict[str, np.ndarray]`` to every process, names,
  dtypes and shapes included (the receivers know none of them).
* :func:`global_batch` — global ``jax.Array``s from the host arrays (identical on every
  process): each process supplies only the shards its devices hold.
* :func:`gather_params` — a numpy copy of the (sharded) params on process 0 for the weight
  push; a collective, so every process calls it.
* :func:`sync_stop` — every process learns whether any process wants to stop.

Every function except :func:`initialize` is a collective when there are several processes:
all processes must call it, in the same order, or the job hangs. Failures need no protocol
of their own: process 0 hosts JAX's coordination service, so when it exits (an exception
included) the other processes are ended by JAX within seconds; :func:`sync_stop` is for
orderly stops (SIGTERM, a checkpoint before preemption) that all processes must take at the
same step.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

# Offsets inside a broadcast buffer are multiples of this, so every array can be viewed in
# place with its dtype's alignment.
_ALIGN = 16
# Broadcast buffers are padded to a few sizes (see _bucket) so the psum behind
# broadcast_one_to_all compiles once per size class, not once per batch.
_MIN_BUFFER = 4096


# --------------------------------------------------------------------------------------
# Start-up.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
    """Where this process stands in the job."""

    coordinator_address: str | None  # process 0's "host:port"; None for one process
    num_processes: int  # processes in the job
    process_id: int  # this process, 0 .. num_processes - 1

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1


def process_setup(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ProcessSetup:
    """Resolve and check the job's layout: arguments first, then the environment.

    Nothing set (or one process) is a single-process run. More than one process needs all
    three values. Raises ValueError naming the argument (and its environment variable) that
    is missing or malformed.
    """
    env = os.environ if environ is None else environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(env, ENV_NUM_PROCESSES, "num_processes")
    if process_id is None:
        process_id = _env_int(env, ENV_PROCESS_ID, "process_id")

    if num_processes is not None and (
        not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1
    ):
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if process_id is not None and (
        not isinstance(process_id, int) or isinstance(process_id, bool) or process_id < 0
    ):
        raise ValueError(f"process_id must be a non-negative int, got {process_id!r}")

    if num_processes is None and coordinator_address is None and process_id in (None, 0):
        return ProcessSetup(None, 1, 0)
    if num_processes is None:
        raise ValueError(
            f"num_processes is not set (argument or {ENV_NUM_PROCESSES}), but "
            f"coordinator_address={coordinator_address!r} / process_id={process_id!r} are"
        )
    if process_id is None:
        if num_processes == 1:
            process_id = 0
        else:
            raise ValueError(
                f"process_id is not set (argument or {ENV_PROCESS_ID}) for a job of "
                f"{num_processes} processes"
            )
    if process_id >= num_processes:
        raise ValueError(
            f"process_id={process_id} is out of range for num_processes={num_processes} "
            f"(allowed 0..{num_processes - 1})"
        )
    if num_processes == 1:
        return ProcessSetup(None, 1, 0)
    if coordinator_address is None:
        raise ValueError(
            f"coordinator_address is not set (argument or {ENV_COORDINATOR}) for a job of "
            f"{num_processes} processes; it is process 0's 'host:port'"
        )
    _split_address(coordinator_address)  # checks the form
    return ProcessSetup(coordinator_address, num_processes, process_id)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: float = 300.0,
    heartbeat_timeout_s: int = 100,
) -> ProcessSetup:
    """Join the multi-process job described by the arguments or the environment.

    Call it first thing in ``main``, before anything touches a JAX device. With one process
    (nothing set) it does nothing. Otherwise it checks what ``jax.distributed`` would only
    report by aborting the process (a fatal log, no Python exception): process 0 checks the
    coordinator's port is free; the others wait up to ``timeout_s`` for the coordinator to
    accept connections. On CPU the cross-process collectives are gloo's (the default of this
    JAX; set here in case it was switched off).

    Args:
      coordinator_address: process 0's ``host:port`` (default ``$JAX_COORDINATOR_ADDRESS``).
      num_processes: processes in the job (default ``$JAX_NUM_PROCESSES``).
      process_id: this process's index (default ``$JAX_PROCESS_ID``).
      timeout_s: how long to wait for the coordinator and the other processes.
      heartbeat_timeout_s: a process silent this long is declared dead and the job ends.
        (Process 0 hosts the coordination service: when it exits, the others end at once.)

    Returns:
      the resolved :class:`ProcessSetup`.

    Raises:
      ValueError: a missing or malformed argument (named), or a coordinator host that does
        not resolve.
      RuntimeError: the coordinator cannot be reached or started, or JAX was already
        initialised differently.
    """
    setup = process_setup(coordinator_address, num_processes, process_id)
    if not setup.is_multi_process:
        return setup
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) == (setup.num_processes, setup.process_id):
            return setup
        raise RuntimeError(
            f"jax.distributed is already initialised as process {jax.process_index()} of "
            f"{jax.process_count()}, not {setup.process_id} of {setup.num_processes}"
        )
    host, port = _split_address(setup.coordinator_address)
    _check_resolves(setup.coordinator_address, host, port)
    if setup.process_id == 0:
        if not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
            _check_port_free(setup.coordinator_address, port)
    else:
        _wait_reachable(setup, host, port, timeout_s)
    if jax.config.jax_cpu_collectives_implementation is None:
        # Without CPU collectives a CPU mesh spanning processes cannot run a psum.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            setup.coordinator_address,
            setup.num_processes,
            setup.process_id,
            initialization_timeout=max(1, int(timeout_s)),
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except Exception as err:
        raise RuntimeError(
            f"jax.distributed.initialize(coordinator_address={setup.coordinator_address!r}, "
            f"num_processes={setup.num_processes}, process_id={setup.process_id}) failed: {err}"
        ) from err
    return setup


def is_coordinator() -> bool:
    """Whether this is process 0: the one that talks to the inference hosts, logs and
    writes checkpoint metadata."""
    return jax.process_index() == 0


def _env_int(env: Mapping[str, str], var: str, name: str) -> int | None:
    raw = env.get(var)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: {var}={raw!r} is not an integer") from None


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port_s = address.rpartition(":")
    host = host.strip("[]")  # "[::1]:1234"
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not sep or not host or not 1 <= port <= 65535:
        raise ValueError(
            f"coordinator_address={address!r} must be 'host:port' with a port in 1..65535 "
            f"(argument or {ENV_COORDINATOR})"
        )
    return host, port


def _check_resolves(address: str, host: str, port: int) -> None:
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(
            f"coordinator_address={address!r}: host {host!r} does not resolve ({err})"
        ) from None


def _check_port_free(address: str, port: int) -> None:
    """Process 0's coordinator binds every interface on ``port``; taken, JAX only says
    "Failed to start RPC server"."""
    candidates = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        candidates.insert(0, (socket.AF_INET6, "::"))  # dual stack, like gRPC's [::]
    for family, any_address in candidates:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((any_address, port))
            return
        except OSError as err:
            if err.errno == errno.EADDRINUSE or family == socket.AF_INET:
                raise RuntimeError(
                    f"coordinator_address={address!r}: process 0 runs the coordinator on port "
                    f"{port}, but it cannot bind it ({err}); choose a free port"
                ) from None
            # No IPv6 on this machine: try IPv4.


def _wait_reachable(setup: ProcessSetup, host: str, port: int, timeout_s: float) -> None:
    """Wait until the coordinator accepts TCP connections (process 0 may start later)."""
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"process {setup.process_id} of {setup.num_processes}: no coordinator answered "
                f"at coordinator_address={setup.coordinator_address!r} within {timeout_s:g} s "
                f"({last}); is process 0 running, and is that its address and port?"
            )
        time.sleep(0.25)


# --------------------------------------------------------------------------------------
# Batches: process 0 → everyone.
# --------------------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bucket(n: int) -> int:
    """A buffer size ≥ n from a small set: ≤ 12.5 % padding, 8 sizes per doubling."""
    if n <= _MIN_BUFFER:
        return _MIN_BUFFER
    step = 1 << (n.bit_length() - 4)
    return _round_up(n, step)


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list[np.ndarray], list[int]]:
    """The JSON header (names, dtypes, shapes, payload offsets) and the C-ordered arrays."""
    names, dtypes, shapes, offsets, contiguous = [], [], [], [], []
    offset = 0
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"broadcast_batch: keys must be str, got {name!r}")
        x = np.asarray(value, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        if x.dtype.kind not in "biufcV" or x.dtype.hasobject:
            raise TypeError(f"broadcast_batch: {name!r} has dtype {x.dtype}, not a numeric one")
        names.append(name)
        dtypes.append(x.dtype.name)
        shapes.append(list(x.shape))
        offsets.append(offset)
        contiguous.append(x)
        offset = _round_up(offset + x.nbytes, _ALIGN)
    header = json.dumps(
        {"names": names, "dtypes": dtypes, "shapes": shapes, "offsets": offsets}
    ).encode()
    return header, contiguous, offsets


def encode_batch(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, int]:
    """Pack a batch into one uint8 buffer: JSON header, then each array at an aligned offset.

    Returns:
      (buffer, header_bytes): the buffer is padded to a bucketed size; ``header_bytes`` is
      the header's length (its start is offset 0, the payload starts at the next multiple
      of 16).
    """
    header, contiguous, offsets = _layout(arrays)
    start = _round_up(len(header), _ALIGN)
    end = start + (offsets[-1] + contiguous[-1].nbytes if contiguous else 0)
    buf = np.zeros(_bucket(end), np.uint8)
    buf[: len(header)] = np.frombuffer(header, np.uint8)
    for x, offset in zip(contiguous, offsets, strict=True):
        buf[start + offset : start + offset + x.nbytes] = x.reshape(-1).view(np.uint8)
    return buf, len(header)


def decode_batch(buf: np.ndarray, header_bytes: int) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode_batch`: fresh, writable arrays with the sent dtypes/shapes."""
    header = json.loads(bytes(buf[:header_bytes]))
    start = _round_up(header_bytes, _ALIGN)
    out = {}
    for name, dtype_name, shape, offset in zip(
        header["names"], header["dtypes"], header["shapes"], header["offsets"], strict=True
    ):
        dtype = np.dtype(jnp.dtype(dtype_name))  # jnp knows bfloat16 & co. (ml_dtypes)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = buf[start + offset : start + offset + nbytes]
        out[name] = raw.view(dtype).reshape(shape).copy()
    return out


def broadcast_batch(arrays: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Process 0's batch on every process, with names, dtypes and shapes.

    Process 0 passes the arrays, every other process passes None. Two collectives: the
    header and buffer sizes, then one uint8 buffer holding everything (bit-exact: it is a
    psum of the source's bytes with zeros). Buffers are padded to bucketed sizes, so a
    new batch shape does not mean a new compilation. With one process it still packs and
    unpacks, so the single- and multi-process paths are the same code.

    Raises:
      ValueError: process 0 passed None, or another process passed arrays.
    """
    source = is_coordinator()
    if source and arrays is None:
        raise ValueError("broadcast_batch: process 0 must pass the batch's arrays, got None")
    if not source and arrays is not None:
        raise ValueError(
            f"broadcast_batch: process {jax.process_index()} must pass None (only process 0 "
            "has the batch)"
        )
    if source:
        buf, header_bytes = encode_batch(arrays)
        if buf.size > np.iinfo(np.int32).max:
            raise ValueError(f"broadcast_batch: {buf.size} bytes is over the 2 GiB limit")
        sizes = np.array([buf.size, header_bytes], np.int32)
    else:
        sizes = np.zeros(2, np.int32)
    if jax.process_count() == 1:
        return decode_batch(buf, header_bytes)
    size, header_bytes = (int(s) for s in multihost_utils.broadcast_one_to_all(sizes))
    if not source:
        buf = np.zeros(size, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return decode_batch(buf, header_bytes)


def global_batch(
    arrays: Mapping[str, np.ndarray],
    shardings: jax.sharding.Sharding | Mapping[str, jax.sharding.Sharding],
) -> dict[str, jax.Array]:
    """Global ``jax.Array``s from host arrays that are identical on every process.

    Each process supplies only the shards of its own devices, so nothing crosses hosts.

    Args:
      arrays: the batch (e.g. from :func:`broadcast_batch`).
      shardings: one sharding for every array (what ``train_step.batch_shardings``
        returns) or one per name.
    """
    out = {}
    for name, value in arrays.items():
        sharding = shardings[name] if isinstance(shardings, Mapping) else shardings
        x = np.asarray(value)
        out[name] = jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
    return out


# --------------------------------------------------------------------------------------
# Params: everyone → process 0; stop flags: everyone ↔ everyone.
# --------------------------------------------------------------------------------------


def _identity(x):
    return x


def gather_params(params: Any) -> Any | None:
    """A numpy copy of every parameter on process 0 (None elsewhere), for the weight push.

    A collective: every process calls it, with the same tree. Leaves are gathered one at a
    time (replicated over the leaf's mesh, copied to host on process 0, released), so the
    devices hold at most one extra whole leaf at a time.
    """
    source = is_coordinator()
    leaves, treedef = jax.tree.flatten(params)
    fetched = []
    for x in leaves:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if isinstance(x.sharding, NamedSharding):
                full = jax.jit(_identity, out_shardings=x.sharding.update(spec=PartitionSpec()))(x)
                host = np.asarray(full.addressable_data(0)) if source else None
                del full
            else:
                host = multihost_utils.process_allgather(x, tiled=True)
            fetched.append(host if source else None)
        else:
            fetched.append(np.asarray(x) if source else None)
    return jax.tree.unflatten(treedef, fetched) if source else None


def sync_stop(stop: bool) -> bool:
    """True on every process when any process passes True.

    Call it once per step, on every process, with this process's reason to stop (the last
    step, SIGTERM, an error in process 0's rollout threads): all processes then leave the
    loop at the same step instead of hanging in the next collective.
    """
    if jax.process_count() == 1:
        return bool(stop)
    flags = multihost_utils.process_allgather(np.int32(bool(stop)))
    return bool(np.any(flags))
