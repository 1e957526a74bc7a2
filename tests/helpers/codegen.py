"""The `XLA_FLAGS` the tests compile with on the CPU: cheaper code generation.

Most of the suite's time is XLA compiling small programs that then run for milliseconds.
LLVM's expensive passes are a third of a compile, and XLA's MLIR fusion emitters most of
what is left: the classic emitters make the same fused loops in a fraction of the time
(docs/development.md, "What makes the suite fit", has the figures). The programs compute the
same to float rounding; only their speed, which no test measures, differs.

An `XLA_FLAGS` entry this jaxlib does not know aborts the process, and the fusion emitters'
switch exists only in some versions, so it is added where a child process accepts it once
per jaxlib version (remembered in `.cache/`). Imports no JAX: `tests/conftest.py` sets the
flags before JAX loads.
"""

import importlib.metadata
import os
import subprocess
import sys

from helpers.paths import REPO

BASE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
NO_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
CACHE = REPO / ".cache"


def accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA compiles with ``flag`` (a child process tries it)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = "import jax; jax.jit(lambda x: x + 1)(1).block_until_ready()"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return done.returncode == 0


def cheap_codegen() -> str:
    """`BASE`, with `NO_FUSION_EMITTERS` where this jaxlib accepts it."""
    version = importlib.metadata.version("jaxlib")
    known = CACHE / f"xla-flag-fusion-emitters-{version}"
    if not known.exists():
        CACHE.mkdir(exist_ok=True)
        partial = known.with_name(f"{known.name}.{os.getpid()}")
        partial.write_text("yes" if accepts(NO_FUSION_EMITTERS) else "no")
        partial.replace(known)  # atomic: xdist workers may probe at the same time
    return f"{BASE} {NO_FUSION_EMITTERS}" if known.read_text() == "yes" else BASE


CHEAP_CODEGEN = cheap_codegen()
