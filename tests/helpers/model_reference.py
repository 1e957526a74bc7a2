"""Reference greedy decoding with the KV cache, through `model.apply` only.

What the inference engine (and the JetStream adapter) must reproduce token for token: a
jitted prefill of the padded prompts and a `jax.lax.scan` of one-token `apply` steps, with
none of the engine's slot bookkeeping, per-layer decode weights or attention windows.
Not a test module (no `test_` prefix): the model, checkpoint and inference tests import it.
"""

import functools

import chex
import jax
import jax.numpy as jnp

from a3po_jax.model import ModelConfig, Params, apply, init_kv_cache


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "capacity"))
def greedy_generate(
    params: Params,
    config: ModelConfig,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    max_new_tokens: int,
    capacity: int | None = None,
) -> jax.Array:
    """Greedy continuation of right-padded prompts with the KV cache.

    Prefill writes the whole padded prompt bucket; padding slots are overwritten by the
    first generated tokens because each row's cache length counts valid tokens only.

    Args:
      params: model parameters.
      config: the architecture.
      prompt_tokens: [B, P] int32, right-padded.
      prompt_lengths: [B] int32 valid prompt tokens per row (>= 1).
      max_new_tokens: tokens to generate per row (no early stop at EOS).
      capacity: cache slots per row; default P + max_new_tokens.
    Returns:
      [B, max_new_tokens] int32 generated tokens.
    """
    b, p = prompt_tokens.shape
    chex.assert_shape(prompt_lengths, (b,))
    capacity = capacity or p + max_new_tokens
    cache = init_kv_cache(config, b, capacity)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    segment_ids = (positions < prompt_lengths[:, None]).astype(jnp.int32)
    logits, cache = apply(
        params, prompt_tokens, positions, config=config, segment_ids=segment_ids, kv_cache=cache
    )
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,V]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)  # [B]

    def step(carry, _):
        token, cache = carry
        pos = cache.lengths[:, None]  # [B, 1]: the new token sits right after the valid ones
        logits, cache = apply(params, token[:, None], pos, config=config, kv_cache=cache)
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (nxt, cache), token

    _, tokens = jax.lax.scan(step, (first, cache), None, length=max_new_tokens)
    return tokens.T  # [B, max_new_tokens]
