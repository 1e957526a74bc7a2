"""The staleness-robust objectives M2PO, GSPO and IcePop, and the effective sample size:
golden values by hand or against NumPy references written here, gradients, invariances
(micro-batched == full batch, public loss == the step's term), the config's refusals and a
short CLI run of each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.processes import train_tiny
from helpers.train_step import (
    accumulated_in_micro_batches,
    assert_same_accumulation,
    staleness_batch,
)

from a3po_jax import model
from a3po_jax.core import losses, objectives, prox
from a3po_jax.core.objectives import gspo, icepop, m2po
from a3po_jax.core.stats import Stats, combine, finalize, masked_ess
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    ConfigError,
    SystemSection,
    TrainConfig,
)

ROOT = Path(__file__).resolve().parents[2]
CFG = model.ModelConfig.tiny()
UNPACKED = SystemSection(
    batch=BatchSection(packed_prompts=False)
)  # the padded rows build_batch lays out

# One sequence of four tokens, used by several golden values: π_θ, π_behav and the
# token ratios ρ = π_θ/π_behav = [1.1111, 1, 0.8571, 2].
P_THETA = np.array([[0.50, 0.40, 0.30, 0.20]])
P_BEHAV = np.array([[0.45, 0.40, 0.35, 0.10]])
LOGP = jnp.log(jnp.asarray(P_THETA, jnp.float32))
BEHAV = jnp.log(jnp.asarray(P_BEHAV, jnp.float32))
ONES = jnp.ones((1, 4))


def _ess(w, m):
    """NumPy reference of the normalised effective sample size over m > 0."""
    w = np.asarray(w, np.float64)[np.asarray(m) > 0]
    return w.sum() ** 2 / (w.size * np.square(w).sum())


def _random(shape, seed, scale=0.3):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 0.5, shape)
    behav = logp + rng.normal(0.0, scale, shape)
    prox_ = logp + rng.normal(0.0, scale / 2, shape)
    adv = np.repeat(rng.normal(0, 1, (shape[0], 1)), shape[1], axis=1)  # one per sequence
    mask = (np.arange(shape[1])[None, :] < rng.integers(2, shape[1] + 1, (shape[0], 1))) * 1.0
    return [jnp.asarray(x, jnp.float32) for x in (logp, prox_, behav, adv, mask)]


def _split_sums(sums, arrays, parts):
    """Sums over ``parts`` row blocks, added as the step adds micro-batches."""
    total = None
    for rows in np.array_split(np.arange(arrays[0].shape[0]), parts):
        loss_sum, count, stats = sums(*(x[rows] for x in arrays))
        total = (
            (loss_sum, count, stats)
            if total is None
            else (total[0] + loss_sum, total[1] + count, combine(total[2], stats))
        )
    return total


def _assert_same_sums(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6)
    fa, fb = finalize(a[2]), finalize(b[2])
    assert fa.keys() == fb.keys()
    for key in fa:
        np.testing.assert_allclose(fa[key], fb[key], rtol=1e-5, atol=1e-6, err_msg=key)


# --------------------------------------------------------------------------------------
# The effective sample size: sums that add, finalized once.
# --------------------------------------------------------------------------------------


def test_ess_golden_values_and_padding():
    @jax.jit  # one program per length: eagerly every primitive compiles its own
    def ess_of(w, m):
        return finalize(Stats(ess={"e": masked_ess(w, m)}))["e"]

    def ess(w, m):
        return float(ess_of(jnp.asarray(w), jnp.asarray(m)))

    assert ess([2.0, 2.0, 2.0], [1, 1, 1]) == pytest.approx(1.0)  # equal weights: all count
    # One weight carries everything: (4)² / (4 · 16) = 1/4 = 1/n.
    assert ess([4.0, 0.0, 0.0, 0.0], [1, 1, 1, 1]) == pytest.approx(0.25)
    # [1, 3]: 16 / (2 · 10) = 0.8; a padded 100 must not enter (it would give ~0.52).
    assert ess([1.0, 3.0, 100.0], [1, 1, 0]) == pytest.approx(0.8)
    assert ess([1.0, 1.0], [0, 0]) == 0.0  # no valid token: 0, like every empty metric


def test_ess_adds_across_micro_batches_exactly():
    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def ess_of_halves(w):
        halves = combine(
            Stats(ess={"e": masked_ess(w[:3], jnp.ones(3))}),
            Stats(ess={"e": masked_ess(w[3:], jnp.ones(3))}),
        )
        return finalize(halves)["e"]

    w = np.array([0.5, 1.0, 4.0, 1.5, 0.1, 2.0])
    # Σw = 9.1, Σw² = 23.51: 82.81 / (6 · 23.51) = 0.5871. The halves have ESS 0.5845 and
    # 0.6901; their mean, 0.6373, is what averaging per micro-batch would report.
    np.testing.assert_allclose(ess_of_halves(jnp.asarray(w)), _ess(w, np.ones(6)), rtol=1e-6)
    assert _ess(w, np.ones(6)) == pytest.approx(0.5871, abs=1e-4)


def test_ppo_reports_the_ess_of_the_weights_it_applies():
    logp, prox_, behav, adv, mask = _random((4, 6), seed=1)
    # One compiled program per setting: eagerly every primitive compiles its own.
    loss = jax.jit(
        losses.decoupled_ppo_loss, static_argnames=("clip_eps", "behav_weight_cap", "cap_mode")
    )
    _, metrics = loss(logp, prox_, behav, adv, mask, clip_eps=0.2)
    w = np.exp(np.asarray(prox_) - np.asarray(behav))
    np.testing.assert_allclose(metrics["mismatch/ess"], _ess(w, mask), rtol=1e-5)
    # With the token cap in mask mode a dropped token weighs 0 and lowers the ESS.
    _, capped = loss(
        logp, prox_, behav, adv, mask, clip_eps=0.2, behav_weight_cap=1.1, cap_mode="mask"
    )
    np.testing.assert_allclose(capped["mismatch/ess"], _ess(np.where(w > 1.1, 0, w), mask), 1e-5)


# --------------------------------------------------------------------------------------
# M2PO.
# --------------------------------------------------------------------------------------


def _m2po_keep_reference(sq, mask, tau):
    """AReaL's rule in NumPy: sort decreasing, mask the first k, k the first index whose
    suffix mean is < τ, else all but one."""
    valid = np.asarray(mask).reshape(-1) > 0
    v = np.asarray(sq, np.float64).reshape(-1)[valid]
    order = np.argsort(-v, kind="stable")
    s = v[order]
    suffix_mean = np.cumsum(s[::-1])[::-1] / np.arange(len(s), 0, -1)
    below = np.nonzero(suffix_mean < tau)[0]
    k = below[0] if len(below) else len(s) - 1
    keep_sorted = np.arange(len(s)) >= k
    keep = np.zeros(len(s), bool)
    keep[order] = keep_sorted
    out = np.zeros(valid.shape, bool)
    out[valid] = keep
    return out.reshape(np.shape(mask))


def test_m2po_mask_golden_values():
    m2po_keep = jax.jit(losses.m2po_keep, static_argnames="tau")  # one program, not one per op

    def keep(sq, m, tau=0.04):
        return np.asarray(m2po_keep(jnp.asarray([sq]), jnp.asarray([m]), tau=tau))[0]

    # Mean 0.07 ≥ τ; without the 0.25 the mean is 0.01 < τ: exactly that token goes.
    assert keep([0.01, 0.25, 0.01, 0.01], [1, 1, 1, 1]).tolist() == [True, False, True, True]
    # Already under τ: nothing dropped (a per-token cutoff at τ would drop the 0.05).
    assert keep([0.05, 0.0, 0.0, 0.0], [1, 1, 1, 1]).tolist() == [True] * 4
    # Every suffix mean ≥ τ: all but the smallest go (never an empty batch).
    assert keep([0.3, 0.2, 0.5, 0.1], [1, 1, 1, 1]).tolist() == [False, False, False, True]
    # A padded position never counts and is never kept, however large its value.
    assert keep([0.01, 9.0, 0.01, 0.01], [1, 0, 1, 1]).tolist() == [True, False, True, True]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_m2po_mask_matches_the_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    sq = rng.exponential(0.05, (5, 9)) * (rng.random((5, 9)) < 0.9)
    mask = (rng.random((5, 9)) < 0.8) * 1.0
    want = _m2po_keep_reference(sq, mask, 0.04)
    got = losses.m2po_keep(jnp.asarray(sq, jnp.float32), jnp.asarray(mask), tau=0.04)
    np.testing.assert_array_equal(np.asarray(got), want)
    jitted = jax.jit(losses.m2po_keep, static_argnames="tau")
    np.testing.assert_array_equal(
        np.asarray(jitted(jnp.asarray(sq, jnp.float32), mask, tau=0.04)), want
    )
    assert 0 < want.sum() < mask.sum()  # the rule is exercised


@pytest.mark.parametrize("jit", [False, True])
def test_m2po_loss_golden_value_and_gradient(jit):
    fn = jax.value_and_grad(
        lambda lp: losses.m2po_loss(lp, BEHAV, ONES, ONES, tau=0.04), has_aux=True
    )
    (loss, metrics), grad = (jax.jit(fn) if jit else fn)(LOGP)
    # (log ρ)² = [0.0111, 0, 0.0238, 0.4805]: mean 0.129 ≥ 0.04, the ρ = 2 token is dropped.
    # ℓ = -(1.1111 + 1 + 0.8571) / 4: the dropped token still counts (a mean over the kept
    # three, -0.9894, would weigh a batch by how much M2PO dropped).
    want = -(0.5 / 0.45 + 1.0 + 0.3 / 0.35) / 4
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(metrics["m2po/masked_frac"]) == 0.25
    np.testing.assert_allclose(
        metrics["m2po/m2_kept"], np.mean(np.log([10 / 9, 1, 6 / 7]) ** 2), 1e-5
    )
    # ∂ℓ/∂logp_t = -ρ_t A_t / N on kept tokens, exactly 0 on the dropped one.
    np.testing.assert_allclose(grad, [[-(0.5 / 0.45) / 4, -0.25, -(0.3 / 0.35) / 4, 0.0]], 1e-6)
    np.testing.assert_allclose(metrics["mismatch/ess"], _ess([10 / 9, 1, 6 / 7, 0], [1] * 4), 1e-5)


def test_m2po_sums_add_across_micro_batches_given_their_masks():
    logp, _, behav, adv, mask = _random((6, 7), seed=3, scale=0.05)

    @jax.jit  # one program per micro-batch shape: eagerly every primitive compiles its own
    def sums(lp, b, a, m):
        return m2po.m2po_sums(lp, b, a, m, aggregate=losses.aggregate_sum, tau=1.0)

    arrays = (logp, behav, adv, mask)
    # τ = 1 keeps every token here, so each micro-batch's mask is the full batch's.
    full = sums(*arrays)
    assert float(finalize(full[2])["m2po/masked_frac"]) == 0.0
    _assert_same_sums(_split_sums(sums, arrays, 3), full)


# --------------------------------------------------------------------------------------
# GSPO.
# --------------------------------------------------------------------------------------


def _gspo_reference(logp, prox_, behav, adv, mask, lo, hi):
    """GSPO in NumPy, sequence by sequence (advantage: the sequence's first token's)."""
    total, n_seq = 0.0, 0
    for b in range(logp.shape[0]):
        m = mask[b] > 0
        if not m.any():
            continue
        s = np.exp(np.mean(logp[b][m] - prox_[b][m]))
        w = np.exp(np.mean(prox_[b][m] - behav[b][m]))
        a = adv[b][m][0]
        total += w * max(-a * s, -a * np.clip(s, 1 - lo, 1 + hi))
        n_seq += 1
    return total / n_seq


def test_gspo_golden_value_and_sequence_clip():
    # Sequence 0: log s = mean(0.1, -0.1, 0.3) = 0.1, s = 1.105 > 1 + ε_high with A = 1:
    # clipped to 1.0004, no gradient. Sequence 1: logp = prox, s = 1, unclipped, A = -2.
    prox_ = jnp.zeros((2, 3)) - 1.0
    logp = prox_ + jnp.array([[0.1, -0.1, 0.3], [0.0, 0.0, 0.0]])
    adv = jnp.array([[1.0] * 3, [-2.0] * 3])
    mask = jnp.ones((2, 3))

    def f(lp):
        return losses.gspo_loss(lp, prox_, prox_, adv, mask)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(logp)
    # (-1.0004 + 2) / 2 sequences (a token mean would weigh equal lengths the same here,
    # but the clip is per sequence: a token-level PPO clip would keep the 0.1 and -0.1
    # tokens unclipped).
    np.testing.assert_allclose(loss, (-(1 + 4e-4) + 2.0) / 2, rtol=1e-6)
    assert float(metrics["gspo/seq_clipfrac"]) == 0.5
    assert float(metrics["mismatch/ess"]) == pytest.approx(1.0)  # prox = behav: w_b = 1
    np.testing.assert_array_equal(grad[0], 0.0)  # the whole clipped sequence
    # Sequence 1: ∂/∂logp_t of -A·s/n_seq with ∂s/∂logp_t = s/n_b: 2 · 1/3 / 2.
    np.testing.assert_allclose(grad[1], [1 / 3] * 3, rtol=1e-6)


def test_gspo_matches_the_numpy_reference_and_gspo_sequence_gradients():
    logp, prox_, behav, adv, mask = _random((5, 8), seed=5, scale=0.02)
    lo, hi = 1e-3, 1e-3  # narrow enough that 3 of the 5 sequences clip
    loss, metrics = jax.jit(losses.gspo_loss, static_argnames=("clip_low", "clip_high"))(
        logp, prox_, behav, adv, mask, clip_low=lo, clip_high=hi
    )
    args = [np.asarray(x, np.float64) for x in (logp, prox_, behav, adv, mask)]
    np.testing.assert_allclose(loss, _gspo_reference(*args, lo, hi), rtol=1e-5)
    assert 0 < float(metrics["gspo/seq_clipfrac"]) < 1

    # GSPO-token's gradient equals GSPO's (s_b differentiated through its mean) when the
    # advantage is one per sequence.
    def gspo_sequence(lp):
        m = mask
        n = jnp.sum(m, -1)
        s = jnp.exp(jnp.sum((lp - prox_) * m, -1) / n)
        w = jnp.exp(jnp.sum((prox_ - behav) * m, -1) / n)
        a = adv[:, 0]
        per_seq = w * jnp.maximum(-a * s, -a * jnp.clip(s, 1 - lo, 1 + hi))
        return jnp.mean(per_seq)

    def gspo_token(lp):
        return losses.gspo_loss(lp, prox_, behav, adv, mask, clip_low=lo, clip_high=hi)[0]

    np.testing.assert_allclose(
        jax.jit(jax.grad(gspo_token))(logp), jax.jit(jax.grad(gspo_sequence))(logp), 1e-5
    )


def test_gspo_sums_add_across_micro_batches():
    arrays = tuple(_random((6, 7), seed=5))

    @jax.jit  # one program per micro-batch shape: eagerly every primitive compiles its own
    def sums(lp, px, b, a, m):
        return gspo.gspo_sums(lp, px, b, a, m, clip_low=3e-4, clip_high=4e-4)

    _assert_same_sums(_split_sums(sums, arrays, 3), sums(*arrays))


# --------------------------------------------------------------------------------------
# IcePop.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_icepop_golden_value_and_zero_gradient_outside_the_band(jit):
    # prox = logp (so r = 1): w = [1.1111, 1, 0.8571, 2]; band [0.9, 1.5] drops the 0.8571
    # (below α) and the 2 (above β). ℓ = -(1.1111 + 1) / 4: the two dropped tokens count in
    # N (TIS would instead keep them with w capped: -(1.1111 + 1 + 0.8571 + 1.5) / 4).
    def f(lp):
        return losses.icepop_loss(
            lp, jax.lax.stop_gradient(lp), BEHAV, ONES, ONES, low=0.9, high=1.5
        )

    fn = jax.value_and_grad(f, has_aux=True)
    (loss, metrics), grad = (jax.jit(fn) if jit else fn)(LOGP)
    np.testing.assert_allclose(loss, -(0.5 / 0.45 + 1.0) / 4, rtol=1e-6)
    assert float(metrics["icepop/masked_frac"]) == 0.5
    assert float(metrics["icepop/below_frac"]) == 0.25
    assert float(metrics["icepop/above_frac"]) == 0.25
    assert float(metrics["mismatch/masked_frac"]) == 0.5
    np.testing.assert_allclose(grad, [[-(0.5 / 0.45) / 4, -0.25, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["mismatch/ess"], _ess([10 / 9, 1, 0, 0], [1] * 4), 1e-5)


def test_icepop_with_a_band_that_drops_nothing_is_decoupled_ppo():
    logp, prox_, behav, adv, mask = _random((4, 6), seed=6)

    def ice(lp):
        return losses.icepop_loss(lp, prox_, behav, adv, mask, low=1e-6, high=1e6)

    def ppo(lp):
        return losses.decoupled_ppo_loss(lp, prox_, behav, adv, mask, clip_eps=0.2)

    (l1, m1), g1 = jax.jit(jax.value_and_grad(ice, has_aux=True))(logp)
    (l2, m2), g2 = jax.jit(jax.value_and_grad(ppo, has_aux=True))(logp)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-6)
    assert float(m1["icepop/masked_frac"]) == 0.0
    for key in m2:
        np.testing.assert_allclose(m1[key], m2[key], rtol=1e-6, err_msg=key)


def test_icepop_sums_add_across_micro_batches():
    arrays = tuple(_random((6, 7), seed=7, scale=0.6))

    @jax.jit  # one program per micro-batch shape: eagerly every primitive compiles its own
    def sums(lp, px, b, a, m):
        return icepop.icepop_sums(
            lp, px, b, a, m, aggregate=losses.aggregate_sum, low=0.5, high=1.5, clip_eps=0.2
        )

    full = sums(*arrays)
    assert 0 < float(finalize(full[2])["icepop/masked_frac"]) < 1  # the band is exercised
    _assert_same_sums(_split_sums(sums, arrays, 2), full)


# --------------------------------------------------------------------------------------
# One road: the step's term (bound from the config) finalized is the public loss.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_name", ["m2po", "gspo", "icepop"])
def test_each_objective_is_its_public_loss_through_the_step(loss_name):
    cfg = TrainConfig(
        algo=AlgoSection(loss=loss_name, prox="a3po", settings={"icepop": {"low": 0.8}}),
        system=UNPACKED,
    )
    algo = step_builder.algorithm(cfg, CFG)
    assert not algo.needs_old_pass and not algo.needs_reference
    batch = staleness_batch()

    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def term_and_public_loss(params, batch):
        logp, _ = algo.forward(params, batch)
        mask, behav, adv = batch["loss_mask"], batch["behav_logp"], batch["advantages"]
        staleness = jnp.where(mask > 0, 2 - batch["versions"], 0).astype(jnp.int32)
        term = algo.loss_term(logp, batch, staleness=staleness, old_logp=None, ref_logp=None)
        px = prox.a3po_prox_logp(logp, behav, staleness)
        public = {
            "m2po": lambda: losses.m2po_loss(logp, behav, adv, mask, staleness=staleness),
            "gspo": lambda: losses.gspo_loss(logp, px, behav, adv, mask, staleness=staleness),
            "icepop": lambda: losses.icepop_loss(
                logp, px, behav, adv, mask, low=0.8, staleness=staleness
            ),
        }
        return term, public[loss_name]()

    (loss_sum, count, stats), (loss, metrics) = term_and_public_loss(
        model.init_params(CFG, jax.random.key(0)), batch
    )
    np.testing.assert_allclose(loss, loss_sum / count, rtol=1e-6)
    want = finalize(stats)
    assert set(metrics) == set(want) | {"loss/num_tokens"}
    assert "mismatch/ess" in want
    for key, value in want.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("loss_name", ["gspo", "icepop"])
@pytest.mark.parametrize("unit", ["step", "update"])
def test_a3po_reads_the_staleness_unit_as_for_ppo(loss_name, unit):
    # With several minibatches the step puts d in training steps beside d in updates;
    # A-3PO's α reads the one algo.a3po_staleness_unit names, in these terms as in ppo's.
    cfg = TrainConfig(
        algo=AlgoSection(loss=loss_name, prox="a3po", a3po_staleness_unit=unit),
        system=UNPACKED,
    )
    algo = step_builder.algorithm(cfg, CFG)
    batch = staleness_batch()

    @jax.jit  # one compiled program: eagerly every primitive compiles its own
    def term_and_public_loss(params, batch):
        logp, _ = algo.forward(params, batch)
        mask, behav, adv = batch["loss_mask"], batch["behav_logp"], batch["advantages"]
        updates = jnp.where(mask > 0, 3, 0).astype(jnp.int32)
        steps = jnp.where(mask > 0, 1, 0).astype(jnp.int32)
        loss_sum, count, _ = algo.loss_term(
            logp,
            {**batch, "step_staleness": steps},
            staleness=updates,
            old_logp=None,
            ref_logp=None,
        )
        px = prox.a3po_prox_logp(logp, behav, steps if unit == "step" else updates)
        public = {
            "gspo": lambda: losses.gspo_loss(logp, px, behav, adv, mask),
            "icepop": lambda: losses.icepop_loss(logp, px, behav, adv, mask),
        }
        return loss_sum, count, public[loss_name]()[0]

    loss_sum, count, loss = term_and_public_loss(model.init_params(CFG, jax.random.key(0)), batch)
    np.testing.assert_allclose(loss_sum / count, loss, rtol=1e-6)


def test_prox_rules_bind_as_for_ppo():
    def build(loss, prox_rule, **batch):
        cfg = TrainConfig(
            algo=AlgoSection(loss=loss, prox=prox_rule), system=SystemSection(batch=batch)
        )
        return step_builder.algorithm(cfg, CFG)

    assert build("icepop", "recompute").needs_old_pass
    assert build("gspo", "recompute").needs_old_pass
    assert not build("gspo", "recompute", one_pass_old=True).needs_old_pass
    assert not build("m2po", "recompute").needs_old_pass  # M2PO reads no prox: no pass


# --------------------------------------------------------------------------------------
# The config.
# --------------------------------------------------------------------------------------


def test_defaults_are_the_papers():
    a = AlgoSection()
    assert a.m2po.tau == 0.04  # arXiv 2510.01161
    assert (a.gspo.clip_low, a.gspo.clip_high) == (3e-4, 4e-4)  # arXiv 2507.18071 §5.1
    assert (a.icepop.low, a.icepop.high) == (0.5, 5.0)  # arXiv 2510.18855
    assert {"m2po", "gspo", "icepop"} <= set(objectives.names())


@pytest.mark.parametrize(
    "field, value",
    [
        ("m2po.tau", float("nan")),
        ("m2po.tau", 0.0),
        ("m2po.tau", float("inf")),
        ("gspo.clip_low", float("nan")),
        ("gspo.clip_low", 1.0),
        ("gspo.clip_high", -1e-4),
        ("gspo.clip_high", float("inf")),
        ("icepop.low", float("nan")),
        ("icepop.low", 1.5),
        ("icepop.high", float("inf")),
        ("icepop.high", 0.9),
    ],
)
def test_bad_hyperparameters_are_refused_naming_the_field(field, value):
    name, key = field.split(".")
    with pytest.raises(ConfigError, match=f"algo.{name}.{key}"):
        AlgoSection(settings={name: {key: value}})


def test_icepop_refuses_prox_behav():
    # prox = behav makes w = 1 on every token: the band could never drop anything.
    with pytest.raises(ConfigError, match="algo.loss='icepop' needs algo.prox in recompute, a3po"):
        AlgoSection(loss="icepop", prox="behav")
    AlgoSection(loss="gspo", prox="behav")  # GSPO against the sampler is the paper's
    AlgoSection(loss="m2po", prox="recompute")  # M2PO reads no prox: any value


# --------------------------------------------------------------------------------------
# Each trains through the CLI.
# --------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    "loss_name, metric",
    [("m2po", "m2po/masked_frac"), ("gspo", "gspo/seq_clipfrac"), ("icepop", "icepop/masked_frac")],
)
def test_each_objective_trains_through_the_cli(tmp_path, loss_name, metric):
    run_dir = tmp_path / "run"
    records = train_tiny(
        run_dir, f"algo.loss={loss_name}", "system.mode=sync", "steps=2", "checkpoint_every=0"
    )
    assert len(records) == 2
    for record in records:
        assert math.isfinite(record["loss/total"]) and record["step/skipped"] == 0
        assert metric in record and 0 <= record["mismatch/ess"] <= 1 + 1e-6
    assert records[0]["optim/grad_norm"] > 0
    assert json.loads((run_dir / "config.json").read_text())["algo"]["loss"] == loss_name


# --------------------------------------------------------------------------------------
# Through the step: micro-batched gradients and metrics equal the full batch's.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_name, extra, metric, exercised",
    [
        ("gspo", dict(prox="a3po"), "gspo/seq_clipfrac", lambda x: 0 < x < 1),
        (
            "icepop",
            dict(prox="recompute", settings={"icepop": {"low": 0.8, "high": 1.25}}),
            "icepop/masked_frac",
            lambda x: 0 < x < 1,
        ),
        # τ high enough that no micro-batch drops a token: each mask is the full batch's.
        ("m2po", dict(settings={"m2po": {"tau": 1e3}}), "m2po/masked_frac", lambda x: x == 0),
    ],
)
def test_micro_batched_step_equals_full_batch(loss_name, extra, metric, exercised):
    cfg = TrainConfig(algo=AlgoSection(loss=loss_name, **extra), system=UNPACKED)
    algo = step_builder.algorithm(cfg, CFG)
    params = model.init_params(CFG, jax.random.key(1))
    batch = staleness_batch(seed=2)

    m1 = assert_same_accumulation(*accumulated_in_micro_batches(algo, params, None, batch, (1, 4)))
    assert exercised(float(m1[metric])) and 0 < float(m1["mismatch/ess"]) <= 1
