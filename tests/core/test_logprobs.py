"""core/logprobs.py: chunked target log-probs and entropies equal the plain [B, T, V] path
(values and gradients, tied and untied heads, temperature != 1, padding, ragged chunks,
under jit) and never hold a [B, T, V] array."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jaxpr_inspect import largest_intermediate

from a3po_jax import model
from a3po_jax.core import logprobs, losses
from a3po_jax.core.logprobs import chunked_token_logprobs

# Float32 rounding of the same sums taken in another order; a wiring error (a wrong
# temperature, a missing 1/T in the backward, a mis-aligned chunk) is O(0.1) or more.
TOL = dict(rtol=1e-5, atol=1e-5)

B, T, D, V = 2, 7, 16, 64  # N = 14 tokens: chunk 4 leaves a remainder of 2.


def _inputs(seed=0, *, b=B, t=T, d=D, v=V):
    kh, kw, kt = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(kh, (b, t, d), jnp.float32)
    head = 0.5 * jax.random.normal(kw, (d, v), jnp.float32)  # logits of O(1): a spread softmax
    targets = jax.random.randint(kt, (b, t), 0, v, jnp.int32)
    return hidden, head, targets


def _plain(hidden, head, targets, temperature):
    """The reference: full [B, T, V] logits, then the losses module's log-softmax path."""
    return _plain_from_logits(jnp.einsum("btd,dv->btv", hidden, head), targets, temperature)


def _plain_from_logits(logits, targets, temperature):
    logits = logits / temperature
    return losses.token_logprobs(logits, targets), losses.entropy(logits)


def _mask(b=B, t=T, pad=2):
    """[B, T] mask with `pad` padding positions per row: at the end of even rows (right
    padding), at the start of odd ones (a masked prompt). Row-major, the last tokens are
    then real, so the shorter last chunk (tokens 12, 13 at N=14, C=4) carries gradient."""
    pos = jnp.arange(t)[None, :]
    odd = (jnp.arange(b) % 2 == 1)[:, None]
    return jnp.where(odd, pos >= pad, pos < t - pad).astype(jnp.float32)


def _masked_objective(fn, targets, mask, temperature):
    """A loss that reads both outputs with different weights, masked as the train step does."""

    def objective(hidden, head):
        logp, ent = fn(hidden, head, targets, temperature)
        return jnp.sum(mask * (1.3 * logp - 0.4 * ent))

    return objective


def _chunked(chunk_size):
    return lambda h, w, tgt, temp: chunked_token_logprobs(
        h, w, tgt, temperature=temp, chunk_size=chunk_size
    )


# Jitted forms of the computations the tests check against: one compiled program each (per
# shape), shared across tests, where eagerly every primitive compiles its own.
_chunked_jit = jax.jit(
    chunked_token_logprobs,
    static_argnames=("temperature", "chunk_size", "vocab_chunk_size", "head_is_table"),
)
_plain_jit = jax.jit(_plain)


@jax.jit
def _plain_grad(hidden, head, targets, mask, temperature):
    objective = _masked_objective(_plain, targets, mask, temperature)
    return jax.grad(objective, argnums=(0, 1))(hidden, head)


@functools.partial(jax.jit, static_argnames=("temperature", "chunk_size"))
def _chunked_grad(hidden, head, targets, mask, *, temperature, chunk_size):
    objective = _masked_objective(_chunked(chunk_size), targets, mask, temperature)
    return jax.grad(objective, argnums=(0, 1))(hidden, head)


def test_golden_value_two_token_vocab():
    # h = 1, W = [0, 2 ln 3], temperature 2: z = [0, ln 3], p = [1/4, 3/4].
    # Forgetting the temperature would give p = [1/10, 9/10] (logp(1) = ln 0.9 = -0.105).
    hidden = jnp.ones((1, 1, 1), jnp.float32)
    head = jnp.array([[0.0, 2 * math.log(3.0)]], jnp.float32)
    logp, ent = _chunked_jit(hidden, head, jnp.array([[1]]), temperature=2.0)
    np.testing.assert_allclose(logp, [[math.log(0.75)]], **TOL)
    np.testing.assert_allclose(ent, [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]], **TOL)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [4, 7, 64])  # remainder 2; divides 14; one chunk > N
