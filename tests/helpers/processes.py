"""Child processes of the tests: a free loopback port and a CPU environment with N
virtual devices."""

import os
import socket

from a3po_jax.parallel import distributed
from helpers.paths import REPO

__all__ = ["REPO", "cpu_env", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (distributed.ENV_COORDINATOR, "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    }
    # Cheaper CPU code generation halves the compile time of each process; every run of a
    # comparison gets the same flags, so the programs compared are compiled alike.
    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {flags}",
    )
    env.update(extra)
    return env
