"""The optimizer update: optax's clip and AdamW, leaf by leaf on a CPU, the skipped step."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from a3po_jax import model
from a3po_jax.core import optim
from a3po_jax.core.stats import Stats

CFG = model.ModelConfig.tiny()


@functools.partial(jax.jit, static_argnums=0)
def _optax_step(opt, grads, state, params):
    """optax's own update over the whole tree, applied, with the updates' norm: one compiled
    program, where eagerly every primitive of every leaf compiles its own."""
    updates, new_state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), new_state, optax.tree.norm(updates)


def _random_like(key, leaves):
    return [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(key, leaves, strict=True)]


@pytest.mark.parametrize("grad_clip", [0.0, 1.0, 1e-3])
def test_apply_grads_is_optax_clip_then_adamw(grad_clip):
    """The update (one scale for 1/count and the clip, a branch for the skip, norms as dot
    products) equals optax's own chain on the averaged gradient, and its metrics equal
    optax's norms."""
    params = model.init_params(CFG, jax.random.key(0))
    opt = optim.make_optimizer(learning_rate=1e-2, weight_decay=0.1)
    state = optim.TrainState(
        params=params, opt_state=jax.jit(opt.init)(params), step=jnp.zeros((), jnp.int32)
    )
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    grad_sums = treedef.unflatten(jax.jit(_random_like)(keys, leaves))
    count = 7.0
    acc = optim.Accumulated(grad_sums, jnp.float32(3.0), jnp.float32(count), Stats())
    new, stats = jax.jit(functools.partial(optim.apply_grads, optimizer=opt, grad_clip=grad_clip))(
        state, acc
    )
    ref_opt = optax.chain(optax.clip_by_global_norm(grad_clip), opt) if grad_clip else opt

    @jax.jit  # one compiled program: eagerly every primitive of every leaf compiles its own
    def reference(grad_sums, params):
        grads = jax.tree.map(lambda g: g / count, grad_sums)
        ref_new_params, ref_new_state, update_norm = _optax_step(
            ref_opt, grads, ref_opt.init(params), params
        )
        return ref_new_params, ref_new_state, optax.tree.norm(grads), update_norm

    ref_new_params, ref_new_state, grad_norm, update_norm = reference(grad_sums, params)
    chex.assert_trees_all_close(new.params, ref_new_params, rtol=1e-5, atol=1e-7)
    # The moments and counts too (the clip's own state is empty).
    ref_adam_state = ref_new_state[1] if grad_clip else ref_new_state
    chex.assert_trees_all_close(new.opt_state, ref_adam_state, rtol=1e-5, atol=1e-7)
    assert int(new.step) == 1
    means = {k: float(v[0] / v[1]) for k, v in stats.means.items()}
    np.testing.assert_allclose(means["optim/grad_norm"], grad_norm, rtol=1e-5)
    np.testing.assert_allclose(means["optim/update_norm"], update_norm, rtol=1e-5)
    param_norm = jax.jit(optax.tree.norm)(new.params)
    np.testing.assert_allclose(means["optim/param_norm"], param_norm, rtol=1e-5)
    np.testing.assert_allclose(means["loss/total"], 3.0 / count, rtol=1e-6)
    assert float(stats.maxima["step/skipped"]) == 0.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.make_optimizer(learning_rate=1e-2, warmup_steps=3, weight_decay=0.1),
        lambda: optax.sgd(optax.linear_schedule(0.1, 0.01, 5), momentum=0.9),
    ],
    ids=["adamw-warmup", "sgd-momentum-schedule"],
)
def test_update_leaf_by_leaf_equals_one_update_of_the_whole_tree(make):
    """Over three steps: the same params, optimizer state (moments, counts) and update norm
    as ``optimizer.update`` over the whole tree."""
    opt = make()
    params = model.init_params(CFG, jax.random.key(0))
    leaves, treedef = jax.tree.flatten(params)
    init = jax.jit(opt.init)
    state, ref_state, ref_params = init(params), init(params), params
    fn = jax.jit(functools.partial(optim.update_leaf_by_leaf, opt))
    random_like = jax.jit(_random_like)
    for step in range(3):
        keys = jax.random.split(jax.random.key(step + 1), len(leaves))
        grads = treedef.unflatten(random_like(keys, leaves))
        params, state, norm = fn(grads, state, params)
        ref_params, ref_state, ref_norm = _optax_step(opt, grads, ref_state, ref_params)
        chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state, ref_state, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)


