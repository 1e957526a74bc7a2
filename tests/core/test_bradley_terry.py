"""The Bradley-Terry loss against hand-computed values, and its train step on the tiny model.

Golden values: a margin of 0 costs log 2 and is half right; a margin m costs log(1 + e^-m)
(m = log 3: log(4/3)); a masked pair counts for nothing. The step: on one fixed batch of
pairs whose chosen side ends in a marker token, a few AdamW steps on a 1-device mesh lower
the loss from log 2 (the zero head) and make every pair right.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from a3po_jax.core.bradley_terry import (
    PairBatch,
    bradley_terry_loss,
    bradley_terry_terms,
    jit_pair_eval,
    jit_reward_step,
)
from a3po_jax.core.optim import make_optimizer
from a3po_jax.core.placement import place_train_state
from a3po_jax.model import ModelConfig, init_params
from a3po_jax.model.reward_model import reward_params_from_policy
from a3po_jax.parallel.sharding import make_mesh


def test_golden_values():
    loss, metrics = bradley_terry_loss(jnp.zeros(3), jnp.zeros(3))
    assert loss == pytest.approx(math.log(2), rel=1e-6)
    assert metrics["reward/pair_accuracy"] == pytest.approx(0.5)

    r_c = jnp.array([math.log(3), 0.0, 2.0])
    r_r = jnp.array([0.0, math.log(3), -1.0])
    per_pair, correct = bradley_terry_terms(r_c, r_r)
    expected = [math.log(4 / 3), math.log(4), math.log(1 + math.exp(-3))]
    np.testing.assert_allclose(per_pair, expected, rtol=1e-6)
    np.testing.assert_array_equal(correct, [1.0, 0.0, 1.0])
    loss, metrics = bradley_terry_loss(r_c, r_r)
    assert loss == pytest.approx(sum(expected) / 3, rel=1e-6)
    assert metrics["reward/pair_accuracy"] == pytest.approx(2 / 3)
    assert metrics["reward/margin"] == pytest.approx((math.log(3) - math.log(3) + 3) / 3)

    # The mask drops the wrong pair: mean over the two that count.
    loss, metrics = bradley_terry_loss(r_c, r_r, jnp.array([1.0, 0.0, 1.0]))
    assert loss == pytest.approx((expected[0] + expected[2]) / 2, rel=1e-6)
    assert metrics["reward/pair_accuracy"] == 1.0 and metrics["reward/num_pairs"] == 2.0
    # Large margins stay finite (softplus, not log of a sigmoid that rounds to 0 or 1).
    per_pair, _ = bradley_terry_terms(jnp.array([-200.0, 200.0]), jnp.array([200.0, -200.0]))
    np.testing.assert_allclose(per_pair, [400.0, 0.0], atol=1e-6)


def _marker_batch(b=4, t=8, marker=7, seed=0):
    """Chosen rows end in `marker`, rejected rows do not; lengths differ per row."""
    rng = np.random.RandomState(seed)
    chosen = rng.randint(10, 100, size=(b, t)).astype(np.int32)
    rejected = chosen.copy()
    lengths = rng.randint(3, t + 1, size=b).astype(np.int32)
    for row, n in enumerate(lengths):
        chosen[row, n - 1] = marker
        chosen[row, n:] = rejected[row, n:] = 0
    mask = np.ones(b, np.float32)
    mask[-1] = 0.0  # a filler pair: must not count
    return PairBatch(chosen, lengths, rejected, lengths.copy(), mask)


# Two compiles (step and evaluation) of the tiny model: over the quick tier's share.
@pytest.mark.e2e
def test_steps_on_one_mesh_lower_the_loss():
    config = ModelConfig.tiny(max_seq_len=64)
    _, params = reward_params_from_policy(init_params(config, jax.random.key(0)), config)
    mesh = make_mesh(devices=jax.devices()[:1])
    optimizer = make_optimizer(learning_rate=3e-3)
    state = place_train_state(params, optimizer, mesh)
    batch = _marker_batch()
    step = jit_reward_step(
        state, mesh, config=config, optimizer=optimizer, grad_clip=1.0, batch_size=4
    )
    evaluate = jit_pair_eval(state.params, mesh, config=config, batch_size=4)
    loss0, correct0, count = np.asarray(evaluate(state.params, batch))
    assert count == 3 and loss0 / count == pytest.approx(math.log(2), rel=1e-6)
    assert correct0 / count == 0.5  # the zero head ties every pair
    losses = []
    for _ in range(6):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss/bradley_terry"]))
    assert losses[0] == pytest.approx(math.log(2), rel=1e-5) and int(state.step) == 6
    assert metrics["step/skipped"] == 0.0
    loss, correct, _ = np.asarray(evaluate(state.params, batch))
    assert loss / count < 0.5 * math.log(2) and correct == count


SHARDED = """
import sys
import chex, jax, numpy as np
sys.path.insert(0, "tests")
from a3po_jax.core.bradley_terry import PairBatch, jit_reward_step
from a3po_jax.core.optim import make_optimizer
from a3po_jax.core.placement import place_train_state
from a3po_jax.model import ModelConfig, init_params
from a3po_jax.model.reward_model import reward_params_from_policy
from a3po_jax.parallel.sharding import make_mesh

assert len(jax.devices()) == 4, jax.devices()
config = ModelConfig.tiny(max_seq_len=64)
_, params = reward_params_from_policy(
    init_params(config, jax.random.key(0)), config, jax.random.key(1), head_std=0.1
)
rng = np.random.RandomState(0)
tokens = rng.randint(1, 100, size=(4, 8)).astype(np.int32)
lengths = np.array([8, 5, 3, 6], np.int32)
batch = PairBatch(tokens, lengths, tokens[::-1].copy(), lengths[::-1].copy(),
                  np.array([1, 1, 1, 0], np.float32))
optimizer = make_optimizer(learning_rate=1e-3)
out = {}
for name, mesh in (("one", make_mesh(1, 1, 1, devices=jax.devices()[:1])),
                   ("four", make_mesh(1, 2, 2))):
    state = place_train_state(params, optimizer, mesh)
    step = jit_reward_step(state, mesh, config=config, optimizer=optimizer, grad_clip=1.0,
                           batch_size=4)
    for _ in range(2):
        state, metrics = step(state, batch)
    out[name] = (jax.device_get(state.params), float(metrics["loss/bradley_terry"]))
    if name == "four":
        spec = state.params["layers"]["attn"]["q_proj"]["kernel"].sharding.spec
        assert "tensor" in str(spec) and "fsdp" in str(spec), spec
        print("score spec", state.params["score"]["kernel"].sharding.spec)
# Adam turns float reordering in near-zero gradients into lr-sized steps: atol 1e-5.
chex.assert_trees_all_close(out["one"][0], out["four"][0], rtol=2e-4, atol=1e-5)
np.testing.assert_allclose(out["one"][1], out["four"][1], rtol=1e-4)
print("SHARDED_OK")
"""


@pytest.mark.multidevice
def test_the_step_sharded_over_four_devices_equals_one():
    """FSDP x tensor parallel, as the policy is laid out: the same update as one device."""
    import subprocess
    import sys

    from helpers.paths import REPO
    from helpers.processes import cpu_env

    proc = subprocess.run(
        [sys.executable, "-c", SHARDED],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=cpu_env(4),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "SHARDED_OK" in proc.stdout
