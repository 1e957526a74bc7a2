"""train_step.apply_grads alone, an old copy of train_step.py against this tree's, on the
default backend: seconds (min and median of 10) and XLA's temporaries, two rounds each.

    git show 8c81be5:a3po_jax/core/train_step.py > /tmp/old_train_step.py
    PYTHONPATH=. python results/bench_gpu_h200/update_ab.py smollm2,qwen2.5-1.5b \
        float32,bfloat16 /tmp/old_train_step.py
"""

import dataclasses
import functools
import importlib.util
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, "scripts")
from bench_common import CONFIGS

from a3po_jax.core import train_step as new
from a3po_jax.model import decoder as model

spec = importlib.util.spec_from_file_location("old_train_step", sys.argv[3])
old = importlib.util.module_from_spec(spec)
sys.modules["old_train_step"] = old
spec.loader.exec_module(old)
print("device", jax.devices()[0].device_kind, flush=True)
for name, dtype in [(n, d) for n in sys.argv[1].split(",") for d in sys.argv[2].split(",")]:
    cfg = dataclasses.replace(CONFIGS[name], param_dtype=dtype, compute_dtype=dtype)
    params = model.init_params(cfg, jax.random.key(0))
    res = {}
    for label, mod in (("old", old), ("new", new), ("old", old), ("new", new)):
        opt = mod.make_optimizer(learning_rate=1e-5)
        fn = jax.jit(
            functools.partial(mod.apply_grads, optimizer=opt, grad_clip=1.0), donate_argnums=(0,)
        )
        acc = mod.Accumulated(
            grads=jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params),
            loss_sum=jnp.ones((), jnp.float32),
            count=jnp.full((), 512.0),
            stats=mod.Stats(),
        )
        state = mod.init_train_state(jax.tree.map(jnp.copy, params), opt)
        c = fn.lower(state, acc).compile()
        temp = c.memory_analysis().temp_size_in_bytes / 2**30
        state, _ = c(state, acc)
        jax.block_until_ready(state)
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            state, m = c(state, acc)
            jax.block_until_ready(state)
            ts.append(time.perf_counter() - t)
        res.setdefault(label, []).append((min(ts), statistics.median(ts), temp))
        del state, acc, c
    for label, rows in res.items():
        print(
            name,
            dtype,
            label,
            " | ".join(
                f"min {a * 1e3:.2f} ms median {b * 1e3:.2f} ms temp {t:.2f} GiB" for a, b, t in rows
            ),
            flush=True,
        )