def test_values_equal_plain_path(jit, temperature, chunk_size):
    hidden, head, targets = _inputs()
    fn = _chunked(chunk_size)
    if jit:
        fn = jax.jit(fn, static_argnums=3)
    got = fn(hidden, head, targets, temperature)
    want = _plain_jit(hidden, head, targets, temperature)
    for g, w in zip(got, want, strict=True):
        assert g.shape == (B, T) and g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, **TOL)


# The forward's vocabulary blocks (V = 64): four of 16; two of 24 and one of 16 left over;
# one of 64; one when the block is wider than the vocabulary.
VOCAB_BLOCKS = [16, 24, 64, 1000]


@pytest.mark.parametrize("vocab_chunk_size", VOCAB_BLOCKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocabulary_blocks_equal_plain_path(temperature, vocab_chunk_size):
    hidden, head, targets = _inputs(7)
    fn = lambda h, w, tgt, temp: chunked_token_logprobs(  # noqa: E731
        h, w, tgt, temperature=temp, chunk_size=4, vocab_chunk_size=vocab_chunk_size
    )
    want = _plain_jit(hidden, head, targets, temperature)
    got = jax.jit(fn, static_argnums=3)(hidden, head, targets, temperature)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)
    mask = _mask()
    grad = lambda f: jax.grad(_masked_objective(f, targets, mask, temperature), argnums=(0, 1))
    want = _plain_grad(hidden, head, targets, mask, temperature)
    for g, w in zip(jax.jit(grad(fn))(hidden, head), want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("vocab_chunk_size", [16, 24])
def test_vocabulary_blocks_rescale_to_a_later_maximum(vocab_chunk_size):
    """Each row's largest logit sits in the vocabulary's last block, 40 above the rest: the
    sums of the earlier blocks must be rescaled to it (e^-40 ≈ 4e-18 of their old scale),
    and a target in an earlier block keeps its tiny probability exactly."""
    hidden, head, targets = _inputs(8)
    head = head.at[:, V - 3].set(0.0)
    hidden = hidden.at[..., 0].set(1.0)
    head = head.at[0, V - 3].set(40.0)  # z[:, V-3] = 40 + (other logits' O(1) spread)
    targets = targets.at[0, 0].set(1).at[1, 0].set(V - 3)
    logp, ent = _chunked_jit(hidden, head, targets, chunk_size=4, vocab_chunk_size=vocab_chunk_size)
    z = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64), np.asarray(head, np.float64))
    lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
    logp_all = z - lse[..., None]
    want_ent = -np.sum(np.exp(logp_all) * logp_all, -1)
    want_logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-3, atol=1e-7)
    assert float(logp[0, 0]) < -30  # the earlier-block target: tiny, not -inf or 0


