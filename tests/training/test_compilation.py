"""JAX's persistent compilation cache for a run (training/compilation.py,
``system.run.compile_cache_dir``).

JAX sets its cache up once per process, and this suite's processes already have one
(tests/conftest.py), so each case runs in a process of its own, started without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from a3po_jax.training import compilation
from a3po_jax.training.config import ConfigError, RunSection

REPO = Path(__file__).resolve().parents[2]
# What tests/conftest.py sets for the suite's own cache, or to turn it off
# (A3PO_TEST_COMPILE_CACHE=off): a case's process starts without it.
SUITE_CACHE = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE")

# Cases in the order a process can meet them: nothing chosen yet, then chosen, then off.
SCRIPT = r"""
import json, os, sys
from pathlib import Path
import jax, jax.numpy as jnp
from a3po_jax.training import compilation

cache, other = Path(sys.argv[1]), Path(sys.argv[2])
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
out = {"empty": compilation.enable("")}
(other.parent / "file").write_text("in the way")
try:
    compilation.enable(str(other.parent / "file" / "cache"))
except ValueError as err:
    out["refused"] = str(err)
out["enabled"] = compilation.enable(str(cache))
out["env"] = os.environ.get("JAX_COMPILATION_CACHE_DIR")
jax.jit(lambda x: jnp.sin(x) * 3.0 + jnp.cos(x))(jnp.arange(7.0)).block_until_ready()
out["hits"] = events.count("/jax/compilation_cache/cache_hits")
out["misses"] = events.count("/jax/compilation_cache/cache_misses")
out["kept"] = compilation.enable(str(other))
jax.config.update("jax_enable_compilation_cache", False)
out["off"] = compilation.enable(str(other))
print(json.dumps(out))
"""


def run_cases(tmp_path: Path, cache: Path, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(SUITE_CACHE)}
    env.update(JAX_PLATFORMS="cpu", **env_extra)
    other = tmp_path / "other" / "cache"
    other.parent.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache), str(other)],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not other.exists()  # never made: the process had chosen, then turned it off
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_process_compiles_into_the_cache_and_the_next_one_loads_from_it(tmp_path):
    cache = tmp_path / "home" / "cache"
    first = run_cases(tmp_path, cache)
    assert first["empty"] is None  # "" chooses no cache
    assert "system.run.compile_cache_dir=" in first["refused"]  # the field, named
    assert first["enabled"] == first["env"] == str(cache)  # children inherit it
    assert (cache.stat().st_mode & 0o777) == 0o700  # JAX trusts what it loads from it
    assert first["misses"] >= 1 and first["hits"] == 0
    assert any(cache.iterdir())
    # The process's choice is kept, and a cache turned off stays off.
    assert first["kept"] == str(cache) and first["off"] is None

    second = run_cases(tmp_path, cache)
    assert second["hits"] >= 1  # the same program, loaded instead of compiled


def test_a_cache_the_process_chose_or_turned_off_is_kept(tmp_path):
    chosen = tmp_path / "chosen"
    kept = run_cases(tmp_path, tmp_path / "run", JAX_COMPILATION_CACHE_DIR=str(chosen))
    assert kept["enabled"] == str(chosen) and not (tmp_path / "run").exists()
    off = run_cases(tmp_path, tmp_path / "run", JAX_ENABLE_COMPILATION_CACHE="false")
    assert off["enabled"] is None and off["hits"] == off["misses"] == 0
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e  # a whole (one-step) run of a3po-train
def test_a_run_compiles_into_its_compile_cache_dir(tmp_path):
    """``system.run.compile_cache_dir`` reaches the run: its programs land there."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(SUITE_CACHE)}
    cmd = [
        sys.executable, "-m", "a3po_jax.cli.train", "experiments/smoke_tiny.py", "steps=1",
        f"run_dir={tmp_path / 'run'}", "checkpoint_every=0", "evaluate=false",
        f"system.run.compile_cache_dir={cache}",
    ]  # fmt: skip
    done = subprocess.run(
        cmd, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600,
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(cache.iterdir())) >= 3  # the train step, the host's kernels, ...
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["time/compile_s"] > 0  # the first step compiled its programs
    assert first["time/compile_s"] < first["time/step_s"] + 60  # (the loads before it too)


def test_compile_seconds_count_a_new_program_once():
    import jax
    import jax.numpy as jnp

    before = compilation.compile_seconds()
    f = jax.jit(lambda x: jnp.tanh(x) * 2.5 - x / 7.0)
    f(jnp.arange(11.0)).block_until_ready()
    made = compilation.compile_seconds()
    assert made > before  # traced, lowered, compiled (or loaded from the suite's cache)
    f(jnp.arange(11.0)).block_until_ready()  # the same program: nothing made
    assert compilation.compile_seconds() == made
    f(jnp.arange(12.0)).block_until_ready()  # a new shape: a new program
    assert compilation.compile_seconds() > made


@pytest.mark.e2e  # starts a gRPC server process
def test_a_served_host_compiles_into_its_compile_cache_dir(tmp_path, monkeypatch):
    """``a3po-serve --compile-cache-dir``: a restarted or joining host loads its programs."""
    from helpers.inference_reference import start_grpc_server, stop_grpc_server

    for name in [k for k in os.environ if k.startswith(SUITE_CACHE)]:
        monkeypatch.delenv(name)  # the suite's own cache (or its turning it off) would win
    cache = tmp_path / "cache"
    args = ["--prefill-buckets", "8", "--warmup", "--compile-cache-dir", str(cache)]
    proc, _ = start_grpc_server(tmp_path / "token", *args)
    try:
        assert len(list(cache.iterdir())) >= 2  # the warm-up's prefill and decode programs
    finally:
        stop_grpc_server(proc)
    blocked = tmp_path / "token" / "cache"  # under a file: cannot be made
    done = subprocess.run(
        [sys.executable, "-m", "a3po_jax.cli.serve", "--compile-cache-dir", str(blocked)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode != 0 and "--compile-cache-dir=" in done.stderr


def test_a_program_bound_drops_the_programs_past_its_limit_and_the_numbers_stay():
    f = jax.jit(lambda x: jnp.tanh(x) * 2.5 - x / 7.0)
    bound = compilation.ProgramBound(f, 2)
    shapes = [(3,), (4,), (3,), (5,), (3,)]
    got, kept = [], []
    for shape in shapes:
        x = {"x": jnp.linspace(-1.0, 1.0, shape[0])}
        cleared = bound(x)
        got.append((cleared, f._cache_size()))
        kept.append(np.asarray(f(x["x"])))
    # (3,) and (4,) compile and stay; (3,) again is kept; (5,) is a third shape: both go.
    assert got == [(False, 0), (False, 1), (False, 2), (True, 0), (False, 1)]
    assert bound.clears == 1 and f._cache_size() == 2
    np.testing.assert_array_equal(kept[4], kept[0])  # compiled again: the same numbers
    unbounded = compilation.ProgramBound(f, 0)
    assert not any(unbounded({"x": jnp.zeros(n)}) for n in range(1, 8))
    with pytest.raises(ValueError, match="limit=-1"):
        compilation.ProgramBound(f, -1)
    with pytest.raises(ConfigError, match="system.run.max_train_programs"):
        RunSection(max_train_programs=-1)
