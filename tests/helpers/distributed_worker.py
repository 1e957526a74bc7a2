"""One process of the multi-process training test (``tests/parallel/test_distributed.py``).

Run with ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` set (one
process of a job) or with none of them (the single-process reference), from the repository
root::

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python tests/helpers/distributed_worker.py --out /tmp/ref.npz

What it does, on every process:

1. ``distributed.initialize()`` from the environment.
2. Protocol checks: process 0 broadcasts batches of many dtypes and shapes (two buffer
   sizes), every process checks what it received against the same deterministic batch;
   ``sync_stop`` with one process asking to stop, then none.
3. Training: the tiny model's state placed on a (data, fsdp, tensor) mesh over all
   processes' devices; per step process 0 alone builds the batch (synthetic groups as in
   ``test_train_step``), broadcasts it, every process wraps it as global arrays and runs the
   jitted step; ``sync_stop`` every step, as the trainer does.
4. ``gather_params`` on process 0, which writes the params and the per-step losses to
   ``--out`` (an .npz).

Any mismatch raises, so the process exits non-zero; success prints ``WORKER_OK``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

# tests/, for the helpers package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from a3po_jax.parallel import distributed  # noqa: E402  (jax must not touch a device before this)


def sample_batch(scale: int) -> dict[str, np.ndarray]:
    """Arrays of every dtype the protocol must carry, in a fixed key order."""
    import ml_dtypes

    rng = np.random.default_rng(scale)
    n = 8 * scale
    return {
        "tokens": rng.integers(0, 50_000, size=(4, n), dtype=np.int32),
        "versions_i64": rng.integers(-(2**40), 2**40, size=(n,), dtype=np.int64),
        "behav_logp": rng.normal(size=(4, n)).astype(np.float32),
        "bf16": rng.normal(size=(3, n)).astype(ml_dtypes.bfloat16),
        "f64": rng.normal(size=(2, 3)),
        "mask": rng.random((4, n)) > 0.5,
        "bytes": rng.integers(0, 255, size=(5,), dtype=np.uint8),
        "scalar": np.float32(-0.0).reshape(()),  # a 0-d array; -0.0 must keep its sign
        "empty": np.zeros((0, 7), np.int16),
        "transposed": np.arange(6 * n, dtype=np.float32).reshape(6, n).T,  # not C-contiguous
        "nan_inf": np.array([np.nan, np.inf, -np.inf, 1e-38], np.float32),
        "c64": (rng.normal(size=3) + 1j * rng.normal(size=3)).astype(np.complex64),
    }


def check_protocol() -> None:
    is_source = distributed.is_coordinator()
    for scale in (1, 4000):  # 4000: a buffer past the smallest bucket
        want = sample_batch(scale)
        got = distributed.broadcast_batch(want if is_source else None)
        assert list(got) == list(want), (list(got), list(want))
        for name, x in want.items():
            y = got[name]
            assert y.dtype == x.dtype and y.shape == x.shape, (name, y.dtype, y.shape, x.dtype)
            assert y.tobytes() == x.tobytes(), name  # bit-exact (tobytes is C order)
            assert y.flags.writeable and y.flags.c_contiguous, name
    import jax

    last = jax.process_index() == jax.process_count() - 1
    assert distributed.sync_stop(last) is True  # one process asking is enough
    assert distributed.sync_stop(False) is False


def train(steps: int, mesh_sizes: tuple[int, int, int]) -> tuple[dict, list[float]]:
    import jax

    from a3po_jax import model
    from a3po_jax.core import placement
    from a3po_jax.core.batching import build_batch
    from a3po_jax.parallel.sharding import make_mesh
    from a3po_jax.training import step_builder
    from a3po_jax.training.config import OptimSection
    from helpers.train_step import CFG, make_config, make_groups

    # A learning rate that moves the weights by ~1e-3 per step, far above the tolerance the
    # test compares them with.
    cfg = dataclasses.replace(make_config(prox="a3po"), optim=OptimSection(learning_rate=1e-3))
    algo = step_builder.algorithm(cfg, CFG)
    optimizer = step_builder.optimizer(cfg)
    mesh = make_mesh(*mesh_sizes)
    params = model.init_params(CFG, jax.random.key(0))
    state = placement.place_train_state(params, optimizer, mesh)
    step_fn = placement.jit_train_step(
        state,
        mesh,
        algo=algo,
        optimizer=optimizer,
        grad_clip=cfg.optim.grad_clip,
        with_reference=False,
    )
    shardings = placement.batch_shardings(mesh, algo.plan.leading_rows)  # 4 groups of 4
    losses = []
    for i in range(steps + 1):
        if distributed.sync_stop(i == steps):
            break
        arrays = None
        if distributed.is_coordinator():
            groups = make_groups(seed=10 + i, versions_from=i)
            arrays = build_batch(
                groups, advantage="grpo", length_bucket=32
            ).arrays()  # one T: no recompiles
        arrays = distributed.broadcast_batch(arrays)
        state, metrics = step_fn(state, distributed.global_batch(arrays, shardings), None)
        losses.append(float(metrics["loss/total"]))  # replicated: readable on every process
    assert len(losses) == steps, losses
    assert int(state.step) == steps
    return distributed.gather_params(state.params), losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help=".npz written by process 0")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mesh", default="1,2,2", help="data,fsdp,tensor")
    args = parser.parse_args()
    t0 = time.perf_counter()
    setup = distributed.initialize(timeout_s=120)

    import jax

    from a3po_jax.model import flatten_params

    assert (jax.process_count(), jax.process_index()) == (
        setup.num_processes,
        setup.process_id,
    )
    print(
        f"process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local / {jax.device_count()} devices",
        flush=True,
    )
    check_protocol()
    print(f"protocol checked at {time.perf_counter() - t0:.1f} s", flush=True)
    mesh_sizes = tuple(int(s) for s in args.mesh.split(","))
    params, losses = train(args.steps, mesh_sizes)
    if distributed.is_coordinator():
        flat = {name: np.asarray(x) for name, x in flatten_params(params).items()}
        np.savez(
            args.out,
            **flat,
            _losses=np.asarray(losses),
            _process_count=np.asarray(jax.process_count()),
        )
    else:
        assert params is None
    print(f"WORKER_OK process {jax.process_index()} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
