"""Target log-probs and entropies of ``softmax(h W / T)`` without ``[B, T, V]`` logits (core).

Core layer (pure): imports only ``a3po_jax.core``, ``a3po_jax.model`` and ``a3po_jax.parallel``.

The plain path (``model.apply`` logits, then ``losses.token_logprobs`` / ``losses.entropy``)
holds float32 logits of shape [B, T, V], their softmax and, under ``jax.grad``, their
cotangent: 0.8 GB each for 4096 tokens of SmolLM2's 49152-token vocabulary. Here the tokens
are cut into chunks of C; each chunk's [C, V] logits live only inside one iteration of a
``lax.scan``, and a ``jax.custom_vjp`` recomputes them in the backward pass instead of
saving them, so neither pass holds more than one chunk of the vocabulary (plus the [D, V]
head gradient it accumulates). On a CPU a chunk's logits are further made a block of Vb
columns at a time (``VOCAB_BLOCK_BYTES``), so no pass holds more than [C, Vb]. The values
and gradients equal the plain path's to float rounding (tests/core/test_logprobs.py).

:func:`forward_logprobs` is the policy's pass over a padded batch (``build_batch``'s rows):
the layer stack, then this head; ``packing.packed_token_logprobs`` is the packed layout's.

Shape letters: B batch, T time, D model width, V vocab, N = B·T tokens, C chunk, K chunks,
Vb vocabulary block.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax import model

# Tokens per chunk (C): one [C, V] float32 buffer per pass (192 MiB at C=1024 and SmolLM2's
# V) and C/2 FLOP per byte of the head it streams, compute-bound from C ≈ 600 on a CPU and on
# a GPU in bfloat16 alike; 1024 is the next power of two (docs/performance.md).
DEFAULT_CHUNK_SIZE = 1024
# On a CPU both passes take a chunk's logits in vocabulary blocks of at most this many bytes
# (``_online_block``, ``_chunk_backward``), which stay in cache instead of a fresh [C, V]
# buffer faulted in and read back (docs/performance.md; the sizes tried: docs/log.md).
VOCAB_BLOCK_BYTES = 8 << 20
MIN_VOCAB_BLOCK = 128


def chunked_token_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int | None = None,
    head_is_table: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-token target log-prob and entropy of ``softmax(hidden @ head / temperature)``,
    computed C tokens at a time so no [B, T, V] array exists in the forward or backward.

        z[b, t]    = hidden[b, t] · head / temperature                 (float32, [V])
        logp[b, t] = z[b, t, targets[b, t]] - logsumexp_v z[b, t, v]
        H[b, t]    = -Σ_v p_v log p_v,    p = softmax(z[b, t])

    the same as ``losses.token_logprobs(logits / temperature, targets)`` and
    ``losses.entropy(logits / temperature)`` with ``logits = hidden @ head``, which is how
    the decoder makes its logits from its final-norm hidden states (float32, no softcap).

    Matmuls run in the inputs' promoted dtype with float32 accumulation (the decoder passes
    float32 states and a float32 head); everything after the matmul is float32, because the
    log-probs feed importance ratios exp(a - b) that bfloat16 rounding would show in.

    Masking is the caller's: every token, padding included, gets a finite value, and a token
    whose outputs the caller multiplies by 0 contributes exactly 0 to both gradients.
    Targets outside [0, V) (none are produced by batching or packing, which pad with 0) pick
    no logit: their logp is -logsumexp, finite.

    Args:
      hidden: [B, T, D] final-norm hidden states (float32 or bfloat16); position t predicts
        ``targets[:, t]``.
      head: [D, V] output projection, or with ``head_is_table`` the [V, D] table of a tied
        model as the embedding stores it. ``model.lm_head_for_logprobs(params, config)``
        returns (head, head_is_table) for either kind of model, as float32, and its
        gradient flows back to the parameter.
      targets: [B, T] integer token ids.
      temperature: T > 0 (static), the sampling temperature the behaviour log-probs used.
      chunk_size: C > 0 (static), tokens per chunk; see ``DEFAULT_CHUNK_SIZE``. A token
        count that C does not divide ends with one shorter chunk (no padded work).
      vocab_chunk_size: vocabulary columns per block within a chunk (static), in both
        passes; None chooses them (``_vocab_block``: on a CPU blocks of
        ``VOCAB_BLOCK_BYTES`` of logits, elsewhere the whole vocabulary). A vocabulary that
        the block does not divide ends with one narrower block.
      head_is_table: (static) ``head`` is [V, D] and is read as it is stored: the logits
        contract its D axis, and its gradient is written in the same layout. For a tied
        model this saves a transposed copy of the table in the forward and a transpose of
        its gradient in the backward (two [D, V] float32 buffers). Values are equal to the
        [D, V] path's to float rounding.

    Returns:
      (logp [B, T], entropy [B, T]), float32.
    """
    temperature = float(temperature)
    _check_args(hidden, head, targets, temperature, chunk_size, vocab_chunk_size, head_is_table)
    b, t, d = hidden.shape
    n = b * t
    logp, ent = _flat_logprobs(
        hidden.reshape(n, d),
        head,
        targets.reshape(n).astype(jnp.int32),
        temperature,
        chunk_size,
        vocab_chunk_size,
        bool(head_is_table),
    )
    return logp.reshape(b, t), ent.reshape(b, t)