def test_vocabulary_block_size_fits_the_budget(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the CPU's rule, on any machine
    budget, least = logprobs.VOCAB_BLOCK_BYTES, logprobs.MIN_VOCAB_BLOCK
    for tokens in (1, 256, 1000, 1280, 3104, 10**6):
        block = logprobs._vocab_block(tokens, 49152)
        assert block == 49152 or block & (block - 1) == 0  # a power of two, or all of V
        assert least <= block <= 49152
        assert 4 * tokens * block <= budget or block == least
        assert block == 49152 or 4 * tokens * 2 * block > budget  # the largest that fits
    assert logprobs._vocab_block(1, 100) == 100  # never wider than the vocabulary
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert logprobs._vocab_block(1280, 49152) == 49152  # accelerators: one block


@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
def test_entropy_of_a_peaked_softmax_keeps_its_small_value(scale):
    """Logits of size 300 with a near-one-hot softmax: the entropy is small (down to
    ~1e-30) and must come out small and accurate, not as the difference of two numbers of
    the logits' size (float32 rounding of 300 is 3e-5). Checked against float64."""
    hidden, head, targets = _inputs(seed=3)
    logp, ent = _chunked_jit(scale * hidden, head, targets, chunk_size=4)
    z = np.einsum("btd,dv->btv", scale * np.asarray(hidden, np.float64), np.asarray(head))
    lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
    logp_all = z - lse[..., None]
    want_ent = -np.sum(np.exp(logp_all) * logp_all, -1)
    want_logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(ent, want_ent, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-4 * scale / 100 + 1e-5)
    if scale == 300.0:
        assert np.median(want_ent) < 1e-3  # the case this test is for: peaked rows


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 7])
def test_gradients_equal_plain_path_with_padding(jit, chunk_size):
    hidden, head, targets = _inputs(1)
    mask = _mask()
    padding = mask == 0
    # Padding positions carry garbage the caller masks: huge states, target 0.
    hidden = jnp.where(padding[..., None], 100.0 * hidden, hidden)
    targets = jnp.where(padding, 0, targets)
    grad = lambda fn: jax.grad(_masked_objective(fn, targets, mask, 0.7), argnums=(0, 1))
    grad_chunked = grad(_chunked(chunk_size))
    if jit:
        grad_chunked = jax.jit(grad_chunked)
    dh, dw = grad_chunked(hidden, head)
    dh_ref, dw_ref = _plain_grad(hidden, head, targets, mask, 0.7)
    np.testing.assert_allclose(dh, dh_ref, **TOL)
    np.testing.assert_allclose(dw, dw_ref, **TOL)
    # Masked tokens: finite outputs, and exactly no gradient into their hidden states.
    logp, ent = _chunked_jit(hidden, head, targets, temperature=0.7, chunk_size=4)
    assert np.isfinite(np.asarray(logp)).all() and np.isfinite(np.asarray(ent)).all()
    np.testing.assert_array_equal(dh[padding], 0.0)
    assert float(jnp.min(jnp.max(jnp.abs(dh[~padding]), axis=-1))) > 0  # every real token


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_model_head_tied_and_untied_gradients_equal_plain_path(tie_embeddings):
    """The head as the decoder holds it: ``model.lm_head_kernel`` of ``init_params`` (the
    embedding table transposed when tied). The reference multiplies by the stored table
    directly. States come from an embedding lookup (a zero-layer decoder), so with a tied
    head the embedding's gradient sums its input and output uses, as in the real model."""
    config = model.ModelConfig.tiny(tie_embeddings=tie_embeddings)
    # x25: init's std 0.02 gives near-uniform softmaxes, whose gradients are too small for
    # a 1e-5 comparison to mean anything; this spreads the logits to O(1).
    params = jax.tree.map(lambda x: 25.0 * x, model.init_params(config, jax.random.key(2)))
    params = {k: params[k] for k in ("embed", "lm_head") if k in params}
    b, t = 2, 9
    tokens = jax.random.randint(jax.random.key(3), (b, t), 0, config.vocab_size, jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    mask = _mask(b, t)
    temperature = 0.8

    def loss(params, chunked):
        table = params["embed"]["embedding"]  # [V, D]
        hidden = table[tokens]  # [B, T, D]
        if chunked:
            head = model.lm_head_kernel(params, config)
            logp, ent = chunked_token_logprobs(
                hidden, head, targets, temperature=temperature, chunk_size=4
            )
        elif tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", hidden, table)
            logp, ent = _plain_from_logits(logits, targets, temperature)
        else:
            logits = jnp.einsum("btd,dv->btv", hidden, params["lm_head"]["kernel"])
            logp, ent = _plain_from_logits(logits, targets, temperature)
        return jnp.sum(mask * (logp + 0.1 * ent)), (logp, ent)

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (val, outs), grads = value_and_grad(params, True)
    (val_ref, outs_ref), grads_ref = value_and_grad(params, False)
    np.testing.assert_allclose(val, val_ref, **TOL)
    for o, o_ref in zip(outs, outs_ref, strict=True):
        np.testing.assert_allclose(o, o_ref, **TOL)
    assert ("lm_head" in grads) == (not tie_embeddings)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, **TOL), grads, grads_ref)
    # The head's gradient is not trivially zero (it would be if the head were cut off).
    head_grad = grads["embed"]["embedding"] if tie_embeddings else grads["lm_head"]["kernel"]
    assert float(jnp.max(jnp.abs(head_grad))) > 1e-2


