"""Multi-process training helpers (``a3po_jax.parallel.distributed``).

Fast tests cover the single-process path in this process: argument and environment
resolution, the batch encoding, ``global_batch`` and ``gather_params``. The slow ones start
real CPU processes (``jax.distributed`` can be initialised once per process, and the device
count is fixed when JAX starts): start-up errors that JAX itself would only report by
aborting, and 2 processes x 2 devices training the tiny model against 1 process x 4
devices (``tests/helpers/distributed_worker.py``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers.processes import REPO, cpu_env, free_port

from a3po_jax import model
from a3po_jax.parallel import distributed
from a3po_jax.parallel.sharding import make_mesh

WORKER = REPO / "tests" / "helpers" / "distributed_worker.py"


# --------------------------------------------------------------------------------------
# Resolving the job's layout.
# --------------------------------------------------------------------------------------


def test_process_setup_reads_the_environment_and_arguments_win():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8476", "JAX_NUM_PROCESSES": "4"}
    setup = distributed.process_setup(environ={**env, "JAX_PROCESS_ID": "3"})
    assert setup == distributed.ProcessSetup("10.0.0.2:8476", 4, 3)
    assert setup.is_multi_process
    # Explicit arguments override the environment, value by value.
    setup = distributed.process_setup("h:1", process_id=1, environ={**env, "JAX_PROCESS_ID": "3"})
    assert setup == distributed.ProcessSetup("h:1", 4, 1)
    # Nothing set, or one process: a single-process run (no coordinator needed).
    assert distributed.process_setup(environ={}) == distributed.ProcessSetup(None, 1, 0)
    assert distributed.process_setup(num_processes=1, environ={}).num_processes == 1
    assert distributed.process_setup(environ={"JAX_NUM_PROCESSES": ""}).num_processes == 1
    assert distributed.process_setup("[::1]:8476", 2, 0, environ={}).is_multi_process


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"num_processes": 2, "process_id": 2}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "process_id=2"),
        ({"num_processes": 2, "process_id": -1}, {}, "process_id must be a non-negative"),
        ({"num_processes": 0}, {}, "num_processes must be a positive"),
        ({"num_processes": 2}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "process_id is not set"),
        ({"num_processes": 2, "process_id": 1}, {}, "coordinator_address is not set"),
        ({"coordinator_address": "h:1"}, {}, "num_processes is not set"),
        ({}, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "one"}, "JAX_PROCESS_ID='one'"),
        ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, {}, "'h' must be"),
        ({"coordinator_address": "h:http", "num_processes": 2, "process_id": 0}, {}, "h:http"),
        ({"coordinator_address": "h:0", "num_processes": 2, "process_id": 0}, {}, "1..65535"),
        ({"coordinator_address": ":80", "num_processes": 2, "process_id": 0}, {}, "':80'"),
    ],
)
def test_process_setup_names_the_bad_argument(kwargs, env, match):
    with pytest.raises(ValueError, match=match):
        distributed.process_setup(**kwargs, environ=env)


def test_initialize_is_a_no_op_for_one_process(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() == distributed.ProcessSetup(None, 1, 0)
    assert not jax.distributed.is_initialized()
    assert distributed.is_coordinator()
    # A bad argument fails before anything is started.
    with pytest.raises(ValueError, match="process_id=5"):
        distributed.initialize("127.0.0.1:1234", 2, 5)
    assert not jax.distributed.is_initialized()


# --------------------------------------------------------------------------------------
# Batches and params on one process.
# --------------------------------------------------------------------------------------


def mixed_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(0, 1000, size=(4, 9), dtype=np.int32),
        "logp": rng.normal(size=(4, 9)).astype(np.float32),
        "bf16": rng.normal(size=(2, 3)).astype(ml_dtypes.bfloat16),
        "mask": rng.random((4, 9)) > 0.5,
        "i64": np.array([-(2**40), 2**40], np.int64),
        "scalar": np.array(-0.0, np.float32),
        "empty": np.zeros((0, 3), np.int16),
        "transposed": np.arange(12, dtype=np.float64).reshape(3, 4).T,
    }


def assert_same_batch(got, want):
    assert list(got) == list(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype, name
        assert got[name].shape == x.shape, name
        assert got[name].tobytes() == x.tobytes(), name  # bit-exact, -0.0 included


def test_encode_decode_round_trips_names_dtypes_and_shapes():
    want = mixed_batch()
    buf, header_bytes = distributed.encode_batch(want)
    assert buf.dtype == np.uint8 and buf.size == 4096  # the smallest bucket
    got = distributed.decode_batch(buf, header_bytes)
    assert_same_batch(got, want)
    assert all(x.flags.writeable and x.flags.c_contiguous for x in got.values())
    # broadcast_batch takes the same path on one process.
    assert_same_batch(distributed.broadcast_batch(want), want)


def test_buffer_sizes_come_from_few_buckets():
    sizes = {
        distributed.encode_batch({"x": np.zeros(n, np.uint8)})[0].size for n in range(0, 70_000, 7)
    }
    # ≤ 12.5 % padding means 8 sizes per doubling: 4096 .. 70 000 bytes is ~4 doublings.
    assert len(sizes) <= 8 * 5, len(sizes)
    for n in (5000, 65_536, 1_000_001):
        size = distributed.encode_batch({"x": np.zeros(n, np.uint8)})[0].size
        assert n < size <= 1.125 * n + 512, (n, size)


def test_broadcast_batch_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError, match="process 0 must pass"):
        distributed.broadcast_batch(None)
    with pytest.raises(TypeError, match="'names'.*object"):
        distributed.broadcast_batch({"names": np.array(["a", None], dtype=object)})
    with pytest.raises(TypeError, match="keys must be str"):
        distributed.broadcast_batch({1: np.zeros(2)})


def test_global_batch_and_gather_params_on_one_process():
    from a3po_jax.core import placement

    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    arrays = {"tokens": np.arange(8, dtype=np.int32).reshape(4, 2), "mask": np.ones((4, 2))}
    out = distributed.global_batch(arrays, placement.batch_shardings(mesh, 4))
    for name, x in arrays.items():
        assert isinstance(out[name], jax.Array)
        assert out[name].sharding == placement.batch_shardings(mesh, 4)
        np.testing.assert_array_equal(np.asarray(out[name]), x)
    params = model.init_params(model.ModelConfig.tiny(), jax.random.key(0))
    host = distributed.gather_params(params)
    assert jax.tree.structure(host) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(params), strict=True):
        assert isinstance(a, np.ndarray)
        np.testing.assert_array_equal(a, np.asarray(b))
    assert distributed.sync_stop(True) is True and distributed.sync_stop(False) is False


# --------------------------------------------------------------------------------------
# Real processes.
# --------------------------------------------------------------------------------------

START_ERRORS = textwrap.dedent(
    """
    import socket, time
    import jax
    from a3po_jax.parallel import distributed

    # Process 1 with no coordinator listening: JAX alone would abort the process (a fatal
    # log after its timeout, no exception); here it is a RuntimeError naming the address.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    try:
        distributed.initialize(f"127.0.0.1:{port}", 2, 1, timeout_s=2)
    except RuntimeError as err:
        assert f"127.0.0.1:{port}" in str(err) and "process 1 of 2" in str(err), err
        assert time.monotonic() - t0 < 30
        print("UNREACHABLE_OK:", err)
    else:
        raise AssertionError("no error for an unreachable coordinator")

    # Process 0 on a port another program holds: JAX says "Failed to start RPC server".
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            distributed.initialize(f"127.0.0.1:{port}", 2, 0, timeout_s=2)
        except RuntimeError as err:
            assert f"port {port}" in str(err), err
            print("PORT_TAKEN_OK:", err)
        else:
            raise AssertionError("no error for a coordinator port in use")
    assert not jax.distributed.is_initialized()
    print("START_ERRORS_OK")
    """
)


@pytest.mark.multidevice
def test_start_up_errors_are_exceptions_not_aborts():
    proc = subprocess.run(
        [sys.executable, "-c", START_ERRORS],
        capture_output=True,
        text=True,
        env=cpu_env(1),
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "START_ERRORS_OK" in proc.stdout


@pytest.mark.multidevice
def test_two_processes_train_like_one(tmp_path):
    """2 processes x 2 CPU devices == 1 process x 4 devices on a (1, 2, 2) mesh: the fsdp
    axis spans the processes, so parameter all-gathers and gradient reductions cross them.
    A batch built by process 0 alone and broadcast must give the same params and losses."""
    steps = 2
    port = free_port()
    multi = {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
    }
    runs = {
        "p0": (cpu_env(2, **multi, JAX_PROCESS_ID="0"), tmp_path / "multi.npz"),
        "p1": (cpu_env(2, **multi, JAX_PROCESS_ID="1"), tmp_path / "unused.npz"),
        "single": (cpu_env(4), tmp_path / "single.npz"),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(WORKER), "--out", str(out), "--steps", str(steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        for name, (env, out) in runs.items()
    }
    logs = {}
    try:
        for name, proc in procs.items():
            logs[name], _ = proc.communicate(timeout=900)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{logs[name][-4000:]}"
        assert "WORKER_OK" in logs[name], logs[name][-2000:]
    assert "process 1 of 2: 2 local / 4 devices" in logs["p1"]
    assert not (tmp_path / "unused.npz").exists()  # only process 0 writes

    multi_out, single_out = np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz")
    assert int(multi_out["_process_count"]) == 2 and int(single_out["_process_count"]) == 1
    np.testing.assert_allclose(multi_out["_losses"], single_out["_losses"], rtol=1e-5, atol=1e-6)
    assert multi_out["_losses"].shape == (steps,)
    init = model.flatten_params(model.init_params(model.ModelConfig.tiny(), jax.random.key(0)))
    init = {name: np.asarray(x) for name, x in init.items()}
    names = sorted(k for k in single_out.files if not k.startswith("_"))
    assert names == sorted(init) == sorted(k for k in multi_out.files if not k.startswith("_"))
    moved = 0.0
    for name in names:
        np.testing.assert_allclose(multi_out[name], single_out[name], rtol=1e-5, atol=1e-5)
        moved = max(moved, float(np.abs(single_out[name] - init[name]).max()))
    # The steps changed the weights (a comparison of two untouched inits would pass too).
    assert moved > 1e-3, moved