def _check_args(
    hidden, head, targets, temperature, chunk_size, vocab_chunk_size, head_is_table
) -> None:
    """:func:`chunked_token_logprobs`' shapes, dtypes and static settings, each named."""
    chex.assert_rank(hidden, 3)
    chex.assert_rank(head, 2)
    chex.assert_rank(targets, 2)
    b, t, d = hidden.shape
    chex.assert_shape(head, (None, d) if head_is_table else (d, None))
    chex.assert_shape(targets, (b, t))
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if vocab_chunk_size is not None and (
        isinstance(vocab_chunk_size, bool)
        or not isinstance(vocab_chunk_size, int)
        or vocab_chunk_size <= 0
    ):
        raise ValueError(
            f"vocab_chunk_size must be a positive int or None, got {vocab_chunk_size!r}"
        )


# ---------------------------------------------------------------------------------------------
# One chunk, forward and backward. Both build the chunk's [C, V] logits from h and W the same
# way, so the backward's recomputation gives the forward's numbers.


def _scales_states(h: jax.Array, w: jax.Array) -> bool:
    """Whether 1/temperature is applied to the [C, D] states rather than the [C, V] logits.

    For a float32 matmul it is: (h / T)·W equals (h·W) / T to float32 rounding, and XLA:CPU
    does not fuse a scale into a dot's output, so scaling the logits kept a second [C, V]
    buffer per chunk (twice the memory, one more pass over it). For bfloat16 inputs the
    float32 product is divided instead: dividing bf16 states would round them once more.
    """
    return jnp.finfo(jnp.result_type(h, w)).bits >= 32


def _scaled(h: jax.Array, w: jax.Array, temperature: float) -> jax.Array:
    """[C, D] h / temperature in the matmul's (promoted, float32) dtype: a bf16 h with a
    float32 head is promoted first, not divided in bf16."""
    return h.astype(jnp.result_type(h, w)) / temperature


def _times_head(x: jax.Array, w: jax.Array, table: bool) -> jax.Array:
    """[C, D] x times the head, float32: x·W for a [D, V] kernel, x·Wᵀ for a [V, D] table
    (contracted on D as it is stored: no transposed copy of the table)."""
    if table:
        return jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _chunk_logits(h: jax.Array, w: jax.Array, temperature: float, table: bool) -> jax.Array:
    """[C, V] float32 z = h·W / temperature."""
    if _scales_states(h, w):
        return _times_head(_scaled(h, w, temperature), w, table)
    return _times_head(h, w, table) / temperature


