"""Structural checks of the compiled training path that keep it at matmul speed on a CPU.

Timings are too noisy for a test (and the CI machine is shared), so these tests read the
compiled HLO instead: they pin the layouts that made the backward pass several times slower
than it needed to be (issue 15), and each would fail on the code before its fix.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from a3po_jax import model

# Odd sizes, so an activation's axes can be told apart by their lengths in the HLO text.
B, T = 3, 20
CONFIG = model.ModelConfig.tiny(d_model=48, ffn_dim=112, n_heads=4, n_kv_heads=2, head_dim=12)


def _compiled_layer_stack_grad(config, *, through_head=False):
    """Compiled HLO of the gradient of the final hidden states, or with `through_head` of
    the target log-probs from `model.apply`'s logits (the lm_head included)."""
    params = model.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def objective(layers, embed):
        p = dict(params, layers=layers, embed=embed)
        if through_head:
            logits, _ = model.apply(p, tokens, positions, config=config)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return jnp.sum(jnp.take_along_axis(logp, tokens[..., None], axis=-1))
        hidden, _ = model.hidden_states(p, tokens, positions, config=config)
        return jnp.sum(hidden**2)

    grad = jax.jit(jax.grad(objective, argnums=(0, 1)))
    return grad.lower(params["layers"], params["embed"]).compile().as_text()


def _transposes(hlo: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(result shape, dimensions) of every transpose in compiled HLO text."""
    found = []
    for shape, dims in re.findall(
        r"= f32\[([0-9,]*)\]\{[0-9,]*\} transpose\([^)]*\), dimensions=\{([0-9,]*)\}", hlo
    ):
        found.append(
            (tuple(int(s) for s in shape.split(",") if s), tuple(int(d) for d in dims.split(",")))
        )
    return found


@pytest.mark.parametrize("remat,through_head", [(False, False), (True, False), (False, True)])
def test_layer_stack_gradient_transposes_no_activation_to_feature_major(remat, through_head):
    """The weight gradients dW = xᵀ·g contract over the B·T tokens. Written as 3-D einsums
    ("btd,df->btf"), XLA:CPU copied every cotangent g [B, T, F] into [F, B, T] before the
    dot, a strided copy as slow as the matmul itself (the layer-stack grad was 5.5x its
    forward). As 2-D [B·T, I] x [I, O] matmuls no activation is transposed except inside
    attention, whose per-row transposes keep B first. The same holds for the lm_head's
    [B, T, V] logits in `model.apply` (the einsum transposed their cotangent)."""
    config = dataclasses.replace(CONFIG, remat=remat)
    transposes = _transposes(_compiled_layer_stack_grad(config, through_head=through_head))
    tokens = B * T
    moved = [
        (shape, dims)
        for shape, dims in transposes
        if int(np.prod(shape)) % tokens == 0
        and int(np.prod(shape)) >= tokens * min(config.head_dim, config.d_model)
        and dims[0] != 0
    ]
    assert not moved, f"activations transposed with the batch axis moved: {moved}"


def _grad_temporaries(hidden_fn, config, b=4, t=64) -> int:
    params = model.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def objective(layers):
        return jnp.sum(hidden_fn(dict(params, layers=layers), tokens, positions) ** 2)

    compiled = jax.jit(jax.grad(objective)).lower(params["layers"]).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _save_everything_stack(params, tokens, positions):
    """The layer stack as a plain scan, every intermediate saved for the backward pass."""
    b, t = tokens.shape
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))

    def one_layer(x, w):
        return model.decoder_layer(w, x, positions, mask, config=CONFIG)[0], None

    x = params["embed"]["embedding"][tokens]
    x, _ = jax.lax.scan(one_layer, x, params["layers"])
    return x


@pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA:CPU's temporaries; other backends save apart"
)
def test_backward_saves_matmul_outputs_not_every_intermediate():
    """Saving every intermediate of every layer (norms, RoPE, SiLU, attention probabilities)
    cost more than recomputing them on a CPU: each is a fresh [L, ...] buffer zero-filled
    and page-faulted on every call (SmolLM2 (8,128): XLA temporaries 2447 -> 661 MiB, the
    layer-stack grad 5.5 -> 4.2 s under the same load). The default keeps the weight
    matmuls' outputs only, and `remat=True` less still."""

    def stack(config):
        return lambda p, tok, pos: model.hidden_states(p, tok, pos, config=config)[0]

    everything = _grad_temporaries(_save_everything_stack, CONFIG)
    default = _grad_temporaries(stack(CONFIG), CONFIG)
    remat = _grad_temporaries(stack(dataclasses.replace(CONFIG, remat=True)), CONFIG)
    assert remat < default < 0.6 * everything, (remat, default, everything)
