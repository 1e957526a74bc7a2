"""Child processes of the tests: a free loopback port, a CPU environment with N virtual
devices, and a test file re-run on N devices."""

import json
import os
import socket
import subprocess
import sys

from a3po_jax.parallel import distributed
from helpers.codegen import CHEAP_CODEGEN
from helpers.paths import REPO

__all__ = ["REPO", "cpu_env", "free_port", "run_file_on_devices", "train_tiny"]


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
    # Cheaper CPU code generation cuts each process's compile time; every run of a
    # comparison gets the same flags, so the programs compared are compiled alike.
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {CHEAP_CODEGEN}",
    )
    env.update(extra)
    return env


def run_file_on_devices(test_file: str, devices: int, keyword: str, **env: str) -> None:
    """Runs the tests of `test_file` whose names hold `keyword` in a child pytest with N
    virtual CPU devices (the suite's cheaper code generation) and fails unless every one of
    them ran and passed: none skipped for want of devices."""
    child_env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {CHEAP_CODEGEN}",
        "JAX_PLATFORMS": "cpu",
        "A3PO_TEST_BUDGET_S": "0",  # the child's tests are the parts of one multidevice test
        **env,
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-x", "-k", keyword]
        + ["-p", "no:cacheprovider", "-m", "multidevice or not multidevice"],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = result.stdout[-5000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, output


def train_tiny(run_dir, *overrides: str, plugins=None) -> list[dict]:
    """``a3po-train experiments/smoke_tiny.py OVERRIDES run_dir=RUN_DIR`` in a child process
    (the installed entry point beside this Python, else the module), with ``plugins`` (a
    folder of modules) on the Python path; asserts it exits 0 and returns its records."""
    script = os.path.join(os.path.dirname(sys.executable), "a3po-train")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "a3po_jax.cli.train"]
    path = [str(plugins)] if plugins is not None else []
    path += [str(REPO), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.run(
        [*command, "experiments/smoke_tiny.py", *overrides, f"run_dir={run_dir}"],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(path)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
