"""Invariance tests of the decoder on tiny random models (no checkpoints, no torch).

The reference-implementation comparisons (transformers logits, SmolLM2) live in
`test_checkpoint_io.py`; here the model is checked against itself: cache == no cache,
packed == unpacked, mask == segment ids, remat == no remat, bf16 ≈ f32, and the unrolled
decode path (`apply_decode`) == `apply`.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_reference import greedy_generate

from a3po_jax.model import (
    DecodeParams,
    KVCache,
    ModelConfig,
    abstract_params,
    apply,
    apply_decode,
    decode_params,
    hidden_states,
    init_kv_cache,
    init_params,
    lm_head_kernel,
    lm_head_logits,
    logical_axes,
    out_major_dot,
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


def _forward(params, tokens, positions, config, **kw):
    return jax.jit(lambda p, t, s: apply(p, t, s, config=config, **kw)[0])(
        params, tokens, positions
    )


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
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
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
    tokens = jax.random.randint(jax.random.key(2), (b, t), 0, config.vocab_size)
    full = _forward(params, tokens, _arange(b, t), config)

    step = jax.jit(lambda p, tok, pos, cache: apply(p, tok, pos, config=config, kv_cache=cache))
    cache = init_kv_cache(config, b, capacity=16)
    logits, cache = step(params, tokens[:, :prefix], _arange(b, prefix), cache)
    pieces = [logits]
    for i in range(prefix, t):
        pos = jnp.full((b, 1), i, jnp.int32)
        logits, cache = step(params, tokens[:, i : i + 1], pos, cache)
        pieces.append(logits)
    np.testing.assert_array_equal(cache.lengths, [t, t])
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-4, rtol=1e-4)


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

    for row, n in enumerate(lengths):
        # one compile for both rows: pad the reference to the bucket too (causal => harmless)
        seq = jnp.concatenate([tokens[row : row + 1, :n], nxt[row : row + 1]], axis=1)
        seq = jnp.pad(seq, ((0, 0), (0, p + 1 - seq.shape[1])))
        ref = _forward(params, seq, _arange(1, p + 1), config)
        np.testing.assert_allclose(logits[row, :n], ref[0, :n], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(step_logits[row, 0], ref[0, n], atol=1e-4, rtol=1e-4)


def test_packed_segments_equal_separate_rows(model):
    """Two sequences packed in one row (segment ids 1, 2, restarted positions) plus padding
    give the same logits as each sequence alone: no attention crosses segments."""
    config, params = model
    a = jax.random.randint(jax.random.key(4), (1, 5), 0, config.vocab_size)
    c = jax.random.randint(jax.random.key(5), (1, 3), 0, config.vocab_size)
    packed = jnp.concatenate([a, c, jnp.zeros((1, 2), jnp.int32)], axis=1)  # [1, 10]
    segment_ids = jnp.array([[1] * 5 + [2] * 3 + [0] * 2], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]], jnp.int32)
    logits = _forward(params, packed, positions, config, segment_ids=segment_ids)
    assert np.isfinite(np.asarray(logits)).all()  # padding queries attend nothing: no NaN
    ref_a = _forward(params, a, _arange(1, 5), config)
    ref_c = _forward(params, c, _arange(1, 3), config)
    np.testing.assert_allclose(logits[0, :5], ref_a[0], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[0, 5:8], ref_c[0], atol=1e-4, rtol=1e-4)


def test_explicit_mask_replaces_causal_and_segments(llama):
    config, params = llama
    b, t = 2, 6
    tokens = jax.random.randint(jax.random.key(6), (b, t), 0, config.vocab_size)
    segment_ids = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]], jnp.int32)
    by_segments = _forward(params, tokens, positions, config, segment_ids=segment_ids)
    idx = jnp.arange(t)
    mask = (
        (idx[:, None] >= idx[None, :])
        & (segment_ids[:, :, None] == segment_ids[:, None, :])
        & (segment_ids[:, None, :] != 0)
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
    logits = _forward(params, tokens[:1], pos, config, attention_mask=jnp.asarray(shared))
    alone = jnp.concatenate([tokens[:1, :2], tokens[:1, 4:6]], axis=1)
    ref = _forward(params, alone, _arange(1, 4), config)
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
    np.testing.assert_allclose(hidden @ lm_head_kernel(params, config), logits, atol=1e-5)
    # Two jitted programs: the same cache up to rounding; a wrong slot is off by O(0.1).
    chex.assert_trees_all_close(hidden_cache, logits_cache, atol=1e-6, rtol=1e-6)
    assert apply(params, tokens, _arange(1, 5), config=config)[1] is None
    assert hidden_states(params, tokens, _arange(1, 5), config=config)[1] is None


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
    fwd = jax.jit(lambda p, t: apply(p, t, _arange(1, width), config=config)[0])
    seq = list(prompt)
    for _ in range(n):
        logits = fwd(params, jnp.array([seq + [0] * (width - len(seq))], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
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
    p = params
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


def test_one_layer_function_serves_apply_and_apply_decode(monkeypatch):
    """The layer maths exists once: `apply` (scanned, traced once for all L layers) and
    `apply_decode` (unrolled, once per layer) both run `decoder_layer`."""
    from a3po_jax.model import decoder

    config = ModelConfig.tiny()
    params = init_params(config, jax.random.key(0))
    calls = []
    real = decoder.decoder_layer

    def counted(w, *args, **kwargs):
        calls.append("fused" if "qkv" in w["attn"] else "stacked")
        return real(w, *args, **kwargs)

    monkeypatch.setattr(decoder, "decoder_layer", counted)
    tok = jnp.zeros((1, 1), jnp.int32)
    cache = init_kv_cache(config, 1, 4)
    jax.eval_shape(lambda p: apply(p, tok, tok, config=config, kv_cache=cache), params)
    assert calls == ["stacked"]
    calls.clear()
    dparams = decode_params(params, config)
    jax.eval_shape(lambda p: apply_decode(p, tok, tok, config=config, kv_cache=cache), dparams)
    assert calls == ["fused"] * config.n_layers


def test_logical_axes_rejects_unknown_parameter():
    params = init_params(ModelConfig.tiny(), jax.random.key(0))
    params["layers"]["attn"]["mystery"] = {"kernel": jnp.zeros((2, 3))}
    with pytest.raises(ValueError, match="layers/attn/mystery/kernel"):
        logical_axes(params)


# ---------------------------------------------------------------------------------------------
# The decode path: `apply_decode` over `decode_params` must be `apply` with another layout.


def _apply_vs_apply_decode(config, params, cache_capacity=8, out_major=True):
    """Right-padded prefill (rows of 5 and 3 valid tokens), then decode steps where row 1 is
    idle (segment 0) in the second one and row 0 writes at the last slot: logits, caches and
    lengths of `apply` and `apply_decode` at every step."""
    b, p = 2, 5
    dparams = decode_params(params, config, out_major=out_major)
    tokens = jax.random.randint(jax.random.key(11), (b, p), 0, config.vocab_size)
    prefill_seg = (jnp.arange(p)[None, :] < jnp.array([[5], [3]])).astype(jnp.int32)
    steps = [
        (tokens, _arange(b, p), prefill_seg),
        (jnp.array([[7], [9]]), jnp.array([[5], [3]]), jnp.ones((b, 1), jnp.int32)),
        (jnp.array([[4], [2]]), jnp.array([[6], [4]]), jnp.array([[1], [0]], jnp.int32)),
        (jnp.array([[8], [5]]), jnp.array([[7], [4]]), jnp.ones((b, 1), jnp.int32)),
    ]
    run = {
        "apply": jax.jit(
            lambda w, tok, pos, seg, cache: apply(
                w, tok, pos, config=config, segment_ids=seg, kv_cache=cache
            )
        ),
        "apply_decode": jax.jit(
            lambda w, tok, pos, seg, cache: apply_decode(
                w, tok, pos, config=config, segment_ids=seg, kv_cache=cache
            )
        ),
    }
    weights = {"apply": params, "apply_decode": dparams}
    out = {}
    for name, fn in run.items():
        cache = init_kv_cache(config, b, cache_capacity)
        trace = []
        for tok, pos, seg in steps:
            logits, cache = fn(weights[name], tok.astype(jnp.int32), pos, seg, cache)
            trace.append((np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v)))
        out[name] = (trace, np.asarray(cache.lengths))
    return out["apply"], out["apply_decode"]


@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_apply_decode_equals_apply(name, out_major):
    """Same logits and caches as `apply` for Llama, Qwen2 (q/k/v bias, untied lm_head) and
    Qwen3 (q/k norm, one kv head), through prefill, decode, an idle row and a full cache,
    in both decode layouts. The two differ only in layout (fused q/k/v and gate/up, weights
    transposed or not, unrolled layers), so anything beyond float rounding is a wiring
    error: a swapped q/k/v block or a wrong head order shifts logits by O(1)."""
    config = CONFIGS[name]
    params = _sharp_params(config)
    (ref, ref_lengths), (got, got_lengths) = _apply_vs_apply_decode(
        config, params, out_major=out_major
    )
    np.testing.assert_array_equal(got_lengths, ref_lengths)
    np.testing.assert_array_equal(ref_lengths, [8, 5])  # row 1 skipped one step
    for (ref_logits, ref_k, ref_v), (logits, k, v) in zip(ref, got, strict=True):
        np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(k, ref_k, atol=1e-5)
        np.testing.assert_allclose(v, ref_v, atol=1e-5)


def test_apply_decode_equals_apply_in_bfloat16():
    """bfloat16 weights and matmuls (logits still float32): fusing q/k/v and gate/up may
    round differently, so the bound is bfloat16's precision (~0.4 %) of the logit scale, far
    below the O(1) error of a wiring bug."""
    config = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16", qkv_bias=True)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _sharp_params(config))
    (ref, _), (got, _) = _apply_vs_apply_decode(config, params)
    for (ref_logits, _, _), (logits, _, _) in zip(ref, got, strict=True):
        assert logits.dtype == np.float32
        scale = np.abs(ref_logits).max()
        assert np.abs(logits - ref_logits).max() < 0.01 * scale


@pytest.mark.parametrize("window", [6, 16])
def test_apply_decode_window_changes_nothing_but_the_reads(window):
    """A decode step attending to the first `window` cache slots gives the logits and the
    cache of one attending to the whole capacity, while every row's token lands inside the
    window (rows at lengths 5 and 3; window 6 is the tightest that holds them)."""
    config = ModelConfig.tiny()
    params = _sharp_params(config)
    dparams = decode_params(params, config)
    b, p, capacity = 2, 5, 32
    tokens = jax.random.randint(jax.random.key(3), (b, p), 0, config.vocab_size)
    seg = (jnp.arange(p)[None, :] < jnp.array([[5], [3]])).astype(jnp.int32)
    cache = init_kv_cache(config, b, capacity)
    _, cache = apply(params, tokens, _arange(b, p), config=config, segment_ids=seg, kv_cache=cache)
    step = dict(config=config, kv_cache=cache, segment_ids=jnp.ones((b, 1), jnp.int32))
    tok, pos = jnp.array([[7], [9]]), jnp.array([[5], [3]])
    full_logits, full_cache = apply_decode(dparams, tok, pos, **step)
    logits, new_cache = apply_decode(dparams, tok, pos, window=window, **step)
    np.testing.assert_allclose(logits, full_logits, atol=1e-5, rtol=1e-5)
    # Two differently compiled programs agree to rounding, not bit for bit (1.5e-8 apart on
    # an AVX-512 Xeon); a token written to the wrong slot or a stale row is off by O(0.1).
    for a, b_ in zip(new_cache, full_cache, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-6, rtol=1e-6)
    for bad in (0, capacity + 1):
        with pytest.raises(ValueError, match="window"):
            apply_decode(dparams, tok, pos, window=bad, **step)


@pytest.mark.parametrize("tied", [True, False])
def test_apply_decode_vocab_major_is_the_logits_transposed(tied):
    """`vocab_major=True` returns the same logits as [V, B·T], column b·T + t for row b's
    token t (the decode step samples down its columns), for the tied out-major lm_head and
    an untied one; two tokens per row, so a mixed-up column order shows."""
    config = ModelConfig.tiny(tie_embeddings=tied)
    params = _sharp_params(config)
    dparams = decode_params(params, config)
    b, t = 3, 2
    cache = init_kv_cache(config, b, 8)
    tok = jax.random.randint(jax.random.key(5), (b, t), 0, config.vocab_size)
    step = dict(config=config, kv_cache=cache)
    logits, cache_rows = apply_decode(dparams, tok, _arange(b, t), **step)
    logits_t, cache_cols = apply_decode(dparams, tok, _arange(b, t), vocab_major=True, **step)
    assert logits_t.shape == (config.vocab_size, b * t)
    np.testing.assert_allclose(logits_t.T.reshape(b, t, -1), logits, atol=1e-6, rtol=1e-6)
    for a, b_ in zip(cache_cols, cache_rows, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-6, rtol=1e-6)


def test_decode_params_layout():
    """Per-layer trees whose fused blocks are the original kernels, transposed (out-major
    `kernel_t` [O, I]); the embedding table is shared with `params` (the tied lm_head reads
    it as it is), not copied."""
    config = CONFIGS["qwen2"]  # biases and an untied lm_head
    params = init_params(config, jax.random.key(0))
    dp = decode_params(params, config)
    assert isinstance(dp, DecodeParams) and len(dp.layers) == config.n_layers
    assert dp.embed is params["embed"]["embedding"]
    assert dp.lm_head is params["lm_head"]["kernel"]
    d, h, n, k, f = (
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        config.ffn_dim,
    )
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    w = dp.layers[1]
    qkv = w["attn"]["qkv"]
    assert set(qkv) == {"kernel_t", "bias"}
    assert qkv["kernel_t"].shape == ((h + 2 * n) * k, d)
    np.testing.assert_array_equal(
        qkv["kernel_t"][: h * k], attn["q_proj"]["kernel"][1].reshape(d, -1).T
    )
    np.testing.assert_array_equal(
        qkv["kernel_t"][(h + n) * k :], attn["v_proj"]["kernel"][1].reshape(d, -1).T
    )
    np.testing.assert_array_equal(
        qkv["bias"][h * k : (h + n) * k], attn["k_proj"]["bias"][1].ravel()
    )
    gate_up = w["mlp"]["gate_up"]["kernel_t"]
    assert gate_up.shape == (2 * f, d)
    np.testing.assert_array_equal(gate_up[:f], mlp["gate_proj"]["kernel"][1].T)
    np.testing.assert_array_equal(gate_up[f:], mlp["up_proj"]["kernel"][1].T)
    np.testing.assert_array_equal(
        w["mlp"]["down_proj"]["kernel_t"], mlp["down_proj"]["kernel"][1].T
    )
    np.testing.assert_array_equal(
        w["attn"]["o_proj"]["kernel_t"], attn["o_proj"]["kernel"][1].reshape(h * k, d).T
    )
    # out_major=False: the same blocks in `apply`'s [I, O] layout.
    w_in = decode_params(params, config, out_major=False).layers[1]
    assert "kernel_t" not in w_in["attn"]["qkv"]
    np.testing.assert_array_equal(w_in["attn"]["qkv"]["kernel"], qkv["kernel_t"].T)
    np.testing.assert_array_equal(w_in["mlp"]["gate_up"]["kernel"], gate_up.T)
    np.testing.assert_array_equal(w_in["mlp"]["down_proj"]["kernel"], mlp["down_proj"]["kernel"][1])
    tied = ModelConfig.tiny()
    assert decode_params(init_params(tied, jax.random.key(0)), tied).lm_head is None


def test_out_major_dot_is_the_product_with_the_transposed_kernel():
    """`out_major_dot(x, kernel_t)` == x @ kernel_tᵀ (golden: a 2x2 by hand, then random
    shapes against numpy to float tolerance), jitted, at one row and at several."""
    x = jnp.array([[1.0, 2.0]])
    kernel_t = jnp.array([[3.0, 4.0], [5.0, 6.0], [0.5, -1.0]])  # [O=3, I=2]
    np.testing.assert_array_equal(jax.jit(out_major_dot)(x, kernel_t), [[11.0, 17.0, -1.5]])
    rng = np.random.default_rng(0)
    for m in (1, 7, 32):
        x = rng.standard_normal((m, 24)).astype(np.float32)
        kt = rng.standard_normal((40, 24)).astype(np.float32)
        got = jax.jit(out_major_dot)(jnp.asarray(x), jnp.asarray(kt))
        assert got.shape == (m, 40)
        np.testing.assert_allclose(got, x @ kt.T, rtol=1e-5, atol=1e-5)


def test_apply_decode_traces_once_and_writes_the_cache_in_place():
    """One trace for repeated steps; with the cache donated, XLA writes the new slots into
    the donated buffer (no [L, B, S, N, K] copy per step): the input cache is consumed."""
    config = ModelConfig.tiny()
    dp = decode_params(_sharp_params(config), config)

    @functools.partial(jax.jit, donate_argnums=(3,))
    @chex.assert_max_traces(n=1)
    def step(w, tok, pos, cache):
        return apply_decode(w, tok, pos, config=config, kv_cache=cache)

    cache = init_kv_cache(config, 2, 8)
    tok = jnp.zeros((2, 1), jnp.int32)
    for _ in range(3):
        old = cache
        _, cache = step(dp, tok, cache.lengths[:, None], cache)
        assert old.k.is_deleted() and old.v.is_deleted()
    np.testing.assert_array_equal(cache.lengths, [3, 3])
    hlo = step.lower(dp, tok, cache.lengths[:, None], cache).compile().as_text()
    cache_shape = f"f32[{config.n_layers},2,8,{config.n_kv_heads},{config.head_dim}]"
    assert not [line for line in hlo.splitlines() if cache_shape in line and " copy(" in line]


# `hidden_states` over a `decode_params` split: what an inference engine's prefill and cache
# recompute run, so that it holds one copy of the weights.


@pytest.mark.parametrize(
    ("name", "out_major", "many_rows"),
    [(name, out_major, False) for name in CONFIGS for out_major in (True, False)]
    + [("qwen2", True, True), ("qwen3", True, True)],
)
def test_hidden_states_over_a_split_equal_the_stacked_path(name, out_major, many_rows, monkeypatch):
    """The same hidden states, cache and lengths as over the stacked params, for Llama, Qwen2
    (bias, untied head) and Qwen3 (q/k norm), in both split layouts, with a right-padded
    cache prefill, a second prefill on top of it and a plain forward over packed segments;
    and the same logits through `lm_head_logits`. `many_rows` lowers the row count above
    which an out-major kernel multiplies as x @ kernel_tᵀ, so both products are checked. A
    layer taken out of order, a missing cache write or a wrong head is off by O(0.1)."""
    from a3po_jax.model import layers

    if many_rows:
        monkeypatch.setattr(layers, "OUT_MAJOR_GEMM_MAX_ROWS", 0)
    config = CONFIGS[name]
    params = _sharp_params(config)
    split = decode_params(params, config, out_major=out_major)
    b, t = 2, 6
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, config.vocab_size)
    seg = (jnp.arange(t)[None, :] < jnp.array([[6], [4]])).astype(jnp.int32)
    run = jax.jit(functools.partial(hidden_states, config=config))
    head = jax.jit(functools.partial(lm_head_logits, config=config))
    ref_cache = got_cache = init_kv_cache(config, b, 16)
    for step in range(2):  # two prefills: the second attends to the first's cache
        pos = _arange(b, t) + ref_cache.lengths[:, None]
        ref, ref_cache = run(params, tokens + step, pos, segment_ids=seg, kv_cache=ref_cache)
        got, got_cache = run(split, tokens + step, pos, segment_ids=seg, kv_cache=got_cache)
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(got_cache.k, ref_cache.k, atol=1e-5)
        np.testing.assert_allclose(got_cache.v, ref_cache.v, atol=1e-5)
        np.testing.assert_array_equal(got_cache.lengths, ref_cache.lengths)
        np.testing.assert_allclose(
            head(split, got.reshape(b * t, -1)),
            head(params, ref.reshape(b * t, -1)),
            atol=1e-4,
            rtol=1e-5,
        )
    np.testing.assert_array_equal(got_cache.lengths, [12, 8])
    packed = jnp.array([[1, 1, 1, 2, 2, 0]], jnp.int32)
    ref, none = run(params, tokens[:1], _arange(1, t), segment_ids=packed)
    got, _ = run(split, tokens[:1], _arange(1, t), segment_ids=packed)
    assert none is None
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)


def test_hidden_states_over_a_split_compile_one_layer():
    """The split path loops over the layers: its compiled program does not grow with depth
    (an unrolled loop over L layers held L copies of the layer's dots)."""
    sizes = {}
    for n_layers in (2, 6):
        config = ModelConfig.tiny(n_layers=n_layers)
        split = decode_params(init_params(config, jax.random.key(0)), config)
        tokens = jnp.zeros((1, 4), jnp.int32)
        hlo = (
            jax.jit(functools.partial(hidden_states, config=config))
            .lower(split, tokens, _arange(1, 4))
            .as_text()
        )
        sizes[n_layers] = hlo.count("dot_general")
    assert sizes[2] == sizes[6], sizes


def test_hidden_states_rejects_a_split_of_another_depth():
    config = ModelConfig.tiny()
    split = decode_params(init_params(config, jax.random.key(0)), config)
    deeper = ModelConfig.tiny(n_layers=config.n_layers + 1)
    with pytest.raises(ValueError, match="DecodeParams has"):
        hidden_states(split, jnp.zeros((1, 2), jnp.int32), _arange(1, 2), config=deeper)