def test_bfloat16_hidden_states():
    """bf16 states are promoted to the float32 head's dtype: values equal the plain path's,
    the hidden-state gradient comes back in bf16 (one bf16 rounding of the float32 one)."""
    hidden, head, targets = _inputs(4)
    hidden16 = hidden.astype(jnp.bfloat16)
    got = _chunked_jit(hidden16, head, targets, temperature=0.7, chunk_size=4)
    want = _plain_jit(hidden16.astype(jnp.float32), head, targets, 0.7)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, **TOL)
    mask = _mask()
    dh, dw = _chunked_grad(hidden16, head, targets, mask, temperature=0.7, chunk_size=4)
    dh_ref, dw_ref = _plain_grad(hidden16.astype(jnp.float32), head, targets, mask, 0.7)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(dw, dw_ref, **TOL)
    np.testing.assert_allclose(dh.astype(jnp.float32), dh_ref, rtol=2.0**-8, atol=1e-6)


def test_bfloat16_states_and_head():
    """Both bf16 (a caller keeping a bf16 head): the matmul runs in bf16 with float32
    accumulation, everything after it in float32; equal to the plain path taken the same way."""
    hidden, head, targets = _inputs(7)
    hidden16, head16 = hidden.astype(jnp.bfloat16), head.astype(jnp.bfloat16)

    def plain16(h, w, tgt, temperature):
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        return _plain_from_logits(logits, tgt, temperature)

    got = _chunked_jit(hidden16, head16, targets, temperature=0.7, chunk_size=4)
    want = jax.jit(plain16, static_argnums=3)(hidden16, head16, targets, 0.7)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, **TOL)
    mask = _mask()
    grads = _chunked_grad(hidden16, head16, targets, mask, temperature=0.7, chunk_size=4)
    grads_ref = jax.jit(jax.grad(_masked_objective(plain16, targets, mask, 0.7), (0, 1)))(
        hidden16, head16
    )
    for g, r in zip(grads, grads_ref, strict=True):
        assert g.dtype == jnp.bfloat16
        # Both are float32 sums rounded once to bf16: at most one bf16 step apart.
        np.testing.assert_allclose(
            g.astype(jnp.float32), r.astype(jnp.float32), rtol=2.0**-7, atol=1e-5
        )


def test_micro_batched_under_vmap_and_scan_equals_full_batch():
    """The train step maps over micro-batches: vmapped or scanned over them, values and the
    summed gradients equal the full batch's (the custom VJP batches and nests in a scan)."""
    hidden, head, targets = _inputs(8, b=4)
    mask = _mask(4, T)
    objective = lambda h, w, tgt, m: _masked_objective(_chunked(4), tgt, m, 0.7)(h, w)
    grad = jax.grad(objective, argnums=(0, 1))
    split = lambda x: x.reshape(2, 2, *x.shape[1:])  # [M=2, b=2, ...]

    dh_full, dw_full = jax.jit(grad)(hidden, head, targets, mask)
    dh_v, dw_v = jax.jit(jax.vmap(grad, in_axes=(0, None, 0, 0)))(
        split(hidden), head, split(targets), split(mask)
    )
    np.testing.assert_allclose(dh_v.reshape(dh_full.shape), dh_full, **TOL)
    np.testing.assert_allclose(dw_v.sum(0), dw_full, **TOL)

    def accumulate(dw_acc, mb):
        return dw_acc + grad(mb[0], head, mb[1], mb[2])[1], None

    xs = (split(hidden), split(targets), split(mask))
    dw_s, _ = jax.jit(lambda xs: jax.lax.scan(accumulate, jnp.zeros_like(head), xs))(xs)
    np.testing.assert_allclose(dw_s, dw_full, **TOL)
    vmapped = jax.vmap(_chunked(4), in_axes=(0, None, 0, None))
    logp_v, _ = jax.jit(vmapped, static_argnums=3)(split(hidden), head, split(targets), 0.7)
    logp_full, _ = _chunked_jit(hidden, head, targets, temperature=0.7, chunk_size=4)
    np.testing.assert_allclose(logp_v.reshape(logp_full.shape), logp_full, **TOL)


def test_out_of_range_target_picks_nothing():
    # A target id outside [0, V) matches no logit: logp = 0 - logsumexp, finite.
    hidden, head, targets = _inputs(5)
    targets = targets.at[0, 0].set(V)
    logp, _ = _chunked_jit(hidden, head, targets, temperature=1.0, chunk_size=4)
    lse = jax.jit(lambda h, w: jax.nn.logsumexp(h[0, 0] @ w))(hidden, head)
    np.testing.assert_allclose(logp[0, 0], -lse, **TOL)


# ---------------------------------------------------------------------------------------------
# No [B, T, V] array: in the traced program and in the compiled one's temporaries.

