"""Golden-value and invariance tests for a3po_jax.core.losses (design.md §3).

Each golden value is small enough to check by hand; the comment beside it says what a
plausible wrong implementation would give instead.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiled import jitted

from a3po_jax.core import losses as L

JIT_VARIANTS = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["nojit", "jit"])


def _ln(x):
    return float(np.log(x))


# ----------------------------------------------------------------------------------------
# token_logprobs / entropy
# ----------------------------------------------------------------------------------------


@JIT_VARIANTS
def test_token_logprobs_golden(maybe_jit):
    # Uniform logits over V=4: every log-prob is log(1/4), whatever the target; a version
    # that forgot the logsumexp would return the raw logit 0.
    logits = jnp.zeros((1, 2, 4))
    targets = jnp.array([[0, 3]])
    np.testing.assert_allclose(maybe_jit(L.token_logprobs)(logits, targets), [[_ln(0.25)] * 2])
    # logits [log 1, log 3] → p = [1/4, 3/4].
    logits = jnp.log(jnp.array([[[1.0, 3.0]]]))
    np.testing.assert_allclose(
        maybe_jit(L.token_logprobs)(logits, jnp.array([[1]])), [[_ln(0.75)]], rtol=1e-6
    )


def test_token_logprobs_float32_from_bfloat16():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 50)).astype(jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(1), (2, 3), 0, 50)
    out = jitted(L.token_logprobs)(logits, targets)
    assert out.dtype == jnp.float32

    @jax.jit
    def reference(logits, targets):
        ref = jax.nn.log_softmax(logits.astype(jnp.float32))
        return jnp.take_along_axis(ref, targets[..., None], -1)[..., 0]

    np.testing.assert_allclose(out, reference(logits, targets), atol=1e-6)


def test_token_logprobs_has_no_one_hot():
    # The [B, T, V] one-hot would show up as a float array of that shape in the jaxpr.
    logits = jnp.zeros((2, 3, 97))
    jaxpr = jax.make_jaxpr(L.token_logprobs)(logits, jnp.zeros((2, 3), jnp.int32))
    eqn_names = {e.primitive.name for e in jaxpr.eqns}
    assert "eq" not in eqn_names, "an equality against iota suggests a one-hot"


def test_entropy_golden():
    # Uniform over 4 → log 4; a point mass → 0.
    logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    np.testing.assert_allclose(jitted(L.entropy)(logits), [[math.log(4), 0.0]], atol=1e-5)


# ----------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------

VALUES = jnp.array([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
MASK = jnp.array([[1, 1, 1], [1, 0, 0]])


def test_aggregate_golden():
    # token_mean over the whole batch: (1+2+3+4)/4 = 2.5. A per-row average then mean
    # would give (2 + 4)/2 = 3.0; forgetting the mask would count the 99s.
    assert float(jitted(L.aggregate, mode="token_mean")(VALUES, MASK)) == pytest.approx(2.5)
    assert float(jitted(L.aggregate, mode="seq_mean_token_mean")(VALUES, MASK)) == pytest.approx(
        3.0
    )
    # Dr.GRPO: per-sequence sums over a constant length 3: (6/3 + 4/3) / 2 = 5/3.
    drgrpo = jitted(L.aggregate, mode="seq_mean_token_sum_norm")
    assert float(drgrpo(VALUES, MASK)) == pytest.approx(5 / 3)
    assert float(
        jitted(L.aggregate, mode="seq_mean_token_sum_norm", max_len=10)(VALUES, MASK)
    ) == pytest.approx((0.6 + 0.4) / 2)


def test_aggregate_all_masked_is_zero_not_nan():
    out = jitted(L.aggregate)(VALUES, jnp.zeros_like(MASK))
    assert float(out) == 0.0


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
def test_micro_batched_sum_with_global_denominator_equals_full_batch(mode):
    key = jax.random.key(3)
    vals = jax.random.normal(key, (6, 5))
    uniform = jax.random.uniform(jax.random.key(4), (6, 5))

    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def run(vals, uniform):
        mask = (uniform > 0.3).astype(jnp.float32)
        mask = mask.at[2].set(0.0)  # one fully padded sequence
        full = L.aggregate(vals, mask, mode=mode)
        if mode == "token_mean":
            denom = jnp.sum(mask)
        else:
            denom = jnp.sum(jnp.sum(mask, -1) > 0)
        parts = [
            L.aggregate(vals[i : i + 2], mask[i : i + 2], mode=mode, denominator=denom)
            for i in range(0, 6, 2)
        ]
        naive = [L.aggregate(vals[i : i + 2], mask[i : i + 2]) for i in range(0, 6, 2)]
        return full, sum(parts), naive

    full, summed, naive = run(vals, uniform)
    np.testing.assert_allclose(summed, full, rtol=1e-6)
    # Averaging per micro-batch instead gives a different number: that's the bug this guards.
    if mode == "token_mean":
        naive = np.mean(naive)
        assert abs(naive - float(full)) > 1e-3


# ----------------------------------------------------------------------------------------
# PPO / decoupled PPO golden values
# ----------------------------------------------------------------------------------------


@JIT_VARIANTS
def test_ppo_clip_golden(maybe_jit):
    # Four tokens, ε = 0.2, ratios r and advantages A:
    #   r=1.5, A=+1 → max(-1.5, -1.2) = -1.2  (clipped; an unclipped PG would give -1.5)
    #   r=1.5, A=-1 → max( 1.5,  1.2) =  1.5  (pessimistic side keeps the unclipped ratio)
    #   r=0.5, A=+1 → max(-0.5, -0.8) = -0.5
    #   r=0.5, A=-1 → max( 0.5,  0.8) =  0.8  (clipped)
    # token_mean = (-1.2 + 1.5 - 0.5 + 0.8) / 4 = 0.15; clip fraction 2/4.
    behav = jnp.zeros((1, 4))
    logp = jnp.log(jnp.array([[1.5, 1.5, 0.5, 0.5]]))
    adv = jnp.array([[1.0, -1.0, 1.0, -1.0]])
    mask = jnp.ones((1, 4))
    loss, m = maybe_jit(lambda *a: L.ppo_clip_loss(*a, clip_eps=0.2))(logp, behav, adv, mask)
    assert float(loss) == pytest.approx(0.15, abs=1e-6)
    assert float(m["loss/clipfrac"]) == pytest.approx(0.5)
    assert float(m["is/weight_mean"]) == pytest.approx(1.0)


def test_clip_higher_asymmetric():
    # r = 1.25, A = +1: with ε_low = ε_high = 0.2 → -1.2; with ε_high = 0.28 → -1.25 (no clip).
    behav = jnp.zeros((1, 1))
    logp = jnp.log(jnp.array([[1.25]]))
    adv, mask = jnp.ones((1, 1)), jnp.ones((1, 1))
    sym, _ = jitted(L.ppo_clip_loss, clip_eps=0.2)(logp, behav, adv, mask)
    high, m = jitted(L.ppo_clip_loss, clip_eps=0.2, clip_eps_high=0.28)(logp, behav, adv, mask)
    assert float(sym) == pytest.approx(-1.2)
    assert float(high) == pytest.approx(-1.25)
    assert float(m["loss/clipfrac"]) == 0.0


def test_decoupled_importance_weight_golden():
    # prox - behav = log 2 → w = 2; logp - prox = log 1.5, A = +1, ε = 0.2:
    # ℓ = 2 · max(-1.5, -1.2) = -2.4. Clipping the *full* ratio π_θ/π_behav = 3 (naive PPO)
    # would give -1.2, and forgetting w would give -1.2 too.
    prox = jnp.log(jnp.array([[2.0]]))
    behav = jnp.zeros((1, 1))
    logp = prox + _ln(1.5)
    loss, m = jitted(L.decoupled_ppo_loss, clip_eps=0.2)(
        logp, prox, behav, jnp.ones((1, 1)), jnp.ones((1, 1))
    )
    assert float(loss) == pytest.approx(-2.4, rel=1e-6)
    assert float(m["is/weight_max"]) == pytest.approx(2.0)
    assert float(m["is/weight_min"]) == pytest.approx(2.0)
    # k3 KL(behav‖θ) with x = behav - logp = -log 3: e^x - 1 - x = 1/3 - 1 + log 3.
    assert float(m["kl/behav_k3"]) == pytest.approx(1 / 3 - 1 + math.log(3), rel=1e-5)


def test_dual_clip_golden():
    # A = -1, r = 5, ε = 0.2: PPO gives max(5, 1.2) = 5; dual clip c = 3 bounds it at 3.
    # For A > 0 dual clip must do nothing: r = 5, A = +1 → max(-5, -1.2) = -1.2.
    behav = jnp.zeros((1, 2))
    logp = jnp.log(jnp.array([[5.0, 5.0]]))
    adv = jnp.array([[-1.0, 1.0]])
    loss, m = jitted(L.ppo_clip_loss, clip_eps=0.2, dual_clip=3.0)(
        logp, behav, adv, jnp.ones((1, 2))
    )
    assert float(loss) == pytest.approx((3.0 - 1.2) / 2)
    assert float(m["loss/dual_clipfrac"]) == pytest.approx(0.5)


def test_behav_weight_cap_mask_keeps_denominator():
    # Token 0 has w = 2 > cap 1.5, token 1 has w = 1 and ℓ = -1 (r = 1, A = 1).
    # "mask": token 0 dropped but still counted → -1/2. A denominator that skipped capped
    # tokens would give -1/1.
    prox = jnp.log(jnp.array([[2.0, 1.0]]))
    behav = jnp.zeros((1, 2))
    logp = prox
    adv, mask = jnp.ones((1, 2)), jnp.ones((1, 2))
    loss, m = jitted(L.decoupled_ppo_loss, clip_eps=0.2, behav_weight_cap=1.5, cap_mode="mask")(
        logp, prox, behav, adv, mask
    )
    assert float(loss) == pytest.approx(-0.5)
    assert float(m["is/capped_frac"]) == pytest.approx(0.5)
    # "truncate": w := 1.5 → (-1.5 - 1) / 2.
    truncate = jitted(L.decoupled_ppo_loss, clip_eps=0.2, behav_weight_cap=1.5, cap_mode="truncate")
    loss, _ = truncate(logp, prox, behav, adv, mask)
    assert float(loss) == pytest.approx(-1.25)


def test_staleness_metrics():
    z = jnp.zeros((2, 2))
    d = jnp.array([[0, 3], [1, 7]])
    mask = jnp.array([[1, 1], [1, 0]])  # the 7 is padding and must not count
    _, m = jitted(L.decoupled_ppo_loss, clip_eps=0.2)(z, z, z, z, mask, staleness=d)
    assert float(m["staleness/mean"]) == pytest.approx(4 / 3)
    assert float(m["staleness/max"]) == 3.0


# ----------------------------------------------------------------------------------------
# A-3PO
# ----------------------------------------------------------------------------------------


@JIT_VARIANTS
def test_a3po_prox_golden(maybe_jit):
    # logp = -1, behav = -3. d = 0 → α = 0 → -1; d = 1 → α = 1 → -3;
    # d = 2 → α = 1/2 → -2; d = 4 → α = 1/4 → -1.5. (α = 1/(d+1) would give -2, -1.67, ...)
    logp = jnp.full((1, 4), -1.0)
    behav = jnp.full((1, 4), -3.0)
    d = jnp.array([[0, 1, 2, 4]])
    prox = maybe_jit(L.a3po_prox_logp)(logp, behav, d)
    np.testing.assert_allclose(prox, [[-1.0, -3.0, -2.0, -1.5]], rtol=1e-6)
    areal = maybe_jit(lambda *a: L.a3po_prox_logp(*a, zero_staleness="behav"))(logp, behav, d)
    np.testing.assert_allclose(areal, [[-3.0, -3.0, -2.0, -1.5]], rtol=1e-6)


def test_a3po_negative_staleness_is_an_error():
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        L.a3po_prox_logp(z, z, jnp.array([[0, -1]]))
    # Under jit it cannot raise; it poisons the value so the loss is non-finite.
    out = jax.jit(L.a3po_prox_logp)(z, z, jnp.array([[0, -1]]))
    assert np.isfinite(out[0, 0]) and np.isnan(out[0, 1])


def test_a3po_prox_has_no_gradient():
    logp = jnp.array([[-1.0, -2.0]])
    behav = jnp.array([[-3.0, -3.0]])
    # d an argument: a3po_prox_logp checks a concrete staleness, so not a closed-over one.
    g = jax.jit(jax.grad(lambda x, d: jnp.sum(L.a3po_prox_logp(x, behav, d))))(
        logp, jnp.array([[0, 2]])
    )
    np.testing.assert_array_equal(g, 0.0)


@functools.partial(jax.jit, static_argnames=("b", "t", "scale"))
def _random_batch(key, b=4, t=6, scale=1.0):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    logp = -jnp.abs(jax.random.normal(k1, (b, t))) - 0.1
    behav = logp + scale * jax.random.normal(k2, (b, t))
    adv = jax.random.normal(k3, (b, t))
    mask = (jax.random.uniform(k4, (b, t)) > 0.25).astype(jnp.float32)
    return logp, behav, adv, mask


def test_staleness_one_makes_a3po_plain_ppo():
    logp, behav, adv, mask = _random_batch(jax.random.key(0))
    prox = jitted(L.a3po_prox_logp)(logp, behav, jnp.ones(logp.shape, jnp.int32))
    a3po, _ = jitted(L.decoupled_ppo_loss, clip_eps=0.2)(logp, prox, behav, adv, mask)
    ppo, _ = jitted(L.ppo_clip_loss, clip_eps=0.2)(logp, behav, adv, mask)
    np.testing.assert_allclose(a3po, ppo, rtol=1e-6)
    # And AReaL's option does the same at d = 0.
    prox0 = jitted(L.a3po_prox_logp, zero_staleness="behav")(
        logp, behav, jnp.zeros(logp.shape, jnp.int32)
    )
    areal, _ = jitted(L.decoupled_ppo_loss, clip_eps=0.2)(logp, prox0, behav, adv, mask)
    np.testing.assert_allclose(areal, ppo, rtol=1e-6)


def test_prox_equal_behav_is_ppo_clip_loss_including_gradients():
    logp, behav, adv, mask = _random_batch(jax.random.key(1))

    def dec(x):
        return L.decoupled_ppo_loss(x, behav, behav, adv, mask, clip_eps=0.2, dual_clip=3.0)[0]

    def ppo(x):
        return L.ppo_clip_loss(x, behav, adv, mask, clip_eps=0.2, dual_clip=3.0)[0]

    dec_value, dec_grad = jax.jit(jax.value_and_grad(dec))(logp)
    ppo_value, ppo_grad = jax.jit(jax.value_and_grad(ppo))(logp)
    np.testing.assert_allclose(dec_value, ppo_value, rtol=1e-6)
    np.testing.assert_allclose(dec_grad, ppo_grad, rtol=1e-6)


def test_a3po_at_zero_staleness_gradient_is_importance_weighted_pg():
    # At d = 0, prox = sg(logp) so r = 1 (never clipped) and w = π_θ/π_behav: the gradient
    # must be that of -Σ m A sg(π_θ/π_behav) logp / Σ m.
    logp, behav, adv, mask = _random_batch(jax.random.key(2))
    d = jnp.zeros(logp.shape, jnp.int32)

    def a3po(x, d):
        prox = L.a3po_prox_logp(x, behav, d)
        return L.decoupled_ppo_loss(x, prox, behav, adv, mask, clip_eps=0.2)[0]

    def is_pg(x):
        w = jax.lax.stop_gradient(jnp.exp(x - behav))
        return -jnp.sum(mask * adv * w * x) / jnp.sum(mask)

    np.testing.assert_allclose(
        jax.jit(jax.grad(a3po))(logp, d), jax.jit(jax.grad(is_pg))(logp), rtol=1e-5, atol=1e-7
    )


def test_gradient_flows_only_through_the_ratio():
    logp, behav, adv, mask = _random_batch(jax.random.key(3), scale=0.1)
    prox = behav + 0.05

    def f(x, p, b, a):
        return L.decoupled_ppo_loss(x, p, b, a, mask, clip_eps=0.2)[0]

    grad_f = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))
    g_logp, g_prox, g_behav, g_adv = grad_f(logp, prox, behav, adv)
    for g in (g_prox, g_behav, g_adv):
        np.testing.assert_array_equal(g, 0.0)

    @jax.jit
    def analytic(logp, prox, behav, adv):
        # Analytic gradient: d/dlogp [w·(-A r)] = -A w r where unclipped, 0 where clipped.
        r = jnp.exp(logp - prox)
        w = jnp.exp(prox - behav)
        unclipped = -adv * r
        clipped = -adv * jnp.clip(r, 0.8, 1.2)
        active = unclipped >= clipped
        return jnp.where(active, -adv * w * r, 0.0) * mask / jnp.sum(mask)

    np.testing.assert_allclose(g_logp, analytic(logp, prox, behav, adv), rtol=1e-5, atol=1e-8)


def test_masked_equals_indexed():
    logp, behav, adv, mask = _random_batch(jax.random.key(4))
    prox = behav + 0.1
    loss, _ = jitted(L.decoupled_ppo_loss, clip_eps=0.2)(logp, prox, behav, adv, mask)
    idx = np.asarray(mask).astype(bool)
    pick = lambda x: jnp.asarray(np.asarray(x)[idx])[None, :]  # noqa: E731
    ones = jnp.ones((1, int(idx.sum())))
    loss_idx, _ = jitted(L.decoupled_ppo_loss, clip_eps=0.2)(
        pick(logp), pick(prox), pick(behav), pick(adv), ones
    )
    np.testing.assert_allclose(loss, loss_idx, rtol=1e-6)


def test_micro_batched_loss_and_grads_equal_full_batch():
    logp, behav, adv, mask = _random_batch(jax.random.key(5), b=8)
    d = jnp.tile(jnp.arange(8)[:, None] % 3, (1, logp.shape[1]))
    n = jnp.sum(mask)

    # One compiled program per batch shape (full, micro-batch): eagerly every primitive
    # compiles its own. The micro-batches are NumPy slices of the same arrays.
    @jax.jit
    def loss_and_grad(x, behav, d, adv, mask, denom=None):
        def loss_fn(x):
            prox = L.a3po_prox_logp(x, behav, d)
            loss, _ = L.decoupled_ppo_loss(
                x, prox, behav, adv, mask, clip_eps=0.2, denominator=denom
            )
            return loss

        return jax.value_and_grad(loss_fn)(x)

    arrays = [np.asarray(a) for a in (logp, behav, d, adv, mask)]
    full, g_full = loss_and_grad(*arrays)
    parts, grads = [], []
    for i in range(0, 8, 2):
        part, grad = loss_and_grad(*(a[i : i + 2] for a in arrays), denom=n)
        parts.append(np.asarray(part))
        grads.append(np.asarray(grad))
    np.testing.assert_allclose(sum(parts), full, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------------------
# Advantages, KL, DPO
# ----------------------------------------------------------------------------------------


def test_grpo_advantages_golden():
    # Group 1: [1, 0] mean .5, population std .5 → [+1, -1]. (Sample std, ddof=1, would
    # give ±0.707.) Group 2: equal rewards → 0, not NaN.
    adv = jitted(L.grpo_advantages, group_size=2)(jnp.array([1.0, 0.0, 1.0, 1.0]))
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0], atol=1e-5)
    drgrpo = jitted(L.grpo_advantages, group_size=2, normalize_std=False)
    adv2 = drgrpo(jnp.array([[1.0, 0.0], [1.0, 1.0]]))
    np.testing.assert_allclose(adv2, [[0.5, -0.5], [0.0, 0.0]])


def test_rloo_advantages_golden():
    # [1, 0, 0]: A_0 = 1 - 0 = 1, A_1 = 0 - (1+0)/2 = -0.5. (Mean baseline incl. self: 2/3.)
    rloo = jitted(L.rloo_advantages, group_size=3)
    np.testing.assert_allclose(rloo(jnp.array([1.0, 0.0, 0.0])), [1, -0.5, -0.5])


def test_advantage_shape_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        L.grpo_advantages(jnp.zeros(5), 2)
    with pytest.raises(ValueError, match="second axis"):
        L.grpo_advantages(jnp.zeros((2, 3)), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        L.rloo_advantages(jnp.zeros(4), 1)


def test_kl_penalty_golden():
    # x = ref - logp = 1: k1 = -1, k2 = 0.5, k3 = e - 2.
    logp, ref = jnp.zeros((1, 1)), jnp.ones((1, 1))
    assert float(jitted(L.kl_penalty, kind="k1")(logp, ref)[0, 0]) == pytest.approx(-1.0)
    assert float(jitted(L.kl_penalty, kind="k2")(logp, ref)[0, 0]) == pytest.approx(0.5)
    k3 = jitted(L.kl_penalty, kind="k3")
    assert float(k3(logp, ref)[0, 0]) == pytest.approx(math.e - 2, rel=1e-6)
    # k3 is zero when the policies agree and non-negative always.
    x = jax.random.normal(jax.random.key(0), (3, 7)) * 3
    assert float(jnp.min(k3(x, x))) == 0.0
    assert float(jnp.min(k3(x, -x))) >= 0.0


def test_online_dpo_golden():
    z = jnp.zeros(2)
    # h = 0 → -log σ(0) = log 2 (a loss without the log would give 0.5).
    loss, m = jitted(L.online_dpo_loss, beta=0.1)(z, z, z, z)
    assert float(loss) == pytest.approx(math.log(2))
    # IPO with β = 0.5, h = 0 → (0 - 1)² = 1.
    loss, _ = jitted(L.online_dpo_loss, beta=0.5, kind="ipo")(z, z, z, z)
    assert float(loss) == pytest.approx(1.0)
    # chosen up by 2 nats vs ref, rejected unchanged, β = 0.5 → -log σ(1).
    loss, m = jitted(L.online_dpo_loss, beta=0.5)(jnp.array([2.0]), z[:1], z[:1], z[:1])
    assert float(loss) == pytest.approx(math.log1p(math.exp(-1.0)))
    assert float(m["dpo/accuracy"]) == 1.0
    assert float(m["dpo/chosen_reward"]) == pytest.approx(1.0)


def test_online_dpo_gradient_sign():
    # Increasing the chosen log-prob must lower the loss; the rejected must raise it.
    z = jnp.zeros(3)

    def loss(c, r):
        return L.online_dpo_loss(c, r, z, z, beta=0.1)[0]

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(z, z)
    assert np.all(np.asarray(g[0]) < 0) and np.all(np.asarray(g[1]) > 0)


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------


def test_bad_input_errors_name_the_argument():
    z = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="advantages has shape"):
        L.decoupled_ppo_loss(z, z, z, jnp.zeros((2,)), z, clip_eps=0.2)
    with pytest.raises(ValueError, match="logp must have rank 2"):
        L.decoupled_ppo_loss(z[0], z[0], z[0], z[0], z[0], clip_eps=0.2)
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        L.ppo_clip_loss(z, z, z, z, clip_eps=0.0)
    with pytest.raises(ValueError, match="behav_weight_cap must be > 0"):
        L.ppo_clip_loss(z, z, z, z, clip_eps=0.2, behav_weight_cap=-1.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        L.ppo_clip_loss(z, z, z, z, clip_eps=0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="aggregation='mean' is not one of token_mean"):
        L.ppo_clip_loss(z, z, z, z, clip_eps=0.2, aggregation="mean")
    with pytest.raises(ValueError, match="cap_mode='drop' is not one of mask, truncate"):
        L.ppo_clip_loss(z, z, z, z, clip_eps=0.2, behav_weight_cap=2.0, cap_mode="drop")
    with pytest.raises(ValueError, match="kind='k4' is not one of k1, k2, k3"):
        L.kl_penalty(z, z, "k4")
    with pytest.raises(ValueError, match="beta must be > 0"):
        L.online_dpo_loss(z[0], z[0], z[0], z[0], beta=0.0)
    with pytest.raises(ValueError, match="kind='hinge' is not one of sigmoid, ipo"):
        L.online_dpo_loss(z[0], z[0], z[0], z[0], beta=0.1, kind="hinge")
    with pytest.raises(ValueError, match="targets has shape"):
        L.token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
    # Errors fire at trace time under jit too.
    with pytest.raises(ValueError, match="advantages has shape"):
        jax.jit(lambda a: L.ppo_clip_loss(z, z, a, z, clip_eps=0.2))(jnp.zeros((2,)))


# ----------------------------------------------------------------------------------------
# Traces once
# ----------------------------------------------------------------------------------------


def test_losses_trace_once_per_shape():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logp, behav, adv, mask, d):
        prox = L.a3po_prox_logp(logp, behav, d)
        return L.decoupled_ppo_loss(logp, prox, behav, adv, mask, clip_eps=0.2, staleness=d)

    for seed in range(3):
        logp, behav, adv, mask = _random_batch(jax.random.key(seed))
        d = jnp.full(logp.shape, seed, jnp.int32)
        step(logp, behav, adv, mask, d)
    chex.clear_trace_counter()


def test_online_dpo_pair_mask_and_global_denominator():
    # Pair 1 is a tie (masked): the loss is pair 0's alone, log 2 at h = 0. Without the mask
    # the tie's -log σ(β·4) would be averaged in.
    z = jnp.zeros(2)
    c = jnp.array([0.0, 4.0])
    loss, m = jitted(L.online_dpo_loss, beta=1.0)(c, z, z, z, mask=jnp.array([1.0, 0.0]))
    assert float(loss) == pytest.approx(math.log(2))
    assert float(m["dpo/num_pairs"]) == 1.0
    # Two micro-batches with the global count add up to the full-batch loss.
    c4 = jnp.array([0.5, -1.0, 2.0, 0.0])
    z4 = jnp.zeros(4)
    full, _ = jitted(L.online_dpo_loss, beta=0.5)(c4, z4, z4, z4)
    half = jitted(L.online_dpo_loss, beta=0.5, denominator=4.0)
    c4_, z4_ = np.asarray(c4), np.asarray(z4)  # NumPy slices: an eager one would compile
    halves = [half(c4_[s], z4_[s], z4_[s], z4_[s])[0] for s in (slice(0, 2), slice(2, 4))]
    np.testing.assert_allclose(sum(halves), full, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# Unreduced pieces: (numerator, count) pairs and per-token / per-pair values
# ----------------------------------------------------------------------------------------


@JIT_VARIANTS
def test_aggregate_sum_golden(maybe_jit):
    # Row 0: values 1, 2, 3 (3 valid); row 1: 4 and 6 valid, the 5 masked; row 2 padding.
    values = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    parts = {m: maybe_jit(lambda v, k, m=m: L.aggregate_sum(v, k, mode=m)) for m in L.AGGREGATIONS}
    # token_mean: (1+2+3+4+6, 5 tokens); a mean of row means would give (2 + 5) / 2 = 3.5.
    np.testing.assert_allclose(parts["token_mean"](values, mask), (16.0, 5.0))
    # seq_mean_token_mean: (2 + 5, 2 rows with a token); counting the padded row gives /3.
    np.testing.assert_allclose(parts["seq_mean_token_mean"](values, mask), (7.0, 2.0), rtol=1e-6)
    # Dr.GRPO: (6/3 + 10/3, 2 rows): every row divided by T = 3, not by its own length.
    np.testing.assert_allclose(
        parts["seq_mean_token_sum_norm"](values, mask), (16.0 / 3.0, 2.0), rtol=1e-6
    )
    for mode in L.AGGREGATIONS:
        num, count = parts[mode](values, mask)
        np.testing.assert_allclose(num / count, L.aggregate(values, mask, mode=mode), rtol=1e-6)


def test_aggregate_sum_parts_add_across_micro_batches():
    vals = jax.random.normal(jax.random.key(5), (6, 5))
    uniform = jax.random.uniform(jax.random.key(6), (6, 5))

    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def run(vals, uniform):
        mask = (uniform > 0.3).astype(jnp.float32)
        mask = mask.at[3].set(0.0)
        out = {}
        for mode in L.AGGREGATIONS:
            pieces = [
                L.aggregate_sum(vals[i : i + 2], mask[i : i + 2], mode=mode) for i in (0, 2, 4)
            ]
            num, count = (sum(p[j] for p in pieces) for j in (0, 1))
            out[mode] = num / count, L.aggregate(vals, mask, mode=mode)
        return out

    for mode, (parts, full) in run(vals, uniform).items():
        np.testing.assert_allclose(parts, full, rtol=1e-6, err_msg=mode)


def test_per_token_ppo_reduces_to_the_reduced_loss():
    key = jax.random.split(jax.random.key(7), 4)
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], jnp.float32)
    kw = dict(clip_eps=0.2, dual_clip=3.0, behav_weight_cap=1.2)

    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def run(key, mask):
        logp = -jax.random.uniform(key[0], (3, 4), minval=0.5, maxval=3.0)
        prox = logp + 0.3 * jax.random.normal(key[1], (3, 4))
        behav = prox + 0.3 * jax.random.normal(key[2], (3, 4))
        adv = jax.random.normal(key[3], (3, 4))
        per_token, diag = L.decoupled_ppo_per_token(logp, prox, behav, adv, mask, **kw)
        loss, metrics = L.decoupled_ppo_loss(logp, prox, behav, adv, mask, **kw)
        n = jnp.sum(mask)
        sums = {
            "mean": jnp.sum(per_token) / jnp.sum(mask),
            "padding": jnp.sum(jnp.abs(per_token) * (1 - mask)),
            "clipfrac": jnp.sum(diag.clipped * mask) / n,
            "capped_frac": jnp.sum(diag.capped * mask) / n,
        }
        return sums, diag, loss, metrics

    sums, diag, loss, metrics = run(key, mask)
    np.testing.assert_allclose(sums["mean"], loss, rtol=1e-6)
    assert float(sums["padding"]) == 0.0  # padding contributes 0
    np.testing.assert_allclose(sums["clipfrac"], metrics["loss/clipfrac"])
    np.testing.assert_allclose(sums["capped_frac"], metrics["is/capped_frac"])
    w = np.asarray(diag.is_weight)[np.asarray(mask) > 0]
    np.testing.assert_allclose(w.max(), metrics["is/weight_max"], rtol=1e-6)
    np.testing.assert_allclose(w.min(), metrics["is/weight_min"], rtol=1e-6)


def test_per_pair_dpo_reduces_to_the_reduced_loss():
    chosen, rejected = jnp.array([-3.0, -2.0, -5.0]), jnp.array([-4.0, -2.5, -1.0])
    ref_c, ref_r = jnp.array([-3.5, -2.0, -4.0]), jnp.array([-3.5, -3.0, -1.5])
    pairs = jnp.array([1.0, 1.0, 0.0])
    per_pair, diag = jitted(L.online_dpo_per_pair, beta=0.5)(chosen, rejected, ref_c, ref_r)
    loss, metrics = jitted(L.online_dpo_loss, beta=0.5)(chosen, rejected, ref_c, ref_r, mask=pairs)
    np.testing.assert_allclose(jnp.sum(per_pair * pairs) / 2.0, loss, rtol=1e-6)
    # h = (logp⁺ - ref⁺) - (logp⁻ - ref⁻): pair 0: 0.5 - (-0.5) = 1; pair 1: 0 - 0.5 = -0.5.
    np.testing.assert_allclose(diag.margin[:2], [0.5, -0.25], rtol=1e-6)
    np.testing.assert_allclose(metrics["dpo/accuracy"], 0.5)


def test_kl_estimators_table_is_kl_penalty():
    logp, ref = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -2.0]])
    # x = ref - logp = (-0.5, 0): k1 = (0.5, 0), k2 = (0.125, 0), k3 = (e^-0.5 - 0.5, 0).
    want = {"k1": [0.5, 0.0], "k2": [0.125, 0.0], "k3": [math.exp(-0.5) - 0.5, 0.0]}
    for kind, estimate in L.KL_ESTIMATORS.items():
        np.testing.assert_allclose(
            jitted(L.kl_penalty, kind=kind)(logp, ref)[0], want[kind], rtol=1e-6
        )
        np.testing.assert_allclose(jitted(estimate)(ref - logp)[0], want[kind], rtol=1e-6)


# ----------------------------------------------------------------------------------------
# Advantage table and KL-in-reward (a3po_jax.core.advantages)
# ----------------------------------------------------------------------------------------


def test_advantage_table_and_kl_shaped_rewards_golden():
    from a3po_jax.core import advantages

    rewards = jnp.array([1.0, 0.0, 1.0, 1.0])  # one group of 4, mean 0.75, std √3 / 4
    drgrpo = jitted(advantages.ESTIMATORS["drgrpo"], group_size=4)
    np.testing.assert_allclose(drgrpo(rewards), [0.25, -0.75, 0.25, 0.25], rtol=1e-6)
    # RLOO: R_i - mean of the other three: 1 - 2/3, 0 - 1, ...
    rloo = jitted(advantages.ESTIMATORS["rloo"], group_size=4)
    np.testing.assert_allclose(rloo(rewards), [1 / 3, -1.0, 1 / 3, 1 / 3], rtol=1e-6)
    with pytest.raises(ValueError, match="'gae'.*grpo, drgrpo, rloo"):
        advantages.estimator("gae")
    # KL in the reward, k1 = logp - ref summed over completion tokens only: row 0 has
    # 0.5 + 0.5 (its third token is masked; counting it would add 2), row 1 has 0.
    logp = jnp.array([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = jnp.array([[-1.5, -1.5, -3.0], [-2.0, -2.0, -2.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    shaped = jitted(advantages.kl_shaped_rewards, kl_coef=0.1, kl_kind="k1")(
        jnp.array([1.0, 1.0]), logp, ref, mask
    )
    np.testing.assert_allclose(shaped, [1.0 - 0.1 * 1.0, 1.0], rtol=1e-6)
    r, adv = jitted(
        advantages.kl_in_reward_advantages,
        group_size=2,
        estimate=advantages.ESTIMATORS["drgrpo"],
        kl_coef=0.1,
        kl_kind="k1",
    )(jnp.array([1.0, 1.0]), logp, ref, mask)
    # One group of 2 with rewards 0.9, 1.0: Dr.GRPO advantages -0.05, +0.05 on valid tokens.
    np.testing.assert_allclose(adv, [[-0.05, -0.05, 0.0], [0.05, 0.05, 0.05]], atol=1e-6)
