"""Invariance tests of the decoder on tiny random models (no checkpoints, no torch).

The reference-implementation comparisons (transformers logits, SmolLM2) live in
`test_checkpoint_io.py`; here the model is checked against itself: cache == no cache,
packed == unpacked, mask == segment ids, remat == no remat, bf16 ≈ f32. The inference
engine's weight layout (`apply_decode` == `apply`) is checked in `test_decode_layout.py`.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.model_reference import greedy_generate

from a3po_jax.model import (
    KVCache,
    ModelConfig,
    abstract_params,
    apply,
    hidden_states,
    init_kv_cache,
    init_params,
    lm_head_kernel,
    logical_axes,
)

CONFIGS = {
    "llama": ModelConfig.tiny(),
    "qwen2": ModelConfig.tiny(qkv_bias=True, tie_embeddings=False),
    "qwen3": ModelConfig.tiny(qk_norm=True, n_kv_heads=1),
}


def _sharp_params(config, seed=0):
    """Random params with a larger embedding scale, so logits are far from uniform and greedy
    argmaxes are not near-ties that float rounding could flip."""
    params = init_params(config, jax.random.key(seed))
    params["embed"]["embedding"] = params["embed"]["embedding"] * 50.0
    return params


# The cache paths are exercised on plain Llama and on Qwen3 (q/k norm sits between the
# projections and the cache write); Qwen2's biases are covered by the transformers comparison.
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    config = CONFIGS[request.param]
    return config, _sharp_params(config)


@pytest.fixture(scope="module")
def llama():
    config = CONFIGS["llama"]
    return config, _sharp_params(config)


# One program per config and shape, shared by every test: a fresh jitted lambda per call
# compiled the whole model again each time.
@functools.partial(jax.jit, static_argnames="config")
def _forward(params, tokens, positions, config, **kw):
    return apply(params, tokens, positions, config=config, **kw)[0]


# one compiled program: eagerly every leaf's cast compiles its own
_to_bfloat16 = jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree))


def _arange(b, t):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_init_matches_config_and_logical_axes(name):
    config = CONFIGS[name]
    params = abstract_params(config)
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == config.n_params
    axes = logical_axes(params)
    # every leaf has one axis name per dimension, and the stacked layer axis comes first
    assert axes["layers"]["attn"]["q_proj"]["kernel"] == ("layers", "embed", "heads", "head_dim")
    for leaf, ax in zip(
        jax.tree.leaves(params),
        jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
        strict=True,
    ):
        assert len(ax) == leaf.ndim


def test_logits_shape_dtype_and_bf16_close_to_f32():
    config = ModelConfig.tiny()
    params = _sharp_params(config)
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, config.vocab_size)
    logits = _forward(params, tokens, _arange(2, 7), config)
    assert logits.shape == (2, 7, config.vocab_size) and logits.dtype == jnp.float32

    bf16 = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
    params16 = _to_bfloat16(params)
    logits16 = _forward(params16, tokens, _arange(2, 7), bf16)
    # logits stay float32 even with bfloat16 weights and matmuls
    assert logits16.dtype == jnp.float32
    # bf16 has ~3 significant digits; logits here are O(10), so 1-2 % relative error is bf16
    # rounding, while a wiring bug (wrong head grouping, missing rope) gives O(1) errors.
    scale = np.abs(np.asarray(logits)).max()
    assert np.abs(np.asarray(logits16) - np.asarray(logits)).max() < 0.03 * scale


def test_prefill_then_decode_equals_full_forward(model):
    """The KV-cache path (prefill a prefix, then one token at a time) gives the same logits
    as one full causal forward over the whole sequence."""
    config, params = model
    b, t, prefix = 2, 10, 4
    # host copies to slice: eager slicing compiles a program per slice shape
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (b, t), 0, config.vocab_size))
    full = _forward(params, tokens, _arange(b, t), config)

    step = jax.jit(lambda p, tok, pos, cache: apply(p, tok, pos, config=config, kv_cache=cache))
    cache = init_kv_cache(config, b, capacity=16)
    logits, cache = step(params, tokens[:, :prefix], _arange(b, prefix), cache)
    pieces = [logits]
    for i in range(prefix, t):
        pos = jnp.full((b, 1), i, jnp.int32)
        logits, cache = step(params, tokens[:, i : i + 1], pos, cache)
        pieces.append(np.asarray(logits))
    np.testing.assert_array_equal(cache.lengths, [t, t])
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=1e-4)


def test_right_padded_prefill_uses_per_row_lengths(model):
    """Rows with different prompt lengths in one right-padded prefill: each row's logits and
    its next decode step equal the unpadded single-row computation."""
    config, params = model
    lengths = [5, 3]
    p, cap = 6, 12
    tokens = jax.random.randint(jax.random.key(3), (2, p), 0, config.vocab_size)
    segment_ids = (jnp.arange(p)[None, :] < jnp.array(lengths)[:, None]).astype(jnp.int32)
    step = jax.jit(
        lambda p, tok, pos, seg, cache: apply(
            p, tok, pos, config=config, segment_ids=seg, kv_cache=cache
        )
    )
    cache = init_kv_cache(config, 2, cap)
    logits, cache = step(params, tokens, _arange(2, p), segment_ids, cache)
    np.testing.assert_array_equal(cache.lengths, lengths)
    nxt = jnp.array([[7], [9]], jnp.int32)
    step_logits, cache = step(params, nxt, cache.lengths[:, None], jnp.ones((2, 1), int), cache)
    np.testing.assert_array_equal(cache.lengths, [6, 4])

    # host copies to slice and pad: eagerly each slice shape compiles its own program
    logits, step_logits = np.asarray(logits), np.asarray(step_logits)
    tokens, nxt = np.asarray(tokens), np.asarray(nxt)
    for row, n in enumerate(lengths):
        # one compile for both rows: pad the reference to the bucket too (causal => harmless)
        seq = np.concatenate([tokens[row : row + 1, :n], nxt[row : row + 1]], axis=1)
        seq = np.pad(seq, ((0, 0), (0, p + 1 - seq.shape[1])))
        ref = np.asarray(_forward(params, seq, _arange(1, p + 1), config))
        np.testing.assert_allclose(logits[row, :n], ref[0, :n], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(step_logits[row, 0], ref[0, n], atol=1e-4, rtol=1e-4)


def test_packed_segments_equal_separate_rows(model):
    """Two sequences packed in one row (segment ids 1, 2, restarted positions) plus padding
    give the same logits as each sequence alone: no attention crosses segments."""
    config, params = model
    a = np.asarray(jax.random.randint(jax.random.key(4), (1, 5), 0, config.vocab_size))
    c = np.asarray(jax.random.randint(jax.random.key(5), (1, 3), 0, config.vocab_size))
    packed = np.concatenate([a, c, np.zeros((1, 2), np.int32)], axis=1)  # [1, 10]
    segment_ids = jnp.array([[1] * 5 + [2] * 3 + [0] * 2], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]], jnp.int32)
    logits = np.asarray(_forward(params, packed, positions, config, segment_ids=segment_ids))
    assert np.isfinite(np.asarray(logits)).all()  # padding queries attend nothing: no NaN
    ref_a = np.asarray(_forward(params, a, _arange(1, 5), config))
    ref_c = np.asarray(_forward(params, c, _arange(1, 3), config))
    np.testing.assert_allclose(logits[0, :5], ref_a[0], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[0, 5:8], ref_c[0], atol=1e-4, rtol=1e-4)


def test_explicit_mask_replaces_causal_and_segments(llama):
    config, params = llama
    b, t = 2, 6
    tokens = jax.random.randint(jax.random.key(6), (b, t), 0, config.vocab_size)
    segment_ids = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]], jnp.int32)
    by_segments = _forward(params, tokens, positions, config, segment_ids=segment_ids)
    # the mask built on the host: eagerly each comparison compiles its own program
    idx, seg = np.arange(t), np.asarray(segment_ids)
    mask = (
        (idx[:, None] >= idx[None, :])
        & (seg[:, :, None] == seg[:, None, :])
        & (seg[:, None, :] != 0)
    )
    by_mask = _forward(params, tokens, positions, config, attention_mask=mask)
    np.testing.assert_allclose(by_mask, by_segments, atol=1e-6)

    # A shared-prompt mask: prompt [0, 1] seen by two responses [2, 3] and [4, 5], which do
    # not see each other. Response 2's logits must equal prompt + response 2 alone.
    shared = np.zeros((1, t, t), bool)
    for q in range(t):
        for k in range(q + 1):
            same_resp = (q in (2, 3) and k in (2, 3)) or (q in (4, 5) and k in (4, 5))
            shared[0, q, k] = k < 2 or same_resp
    pos = jnp.array([[0, 1, 2, 3, 2, 3]], jnp.int32)
    tokens = np.asarray(tokens)
    logits = np.asarray(
        _forward(params, tokens[:1], pos, config, attention_mask=jnp.asarray(shared))
    )
    alone = np.concatenate([tokens[:1, :2], tokens[:1, 4:6]], axis=1)
    ref = np.asarray(_forward(params, alone, _arange(1, 4), config))
    np.testing.assert_allclose(logits[0, 4:6], ref[0, 2:4], atol=1e-4, rtol=1e-4)


def test_fully_masked_rows_are_finite_and_grads_too():
    config = ModelConfig.tiny()
    params = _sharp_params(config)
    tokens = jnp.zeros((2, 4), jnp.int32)
    segment_ids = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]], jnp.int32)  # row 1 all padding

    def loss(p):
        logits = apply(p, tokens, _arange(2, 4), config=config, segment_ids=segment_ids)[0]
        return jnp.sum(logits * (segment_ids[..., None] != 0))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert np.isfinite(value)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_remat_gives_same_loss_and_grads():
    config = ModelConfig.tiny()
    params = _sharp_params(config)
    tokens = jax.random.randint(jax.random.key(7), (2, 6), 0, config.vocab_size)

    def loss_fn(cfg):
        def loss(p):
            logits = apply(p, tokens, _arange(2, 6), config=cfg)[0]
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

        return jax.jit(jax.value_and_grad(loss))

    v1, g1 = loss_fn(config)(params)
    v2, g2 = loss_fn(ModelConfig.tiny(remat=True))(params)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    chex.assert_trees_all_close(g1, g2, atol=1e-6, rtol=1e-5)


def test_hidden_states_reproduce_logits():
    """`hidden_states` is `apply` without the lm_head: the same cache, and hidden states that
    `lm_head_kernel` turns into `apply`'s logits (untied head: a wrong head matrix or a
    missing final norm is off by O(1))."""
    config = ModelConfig.tiny(tie_embeddings=False)
    params = _sharp_params(config)
    tokens = jax.random.randint(jax.random.key(8), (1, 5), 0, config.vocab_size)
    cache = init_kv_cache(config, 1, 8)
    kw = dict(config=config, kv_cache=cache)
    logits, logits_cache = jax.jit(functools.partial(apply, **kw))(params, tokens, _arange(1, 5))
    hidden, hidden_cache = jax.jit(functools.partial(hidden_states, **kw))(
        params, tokens, _arange(1, 5)
    )
    assert hidden.shape == (1, 5, config.d_model) and hidden.dtype == jnp.float32
    # one compiled program: eagerly the head's cast, transpose and product compile apart
    head = jax.jit(lambda h, p: h @ lm_head_kernel(p, config))
    np.testing.assert_allclose(head(hidden, params), logits, atol=1e-5)
    # Two jitted programs: the same cache up to rounding; a wrong slot is off by O(0.1).
    chex.assert_trees_all_close(hidden_cache, logits_cache, atol=1e-6, rtol=1e-6)
    # traced, not run: eagerly the whole model compiles op by op
    for fn in (apply, hidden_states):
        out = jax.eval_shape(functools.partial(fn, config=config), params, tokens, _arange(1, 5))
        assert out[1] is None


def test_cache_writes_past_capacity_are_dropped():
    """Writing at slot lengths + t >= capacity must not clamp and overwrite valid slots (what
    `dynamic_update_slice` would do)."""
    config = ModelConfig.tiny()
    params = _sharp_params(config)
    step = jax.jit(lambda p, tok, pos, cache: apply(p, tok, pos, config=config, kv_cache=cache))
    cache = init_kv_cache(config, 1, capacity=4)
    _, cache = step(params, jnp.array([[3, 4]], jnp.int32), _arange(1, 2), cache)
    _, cache = step(params, jnp.array([[5, 6]], jnp.int32), _arange(1, 2) + 2, cache)
    before = np.asarray(cache.k)
    # 2 new tokens at slots 3 and 4 (same shapes: no recompile): slot 3 is written, slot 4
    # does not exist; slot 2 keeps its key
    cache = cache._replace(lengths=jnp.array([3], jnp.int32))
    _, cache2 = step(params, jnp.array([[8, 9]], jnp.int32), jnp.array([[3, 4]]), cache)
    np.testing.assert_array_equal(np.asarray(cache2.k)[:, :, :3], before[:, :, :3])
    assert not np.allclose(np.asarray(cache2.k)[:, :, 3], before[:, :, 3])  # token 8 landed


def test_inactive_rows_keep_their_length():
    """Decode with segment id 0 for a row (an idle engine slot) leaves its length unchanged."""
    config = ModelConfig.tiny()
    params = _sharp_params(config)
    cache = init_kv_cache(config, 2, capacity=8)
    cache = cache._replace(lengths=jnp.array([3, 5], jnp.int32))
    _, new = jax.jit(
        lambda p, cache: apply(
            p,
            jnp.array([[1], [2]], jnp.int32),
            jnp.array([[3], [5]], jnp.int32),
            config=config,
            segment_ids=jnp.array([[1], [0]], jnp.int32),
            kv_cache=cache,
        )
    )(params, cache)
    assert isinstance(new, KVCache)
    np.testing.assert_array_equal(new.lengths, [4, 5])


def _greedy_by_recomputation(params, config, prompt, n):
    """Full causal forward over the whole sequence for every new token (no cache). The
    sequence is right-padded to a fixed length so this compiles once; causal attention makes
    the padding after the last token irrelevant to its logits."""
    width = len(prompt) + n
    seq = list(prompt)
    for _ in range(n):
        tokens = np.array([seq + [0] * (width - len(seq))], np.int32)
        logits = np.asarray(_forward(params, tokens, _arange(1, width), config))
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))  # on the host: no program
    return seq[len(prompt) :]


def test_greedy_with_cache_equals_recomputation(model):
    config, params = model
    prompts = [[5, 17, 99, 3, 42], [8, 1]]
    p = max(map(len, prompts))
    padded = jnp.array([q + [0] * (p - len(q)) for q in prompts], jnp.int32)
    lengths = jnp.array([len(q) for q in prompts], jnp.int32)
    out = greedy_generate(params, config, padded, lengths, max_new_tokens=6)
    for row, prompt in enumerate(prompts):
        assert out[row].tolist() == _greedy_by_recomputation(params, config, prompt, 6)


def test_decode_step_traces_once():
    config = ModelConfig.tiny()
    params = _sharp_params(config)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(p, tok, pos, cache):
        return apply(p, tok, pos, config=config, kv_cache=cache)

    cache = init_kv_cache(config, 2, 8)
    tok = jnp.zeros((2, 1), jnp.int32)
    for _ in range(3):
        _, cache = step(params, tok, cache.lengths[:, None], cache)
    np.testing.assert_array_equal(cache.lengths, [3, 3])


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(head_dim=15), "head_dim"),
        (dict(d_model=0), "d_model"),
        (dict(param_dtype="fp8"), "param_dtype"),
        (dict(compute_dtype="int8"), "compute_dtype"),
        (dict(rms_eps=0.0), "rms_eps"),
        (dict(rope_type="yarn"), "rope_type"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.tiny(**overrides)


def test_init_params_keeps_its_random_streams():
    """A seed gives the weights it gave before the decoder became plain functions (Flax
    still draws them, one stream per parameter name and layer). Values recorded from the
    Flax-module decoder; a changed stream gives unrelated numbers, not a 1e-6 shift."""
    params = init_params(ModelConfig.tiny(qkv_bias=True, tie_embeddings=False), jax.random.key(0))
    p = jax.tree.map(np.asarray, params)  # indexed on the host: no program per slice
    expected = [  # (leaf[index], values)
        (p["embed"]["embedding"][0, :3], [-0.0125226555, 0.0127407629, 0.0072157695]),
        (
            p["layers"]["attn"]["q_proj"]["kernel"][1, 0, 0, :3],
            [-0.0160886105, 0.0236787796, 0.0173190627],
        ),
        (p["layers"]["mlp"]["down_proj"]["kernel"][0, 0, :2], [-0.0603424571, -0.0292957108]),
        (p["lm_head"]["kernel"][0, :3], [0.0365605205, 0.0115733678, -0.0079567321]),
    ]
    for got, values in expected:
        np.testing.assert_allclose(got, values, rtol=1e-6)


def test_logical_axes_rejects_unknown_parameter():
    params = init_params(ModelConfig.tiny(), jax.random.key(0))
    params["layers"]["attn"]["mystery"] = {"kernel": jnp.zeros((2, 3))}
    with pytest.raises(ValueError, match="layers/attn/mystery/kernel"):
        logical_axes(params)