# N·V = 262144 elements; one chunk's logits 32768; the head (and its gradient) 16384.
BM, TM, DM, VM, CM = 4, 64, 16, 1024, 32


def _memory_case():
    hidden, head, targets = _inputs(6, b=BM, t=TM, d=DM, v=VM)
    mask = jnp.ones((BM, TM), jnp.float32)
    chunked = _chunked(CM)
    fwd = lambda fn: lambda h, w: fn(h, w, targets, 0.7)
    grad = lambda fn: jax.grad(_masked_objective(fn, targets, mask, 0.7), (0, 1))
    return (
        hidden,
        head,
        {
            "forward": (fwd(chunked), fwd(_plain)),
            "grad": (grad(chunked), grad(_plain)),
        },
    )


@pytest.mark.parametrize("which", ["forward", "grad"])
def test_jaxpr_has_no_full_vocabulary_intermediate(which):
    hidden, head, cases = _memory_case()
    chunked, plain = cases[which]
    full = BM * TM * VM
    # The check can fail: the plain path's program holds [B, T, V] values.
    assert largest_intermediate(jax.make_jaxpr(plain)(hidden, head).jaxpr) >= full
    largest = largest_intermediate(jax.make_jaxpr(chunked)(hidden, head).jaxpr)
    # Exactly one chunk's logits: the walk reached inside the scan, and nothing larger exists.
    assert largest == CM * VM


@pytest.mark.parametrize("which", ["forward", "grad"])
def test_compiled_temporaries_far_below_full_logits(which):
    hidden, head, cases = _memory_case()
    chunked, plain = cases[which]
    full_bytes = BM * TM * VM * 4

    def temp_bytes(fn):
        return jax.jit(fn).lower(hidden, head).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(plain) >= full_bytes  # the plain path does hold the logits
    assert temp_bytes(chunked) < full_bytes / 2


@pytest.mark.parametrize("which", ["forward", "grad"])
def test_vocabulary_blocks_hold_less_than_one_chunk_of_logits(which):
    """With blocks of VM/8 columns neither pass makes a chunk's [C, V] logits: the forward
    needs less than one chunk of them, the backward less than one beside the [D, V]
    gradient and its accumulator. Whole rows (one block) need more: the check can fail."""
    hidden, head, targets = _inputs(6, b=BM, t=TM, d=DM, v=VM)
    mask = jnp.ones((BM, TM), jnp.float32)
    chunk_logits, head_bytes = CM * VM * 4, DM * VM * 4
    bound = chunk_logits if which == "forward" else chunk_logits + 2 * head_bytes

    def temp_bytes(vocab_chunk_size):
        fn = lambda h, w, tgt, temp: chunked_token_logprobs(  # noqa: E731
            h, w, tgt, temperature=temp, chunk_size=CM, vocab_chunk_size=vocab_chunk_size
        )
        if which == "forward":
            program = lambda h, w: fn(h, w, targets, 0.7)  # noqa: E731
        else:
            program = jax.grad(_masked_objective(fn, targets, mask, 0.7), (0, 1))
        compiled = jax.jit(program).lower(hidden, head).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole_rows = temp_bytes(VM)
    if jax.default_backend() != "cpu" and whole_rows <= bound:
        pytest.skip(f"{jax.default_backend()} fuses whole-row logits into their reductions")
    assert whole_rows > bound
    assert temp_bytes(VM // 8) < bound


def test_invalid_arguments_are_refused():
    hidden, head, targets = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, head, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(hidden, head, targets, chunk_size=0)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="vocab_chunk_size"):
            chunked_token_logprobs(hidden, head, targets, vocab_chunk_size=bad)
    with pytest.raises(ValueError, match="integer"):
        chunked_token_logprobs(hidden, head, targets.astype(jnp.float32))
    with pytest.raises(AssertionError):  # chex: head's D does not match hidden's
        chunked_token_logprobs(hidden, head[1:], targets)


# --- a [V, D] table read as it is stored (head_is_table; tied models) ------------------------