def _vocab_block(n_tokens: int, vocab: int, requested: int | None = None) -> int:
    """Vocabulary columns per block for a chunk of `n_tokens` (static), in both passes.

    The caller's ``requested`` width (at most the vocabulary) if given; else, on a CPU, the
    largest power of two whose [n_tokens, block] float32 logits fit in ``VOCAB_BLOCK_BYTES``
    (at least ``MIN_VOCAB_BLOCK``, at most the vocabulary); on an accelerator the whole
    vocabulary (one block: no page faults to avoid there, and blocks were not measured).
    """
    if requested:
        return min(vocab, requested)
    if jax.default_backend() != "cpu":
        return vocab
    fit = max(1, VOCAB_BLOCK_BYTES // (4 * max(1, n_tokens)))
    return min(vocab, max(MIN_VOCAB_BLOCK, 1 << (fit.bit_length() - 1)))


def _vocab_axis(table: bool) -> int:
    """The head's vocabulary axis: 0 for a [V, D] table, 1 for a [D, V] kernel."""
    return 0 if table else 1


def _block_widths(w: jax.Array, table: bool, requested: int | None):
    """``block(n_tokens)``: the vocabulary block width for a chunk of that many tokens, over
    this head's vocabulary (``_vocab_block``)."""
    vocab = w.shape[_vocab_axis(table)]
    return functools.partial(_vocab_block, vocab=vocab, requested=requested)


def _over_blocks(step, carry, w: jax.Array, vocab_block: int, table: bool):
    """``carry = step(carry, w_block, col0)`` over the head's vocabulary blocks in order
    (columns of a [D, V] kernel, rows of a [V, D] table): the full blocks of
    ``vocab_block`` entries (a scan when there are several), then the narrower remainder,
    if any."""
    axis = _vocab_axis(table)
    v = w.shape[axis]
    full = v // vocab_block

    def body(carry, j):
        col0 = j * vocab_block
        w_block = jax.lax.dynamic_slice_in_dim(w, col0, vocab_block, axis=axis)
        return step(carry, w_block, col0), None

    if full == 1:
        carry, _ = body(carry, 0)
    elif full > 1:
        carry, _ = jax.lax.scan(body, carry, jnp.arange(full))
    if v % vocab_block:
        rest = jax.lax.slice_in_dim(w, full * vocab_block, v, axis=axis)
        carry = step(carry, rest, full * vocab_block)
    return carry


def _online_block(carry, z, col0, tgt):
    """Fold one vocabulary block's [C, Vb] logits z (columns col0 ...) into a chunk's running
    (m, S, U, z_target).

    With m' = max(m, max z), the sums are rescaled to the new maximum before the block's
    terms are added:
        S' = S·e^(m - m') + Σ e^(z - m'),
        U' = e^(m - m')·(U + (m - m')·S) + Σ e^(z - m')·(z - m')
    (U = Σ e·y in the shifted y = z - m, so the entropy keeps a peaked softmax's small
    value). The first block starts from m = -1e30, S = U = 0, where
    e^(m - m') = 0 and (m - m')·S = 0 exactly.
    """
    m, total, u, picked = carry
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    rescale = jnp.exp(m - m_new)
    y = z - m_new[:, None]  # fused with exp into the two sums (no [C, Vb] buffer)
    e = jnp.exp(y)
    u = rescale * (u + (m - m_new) * total) + jnp.sum(e * y, axis=-1)
    total = total * rescale + jnp.sum(e, axis=-1)
    col = col0 + jnp.arange(z.shape[-1])
    picked = picked + jnp.sum(jnp.where(col[None, :] == tgt[:, None], z, 0.0), axis=-1)
    return m_new, total, u, picked


def _chunk_forward(h, w, tgt, temperature, vocab_block, table):
    """(logp [C], entropy [C], logsumexp [C]) of one chunk of tokens, the vocabulary taken
    ``vocab_block`` columns at a time (one block: the whole [C, V] logits at once).

    One exponential per logit: with m = max z, y = z - m <= 0, e = exp(y), S = Σ e and
    U = Σ e·y,
        lse = m + log S,    H = -Σ p log p = -Σ p (y - log S) = log S - U / S
    (in the shifted y, so a peaked softmax does not subtract two numbers of z's size),
    accumulated block by block with the maximum updated online (``_online_block``).
    `jax.nn.logsumexp` and then `losses.entropy`'s -Σ p log p took two passes of exp over
    the [C, V] logits, a third of the head's forward on XLA:CPU (docs/log.md). Equal to
    those to float rounding (tests/core/test_logprobs.py). A target outside [0, V) matches no
    column: logp = -lse.
    """
    c = h.shape[0]
    start = (jnp.full((c,), -1e30, jnp.float32), *(jnp.zeros((c,), jnp.float32),) * 3)

    def step(carry, w_block, col0):
        return _online_block(carry, _chunk_logits(h, w_block, temperature, table), col0, tgt)

    carry = _over_blocks(step, start, w, vocab_block, table)
    m, total, u, picked = carry
    log_total = jnp.log(total)
    lse = m + log_total
    return picked - lse, log_total - u / total, lse


def _block_grads(h, w_block, col0, tgt, lse, ent, g_logp, g_ent, temperature, table):
    """(dh [C, D], dW block) float32 from one vocabulary block's logits, recomputed; the
    block's gradient in the head's own layout ([D, Vb] of a kernel, [Vb, D] of a table).

    With p = softmax(z), log p = z - lse:
        d logp_t / dz_k = δ_kt - p_k
        d H / dz_k      = -p_k (log p_k + H)
    so dz_k = g_logp δ_kt - p_k (g_logp + g_H (log p_k + H)); z = (h / T)·W gives
    dW = (h / T)ᵀ·dz and dh = (dz·Wᵀ) / T, wherever the 1/T was applied. dh sums over the
    blocks; each block's dW columns are its own.
    """
    z = _chunk_logits(h, w_block, temperature, table)  # [C, Vb]
    logp_all = z - lse[:, None]
    p = jnp.exp(logp_all)
    is_target = (col0 + jnp.arange(z.shape[-1]))[None, :] == tgt[:, None]
    dz = jnp.where(is_target, g_logp[:, None], 0.0) - p * (
        g_logp[:, None] + g_ent[:, None] * (logp_all + ent[:, None])
    )  # [C, Vb]
    scaled_states = _scales_states(h, w_block)
    if scaled_states:  # z = (h / T)·W: dW from the scaled states, dh divided by T
        d_logits, h_used = dz, _scaled(h, w_block, temperature)
    else:  # z = (h·W) / T: both from dz / T
        d_logits, h_used = dz / temperature, h
    f32 = jnp.float32
    if table:  # w_block [Vb, D]
        dh = jnp.dot(d_logits, w_block, preferred_element_type=f32)
        contract_tokens = (((0,), (0,)), ((), ()))
        dw = jax.lax.dot_general(d_logits, h_used, contract_tokens, preferred_element_type=f32)
    else:  # w_block [D, Vb]
        dh = jnp.dot(d_logits, w_block.T, preferred_element_type=f32)
        dw = jnp.dot(h_used.T, d_logits, preferred_element_type=f32)
    if scaled_states:
        dh = dh / temperature
    return dh, dw


def _chunk_backward(h, w, tgt, lse, ent, g_logp, g_ent, temperature, vocab_block, table, dw_acc):
    """(dh [C, D] float32, dw_acc + this chunk's dW float32, in the head's layout), the
    chunk's logits recomputed ``vocab_block`` entries at a time (one block: the whole
    [C, V] at once)."""
    axis = _vocab_axis(table)

    def step(carry, w_block, col0):
        dh, acc = carry
        dh_b, dw_b = _block_grads(
            h, w_block, col0, tgt, lse, ent, g_logp, g_ent, temperature, table
        )  # dW_b: this block's own vocabulary entries
        old = jax.lax.dynamic_slice_in_dim(acc, col0, dw_b.shape[axis], axis=axis)
        return dh + dh_b, jax.lax.dynamic_update_slice_in_dim(acc, old + dw_b, col0, axis=axis)

    start = (jnp.zeros((h.shape[0], h.shape[1]), jnp.float32), dw_acc)
    return _over_blocks(step, start, w, vocab_block, table)


# ---------------------------------------------------------------------------------------------
# All N tokens: K full chunks under lax.scan, then the remainder (N mod C tokens) as one
# shorter chunk, so no padded token is ever computed.


def _chunk_len(n: int, chunk_size: int) -> int:
    """C actually used: at most the token count (one chunk when N <= chunk_size), at least 1."""
    return max(1, min(chunk_size, n))


def _split(x: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """[N, ...] -> ([K, C, ...] full chunks, [R, ...] remainder), K = N // C, R = N mod C."""
    k = x.shape[0] // chunk
    return x[: k * chunk].reshape(k, chunk, *x.shape[1:]), x[k * chunk :]


def _forward_all(h, w, tgt, temperature, chunk_size, vocab_chunk_size, table):
    """(logp [N], entropy [N], logsumexp [N])."""
    n = h.shape[0]
    chunk = _chunk_len(n, chunk_size)
    h_full, h_rest = _split(h, chunk)
    t_full, t_rest = _split(tgt, chunk)
    block = _block_widths(w, table, vocab_chunk_size)

    def body(carry, xs):
        h_c, tgt_c = xs
        return carry, _chunk_forward(h_c, w, tgt_c, temperature, block(chunk), table)

    _, full = jax.lax.scan(body, None, (h_full, t_full))  # 3 x [K, C]
    outs = [x.reshape(-1) for x in full]
    if h_rest.shape[0]:
        rest = _chunk_forward(h_rest, w, t_rest, temperature, block(h_rest.shape[0]), table)
        outs = [jnp.concatenate([a, r]) for a, r in zip(outs, rest, strict=True)]
    return tuple(outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _flat_logprobs(h, w, tgt, temperature, chunk_size, vocab_chunk_size, table):
    """(logp [N], entropy [N]) of N flattened tokens; h [N, D], w [D, V] (a kernel) or
    [V, D] (``table``), tgt [N] int32."""
    logp, ent, _ = _forward_all(h, w, tgt, temperature, chunk_size, vocab_chunk_size, table)
    return logp, ent


def _flat_logprobs_fwd(h, w, tgt, temperature, chunk_size, vocab_chunk_size, table):
    logp, ent, lse = _forward_all(h, w, tgt, temperature, chunk_size, vocab_chunk_size, table)
    # Residuals are the inputs (already alive in the caller) and two [N] vectors; the
    # [N, V] logits are recomputed chunk by chunk in the backward, never saved.
    return (logp, ent), (h, w, tgt, lse, ent)


def _flat_logprobs_bwd(temperature, chunk_size, vocab_chunk_size, table, residuals, cotangents):
    h, w, tgt, lse, ent = residuals
    g_logp, g_ent = cotangents  # [N] each
    n = h.shape[0]
    chunk = _chunk_len(n, chunk_size)
    xs_full, xs_rest = zip(
        *(_split(x, chunk) for x in (h, tgt, lse, ent, g_logp, g_ent)), strict=True
    )
    block = _block_widths(w, table, vocab_chunk_size)

    def body(dw_acc, xs):
        h_c, tgt_c, lse_c, ent_c, gl_c, ge_c = xs
        return _chunk_backward(
            h_c, w, tgt_c, lse_c, ent_c, gl_c, ge_c, temperature, block(chunk), table, dw_acc
        )[::-1]

    # dW is summed over chunks in float32 in the scan carry (the head's shape and layout).
    dw_acc, dh_full = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs_full)
    dh = dh_full.reshape(-1, h.shape[1])
    if xs_rest[0].shape[0]:
        h_r, tgt_r, lse_r, ent_r, gl_r, ge_r = xs_rest
        dh_r, dw_acc = _chunk_backward(
            h_r,
            w,
            tgt_r,
            lse_r,
            ent_r,
            gl_r,
            ge_r,
            temperature,
            block(h_r.shape[0]),
            table,
            dw_acc,
        )
        dh = jnp.concatenate([dh, dh_r])
    # Integer targets take a float0 cotangent (no gradient).
    d_tgt = np.zeros(tgt.shape, jax.dtypes.float0)
    return dh.astype(h.dtype), dw_acc.astype(w.dtype), d_tgt


_flat_logprobs.defvjp(_flat_logprobs_fwd, _flat_logprobs_bwd)


# --------------------------------------------------------------------------------------
# The policy's log-probs of a padded batch.
# --------------------------------------------------------------------------------------


def batch_hidden(
    params: model.Params, batch: dict[str, jax.Array], *, model_config: model.ModelConfig
) -> jax.Array:
    """[B, T, D] float32 final-norm hidden states of a ``TrainBatch.arrays()`` batch (no
    lm_head; ``packing.packed_hidden`` is the packed layout's)."""
    hidden, _ = model.hidden_states(
        params,
        batch["tokens"],
        batch["positions"],
        config=model_config,
        segment_ids=batch["segment_ids"],
    )
    return hidden


def forward_logprobs(
    params: model.Params,
    batch: dict[str, jax.Array],
    *,
    model_config: model.ModelConfig,
    temperature: float,
) -> tuple[jax.Array, jax.Array]:
    """Token log-probs of the targets under ``softmax(logits / temperature)`` and entropies.

    The behaviour log-probs from the inference host are taken at the sampling temperature,
    so the trainer's must be too, or the importance ratio is off by the temperature.

    The head runs chunk by chunk over tokens (:func:`chunked_token_logprobs`, which
    recomputes each chunk's logits in the backward pass), so neither pass holds the
    [B, T, V] logits; the values equal ``token_logprobs(apply(...) / temperature)``.

    Returns:
      (logp [B, T], entropy [B, T]) float32.
    """
    hidden = batch_hidden(params, batch, model_config=model_config)  # [B, T, D] float32
    head, is_table = model.lm_head_for_logprobs(params, model_config)  # [V, D] tied, [D, V]
    return chunked_token_logprobs(
        hidden, head, batch["targets"], temperature=temperature, head_is_table=is_table
    )
