"""The `XLA_FLAGS` the tests compile with on the CPU: cheaper code generation.

Most of the suite's time is XLA compiling small programs that then run for milliseconds.
LLVM's expensive passes are a third of a compile, and XLA's MLIR fusion emitters most of
what is left: the classic emitters make the same fused loops in a fraction of the time
(docs/development.md, "What makes the suite fit", has the figures). The programs compute the
same to float rounding; only their speed, which no test measures, differs.

One LLVM module per program instead of XLA's default split into up to 32 for parallel
code generation: the suite's two workers keep both cores busy already, so the split only
adds its overhead to each compile (docs/development.md, "Measured").

An `XLA_FLAGS` entry this jaxlib does not know aborts the process, and these switches exist
only in some versions, so each is added where a child process accepts it, probed once per
jaxlib version (remembered in `.cache/`). Imports no JAX: `tests/conftest.py` sets the
flags before JAX loads.
"""

import importlib.metadata
import os
import subprocess
import sys

from helpers.paths import REPO

BASE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
NO_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"
# The flags added where this jaxlib accepts them, each with the name its answer is kept under.
OPTIONAL = {NO_FUSION_EMITTERS: "fusion-emitters", ONE_CODEGEN_PART: "codegen-split"}
CACHE = REPO / ".cache"


def accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA compiles with ``flag`` (a child process tries it)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = "import jax; jax.jit(lambda x: x + 1)(1).block_until_ready()"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return done.returncode == 0


def cheap_codegen() -> str:
    """`BASE`, with each of `OPTIONAL` this jaxlib accepts."""
    version = importlib.metadata.version("jaxlib")
    flags = [BASE]
    for flag, name in OPTIONAL.items():
        known = CACHE / f"xla-flag-{name}-{version}"
        if not known.exists():
            CACHE.mkdir(exist_ok=True)
            partial = known.with_name(f"{known.name}.{os.getpid()}")
            partial.write_text("yes" if accepts(flag) else "no")
            partial.replace(known)  # atomic: xdist workers may probe at the same time
        if known.read_text() == "yes":
            flags.append(flag)
    return " ".join(flags)


CHEAP_CODEGEN = cheap_codegen()