def _table_fn(chunk_size, vocab_chunk_size=None):
    """The chunked path given the [V, D] table, as a function of the [D, V] head, so that its
    values and gradients compare with the plain path's directly (dW comes back transposed)."""

    def fn(h, w, tgt, temp):
        return chunked_token_logprobs(
            h,
            w.T,
            tgt,
            temperature=temp,
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
            head_is_table=True,
        )

    return fn


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size, vocab_chunk_size", [(4, None), (7, 24), (64, 16), (4, 1000)])
def test_table_layout_equals_plain_path(temperature, chunk_size, vocab_chunk_size):
    """Values and both gradients, with a chunk remainder (N = 14, C = 4), a vocabulary
    remainder (blocks of 24 in V = 64), one whole chunk, and a block wider than V."""
    hidden, head, targets = _inputs(11)
    fn = _table_fn(chunk_size, vocab_chunk_size)
    got = jax.jit(fn, static_argnums=3)(hidden, head, targets, temperature)
    for g, w in zip(got, _plain_jit(hidden, head, targets, temperature), strict=True):
        np.testing.assert_allclose(g, w, **TOL)
    mask = _mask()
    grad = lambda f: jax.grad(_masked_objective(f, targets, mask, temperature), argnums=(0, 1))
    want = _plain_grad(hidden, head, targets, mask, temperature)
    for g, w in zip(jax.jit(grad(fn))(hidden, head), want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_table_layout_with_bfloat16_states():
    """bf16 hidden states with a float32 table: the logits divided after the matmul, as in the
    kernel layout, and both layouts agree."""
    hidden, head, targets = _inputs(12)
    hidden16 = hidden.astype(jnp.bfloat16)
    want = _chunked_jit(hidden16, head, targets, temperature=0.7, chunk_size=4)
    got = jax.jit(_table_fn(4), static_argnums=3)(hidden16, head, targets, 0.7)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_table_layout_checks_the_table_shape():
    hidden, head, targets = _inputs()
    with pytest.raises(AssertionError):
        chunked_token_logprobs(hidden, head, targets, head_is_table=True)  # [D, V], not [V, D]


def test_tied_model_gradient_through_the_table_equals_the_transposed_kernel():
    """The tied embedding's gradient through the train step's head (lm_head_for_logprobs, the
    table as stored) equals the one through lm_head_kernel (its transpose), lookups included."""
    cfg = model.ModelConfig.tiny(vocab_size=96)
    assert cfg.tie_embeddings
    params = model.init_params(cfg, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 9), 0, cfg.vocab_size, jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)

    def objective(prm, as_table):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        hidden = model.hidden_states(prm, tokens, positions, config=cfg)[0]
        if as_table:
            head, is_table = model.lm_head_for_logprobs(prm, cfg)
            assert is_table and head.shape == (cfg.vocab_size, cfg.d_model)
        else:
            head, is_table = model.lm_head_kernel(prm, cfg), False
        logp, ent = chunked_token_logprobs(
            hidden, head, targets, temperature=0.7, chunk_size=8, head_is_table=is_table
        )
        return jnp.sum(logp) - 0.1 * jnp.sum(ent)

    grad = jax.jit(jax.grad(objective), static_argnums=1)  # one program per layout
    got = grad(params, True)
    want = grad(params, False)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_table_layout_needs_no_transposed_copy_of_the_table():
    """A tied head given as its table holds at least one [D, V] float32 buffer less in the
    forward + backward than the same head transposed into a kernel inside the program (the
    copy XLA makes for the transpose, and the transpose of its gradient). The check can
    fail: drop head_is_table and the two programs are the same."""
    d, v = 64, 4096
    hidden, _, targets = _inputs(13, b=2, t=64, d=d, v=v)
    table = 0.1 * jax.random.normal(jax.random.key(14), (v, d), jnp.float32)
    mask = jnp.ones(targets.shape, jnp.float32)

    def temp_bytes(as_table):
        def objective(h, tab):
            head = tab if as_table else tab.T
            logp, ent = chunked_token_logprobs(
                h, head, targets, temperature=0.7, chunk_size=32, head_is_table=as_table
            )
            return jnp.sum(mask * (logp - 0.1 * ent))

        program = jax.jit(jax.grad(objective, argnums=(0, 1)))
        return program.lower(hidden, table).compile().memory_analysis().temp_size_in_bytes

    transposed = temp_bytes(False)
    if jax.default_backend() != "cpu" and transposed < d * v * 4:
        pytest.skip(f"{jax.default_backend()} reads the transposed table without a copy")
    assert temp_bytes(True) <= transposed - d * v * 4
