"""Independent cross-check: the losses written plainly in NumPy, token by token, agree with
a3po_jax.core.losses on random inputs, including all-masked rows, huge ratios and zero
advantages. The NumPy code loops over tokens on purpose: it shares no vectorised trick (and
so no bug) with the JAX code.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiled import jitted

from a3po_jax.core import losses as L


def np_decoupled_ppo(logp, prox, behav, adv, mask, eps_lo, eps_hi, dual, cap, cap_mode, agg):
    b_size, t_size = logp.shape
    per_tok = np.zeros((b_size, t_size))
    for b in range(b_size):
        for t in range(t_size):
            if not mask[b, t]:
                continue
            r = math.exp(logp[b, t] - prox[b, t])
            w = math.exp(prox[b, t] - behav[b, t])
            if cap is not None and w > cap:
                if cap_mode == "mask":
                    continue
                w = cap
            a = adv[b, t]
            lo = -a * r
            hi = -a * min(max(r, 1 - eps_lo), 1 + eps_hi)
            ell = max(lo, hi)
            if dual is not None and a < 0:
                ell = min(ell, -dual * a)
            per_tok[b, t] = w * ell
    n_tok = mask.sum()
    if agg == "token_mean":
        return per_tok.sum() / n_tok if n_tok else 0.0
    seqs = [b for b in range(b_size) if mask[b].sum() > 0]
    if not seqs:
        return 0.0
    if agg == "seq_mean_token_mean":
        return sum(per_tok[b].sum() / mask[b].sum() for b in seqs) / len(seqs)
    return sum(per_tok[b].sum() / t_size for b in seqs) / len(seqs)


def np_a3po_prox(logp, behav, d):
    out = np.empty_like(logp)
    for idx, dd in np.ndenumerate(d):
        alpha = 0.0 if dd == 0 else 1.0 / dd
        out[idx] = alpha * behav[idx] + (1 - alpha) * logp[idx]
    return out


def np_grpo(rewards, g, normalize_std, eps=1e-6):
    out = []
    for i in range(0, len(rewards), g):
        grp = rewards[i : i + g]
        mu = sum(grp) / g
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / g)
        out += [(x - mu) / (sd + eps) if normalize_std else x - mu for x in grp]
    return np.array(out)


CASES = [
    # (seed, eps_lo, eps_hi, dual, cap, cap_mode, aggregation, log-ratio scale)
    (0, 0.2, 0.2, None, None, "mask", "token_mean", 0.3),
    (1, 0.2, 0.28, 3.0, None, "mask", "token_mean", 1.0),
    (2, 0.1, 0.1, None, 2.0, "mask", "seq_mean_token_mean", 1.0),
    (3, 0.2, 0.2, 2.0, 1.5, "truncate", "seq_mean_token_sum_norm", 1.0),
    (4, 0.2, 0.2, 3.0, None, "mask", "token_mean", 20.0),  # huge ratios, e^±40
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_decoupled_ppo_matches_numpy(case):
    seed, eps_lo, eps_hi, dual, cap, cap_mode, agg, scale = case
    rng = np.random.default_rng(seed)
    b, t = 5, 7
    logp = -np.abs(rng.normal(size=(b, t))) - 0.05
    behav = logp + scale * rng.normal(size=(b, t))
    d = rng.integers(0, 5, size=(b, t))
    adv = rng.normal(size=(b, t))
    adv[1] = 0.0  # zero advantages: contribute exactly 0
    mask = (rng.uniform(size=(b, t)) > 0.3).astype(np.float64)
    mask[3] = 0.0  # an all-masked row
    prox_np = np_a3po_prox(logp, behav, d)
    prox = jitted(L.a3po_prox_logp)(jnp.asarray(logp), jnp.asarray(behav), jnp.asarray(d))
    np.testing.assert_allclose(prox, prox_np, rtol=1e-5, atol=1e-5)
    expected = np_decoupled_ppo(
        logp, prox_np, behav, adv, mask, eps_lo, eps_hi, dual, cap, cap_mode, agg
    )
    got, metrics = jitted(
        L.decoupled_ppo_loss,
        clip_eps=eps_lo,
        clip_eps_high=eps_hi,
        dual_clip=dual,
        behav_weight_cap=cap,
        cap_mode=cap_mode,
        aggregation=agg,
    )(
        jnp.asarray(logp, jnp.float32),
        prox,
        jnp.asarray(behav, jnp.float32),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask),
    )
    assert np.isfinite(float(got))
    np.testing.assert_allclose(float(got), expected, rtol=1e-4, atol=1e-5)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_all_masked_batch_is_finite_zero():
    z = jnp.zeros((2, 3))
    big = jnp.full((2, 3), 50.0)
    loss, metrics = jitted(L.decoupled_ppo_loss, clip_eps=0.2)(big, z, -big, jnp.ones((2, 3)), z)
    assert float(loss) == 0.0
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_matches_numpy(normalize_std):
    rng = np.random.default_rng(7)
    r = rng.integers(0, 2, size=24).astype(np.float64)
    np.testing.assert_allclose(
        jitted(L.grpo_advantages, group_size=6, normalize_std=normalize_std)(jnp.asarray(r)),
        np_grpo(r, 6, normalize_std),
        rtol=1e-5,
        atol=1e-5,
    )


def test_rloo_kl_dpo_match_numpy():
    rng = np.random.default_rng(8)
    r = rng.normal(size=12)
    expected = [r[i] - (sum(r[(i // 4) * 4 : (i // 4) * 4 + 4]) - r[i]) / 3 for i in range(12)]
    # float32 vs float64: differences of O(1) numbers carry ~1e-7 absolute error.
    rloo = jitted(L.rloo_advantages, group_size=4)
    np.testing.assert_allclose(rloo(jnp.asarray(r)), expected, rtol=1e-5, atol=1e-6)

    logp, ref = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    x = ref - logp
    for kind, ref_val in (("k1", -x), ("k2", x**2 / 2), ("k3", np.exp(x) - 1 - x)):
        np.testing.assert_allclose(
            jitted(L.kl_penalty, kind=kind)(jnp.asarray(logp), jnp.asarray(ref)),
            ref_val,
            rtol=1e-5,
            atol=1e-6,
        )

    c, rj, cr, rr = (rng.normal(size=6) * 5 for _ in range(4))
    beta = 0.3
    h = (c - cr) - (rj - rr)
    sig = np.mean([math.log1p(math.exp(-beta * hh)) for hh in h])
    ipo = np.mean((h - 1 / (2 * beta)) ** 2)
    args = [jnp.asarray(a, jnp.float32) for a in (c, rj, cr, rr)]
    np.testing.assert_allclose(jitted(L.online_dpo_loss, beta=beta)(*args)[0], sig, rtol=1e-5)
    ipo_loss = jitted(L.online_dpo_loss, beta=beta, kind="ipo")
    np.testing.assert_allclose(ipo_loss(*args)[0], ipo, rtol=1e-5)


def test_token_logprobs_matches_numpy():
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(2, 3, 11)) * 4
    targets = rng.integers(0, 11, size=(2, 3))
    expected = np.empty((2, 3))
    for b in range(2):
        for t in range(3):
            row = logits[b, t]
            m = row.max()
            expected[b, t] = row[targets[b, t]] - (m + math.log(np.exp(row - m).sum()))
    got = jitted(L.token_logprobs)(jnp.asarray(logits, jnp.float32), jnp.asarray(targets))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