def test_apply_grads_updates_an_optimizer_not_known_to_be_leafwise_over_the_whole_tree():
    """A plain optax chain with a global transform inside (its clip sees every leaf at
    once): apply_grads does not split it by leaf. Leaf by leaf it would clip each leaf on
    its own norm, and the second step's params would differ."""
    assert isinstance(optim.make_optimizer(learning_rate=1e-2), optim.LeafwiseOptimizer)
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    assert not isinstance(opt, optim.LeafwiseOptimizer)
    params = {"a": jnp.zeros((2,), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}
    state = optim.TrainState(
        params=params, opt_state=opt.init(params), step=jnp.zeros((), jnp.int32)
    )
    ref_params, ref_state = params, opt.init(params)
    step = jax.jit(functools.partial(optim.apply_grads, optimizer=opt, grad_clip=0.0))
    grad_steps = (
        {"a": jnp.array([3.0, 4.0]), "b": jnp.array([1.0, 0.0])},
        {"a": jnp.array([0.1, 0.1]), "b": jnp.array([1.0, 0.0])},
    )
    for grads in grad_steps:
        state, stats = step(
            state, optim.Accumulated(grads, jnp.float32(0.0), jnp.float32(1.0), Stats())
        )
        ref_params, ref_state, ref_norm = _optax_step(opt, grads, ref_state, ref_params)
        np.testing.assert_allclose(float(stats.means["optim/update_norm"][0]), ref_norm, rtol=1e-5)
    chex.assert_trees_all_close(state.params, ref_params, rtol=1e-5, atol=1e-7)
    # Leaf by leaf, the same chain gives other params: the comparison above can fail.
    leafwise = params, opt.init(params)
    leaf_by_leaf = jax.jit(functools.partial(optim.update_leaf_by_leaf, opt))
    for grads in grad_steps:
        p, s, _ = leaf_by_leaf(grads, leafwise[1], leafwise[0])
        leafwise = p, s
    assert not np.allclose(leafwise[0]["b"], ref_params["b"], rtol=1e-3)


def test_update_leaf_by_leaf_holds_one_leafs_update_at_a_time():
    """XLA's own memory figure for the compiled update of eight 4 MiB leaves, params and
    state donated as the train step donates them: at most three leaves' worth of
    temporaries, where one ``optimizer.update`` over the tree with the norm of its updates
    holds every leaf's update (design §6)."""
    leaf_bytes = 4 * 2**20
    params = {f"w{i}": jnp.full((1024, 1024), 0.1 * i, jnp.float32) for i in range(8)}
    grads = jax.tree.map(lambda x: x + 1.0, params)
    opt = optim.make_optimizer(learning_rate=1e-2)
    state = opt.init(params)

    # Arguments in the outputs' order: jit pairs donated buffers with outputs in order.
    def leaf_by_leaf(params, state, grads):
        return optim.update_leaf_by_leaf(opt, grads, state, params)

    def whole_tree(params, state, grads):
        updates, new_state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, optim.tree_norm(updates)

    def temp_leaves(fn):
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        return analysis.temp_size_in_bytes / leaf_bytes

    leafwise, whole = temp_leaves(leaf_by_leaf), temp_leaves(whole_tree)
    print(f"temporaries in leaves: leaf by leaf {leafwise:.2f}, whole tree {whole:.2f}")
    assert leafwise <= 3.0, leafwise

    # And through apply_grads, which takes that path on a CPU only.
    if jax.default_backend() != "cpu":
        return
    train_state = optim.init_train_state(params, opt)
    acc = optim.Accumulated(grads, jnp.float32(1.0), jnp.float32(2.0), Stats())
    step = jax.jit(
        functools.partial(optim.apply_grads, optimizer=opt, grad_clip=1.0), donate_argnums=(0,)
    )
    analysis = step.lower(train_state, acc).compile().memory_analysis()
    assert analysis.temp_size_in_bytes / leaf_bytes <= 3.0


def test_apply_grads_skips_a_non_finite_gradient_untouched():
    params = model.init_params(CFG, jax.random.key(0))
    opt = optim.make_optimizer(learning_rate=1e-2)
    state = optim.TrainState(
        params=params, opt_state=jax.jit(opt.init)(params), step=jnp.zeros((), jnp.int32)
    )
    grad_sums = jax.jit(lambda params: jax.tree.map(jnp.ones_like, params))(params)
    grad_sums["final_norm"]["scale"] = grad_sums["final_norm"]["scale"].at[0].set(jnp.inf)
    acc = optim.Accumulated(grad_sums, jnp.float32(1.0), jnp.float32(2.0), Stats())
    new, stats = jax.jit(functools.partial(optim.apply_grads, optimizer=opt, grad_clip=1.0))(
        state, acc
    )
    chex.assert_trees_all_equal(new.params, params)
    chex.assert_trees_all_equal(new.opt_state, state.opt_state)
    assert int(new.step) == 0 and float(stats.maxima["step/skipped"]) == 1.0
    assert float(stats.means["optim/update_norm"][0]) == 0.0
