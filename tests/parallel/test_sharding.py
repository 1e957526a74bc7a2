"""Mesh and sharding rules; sharded == unsharded on 8 fake CPU devices.

The main pytest process has one CPU device, and XLA's device count is fixed at start-up, so
`test_sharded_suite_in_8_device_subprocess` re-runs this file in a child process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`; there the `test_eight_*` tests run and
the one-device tests are skipped.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.processes import run_file_on_devices
from jax.sharding import PartitionSpec as P

from a3po_jax.model import (
    ModelConfig,
    abstract_params,
    apply,
    init_kv_cache,
    init_params,
)
from a3po_jax.parallel.sharding import (
    INFERENCE_RULES,
    TRAIN_RULES,
    IndivisibleError,
    batch_sharding,
    check_batch_divisible,
    kv_cache_shardings,
    make_mesh,
    param_shardings,
    shard_params,
)

EIGHT = jax.device_count() == 8
eight_only = pytest.mark.skipif(not EIGHT, reason="runs in the 8-device subprocess")
one_only = pytest.mark.skipif(EIGHT, reason="runs in the main (1-device) process")


# ---------------------------------------------------------------------------------------------
# One device


@one_only
@pytest.mark.multidevice
def test_sharded_suite_in_8_device_subprocess():
    # every test_eight_* runs and passes
    run_file_on_devices(__file__, 8, "eight")


@one_only
def test_one_device_mesh_and_errors():
    mesh = make_mesh()
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="data=2"):
        make_mesh(data=2, fsdp=1)
    with pytest.raises(ValueError, match="tensor=-1 cannot be inferred"):
        make_mesh(data=1, fsdp=2, tensor=-1)
    with pytest.raises(ValueError, match="only one axis"):
        make_mesh(data=-1, fsdp=-1)


def test_parameter_without_rule_is_named():
    config = ModelConfig.tiny(qkv_bias=True)
    shapes = abstract_params(config)
    mesh = make_mesh(devices=jax.devices()[:1])
    rules = tuple(r for r in TRAIN_RULES if r[0] != "kv_heads")
    with pytest.raises(ValueError, match=r"layers/attn/k_proj/(kernel|bias).*'kv_heads'"):
        param_shardings(shapes, mesh, rules)


def test_rules_cover_every_parameter_of_every_variant():
    mesh = make_mesh(devices=jax.devices()[:1])
    for config in (
        ModelConfig.tiny(),
        ModelConfig.tiny(qkv_bias=True, tie_embeddings=False),
        ModelConfig.tiny(qk_norm=True),
    ):
        for rules in (TRAIN_RULES, INFERENCE_RULES):
            shardings = param_shardings(abstract_params(config), mesh, rules)
            assert len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(abstract_params(config)))


# ---------------------------------------------------------------------------------------------
# Eight devices (subprocess)

CONFIG = ModelConfig.tiny(n_heads=4, n_kv_heads=2, qkv_bias=True, tie_embeddings=False)


def _data(batch=8, t=6, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (batch, t), 0, CONFIG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    segment_ids = jnp.ones((batch, t), jnp.int32).at[1, 4:].set(0)  # some padding
    return tokens, positions, segment_ids


def _loss(params, tokens, positions, segment_ids):
    logits = apply(params, tokens, positions, config=CONFIG, segment_ids=segment_ids)[0]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = segment_ids[:, 1:] != 0
    return -jnp.sum(target * mask) / jnp.sum(mask), logits


@eight_only
def test_eight_make_mesh_infers_and_checks():
    mesh = make_mesh(data=2, fsdp=-1, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="data=3"):
        make_mesh(data=3, fsdp=1, tensor=2)


@eight_only
@pytest.mark.parametrize("rules_name", ["train", "inference"])
def test_eight_sharded_forward_and_grads_equal_unsharded(rules_name):
    rules = TRAIN_RULES if rules_name == "train" else INFERENCE_RULES
    mesh = make_mesh(data=2, fsdp=2, tensor=2) if rules_name == "train" else make_mesh(4, 1, 2)
    params = init_params(CONFIG, jax.random.key(0))
    params["embed"]["embedding"] *= 20.0  # logits far from uniform: a real comparison
    tokens, positions, segment_ids = _data()
    grad_fn = jax.value_and_grad(_loss, has_aux=True)

    (ref_loss, ref_logits), ref_grads = jax.jit(grad_fn)(params, tokens, positions, segment_ids)

    p_shard = param_shardings(params, mesh, rules)
    b_shard = batch_sharding(mesh, rules, batch_size=tokens.shape[0])
    sharded_params = shard_params(params, p_shard)
    q_spec = p_shard["layers"]["attn"]["q_proj"]["kernel"].spec
    if rules_name == "train":
        assert q_spec == P(None, "fsdp", "tensor", None)  # FSDP over D, heads over tensor
        # the weight really is split 4 ways: each device holds a quarter
        shard = sharded_params["layers"]["attn"]["q_proj"]["kernel"].addressable_shards[0]
        assert shard.data.shape == (2, 32, 2, 16)
    else:
        assert q_spec == P(None, None, "tensor", None)  # replicated over data
    step = jax.jit(
        grad_fn,
        in_shardings=(p_shard, b_shard, b_shard, b_shard),
        out_shardings=((None, None), p_shard),
    )
    (loss, logits), grads = step(sharded_params, tokens, positions, segment_ids)
    # Only the summation order differs (partial sums over fsdp/tensor shards).
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-6, rtol=1e-4)
    assert all(jax.tree.leaves(jax.tree.map(lambda g, s: g.sharding == s, grads, p_shard)))


@eight_only
def test_eight_sharded_kv_cache_decode_equals_unsharded():
    mesh = make_mesh(data=4, fsdp=1, tensor=2)
    params = init_params(CONFIG, jax.random.key(1))
    tokens, positions, segment_ids = _data(batch=4, t=5, seed=2)
    cache = init_kv_cache(CONFIG, 4, 8)

    def prefill_and_step(p, tok, pos, seg, cache):
        _, cache = apply(p, tok, pos, config=CONFIG, segment_ids=seg, kv_cache=cache)
        nxt = tok[:, :1]
        logits, cache = apply(p, nxt, cache.lengths[:, None], config=CONFIG, kv_cache=cache)
        return logits, cache

    ref_logits, ref_cache = jax.jit(prefill_and_step)(params, tokens, positions, segment_ids, cache)
    p_shard = param_shardings(params, mesh, INFERENCE_RULES)
    c_shard = kv_cache_shardings(mesh, INFERENCE_RULES, cache)
    assert c_shard.k.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    b_shard = batch_sharding(mesh, INFERENCE_RULES)
    step = jax.jit(
        prefill_and_step,
        in_shardings=(p_shard, b_shard, b_shard, b_shard, c_shard),
        out_shardings=(None, c_shard),
    )
    logits, new_cache = step(
        shard_params(params, p_shard),
        tokens,
        positions,
        segment_ids,
        jax.device_put(cache, c_shard),
    )
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(new_cache.lengths, ref_cache.lengths)
    np.testing.assert_allclose(new_cache.k, ref_cache.k, atol=1e-5)


@eight_only
def test_eight_mesh_not_dividing_heads_or_batch_names_both_numbers():
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    three_kv = ModelConfig.tiny(n_heads=6, n_kv_heads=3, head_dim=8)
    with pytest.raises(IndivisibleError, match=r"k_proj/kernel: kv_heads = 3 .* size 4") as err:
        param_shardings(abstract_params(three_kv), mesh, INFERENCE_RULES)
    assert err.value.mesh_axes == ("tensor",)  # the trainer names system.mesh.tensor by it
    # Replicating kv heads (rule kv_heads -> None, as for multi-query attention) leaves the
    # query heads to be checked.
    rules = tuple((k, None if k == "kv_heads" else v) for k, v in INFERENCE_RULES)
    six_heads = ModelConfig.tiny(n_heads=6, n_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"attn/(o|q)_proj/kernel: heads = 6 .* size 4"):
        param_shardings(abstract_params(six_heads), mesh, rules)
    param_shardings(abstract_params(ModelConfig.tiny(n_heads=8, n_kv_heads=1)), mesh, rules)
    with pytest.raises(IndivisibleError, match=r"batch = 6 .* size 8") as err:
        check_batch_divisible(6, make_mesh(data=4, fsdp=2, tensor=1))
    assert err.value.mesh_axes == ("data", "fsdp")
    with pytest.raises(ValueError, match=r"batch = 6 .* size 4"):
        batch_sharding(make_mesh(data=2, fsdp=2, tensor=2), TRAIN_RULES, batch_size=6)


@eight_only
def test_eight_checkpoint_loads_straight_into_shardings(tmp_path):
    from a3po_jax.model.checkpoint_io import load_hf_checkpoint, save_hf_checkpoint

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    params = init_params(CONFIG, jax.random.key(3))
    save_hf_checkpoint(params, CONFIG, tmp_path)
    config, loaded = load_hf_checkpoint(
        tmp_path, shardings=lambda c: param_shardings(abstract_params(c), mesh, TRAIN_RULES)
    )
    assert config == CONFIG
    expected = param_shardings(params, mesh, TRAIN_RULES)
    assert all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, loaded, expected)))
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
