"""The jitted train step on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices gives
the same parameters as on one device. Runs in a subprocess: the device count is fixed when
JAX starts, and the main test process has one device."""

import subprocess
import sys
import textwrap

import pytest
from helpers.paths import REPO
from helpers.processes import cpu_env

SCRIPT = textwrap.dedent(
    """
    import functools, sys
    import chex, jax, numpy as np
    sys.path.insert(0, "tests")
    from helpers.train_step import make_groups, make_config, CFG
    from a3po_jax import model
    from a3po_jax.core import placement
    from a3po_jax.training import step_builder
    from a3po_jax.core.batching import build_batch
    from a3po_jax.parallel.sharding import make_mesh

    assert len(jax.devices()) == 8, jax.devices()
    cfg = make_config(prox="a3po")
    algo = step_builder.algorithm(cfg, CFG)
    opt = step_builder.optimizer(cfg)
    batch = build_batch(make_groups(versions_from=1), advantage="grpo", length_bucket=16)
    arrays = batch.arrays()
    params = model.init_params(CFG, jax.random.key(0))
    out = {}
    for name, mesh in (("one", make_mesh(1, 1, 1, devices=jax.devices()[:1])),
                       ("eight", make_mesh(2, 2, 2))):
        state = placement.place_train_state(params, opt, mesh)
        step = placement.jit_train_step(state, mesh, algo=algo, optimizer=opt, grad_clip=1.0,
                                        with_reference=False)
        state, metrics = step(state, arrays, None)
        state, metrics = step(state, arrays, None)
        out[name] = (jax.device_get(state.params), float(metrics["loss/total"]))
        if name == "eight":
            spec = state.params["layers"]["attn"]["q_proj"]["kernel"].sharding.spec
            print("q_proj spec", spec)
            assert "tensor" in str(spec) and "fsdp" in str(spec), spec
    chex.assert_trees_all_close(out["one"][0], out["eight"][0], rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(out["one"][1], out["eight"][1], rtol=1e-4)
    # A mesh that does not divide the batch is refused with both numbers named.
    try:
        placement.batch_shardings(make_mesh(1, 8, 1), 12)
    except ValueError as err:
        assert "12" in str(err) and "8" in str(err), err
    else:
        raise AssertionError("12 rows over 8 devices was accepted")
    print("SHARDED_OK")
    """
)


@pytest.mark.multidevice
def test_sharded_train_step_equals_unsharded():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=cpu_env(8),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "SHARDED_OK" in proc.stdout
