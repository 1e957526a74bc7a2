"""M2PO's three readings (``algo.m2po.reading``, ``a3po_jax/core/objectives/m2po.py``):
golden values by hand, NumPy references of the papers' and the authors' loops written
here, gradients that are exactly 0 where a token is dropped or clipped, the micro-batch
rule, the config's refusal. The default reading's own tests are in
``test_objectives_offpolicy.py``, unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.train_step import (
    accumulated_in_micro_batches,
    assert_same_accumulation,
    staleness_batch,
)

from a3po_jax import model
from a3po_jax.core import losses, objectives
from a3po_jax.core.objectives import m2po
from a3po_jax.core.stats import combine, finalize
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    ConfigError,
    SystemSection,
    TrainConfig,
)

CFG = model.ModelConfig.tiny()
E = np.exp

# Two sequences of three tokens, log ρ chosen by hand; A = +1 for the first, -1 for the
# second. The clip side S (A > 0 with ρ > 1, A < 0 with ρ < 1) is [T, T, F], [T, T, F]:
# ρ = e^{-0.2} under A > 0 and ρ = e^{0.4} under A < 0 are on the side PPO never clips.
LOG_RATIO = np.array([[0.1, 0.3, -0.2], [-0.1, -0.5, 0.4]])
ADV = jnp.asarray([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
BEHAV = jnp.full((2, 3), -1.0, jnp.float32)
LOGP = BEHAV + jnp.asarray(LOG_RATIO, jnp.float32)
ONES = jnp.ones((2, 3))


def _loss(reading, logp=LOGP, behav=BEHAV, adv=ADV, mask=ONES, tau=0.04):
    return m2po.m2po_loss(logp, behav, adv, mask, tau=tau, reading=reading)


# Jitted: one compiled program per shape, where eagerly every primitive compiles its own.
_clip_side = jax.jit(m2po.m2po_clip_side)
_clip_side_keep = jax.jit(m2po.m2po_clip_side_keep, static_argnames="tau")
_bound = jax.jit(m2po.m2po_bound, static_argnames="tau")
_m2po_keep = jax.jit(losses.m2po_keep, static_argnames="tau")


# --------------------------------------------------------------------------------------
# The clip side and the clip-side mask.
# --------------------------------------------------------------------------------------


def test_clip_side_is_where_ppos_clip_can_bind():
    lr = jnp.asarray([[0.1, -0.1, 0.2, -0.2, 0.0, 0.3]])
    adv = jnp.asarray([[1.0, 1.0, -1.0, -1.0, 1.0, 0.0]])
    side = _clip_side(lr, adv, jnp.ones((1, 6)))
    # A > 0: only ρ > 1; A < 0: only ρ < 1; ρ = 1 and A = 0 never.
    assert side.tolist() == [[True, False, False, True, False, False]]
    # A padded position is never on it.
    assert not _clip_side(lr, adv, jnp.zeros((1, 6))).any()


def test_clip_side_mask_golden_values():
    def keep(sq, side, m=(1, 1, 1, 1), tau=0.04):
        args = (jnp.asarray([sq]), jnp.asarray([m]), jnp.asarray([side]))
        return np.asarray(_clip_side_keep(*args, tau=tau))[0].tolist()

    def keep_all_tokens(sq, tau=0.04):
        return np.asarray(_m2po_keep(jnp.asarray([sq]), jnp.ones((1, len(sq))), tau=tau))[0]

    every = [True] * 4
    # Mean 0.07 > τ; without the 0.25 the mean is 0.01 ≤ τ: exactly that token goes.
    assert keep([0.01, 0.25, 0.01, 0.01], every) == [True, False, True, True]
    # A mean equal to τ stays (while mean > τ), where all_tokens_mask's "< τ" drops one.
    assert keep([0.04, 0.04], [True, True], m=(1, 1)) == [True, True]
    assert keep_all_tokens([0.04, 0.04]).tolist() == [False, True]
    # Every value > τ: all of S goes (all_tokens_mask keeps the smallest).
    assert keep([0.3, 0.2, 0.5, 0.1], every) == [False] * 4
    assert keep_all_tokens([0.3, 0.2, 0.5, 0.1]).tolist() == [False, False, False, True]
    # A token off the clip side is never dropped, however large its value...
    assert keep([0.01, 9.0, 0.01, 0.01], [True, False, True, True]) == every
    # ... nor counted in S's mean: S's mean is 0.01 here, nothing goes.
    assert keep([0.01, 0.3, 0.01, 0.3], [True, False, True, False]) == every
    # Empty S: nothing dropped. A padded position is never kept.
    assert keep([0.5, 0.5, 0.5, 0.5], [False] * 4) == every
    assert keep([0.01, 9.0, 0.01, 0.01], every, m=(1, 0, 1, 1)) == [True, False, True, True]


def _algorithm1_reference(sq, mask, side, tau):
    """Algorithm 1 of the paper with T = S, literally: while mean_T v > τ, drop argmax_T v
    (the first of equal values)."""
    sq = np.asarray(sq, np.float64).reshape(-1)
    valid = np.asarray(mask).reshape(-1) > 0
    t = [i for i in range(sq.size) if side.reshape(-1)[i] and valid[i]]
    keep = valid.copy()
    while t and np.mean(sq[t]) > tau:
        j = t[int(np.argmax(sq[t]))]
        keep[j] = False
        t.remove(j)
    return keep.reshape(np.shape(mask))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_side_mask_matches_the_literal_algorithm(seed):
    rng = np.random.default_rng(seed)
    lr = rng.normal(0.0, 0.3, (5, 9))
    adv = np.repeat(rng.normal(0, 1, (5, 1)), 9, axis=1)
    mask = (rng.random((5, 9)) < 0.8) * 1.0
    side = np.asarray(_clip_side(jnp.asarray(lr), jnp.asarray(adv), jnp.asarray(mask)))
    sq = jnp.asarray(lr**2, jnp.float32)
    want = _algorithm1_reference(np.asarray(sq), mask, side, 0.04)
    got = _clip_side_keep(sq, jnp.asarray(mask), jnp.asarray(side), tau=0.04)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert 0 < (side & ~want).sum() < side.sum()  # the rule is exercised


# --------------------------------------------------------------------------------------
# The authors' bound.
# --------------------------------------------------------------------------------------


def test_bound_golden_values():
    def bound(sq, side=None, tau=0.04):
        side = [True] * len(sq) if side is None else side
        return float(_bound(jnp.asarray([sq]), jnp.asarray([side]), tau=tau))

    # u = [0.01, 0.01, 0.09, 0.25], n = 4, mean 0.09 > τ, τ·n = 0.16. Capped sums
    # C(j) = Σ_{i<j} u_i + (n - j)·u_j: 0.04, 0.04, 0.20: the first ≥ 0.16 is j = 2, so
    # b = u_1 = 0.01 (|log ρ| ≤ 0.1). The exact solve between breakpoints would give
    # (0.16 - 0.02) / 2 = 0.07; the authors' loop stops at the breakpoint below.
    assert bound([0.09, 0.01, 0.25, 0.01]) == pytest.approx(0.01)
    # u = [0, 0.02, 0.03, 0.1, 0.4], τ·n = 0.2: C = 0, 0.08, 0.11, 0.25: j = 3, b = u_2.
    assert bound([0.4, 0.0, 0.1, 0.03, 0.02]) == pytest.approx(0.03)
    # C(0) = 2 · 0.09 = 0.18 ≥ τ·n = 0.08: k = 0, b = 0 (every token of S clipped).
    assert bound([0.09, 0.25]) == 0.0
    # Mean 0.03 ≤ τ, an empty S, and a value off S: no clip.
    assert bound([0.01, 0.05]) == np.inf
    assert bound([0.5, 0.5], side=[False, False]) == np.inf
    assert bound([0.01, 9.0], side=[True, False]) == np.inf


def _authors_bound_reference(sq, side, tau):
    """The authors' ``kpo_clip_harmful_tokens`` / ``_solve_tau_from_sorted_delta2`` in
    NumPy, as a loop: b on (log ρ)², +inf for no clip."""
    u = np.sort(np.asarray(sq, np.float64).reshape(-1)[side.reshape(-1)])
    n = u.size
    if n == 0 or u.mean() <= tau:
        return np.inf
    for k in range(n):
        if u[: k + 1].sum() + u[k] * (n - k - 1) >= tau * n:
            return u[k - 1] if k > 0 else 0.0
    raise AssertionError("the total exceeds the budget: some k must hit")


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_bound_matches_the_authors_loop(seed):
    rng = np.random.default_rng(seed)
    lr = rng.normal(0.0, 0.1 + 0.1 * seed, (4, 8))
    adv = np.repeat(rng.normal(0, 1, (4, 1)), 8, axis=1)
    side = np.asarray(_clip_side(jnp.asarray(lr), jnp.asarray(adv), jnp.ones((4, 8))))
    sq = np.asarray(jnp.square(jnp.asarray(lr, jnp.float32)))
    want = _authors_bound_reference(sq, side, 0.04)
    assert np.isfinite(want) == (seed >= 2)  # seeds 0-1: S's mean ≤ τ, 2-3: a bound
    got = _bound(sq, jnp.asarray(side), tau=0.04)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


# --------------------------------------------------------------------------------------
# The losses: golden values and gradients by hand.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_clip_side_mask_loss_golden_value_and_gradient(jit):
    fn = jax.value_and_grad(lambda lp: _loss("clip_side_mask", lp), has_aux=True)
    (loss, metrics), grad = (jax.jit(fn) if jit else fn)(LOGP)
    # S's (log ρ)² = [0.01, 0.09, 0.01, 0.25], mean 0.09 > τ; without the 0.25 (log ρ =
    # -0.5) the mean is 0.0367 ≤ τ. The 0.4 token (v = 0.16, off S) stays; all_tokens_mask
    # would drop it too. ℓ_t = -A_t ρ_t over 6 tokens, the dropped one counting as 0.
    want = (-E(0.1) - E(0.3) - E(-0.2) + E(-0.1) + E(0.4)) / 6
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    want_grad = np.array([[-E(0.1), -E(0.3), -E(-0.2)], [E(-0.1), 0.0, E(0.4)]]) / 6
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)
    assert float(grad[1, 1]) == 0.0  # exactly
    np.testing.assert_allclose(metrics["m2po/masked_frac"], 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(metrics["m2po/clip_side_frac"], 4 / 6, rtol=1e-6)
    np.testing.assert_allclose(metrics["m2po/m2_clip_side"], 0.36 / 4, rtol=1e-5)
    np.testing.assert_allclose(metrics["m2po/m2"], 0.56 / 6, rtol=1e-5)
    np.testing.assert_allclose(metrics["m2po/m2_kept"], 0.31 / 5, rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_derived_clip_loss_golden_value_and_gradient(jit):
    fn = jax.value_and_grad(lambda lp: _loss("derived_clip", lp), has_aux=True)
    (loss, metrics), grad = (jax.jit(fn) if jit else fn)(LOGP)
    # S's values are those of test_bound_golden_values: b = 0.01, the clip is
    # [e^{-0.1}, e^{0.1}]. It binds on log ρ = 0.3 (A > 0) and -0.5 (A < 0): their ρ is
    # held at e^{0.1} and e^{-0.1}, no gradient. The 0.1 and -0.1 tokens sit at the bound
    # and keep theirs; -0.2 under A > 0 and 0.4 under A < 0 are past it on the other
    # side, where PPO's clip never binds.
    want = (-2 * E(0.1) - E(-0.2) + 2 * E(-0.1) + E(0.4)) / 6
    np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-7)  # a float32 difference
    want_grad = np.array([[-E(0.1), 0.0, -E(-0.2)], [E(-0.1), 0.0, E(0.4)]]) / 6
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)
    assert float(grad[0, 1]) == 0.0 and float(grad[1, 1]) == 0.0  # exactly
    np.testing.assert_allclose(metrics["m2po/masked_frac"], 2 / 6, rtol=1e-6)
    np.testing.assert_allclose(metrics["m2po/m2_clip_side"], 0.36 / 4, rtol=1e-5)


def test_all_tokens_mask_on_the_same_tokens_drops_off_the_clip_side_too():
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: _loss("all_tokens_mask", lp), has_aux=True
    )(LOGP)
    # All six (log ρ)²: mean 0.0933; dropping 0.25 leaves 0.062, dropping 0.16 too 0.0375
    # < τ: the -0.5 and the 0.4 tokens go.
    np.testing.assert_allclose(loss, (-E(0.1) - E(0.3) - E(-0.2) + E(-0.1)) / 6, rtol=1e-6)
    assert float(grad[1, 1]) == 0.0 and float(grad[1, 2]) == 0.0
    np.testing.assert_allclose(metrics["m2po/masked_frac"], 2 / 6, rtol=1e-6)
    assert "m2po/clip_side_frac" not in metrics  # the default's metrics are unchanged


def test_derived_clip_is_ppos_clip_at_the_derived_bound():
    rng = np.random.default_rng(5)
    behav = jnp.asarray(rng.normal(-1.5, 0.5, (4, 8)), jnp.float32)
    logp = behav + jnp.asarray(rng.normal(0.0, 0.3, (4, 8)), jnp.float32)
    adv = jnp.asarray(np.repeat(rng.normal(0, 1, (4, 1)), 8, axis=1), jnp.float32)
    mask = jnp.asarray((np.arange(8)[None, :] < np.array([[8], [5], [7], [3]])) * 1.0)
    side = _clip_side(logp - behav, adv, mask)
    b = float(_bound(jnp.square(logp - behav), side, tau=0.04))
    assert 0 < b < np.inf  # the clip is on and not total
    # The one token at the bound (v = b) keeps its gradient here; PPO's float32 compare of
    # ρ with 1 + ε there can go either way, so its band is widened by 1e-6.
    eps_low, eps_high = 1 - E(-np.sqrt(b)) * (1 - 1e-6), E(np.sqrt(b)) * (1 + 1e-6) - 1

    def ppo(lp):
        return losses.ppo_clip_loss(lp, behav, adv, mask, clip_eps=eps_low, clip_eps_high=eps_high)

    (got, metrics), got_grad = jax.jit(
        jax.value_and_grad(
            lambda lp: m2po.m2po_loss(lp, behav, adv, mask, reading="derived_clip"), has_aux=True
        )
    )(logp)
    (want, _), want_grad = jax.jit(jax.value_and_grad(ppo, has_aux=True))(logp)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert 0 < float(metrics["m2po/masked_frac"]) < 1


def test_an_unknown_reading_is_refused_naming_it():
    with pytest.raises(ValueError, match="reading='v2' is not one of all_tokens_mask, clip"):
        _loss("v2")


# --------------------------------------------------------------------------------------
# Micro-batches: the sums add when each micro-batch's selection is the full batch's.
# --------------------------------------------------------------------------------------


def _random(shape, seed, scale):
    rng = np.random.default_rng(seed)
    behav = rng.normal(-1.5, 0.5, shape)
    logp = behav + rng.normal(0.0, scale, shape)
    adv = np.repeat(rng.normal(0, 1, (shape[0], 1)), shape[1], axis=1)
    mask = (np.arange(shape[1])[None, :] < rng.integers(2, shape[1] + 1, (shape[0], 1))) * 1.0
    return [jnp.asarray(x, jnp.float32) for x in (logp, behav, adv, mask)]


def _sums(reading, tau):
    def sums(lp, b, a, m):
        return m2po.m2po_sums(lp, b, a, m, aggregate=losses.aggregate_sum, tau=tau, reading=reading)

    return jax.jit(sums)  # one program per micro-batch shape


def _in_parts(sums, arrays, parts):
    total = None
    for rows in np.array_split(np.arange(arrays[0].shape[0]), parts):
        part = sums(*(x[rows] for x in arrays))
        total = (
            part
            if total is None
            else (total[0] + part[0], total[1] + part[1], combine(total[2], part[2]))
        )
    return total


@pytest.mark.parametrize("reading", m2po.M2PO_READINGS)
def test_sums_add_across_micro_batches_when_nothing_is_selected(reading):
    arrays = _random((6, 7), seed=3, scale=0.05)
    sums = _sums(reading, tau=1.0)  # no micro-batch's M̂₂ reaches 1: nothing dropped or clipped
    full, parts = sums(*arrays), _in_parts(sums, arrays, 3)
    assert float(finalize(full[2])["m2po/masked_frac"]) == 0.0
    np.testing.assert_allclose(parts[0], full[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(parts[1], full[1])
    fa, fb = finalize(parts[2]), finalize(full[2])
    assert fa.keys() == fb.keys()
    for key in fa:
        np.testing.assert_allclose(fa[key], fb[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_the_derived_bound_is_each_micro_batchs_own():
    # As in the authors' code (one call per micro-batch): halves of a batch get their own
    # b, so the micro-batched loss is not the full batch's once a clip binds.
    arrays = _random((6, 7), seed=4, scale=0.4)
    sums = _sums("derived_clip", tau=0.04)
    full, parts = sums(*arrays), _in_parts(sums, arrays, 2)
    bounds = []
    for rows in ([0, 1, 2], [3, 4, 5]):
        lp, b, a, m = (x[np.array(rows)] for x in arrays)
        side = _clip_side(lp - b, a, m)
        bounds.append(float(_bound(jnp.square(lp - b), side, tau=0.04)))
    assert bounds[0] != bounds[1]
    assert float(abs(full[0] - parts[0])) > 1e-4


@pytest.mark.parametrize("reading", ["clip_side_mask", "derived_clip"])
def test_micro_batched_step_equals_full_batch(reading):
    # τ high enough that no micro-batch drops or clips a token: each selection is the
    # full batch's, so gradients and metrics add exactly.
    algo_cfg = AlgoSection(loss="m2po", settings={"m2po": {"tau": 1e3, "reading": reading}})
    cfg = TrainConfig(algo=algo_cfg, system=SystemSection(batch=BatchSection(packed_prompts=False)))
    algo = step_builder.algorithm(cfg, CFG)
    params = model.init_params(CFG, jax.random.key(1))
    batch = staleness_batch(seed=2)
    m1 = assert_same_accumulation(*accumulated_in_micro_batches(algo, params, None, batch, (1, 4)))
    assert float(m1["m2po/masked_frac"]) == 0 and 0 < float(m1["m2po/clip_side_frac"]) < 1


# --------------------------------------------------------------------------------------
# The config and the registration.
# --------------------------------------------------------------------------------------


def test_the_default_reading_is_the_one_the_module_had():
    assert AlgoSection().m2po.reading == "all_tokens_mask"
    assert m2po.M2PO_READINGS == ("all_tokens_mask", "clip_side_mask", "derived_clip")
    for reading in m2po.M2PO_READINGS:
        AlgoSection(loss="m2po", settings={"m2po": {"reading": reading}})


def test_a_bad_reading_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="algo.m2po.reading='v1' is not one of all_tokens_mask"):
        AlgoSection(loss="m2po", settings={"m2po": {"reading": "v1"}})
    with pytest.raises(ValueError, match="reading='v1' is not one of all_tokens_mask"):
        m2po.M2POSettings(reading="v1")


@pytest.mark.parametrize("reading", m2po.M2PO_READINGS)
def test_the_registered_term_reads_the_reading(reading):
    fn = m2po.m2po(objectives.ObjectiveSpec(settings=m2po.M2POSettings(reading=reading))).fn
    mb = {"behav_logp": BEHAV, "advantages": ADV, "loss_mask": ONES}
    got = fn(LOGP, mb, staleness=jnp.zeros((2, 3)), old_logp=None, ref_logp=None)
    want = m2po.m2po_sums(
        LOGP, BEHAV, ADV, ONES, aggregate=losses.aggregate_sum, tau=0.04, reading=reading
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1])
