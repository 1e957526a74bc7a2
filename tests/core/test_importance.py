"""Sequence-level truncated / masked importance weights and the ``mismatch/*`` metrics."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.factories import synthetic_groups

from a3po_jax import model
from a3po_jax.core import importance, losses, optim
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.training import config as config_lib
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    RolloutSection,
    SystemSection,
    TrainConfig,
)

CFG = model.ModelConfig.tiny()
LN = math.log

# Three sequences, T = 3, cap C = 3 (log w = prox - behav per token):
#   A: w = 2, 2, 1     (3 valid)  W = 4      geometric mean 4^(1/3) ≈ 1.587
#   B: w = 1/2, 1/2    (2 valid)  W = 1/4    geometric mean 1/2
#   C: w = 1.5, 1.5    (2 valid)  W = 2.25   geometric mean 1.5
# No single token is above 3 or below 1/3, so a token-level cap at C = 3 (TIS or MIS) would
# change nothing at all; the sequence level sees A's product 4 > 3 and B's 1/4 < 1/3.
HAND_LOG_W = np.array(
    [[LN(2), LN(2), 0.0], [LN(0.5), LN(0.5), 0.0], [LN(1.5), LN(1.5), 0.0]], np.float32
)
HAND_MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 0]], np.float32)
HAND = {
    # (mode, form): (weight per sequence, kept, truncated)
    ("truncate", "product"): ([3.0, 0.25, 2.25], [1, 1, 1], [1, 0, 0]),
    ("mask", "product"): ([3.0, 0.25, 2.25], [0, 1, 1], [0, 0, 0]),
    ("mask_both", "product"): ([3.0, 1 / 3, 2.25], [0, 0, 1], [0, 0, 0]),
    ("truncate", "geometric_mean"): ([4 ** (1 / 3), 0.5, 1.5], [1, 1, 1], [0, 0, 0]),
    ("mask", "geometric_mean"): ([4 ** (1 / 3), 0.5, 1.5], [1, 1, 1], [0, 0, 0]),
}


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("mode, form", list(HAND))
def test_sequence_weights_hand_checked(mode, form, use_jit):
    fn = importance.make_sequence_correction(3.0, mode=mode, form=form)
    fn = jax.jit(fn) if use_jit else fn
    corr = fn(jnp.asarray(HAND_LOG_W), jnp.asarray(HAND_MASK))
    weight, kept, truncated = HAND[(mode, form)]
    kept = np.asarray(kept, bool)
    # A dropped sequence's weight is never used; compare the kept ones (and truncation).
    np.testing.assert_allclose(corr.token_weight[:, 0][kept], np.asarray(weight)[kept], rtol=1e-6)
    np.testing.assert_array_equal(corr.seq_keep, kept)
    np.testing.assert_array_equal(corr.seq_truncated, np.asarray(truncated, bool))
    np.testing.assert_allclose(np.exp(corr.log_seq_weight), [4.0, 0.25, 2.25] if form == "product"
                               else [4 ** (1 / 3), 0.5, 1.5], rtol=1e-6)  # fmt: skip


def test_sequence_weights_in_the_loss_hand_checked():
    # logp = prox, so r = 1 and the unweighted per-token loss is -A; with seq-TIS at C = 3
    # every token of A is weighted 3, of B 1/4, of C 2.25. The token-level weights would
    # have been 2, 2, 1 | 1/2, 1/2 | 1.5, 1.5 (and a token cap at 3 would keep them).
    prox = jnp.zeros((3, 3))
    behav = -jnp.asarray(HAND_LOG_W)
    adv = jnp.ones((3, 3))
    correction = importance.make_sequence_correction(3.0, mode="truncate")
    # Jitted: one compiled program each, where eagerly every primitive compiles its own.
    per_token_loss = jax.jit(
        losses.decoupled_ppo_per_token,
        static_argnames=("clip_eps", "behav_weight_cap", "seq_correction"),
    )
    per_token, diag = per_token_loss(
        prox, prox, behav, adv, jnp.asarray(HAND_MASK), clip_eps=0.2, seq_correction=correction
    )
    expected = -np.array([[3, 3, 3], [0.25, 0.25, 0], [2.25, 2.25, 0]]) * HAND_MASK
    np.testing.assert_allclose(per_token, expected, rtol=1e-6)
    np.testing.assert_allclose(diag.truncated, [[1, 1, 1], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(diag.seq_log_weight, np.log([4.0, 0.25, 2.25]), rtol=1e-6)
    token, _ = per_token_loss(
        prox, prox, behav, adv, jnp.asarray(HAND_MASK), clip_eps=0.2, behav_weight_cap=3.0
    )
    np.testing.assert_allclose(token, -np.exp(HAND_LOG_W) * HAND_MASK, rtol=1e-6)


def numpy_sequence_weights(log_w, mask, cap, mode, form):
    """An independent reference: one sequence at a time, in float64, with plain products."""
    weights, keep, truncated, log_seq = [], [], [], []
    for lw, m in zip(log_w.astype(np.float64), mask, strict=True):
        ratios = np.exp(lw[m > 0])
        if form == "product":
            w = float(np.prod(ratios))
        else:
            w = float(np.prod(ratios) ** (1.0 / max(len(ratios), 1)))
        log_seq.append(math.log(w))
        if mode == "truncate":
            weights.append(min(w, cap)), keep.append(True), truncated.append(w > cap)
        elif mode == "mask":
            weights.append(w), keep.append(w <= cap), truncated.append(False)
        else:
            weights.append(w), keep.append(1 / cap <= w <= cap), truncated.append(False)
    return np.array(weights), np.array(keep), np.array(truncated), np.array(log_seq)


@pytest.mark.parametrize("form", importance.SEQ_FORMS)
@pytest.mark.parametrize("mode", importance.SEQ_CAP_MODES)
def test_sequence_weights_match_numpy(mode, form):
    rng = np.random.default_rng(0)
    b, t = 64, 12
    lengths = rng.integers(0, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    log_w = (rng.normal(0.0, 0.3, size=(b, t)) * mask).astype(np.float32)
    cap = 1.5 if form == "product" else 1.2  # the geometric mean drifts less
    corr = jax.jit(importance.make_sequence_correction(cap, mode=mode, form=form))(
        jnp.asarray(log_w), jnp.asarray(mask)
    )
    weight, keep, truncated, log_seq = numpy_sequence_weights(log_w, mask, cap, mode, form)
    # The reference cannot sit on the threshold by chance at float32 resolution here.
    assert np.min(np.abs(np.abs(log_seq) - math.log(cap))) > 1e-4
    np.testing.assert_allclose(corr.log_seq_weight, log_seq, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(corr.seq_keep, keep)
    np.testing.assert_array_equal(corr.seq_truncated, truncated & (lengths > 0))
    np.testing.assert_allclose(corr.token_weight[:, 0][keep], weight[keep], rtol=1e-5)
    assert 0 < keep.sum() < b or mode == "truncate"  # the case exercises both outcomes


def _advantages(shape):
    return np.random.default_rng(1).normal(size=shape).astype(np.float32)


def _loss(log_w, mask, *, logp_shift, **kw):
    """The decoupled loss with prox fixed, behav = prox - log w and logp = prox + shift."""
    prox = jnp.asarray(np.random.default_rng(7).normal(-2.0, 0.5, size=log_w.shape), jnp.float32)
    adv = jnp.asarray(_advantages(log_w.shape))
    return _jitted_loss(prox, jnp.asarray(log_w), adv, jnp.asarray(mask), logp_shift, **kw)


# One compiled program per setting: eagerly every primitive compiles its own.
@functools.partial(jax.jit, static_argnames=("behav_weight_cap", "cap_mode", "seq_correction"))
def _jitted_loss(prox, log_w, adv, mask, logp_shift, **kw):
    behav = prox - log_w
    return losses.decoupled_ppo_loss(prox + logp_shift, prox, behav, adv, mask, clip_eps=0.2, **kw)


@pytest.mark.parametrize("mode", importance.SEQ_CAP_MODES)
def test_one_token_sequences_are_the_token_level_loss(mode):
    # With one token per sequence the sequence weight is the token weight: a large C gives
    # the plain decoupled loss (no cap), and C = 1.3 gives the token-level TIS / MIS.
    rng = np.random.default_rng(2)
    mask = np.zeros((32, 4), np.float32)
    mask[:, 0] = 1.0
    log_w = (rng.normal(0.0, 0.4, size=(32, 4)) * mask).astype(np.float32)
    shift = jnp.asarray(rng.normal(0.0, 0.1, size=(32, 4)), jnp.float32)
    plain, _ = _loss(log_w, mask, logp_shift=shift)
    big = importance.make_sequence_correction(1e6, mode=mode)
    seq_big, _ = _loss(log_w, mask, logp_shift=shift, seq_correction=big)
    np.testing.assert_allclose(seq_big, plain, rtol=1e-6)
    if mode != "mask_both":  # the token level has no lower bound
        token, _ = _loss(log_w, mask, logp_shift=shift, behav_weight_cap=1.3, cap_mode=mode)
        seq, _ = _loss(
            log_w,
            mask,
            logp_shift=shift,
            seq_correction=importance.make_sequence_correction(1.3, mode=mode),
        )
        np.testing.assert_allclose(seq, token, rtol=1e-6)
        assert not np.isclose(float(token), float(plain))  # the cap bites in this case


def test_large_cap_is_untruncated_sequence_is_and_prox_equal_behav_is_plain():
    # Longer sequences: a large C changes nothing, so the loss is the decoupled loss with
    # each token weighted by its sequence's full product (computed here in NumPy). It is
    # the plain (token-weighted) decoupled loss exactly when prox = behav (all w_t = 1).
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 7, size=16)
    mask = (np.arange(6)[None, :] < lengths[:, None]).astype(np.float32)
    log_w = (rng.normal(0.0, 0.2, size=(16, 6)) * mask).astype(np.float32)
    big = importance.make_sequence_correction(1e9, mode="mask_both")
    shift = jnp.zeros((16, 6))
    seq, _ = _loss(log_w, mask, logp_shift=shift, seq_correction=big)
    # r = 1 (logp = prox): ℓ_t = -A_t · W_b.
    adv = _advantages((16, 6)).astype(np.float64)
    w_seq = np.exp((log_w.astype(np.float64) * mask).sum(-1))
    expected = np.sum(-adv * w_seq[:, None] * mask) / mask.sum()
    np.testing.assert_allclose(seq, expected, rtol=1e-5)
    zero = np.zeros_like(log_w)
    plain, _ = _loss(zero, mask, logp_shift=shift + 0.05)
    seq, _ = _loss(zero, mask, logp_shift=shift + 0.05, seq_correction=big)
    np.testing.assert_allclose(seq, plain, rtol=1e-6)


def test_histogram_quantiles_match_numpy_within_one_bin():
    rng = np.random.default_rng(4)
    log_w = rng.standard_t(df=3, size=(40, 50)).astype(np.float32) * 0.05
    mask = (rng.random((40, 50)) < 0.7).astype(np.float32)
    qs = (0.01, 0.5, 0.99)
    # Two halves, histograms added: the same as one histogram of everything.
    histogram = jax.jit(importance.log_weight_histogram)  # one program for both halves
    quantiles = jax.jit(importance.histogram_quantiles, static_argnums=1)
    counts = histogram(jnp.asarray(log_w[:20]), jnp.asarray(mask[:20]))
    counts = counts + histogram(jnp.asarray(log_w[20:]), jnp.asarray(mask[20:]))
    assert float(counts.sum()) == mask.sum()
    got = np.log(np.asarray(quantiles(counts, qs)))
    valid = log_w[mask > 0].astype(np.float64)
    for q, g in zip(qs, got, strict=True):
        exact = np.quantile(valid, q, method="inverted_cdf")
        # One bin in log w is du · sqrt(s² + x²) wide at x (the asinh spacing).
        width = importance.HIST_DU * math.hypot(importance.HIST_SCALE, exact)
        assert abs(g - exact) <= width, (q, g, exact, width)
    empty = quantiles(jnp.zeros(importance.HIST_BINS), qs)
    np.testing.assert_array_equal(empty, 0.0)


# --------------------------------------------------------------------------------------
# The metrics on a real (tiny model) train step.
# --------------------------------------------------------------------------------------


def _step_case(seed, **algo):
    cfg = TrainConfig(
        rollout=RolloutSection(group_size=4, groups_per_step=4),
        algo=AlgoSection(prox="a3po", **algo),
        system=SystemSection(
            batch=BatchSection(micro_batch_size=4, packed_prompts=False)
        ),  # padded rows below
    )
    groups = synthetic_groups(
        4,
        4,
        prompt_len=(3, 8),
        response_len=(2, 11),
        vocab=CFG.vocab_size,
        versions=lambda g, i: 1 - (i % 2),  # at version 1: even samples d = 0, odd d = 1
        seed=seed,
    )
    batch = {
        k: jnp.asarray(v)
        for k, v in build_batch(groups, advantage="grpo", length_bucket=16).arrays().items()
    }
    params = model.init_params(CFG, jax.random.key(seed))
    algo = step_builder.algorithm(cfg, CFG)
    # Behaviour = the trainer's own log-probs plus noise: a train-inference mismatch.
    logp, _ = jax.jit(algo.forward)(params, batch)  # one program, not one per op
    mask = np.asarray(batch["loss_mask"])
    noise = np.random.default_rng(seed).normal(0.0, 0.05, size=mask.shape) * mask
    batch["behav_logp"] = jnp.asarray((np.asarray(logp) + noise) * mask, jnp.float32)
    opt = step_builder.optimizer(cfg)
    state = optim.init_train_state(params, opt)._replace(step=jnp.int32(1))
    step = jax.jit(functools.partial(ts.train_step, algo=algo, optimizer=opt, grad_clip=1.0))
    _, metrics = step(state, batch, None)
    d = 1 - np.asarray(batch["versions"])  # staleness at version 1 (valid tokens)
    return (
        metrics,
        np.asarray(logp, np.float64),
        np.asarray(batch["behav_logp"], np.float64),
        d,
        mask,
    )


def test_mismatch_metrics_on_a_train_step_match_numpy():
    metrics, logp, behav, d, mask = _step_case(5)
    valid = mask > 0
    fresh = valid & (d == 0)
    assert fresh.sum() > 0 and (valid & (d == 1)).sum() > 0
    # A-3PO: prox = logp at d = 0 and behav at d = 1, so log w = logp - behav or 0.
    log_w = np.where(fresh, logp - behav, 0.0)
    x = (behav - logp)[fresh]
    np.testing.assert_allclose(metrics["mismatch/k3_kl_fresh"], np.mean(np.expm1(x) - x), rtol=1e-4)
    assert float(metrics["mismatch/fresh_tokens"]) == fresh.sum()
    w = np.exp(log_w[valid])
    np.testing.assert_allclose(metrics["mismatch/iw_max"], w.max(), rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch/iw_min"], w.min(), rtol=1e-5)
    for name, q in importance.QUANTILES.items():
        exact = np.quantile(log_w[valid], q, method="inverted_cdf")
        width = importance.HIST_DU * math.hypot(importance.HIST_SCALE, exact)
        assert abs(math.log(float(metrics[f"mismatch/iw_{name}"])) - exact) <= width + 1e-6
    log_seq = (log_w * mask).sum(-1)
    np.testing.assert_allclose(metrics["mismatch/seq_log_iw_max"], log_seq.max(), atol=1e-5)
    np.testing.assert_allclose(metrics["mismatch/seq_log_iw_min"], log_seq.min(), atol=1e-5)
    for key in ("masked_frac", "truncated_frac", "seq_masked_frac", "seq_truncated_frac"):
        assert float(metrics[f"mismatch/{key}"]) == 0.0  # no cap configured
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_sequence_mask_metrics_on_a_train_step_match_numpy():
    # First a run without a cap gives the arrays; C is then put between two sequences'
    # |log W| so the expected masked set is unambiguous at float32 resolution.
    _, logp, behav, d, mask = _step_case(6)
    log_w = np.where((mask > 0) & (d == 0), logp - behav, 0.0)
    abs_seq = np.sort(np.abs((log_w * mask).sum(-1)))
    gaps = np.diff(abs_seq)
    k = int(np.argmax(gaps[4:-4])) + 4  # a wide gap in the middle
    cap = math.exp((abs_seq[k] + abs_seq[k + 1]) / 2)
    metrics, *_ = _step_case(6, seq_weight_cap=cap, seq_cap_mode="mask_both")
    dropped = np.abs((log_w * mask).sum(-1)) > math.log(cap)
    assert 0 < dropped.sum() < len(dropped)
    np.testing.assert_allclose(metrics["mismatch/seq_masked_frac"], dropped.mean(), rtol=1e-6)
    token_frac = (mask * dropped[:, None]).sum() / mask.sum()
    np.testing.assert_allclose(metrics["mismatch/masked_frac"], token_frac, rtol=1e-6)
    assert float(metrics["mismatch/seq_truncated_frac"]) == 0.0
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_sequence_settings_are_validated_where_they_are_read():
    with pytest.raises(config_lib.ConfigError, match="seq_weight_cap"):
        AlgoSection(seq_weight_cap=0.5)
    with pytest.raises(config_lib.ConfigError, match="seq_cap_mode"):
        AlgoSection(seq_cap_mode="clip")
    with pytest.raises(config_lib.ConfigError, match="behav_weight_cap"):
        AlgoSection(seq_weight_cap=2.0, behav_weight_cap=2.0)
    with pytest.raises(config_lib.ConfigError, match="geometric_mean"):
        AlgoSection(seq_weight_form="arith")
    cfg = TrainConfig(algo=AlgoSection(seq_weight_cap=2.0, seq_cap_mode="mask"))
    algo = step_builder.algorithm(cfg, CFG)
    assert algo.loss_term.keywords["seq_correction"] is not None
    plain = step_builder.algorithm(TrainConfig(), CFG)
    assert plain.loss_term.keywords["seq_correction"] is None


# --------------------------------------------------------------------------------------
# The dashboard: results.plot_mismatch and the summary's mismatch.png.
# --------------------------------------------------------------------------------------


def _mismatch_run(root, name, seed, steps=6, with_mismatch=True):
    import json

    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = TrainConfig(algo=AlgoSection(seq_weight_cap=2.0, seq_cap_mode="mask"), seed=seed)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(steps):
        record = {"step": i + 1, "wall_time": 10.0 * i, "reward/mean": 0.1 * i}
        if with_mismatch:
            spread = 0.01 * (1 + i)
            record |= {
                "mismatch/k3_kl_fresh": 1e-4 * (1 + i),
                "mismatch/iw_p01": 1 - spread,
                "mismatch/iw_p50": 1.0,
                "mismatch/iw_p99": 1 + spread,
                "mismatch/iw_min": 1 - 3 * spread,
                "mismatch/iw_max": 1 + 3 * spread,
                "mismatch/masked_frac": float(rng.random()) * 0.1,
                "mismatch/truncated_frac": 0.0,
                "mismatch/seq_masked_frac": float(rng.random()) * 0.2,
                "mismatch/seq_truncated_frac": 0.0,
            }
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_results_plot_the_mismatch_when_logged(tmp_path):
    pytest.importorskip("matplotlib")
    from a3po_jax.analysis import results
    from a3po_jax.cli import results as results_cli

    _mismatch_run(tmp_path / "runs", "seed0", 0)
    _mismatch_run(tmp_path / "runs", "seed1", 1)
    runs = results.load_runs([tmp_path / "runs"])
    fig = results.plot_mismatch(runs)
    kl, iw, tokens, seqs = fig.axes[:4]
    assert len(kl.lines) == 2  # one KL line per run
    # Per run: the p50 line and the two dotted tails; the band is one collection.
    assert len(iw.lines) == 6 and len(iw.collections) == 2
    np.testing.assert_allclose(iw.lines[0].get_ydata(), 1.0)
    assert len(tokens.lines) == len(seqs.lines) == 4  # masked and truncated per run
    out = tmp_path / "out"
    assert results_cli.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert (out / "mismatch.png").read_bytes().startswith(b"\x89PNG")
    assert "](mismatch.png)" in (out / "summary.md").read_text()
    # A run from before the dashboard existed gets no mismatch figure.
    _mismatch_run(tmp_path / "old", "run", 0, with_mismatch=False)
    old_out = tmp_path / "old_out"
    assert results_cli.main([str(tmp_path / "old"), "--out", str(old_out)]) == 0
    assert not (old_out / "mismatch.png").exists()
