"""The inference engine's weight layout (`inference/engine/decode_layout.py`) against the model.

`apply_decode` and `hidden_states` over `decode_params` must be `model.apply` and
`model.hidden_states` with the weights laid out otherwise: same logits, caches and lengths
up to float rounding, for Llama, Qwen2 (q/k/v bias, untied head) and Qwen3 (q/k norm), in
the out-major and in-major layouts. With `shards` the fused matrices are ordered shard by
shard for tensor parallelism: `shards=1` is the plain layout bit for bit, `shards=2` gives
the same logits on one device, and on a 2-device mesh (`tensor=2`) each device holds only
its shard and the logits do not change.

The main pytest process has one CPU device, and XLA's device count is fixed at start-up, so
`test_two_device_suite_in_a_subprocess` re-runs this file in a child process with
`XLA_FLAGS=--xla_force_host_platform_device_count=2`; there the `test_two_devices_*` tests
run and the one-device tests are skipped (as `test_sharding.py` does with 8).
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.processes import run_file_on_devices

from a3po_jax import model as model_lib
from a3po_jax.inference.engine import decode_layout
from a3po_jax.inference.engine.decode_layout import (
    DecodeParams,
    apply_decode,
    decode_logical_axes,
    decode_params,
    decode_shardings,
    hidden_states,
    lm_head_logits,
    out_major_dot,
)
from a3po_jax.inference.transfer import layout as wire_layout
from a3po_jax.model import ModelConfig, apply, init_kv_cache, init_params
from a3po_jax.parallel.sharding import INFERENCE_RULES, kv_cache_shardings, make_mesh

CONFIGS = {
    "llama": ModelConfig.tiny(),
    "qwen2": ModelConfig.tiny(qkv_bias=True, tie_embeddings=False),
    "qwen3": ModelConfig.tiny(qk_norm=True, n_kv_heads=1),
}
LAYOUT_MATRIX = {("qwen2", True), ("qwen3", False)}
# Head counts (4 q, 2 kv) and ffn_dim (128) divisible by 2 shards, one per variant.
SHARDABLE = {
    "llama": ModelConfig.tiny(),
    "qwen2": ModelConfig.tiny(qkv_bias=True, tie_embeddings=False),
    "qwen3": ModelConfig.tiny(qk_norm=True),
}

TWO = jax.device_count() == 2
two_only = pytest.mark.skipif(not TWO, reason="runs in the 2-device subprocess")
one_only = pytest.mark.skipif(TWO, reason="runs in the main (1-device) process")


def _sharp_params(config, seed=0):
    """Random params with a larger embedding scale, so logits are far from uniform and greedy
    argmaxes are not near-ties that float rounding could flip."""
    params = init_params(config, jax.random.key(seed))
    params["embed"]["embedding"] = params["embed"]["embedding"] * 50.0
    return params


def _arange(b, t):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


# Computations under test run jitted, one program per config and shape: outside `jax.jit`
# every primitive compiles its own program for each new shape.
_apply = jax.jit(apply, static_argnames="config")
_stacked_hidden_states = jax.jit(model_lib.hidden_states, static_argnames="config")
_stacked_lm_head_logits = jax.jit(model_lib.lm_head_logits, static_argnames="config")
_apply_decode = jax.jit(apply_decode, static_argnames=("config", "window", "vocab_major"))
_to_bfloat16 = jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree))


@one_only
@pytest.mark.multidevice
def test_two_device_suite_in_a_subprocess():
    # every test_two_devices_* runs and passes
    run_file_on_devices(__file__, 2, "two_devices")


def test_one_layer_function_serves_apply_and_apply_decode(monkeypatch):
    """The layer maths exists once: `model.apply` (scanned, traced once for all L layers) and
    `apply_decode` (unrolled, once per layer) both run `model.decoder_layer`, the first
    with the training layout's reader, the second with this layout's."""
    from a3po_jax.model import decoder

    config = ModelConfig.tiny()
    params = init_params(config, jax.random.key(0))
    calls = []
    real = model_lib.decoder_layer

    def counted(w, *args, weights=model_lib.TRAINING_WEIGHTS, **kwargs):
        calls.append(type(weights).__name__)
        return real(w, *args, weights=weights, **kwargs)

    monkeypatch.setattr(decoder, "decoder_layer", counted)  # what the scan calls
    monkeypatch.setattr(model_lib, "decoder_layer", counted)  # what this layout calls
    tok = jnp.zeros((1, 1), jnp.int32)
    cache = init_kv_cache(config, 1, 4)
    jax.eval_shape(lambda p: apply(p, tok, tok, config=config, kv_cache=cache), params)
    assert calls == ["ModuleWeights"]
    calls.clear()
    dparams = decode_params(params, config)
    jax.eval_shape(lambda p: apply_decode(p, tok, tok, config=config, kv_cache=cache), dparams)
    assert calls == ["FusedWeights"] * config.n_layers


# ---------------------------------------------------------------------------------------------
# `apply_decode` over `decode_params` must be `model.apply` with another layout.


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
    # the module's jits: `apply`'s programs are shared by a config's two layouts
    run = {
        "apply": lambda w, tok, pos, seg, cache: _apply(
            w, tok, pos, config=config, segment_ids=seg, kv_cache=cache
        ),
        "apply_decode": lambda w, tok, pos, seg, cache: _apply_decode(
            w, tok, pos, config=config, segment_ids=seg, kv_cache=cache
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


# Every model with either layout: llama with both, qwen2 and qwen3 each with the other's
# layout in the whole suite alone (the layout is the same code for every model).
@pytest.mark.parametrize(
    ("name", "out_major"),
    [
        pytest.param(name, out_major, id=f"{name}-{'out' if out_major else 'in'}_major",
                     marks=[pytest.mark.matrix] if (name, out_major) in LAYOUT_MATRIX else [])
        for name in CONFIGS
        for out_major in (True, False)
    ],
)  # fmt: skip
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
    params = _to_bfloat16(_sharp_params(config))
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
    _, cache = _apply(params, tokens, _arange(b, p), config=config, segment_ids=seg, kv_cache=cache)
    step = dict(config=config, kv_cache=cache, segment_ids=jnp.ones((b, 1), jnp.int32))
    tok, pos = jnp.array([[7], [9]]), jnp.array([[5], [3]])
    full_logits, full_cache = _apply_decode(dparams, tok, pos, **step)
    logits, new_cache = _apply_decode(dparams, tok, pos, window=window, **step)
    np.testing.assert_allclose(logits, full_logits, atol=1e-5, rtol=1e-5)
    # Two differently compiled programs agree to rounding, not bit for bit (1.5e-8 apart on
    # an AVX-512 Xeon); a token written to the wrong slot or a stale row is off by O(0.1).
    for a, b_ in zip(new_cache, full_cache, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-6, rtol=1e-6)
    for bad in (0, capacity + 1):  # eager: the check raises before any computation
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
    logits, cache_rows = _apply_decode(dparams, tok, _arange(b, t), **step)
    logits_t, cache_cols = _apply_decode(dparams, tok, _arange(b, t), vocab_major=True, **step)
    assert logits_t.shape == (config.vocab_size, b * t)
    logits_t = np.asarray(logits_t)  # transposed on the host: no program
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
    # host copies to slice: eagerly each slice and transpose compiles its own program
    attn, mlp = jax.tree.map(np.asarray, (params["layers"]["attn"], params["layers"]["mlp"]))
    w = jax.tree.map(np.asarray, dp.layers[1])
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
    [
        pytest.param(
            name,
            out_major,
            False,
            marks=[pytest.mark.matrix] if (name, out_major) in LAYOUT_MATRIX else [],
        )
        for name in CONFIGS
        for out_major in (True, False)
    ]
    + [("qwen2", True, True), ("qwen3", True, True)],
)
def test_hidden_states_over_a_split_equal_the_stacked_path(name, out_major, many_rows, monkeypatch):
    """The same hidden states, cache and lengths as over the stacked params, for Llama, Qwen2
    (bias, untied head) and Qwen3 (q/k norm), in both split layouts, with a right-padded
    cache prefill, a second prefill on top of it and a plain forward over packed segments;
    and the same logits through `lm_head_logits`. `many_rows` lowers the row count above
    which an out-major kernel multiplies as x @ kernel_tᵀ, so both products are checked. A
    layer taken out of order, a missing cache write or a wrong head is off by O(0.1)."""
    if many_rows:
        monkeypatch.setattr(decode_layout, "OUT_MAJOR_GEMM_MAX_ROWS", 0)
    config = CONFIGS[name]
    params = _sharp_params(config)
    split = decode_params(params, config, out_major=out_major)
    b, t = 2, 6
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, config.vocab_size)
    seg = (jnp.arange(t)[None, :] < jnp.array([[6], [4]])).astype(jnp.int32)
    # The stacked reference through the module's jits, compiled once per config for every
    # layout; the split path traced afresh here, under this test's OUT_MAJOR_GEMM_MAX_ROWS.
    run_ref = functools.partial(_stacked_hidden_states, config=config)
    run = jax.jit(functools.partial(hidden_states, config=config))
    head_ref = functools.partial(_stacked_lm_head_logits, config=config)
    head = jax.jit(lm_head_logits)
    ref_cache = got_cache = init_kv_cache(config, b, 16)
    for step in range(2):  # two prefills: the second attends to the first's cache
        pos = _arange(b, t) + ref_cache.lengths[:, None]
        ref, ref_cache = run_ref(params, tokens + step, pos, segment_ids=seg, kv_cache=ref_cache)
        got, got_cache = run(split, tokens + step, pos, segment_ids=seg, kv_cache=got_cache)
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(got_cache.k, ref_cache.k, atol=1e-5)
        np.testing.assert_allclose(got_cache.v, ref_cache.v, atol=1e-5)
        np.testing.assert_array_equal(got_cache.lengths, ref_cache.lengths)
        np.testing.assert_allclose(
            head(split, got.reshape(b * t, -1)),
            head_ref(params, ref.reshape(b * t, -1)),
            atol=1e-4,
            rtol=1e-5,
        )
    np.testing.assert_array_equal(got_cache.lengths, [12, 8])
    packed = jnp.array([[1, 1, 1, 2, 2, 0]], jnp.int32)
    ref, none = run_ref(params, tokens[:1], _arange(1, t), segment_ids=packed)
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


# ---------------------------------------------------------------------------------------------
# Shards: the fused matrices ordered for tensor parallelism.


def _plain_layer(params, i, out_major):
    """Layer i as the layout was before it had shards: q, k, v (and gate, up) side by side.
    Built with numpy (exact copies): eagerly every slice and concatenation compiles its own
    program."""
    w = jax.tree.map(lambda x: np.asarray(x)[i], params["layers"])
    attn, mlp = w["attn"], w["mlp"]
    d = attn["q_proj"]["kernel"].shape[0]

    def matrix(kernels):
        if out_major:
            return {"kernel_t": np.concatenate([k.T for k in kernels], axis=0)}
        return {"kernel": np.concatenate(kernels, axis=-1)}

    qkv = matrix([attn[f"{x}_proj"]["kernel"].reshape(d, -1) for x in "qkv"])
    if "bias" in attn["q_proj"]:
        qkv["bias"] = np.concatenate([attn[f"{x}_proj"]["bias"].ravel() for x in "qkv"])
    o_proj = matrix([attn["o_proj"]["kernel"].reshape(-1, d)]) if out_major else attn["o_proj"]
    fused_attn = {"qkv": qkv, "o_proj": o_proj}
    fused_attn.update({name: attn[name] for name in ("q_norm", "k_norm") if name in attn})
    down = matrix([mlp["down_proj"]["kernel"]]) if out_major else mlp["down_proj"]
    gate_up = matrix([mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"]])
    return {
        "input_norm": w["input_norm"],
        "attn": fused_attn,
        "post_attn_norm": w["post_attn_norm"],
        "mlp": {"gate_up": gate_up, "down_proj": down},
    }


@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_shard_is_the_plain_layout_bit_for_bit(name, out_major):
    """`shards=1` (the default) lays every layer out exactly as q, k, v and gate, up side by
    side: the same tree, the same arrays to the bit."""
    config = CONFIGS[name]
    params = init_params(config, jax.random.key(0))
    dp = decode_params(params, config, out_major=out_major)
    assert dp.shards == 1
    chex.assert_trees_all_equal(dp, decode_params(params, config, out_major=out_major, shards=1))
    for i, layer in enumerate(dp.layers):
        expected = _plain_layer(params, i, out_major)
        assert jax.tree.structure(layer) == jax.tree.structure(expected)
        for got, want in zip(jax.tree.leaves(layer), jax.tree.leaves(expected), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
def test_shards_order_the_fused_rows_shard_by_shard(out_major):
    """With 2 shards (4 q heads, 2 kv heads, F = 128), the first half of the fused q/k/v
    rows is q heads 0-1, k head 0, v head 0 and the second half q heads 2-3, k head 1, v
    head 1; gate/up's halves are gate columns 0-63 then up columns 0-63, and 64-127 of each.
    o_proj and down_proj keep their natural order. A whole-matrix q/k/v order (all q first)
    would put kv rows in the first half's place of q heads 2-3."""
    config = SHARDABLE["qwen2"]
    params = init_params(config, jax.random.key(1))
    h, n, k, f, d = config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim, 64
    dp = decode_params(params, config, out_major=out_major, shards=2)
    plain = decode_params(params, config, out_major=out_major)
    assert dp.shards == 2
    for i, layer in enumerate(dp.layers):
        w = jax.tree.map(lambda x, i=i: np.asarray(x)[i], params["layers"])
        attn, mlp = w["attn"], w["mlp"]
        q, kk, v = (attn[f"{x}_proj"]["kernel"] for x in "qkv")  # [D, heads, K]
        halves = [
            np.concatenate(
                [
                    q[:, s * h // 2 : (s + 1) * h // 2].reshape(d, -1),
                    kk[:, s * n // 2 : (s + 1) * n // 2].reshape(d, -1),
                    v[:, s * n // 2 : (s + 1) * n // 2].reshape(d, -1),
                ],
                axis=1,
            )
            for s in range(2)
        ]
        qkv = np.concatenate(halves, axis=1)  # [D, (H + 2N)·K]
        gate, up = mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"]
        gate_up = np.concatenate(
            [gate[:, : f // 2], up[:, : f // 2], gate[:, f // 2 :], up[:, f // 2 :]], 1
        )
        key = "kernel_t" if out_major else "kernel"
        as_stored = (lambda m: m.T) if out_major else (lambda m: m)
        np.testing.assert_array_equal(layer["attn"]["qkv"][key], as_stored(qkv))
        np.testing.assert_array_equal(layer["mlp"]["gate_up"][key], as_stored(gate_up))
        b = [attn[f"{x}_proj"]["bias"] for x in "qkv"]  # [heads, K]
        bias = np.concatenate(
            [b[0][: h // 2].ravel(), b[1][: n // 2].ravel(), b[2][: n // 2].ravel()]
            + [b[0][h // 2 :].ravel(), b[1][n // 2 :].ravel(), b[2][n // 2 :].ravel()]
        )
        np.testing.assert_array_equal(layer["attn"]["qkv"]["bias"], bias)
        for part in ("attn/o_proj", "mlp/down_proj"):
            outer, inner = part.split("/")
            chex.assert_trees_all_equal(layer[outer][inner], plain.layers[i][outer][inner])
    assert (h + 2 * n) * k == dp.layers[0]["attn"]["qkv"]["bias"].shape[0]


@jax.jit
def _last_token_logits(dparams, hidden, lengths):
    """`lm_head_logits` at each row's last token, the gather in the same program (eagerly
    each index op compiles its own)."""
    return lm_head_logits(dparams, hidden[jnp.arange(hidden.shape[0]), lengths - 1])


def _serve(config, dparams, place_cache=lambda cache: cache):
    """What an engine runs over the layout: a prefill of two right-padded prompts (6 and 4
    tokens) through `hidden_states` and `lm_head_logits` at each row's last token, then
    three decode steps through `apply_decode` (row 1 idle in the second, the last one
    vocabulary-major). Returns every step's [B, V] logits and the final cache, on the host."""
    b, t = 2, 6
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, config.vocab_size)
    lengths = jnp.array([6, 4])
    seg = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32)
    cache = place_cache(init_kv_cache(config, b, 16))
    prefill = jax.jit(functools.partial(hidden_states, config=config))
    step = jax.jit(functools.partial(apply_decode, config=config), static_argnames="vocab_major")
    hidden, cache = prefill(dparams, tokens, _arange(b, t), segment_ids=seg, kv_cache=cache)
    out = [_last_token_logits(dparams, hidden, lengths)]
    for tok, active, vocab_major in (([7, 9], [1, 1], False), ([4, 2], [1, 0], False)) + (
        ([8, 5], [1, 1], True),
    ):
        seg = jnp.array(active, jnp.int32)[:, None]
        logits, cache = step(
            dparams,
            jnp.array(tok, jnp.int32)[:, None],
            cache.lengths[:, None],
            kv_cache=cache,
            segment_ids=seg,
            vocab_major=vocab_major,
        )
        logits = np.asarray(logits)  # sliced on the host: no program
        out.append(logits.T if vocab_major else logits[:, 0])
    return [np.asarray(x) for x in out], [np.asarray(x) for x in cache]


def _assert_served_alike(got, ref):
    (logits, cache), (ref_logits, ref_cache) = got, ref
    for a, b in zip(logits, ref_logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache[:2], ref_cache[:2], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache[2], ref_cache[2])
    np.testing.assert_array_equal(cache[2], [9, 6])  # row 1 skipped one step


@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
@pytest.mark.parametrize("name", list(SHARDABLE))
def test_sharded_layout_serves_the_same_logits_on_one_device(name, out_major):
    """The shard-by-shard order is read back to the same q/k/v and gate/up: prefill and
    decode over `shards=2` give `shards=1`'s logits and caches (a misread head is off by
    O(1))."""
    config = SHARDABLE[name]
    params = _sharp_params(config)
    ref = _serve(config, decode_params(params, config, out_major=out_major))
    got = _serve(config, decode_params(params, config, out_major=out_major, shards=2))
    _assert_served_alike(got, ref)


def test_decode_params_refuses_shards_that_split_a_head_or_a_column():
    """Every shard must hold whole q heads, kv heads and MLP columns; the error names the
    shard count and the field it does not divide."""
    config = ModelConfig.tiny()  # 4 q heads, 2 kv heads, F = 128
    params = init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match=r"shards=3 does not divide ModelConfig.n_heads=4"):
        decode_params(params, config, shards=3)
    with pytest.raises(ValueError, match=r"shards=4 does not divide ModelConfig.n_kv_heads=2"):
        decode_params(params, config, shards=4)
    odd = ModelConfig.tiny(ffn_dim=129)
    with pytest.raises(ValueError, match=r"shards=2 does not divide ModelConfig.ffn_dim=129"):
        decode_params(init_params(odd, jax.random.key(0)), odd, shards=2)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="shards must be a positive int"):
            decode_params(params, config, shards=bad)


@one_only
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
@pytest.mark.parametrize("name", list(SHARDABLE))
def test_the_wire_layout_made_with_numpy_is_decode_params_bit_for_bit(name, out_major, shards):
    """A weight push's pusher lays the serving tensors out with numpy (`fill_serving`) from
    the stacked params; the host installs them as they come. Every leaf must be
    `decode_params`' own, bit for bit (a transposed piece in another row order, or a shard's
    q heads in another shard's place, would still have every value somewhere)."""
    config = SHARDABLE[name]
    params = init_params(config, jax.random.key(3))
    model = {k: np.asarray(v) for k, v in model_lib.flatten_params(params).items()}
    split = model_lib.flatten_params(
        decode_params(params, config, out_major=out_major, shards=shards)
    )
    options = {"out_major": out_major, "shards": shards}
    for leaf_name, leaf in split.items():
        out = np.full(leaf.shape, np.nan, leaf.dtype)
        wire_layout.fill_serving(out, leaf_name, model, **options)
        np.testing.assert_array_equal(out, np.asarray(leaf), err_msg=leaf_name)
        source = wire_layout.serving_source(leaf_name, model, **options)
        if source is not None:  # sent as it lies: a view of the model's array, no copy
            assert np.shares_memory(source, model[_model_name(leaf_name)])
    with pytest.raises(ValueError, match="'layers/x/attn' is not a serving tensor"):
        wire_layout.fill_serving(out, "layers/x/attn", model, **options)


@one_only
def test_tiled_transposes_cover_every_element(monkeypatch):
    """`fill_serving`'s transposes go tile by tile: with tiles that divide neither side (3
    against 7 x 10), the ragged edge tiles must still land, each element in its place."""
    monkeypatch.setattr(wire_layout, "_TRANSPOSE_TILE", 3)
    src = np.arange(70, dtype=np.float32).reshape(7, 10)
    out = np.full((10, 7), np.nan, np.float32)
    wire_layout.copy_transposed(out, src)
    np.testing.assert_array_equal(out, src.T)
    with pytest.raises(ValueError, match="transpose of"):
        wire_layout.copy_transposed(np.empty((7, 10), np.float32), src)


def _model_name(serving_name: str) -> str:
    top = {
        "embed": "embed/embedding",
        "final_norm": "final_norm/scale",
        "lm_head": "lm_head/kernel",
    }
    if serving_name in top:
        return top[serving_name]
    return "layers/" + serving_name.split("/", 2)[2]


def test_shards_are_static_not_leaves():
    """`shards` and `out_major` are tree metadata: no leaf is a Python number, two layouts
    have different tree structures, and a jitted step traces once per layout, not per
    call."""
    config = ModelConfig.tiny()
    params = init_params(config, jax.random.key(0))
    one, two = (decode_params(params, config, shards=s) for s in (1, 2))
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(two))
    assert jax.tree.structure(one) != jax.tree.structure(two)
    traces = []

    @jax.jit
    def shards_of(dp):
        traces.append(dp.shards)
        return dp.embed.sum()

    for dp in (one, one, two, two):
        shards_of(dp)
    assert traces == [1, 2]


@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_leaf_has_logical_axes(name, out_major):
    """Every leaf of every variant is named in the model's vocabulary: the fused rows and
    o_proj's / down_proj's inputs by "heads" / "mlp" (what `tensor` splits), the table by
    "vocab", the norms by axes no rule splits; and `decode_shardings` places each one (a
    one-device mesh here; the 2-device subprocess splits them)."""
    config = CONFIGS[name]
    shapes = jax.eval_shape(
        functools.partial(decode_params, config=config, out_major=out_major),
        model_lib.abstract_params(config),
    )
    axes = decode_logical_axes(shapes)
    layer = axes.layers[0]
    if out_major:
        assert layer["attn"]["qkv"]["kernel_t"] == ("heads", "embed")
        assert layer["attn"]["o_proj"]["kernel_t"] == ("embed", "heads")
        assert layer["mlp"]["gate_up"]["kernel_t"] == ("mlp", "embed")
        assert layer["mlp"]["down_proj"]["kernel_t"] == ("embed", "mlp")
    else:
        assert layer["attn"]["qkv"]["kernel"] == ("embed", "heads")
        assert layer["mlp"]["gate_up"]["kernel"] == ("embed", "mlp")
    assert layer["input_norm"]["scale"] == ("norm",)
    assert axes.embed == ("vocab", "embed")
    assert (axes.lm_head is None) == config.tie_embeddings
    mesh = make_mesh(devices=jax.devices()[:1])
    placed = decode_shardings(shapes, mesh)
    assert jax.tree.structure(placed) == jax.tree.structure(shapes)
    assert all(isinstance(s, jax.sharding.NamedSharding) for s in jax.tree.leaves(placed))
    rules = tuple(r for r in INFERENCE_RULES if r[0] != "mlp")
    with pytest.raises(ValueError, match=r"layers/0/mlp/(down_proj|gate_up)/kernel.*'mlp'"):
        decode_shardings(shapes, mesh, rules)


def test_other_layer_weights_are_carried_with_the_model_axes(monkeypatch):
    """A weight the layout does not fuse (an architecture's extra, here a per-head "sink"
    [L, H] beside q_norm) is carried into every layer as the model has it, and has the
    logical axes the model gives it: a new architecture touches the model only."""
    config = ModelConfig.tiny(qk_norm=True)
    params = init_params(config, jax.random.key(0))
    sink = jax.random.normal(jax.random.key(1), (config.n_layers, config.n_heads))
    params["layers"]["attn"]["sink"] = {"scale": sink}
    monkeypatch.setitem(model_lib.PARAM_LOGICAL_AXES, "layers/attn/sink/scale", ("layers", "heads"))
    for shards in (1, 2):
        dp = decode_params(params, config, shards=shards)
        for i, layer in enumerate(dp.layers):
            np.testing.assert_array_equal(layer["attn"]["sink"]["scale"], sink[i])
            np.testing.assert_array_equal(
                layer["attn"]["q_norm"]["scale"], params["layers"]["attn"]["q_norm"]["scale"][i]
            )
        axes = decode_logical_axes(dp)
        assert axes.layers[0]["attn"]["sink"]["scale"] == ("heads",)
        assert axes.layers[0]["attn"]["q_norm"]["scale"] == ("head_dim",)
        assert axes.layers[0]["post_attn_norm"]["scale"] == ("norm",)


def test_a_leaf_the_layout_does_not_know_is_named():
    config = ModelConfig.tiny()
    dp = decode_params(init_params(config, jax.random.key(0)), config)
    layers = (dict(dp.layers[0], extra={"scale": jnp.ones(3)}),) + dp.layers[1:]
    with pytest.raises(ValueError, match="layers/0/extra/scale"):
        decode_logical_axes(dp.replace(layers=layers))


# ---------------------------------------------------------------------------------------------
# Two devices (subprocess): the layout split over a `tensor` mesh axis.


def _two_device_mesh():
    return make_mesh(data=1, fsdp=1, tensor=2)


@two_only
@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
@pytest.mark.parametrize("name", list(SHARDABLE))
def test_two_devices_sharded_layout_serves_what_one_device_does(name, out_major):
    """`shards=2` placed on a tensor=2 mesh (weights by `decode_shardings`, the KV cache by
    `kv_cache_shardings`) gives the logits and caches of `shards=1` on one device, through
    prefill and decode; each device holds only its shard of q/k/v, gate/up, o_proj and
    down_proj (half the rows or columns: its own heads and MLP columns) and of the table."""
    config = SHARDABLE[name]
    params = _sharp_params(config)
    one_device = jax.devices()[0]
    plain = jax.device_put(decode_params(params, config, out_major=out_major), one_device)
    ref = _serve(config, plain, lambda cache: jax.device_put(cache, one_device))

    mesh = _two_device_mesh()
    split = decode_params(params, config, out_major=out_major, shards=2)
    split = jax.device_put(split, decode_shardings(split, mesh))
    got = _serve(
        config,
        split,
        lambda cache: jax.device_put(cache, kv_cache_shardings(mesh, INFERENCE_RULES, cache)),
    )
    _assert_served_alike(got, ref)

    h, n, k, f, d = (config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim, 64)
    layer = split.layers[0]
    if out_major:
        per_device = {
            ("attn", "qkv", "kernel_t"): ((h + 2 * n) * k // 2, d),
            ("attn", "o_proj", "kernel_t"): (d, h * k // 2),
            ("mlp", "gate_up", "kernel_t"): (2 * f // 2, d),
            ("mlp", "down_proj", "kernel_t"): (d, f // 2),
        }
    else:
        per_device = {
            ("attn", "qkv", "kernel"): (d, (h + 2 * n) * k // 2),
            ("attn", "o_proj", "kernel"): (h // 2, k, d),
            ("mlp", "gate_up", "kernel"): (d, 2 * f // 2),
            ("mlp", "down_proj", "kernel"): (f // 2, d),
        }
    if config.qkv_bias:
        per_device[("attn", "qkv", "bias")] = ((h + 2 * n) * k // 2,)
    for (outer, inner, leaf), shape in per_device.items():
        array = layer[outer][inner][leaf]
        whole = np.asarray(array)
        shards = sorted(array.addressable_shards, key=lambda s: s.device.id)
        assert len(shards) == 2 and len({s.device for s in shards}) == 2
        for shard in shards:
            assert shard.data.shape == shape, (outer, inner, leaf)
            # Device s holds piece s of the shard-ordered matrix: whole heads / columns.
            np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])
    assert split.embed.addressable_shards[0].data.shape == (config.vocab_size // 2, d)
    assert layer["input_norm"]["scale"].addressable_shards[0].data.shape == (d,)


@two_only
def test_two_devices_a_mesh_that_splits_a_shard_is_refused():
    """The plain layout (one shard: all q rows, then k, then v) on a tensor=2 mesh would hand
    device 1 the tail of the q heads and all of k and v: refused, naming both numbers."""
    config = ModelConfig.tiny()
    dp = decode_params(init_params(config, jax.random.key(0)), config)
    with pytest.raises(ValueError, match=r"shards=1 is not a multiple of the 2 devices"):
        decode_shardings(dp, _two_device_mesh())


@two_only
@pytest.mark.parametrize("out_major", [True, False], ids=["out_major", "in_major"])
def test_two_devices_the_sharded_programs_move_activations_not_weights(out_major):
    """Splitting q/k/v and gate/up back per shard is a local reshape: the compiled decode step
    and prefill over the tensor=2 layout gather nothing (no all-gather, all-to-all,
    collective-permute or reduce-scatter) and all-reduce only [.., D] activations: the
    vocabulary-split embedding lookup once, o_proj's and down_proj's partial sums per layer.
    A layout whose per-device rows mixed heads would need the weights or q/k/v gathered."""
    config = SHARDABLE["qwen2"]
    mesh = _two_device_mesh()
    split = decode_params(
        init_params(config, jax.random.key(0)), config, out_major=out_major, shards=2
    )
    split = jax.device_put(split, decode_shardings(split, mesh))

    def collectives(lowered):
        hlo = lowered.compile().as_text()
        ops = "all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce"
        found = re.findall(rf"= (\w+)\[([\d,]*)\]\S* ({ops})\(", hlo)
        return [(op, tuple(int(x) for x in dims.split(",") if x)) for _, dims, op in found]

    def placed_cache(b, capacity):
        cache = init_kv_cache(config, b, capacity)
        return jax.device_put(cache, kv_cache_shardings(mesh, INFERENCE_RULES, cache))

    tok = jnp.zeros((4, 1), jnp.int32)
    decode = jax.jit(functools.partial(apply_decode, config=config)).lower(
        split, tok, tok, kv_cache=placed_cache(4, 16)
    )
    prompts = jnp.zeros((2, 8), jnp.int32)
    prefill = jax.jit(functools.partial(hidden_states, config=config)).lower(
        split, prompts, prompts, kv_cache=placed_cache(2, 8)
    )
    for lowered in (decode, prefill):
        found = collectives(lowered)
        assert found and {op for op, _ in found} == {"all-reduce"}, found
        assert all(
            shape[-1] == config.d_model or shape[0] == config.d_model for _, shape in found
        ), found
        assert len(found) <= 2 * config.n_layers + 1, found
