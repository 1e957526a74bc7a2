"""Golden-value and invariance tests for a3po_jax.inference.engine.sampling and request types."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from a3po_jax.core.types import FINISH_REASONS as CORE_FINISH_REASONS
from a3po_jax.core.types import Rollout
from a3po_jax.inference.engine import sampling
from a3po_jax.inference.types import (
    FINISH_REASONS,
    ErrorKind,
    GenerateRequest,
    SampleResult,
    SamplingParams,
    error_result,
)

JIT_VARIANTS = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["nojit", "jit"])

PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)

# Setup, references and functions not tested eagerly run jitted: outside `jax.jit` every
# primitive compiles its own program for each new shape.
_sample_keys = jax.jit(sampling.sample_keys)
_sample_tokens = jax.jit(sampling.sample_tokens)
_argmax = jax.jit(functools.partial(jnp.argmax, axis=-1))


@jax.jit
def _log_softmax_at(logits, temperature, tokens):
    """log_softmax(logits / T)[token] per row, T := 1 for greedy rows."""
    scale = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    return jax.nn.log_softmax(logits / scale, axis=-1)[jnp.arange(logits.shape[0]), tokens]


@jax.jit
def _categorical_row(keys, logits, temperature, i):
    """What `jax.random.categorical` draws for row i at its temperature."""
    return jax.random.categorical(keys[i], logits[i] / temperature[i])


def _kept(masked) -> list[list[int]]:
    return [np.flatnonzero(np.isfinite(row)).tolist() for row in np.asarray(masked)]


@JIT_VARIANTS
def test_truncate_logits_golden(maybe_jit):
    logits = jnp.log(jnp.asarray(np.tile(PROBS, (5, 1))))  # [5, 4]
    top_k = jnp.array([0, 2, 0, 0, 2], jnp.int32)
    top_p = jnp.array([1.0, 1.0, 0.7, 0.5, 0.6], jnp.float32)
    kept = _kept(maybe_jit(sampling.truncate_logits)(logits, top_k, top_p))
    assert kept[0] == [0, 1, 2, 3]  # both off
    assert kept[1] == [0, 1]  # top-2
    # top_p 0.7: mass before token 1 is 0.5 < 0.7 (kept), before token 2 it is 0.8 (cut).
    # An inclusive cumsum (0.8 >= 0.7 at token 1) would wrongly cut token 1 as well.
    assert kept[2] == [0, 1]
    # top_p 0.5: mass before token 1 is exactly 0.5, not < 0.5: only the argmax survives.
    assert kept[3] == [0]
    # top_k 2 then top_p 0.6 on the renormalised pair [0.625, 0.375]: 0.625 >= 0.6 cuts
    # token 1. Top-p on the unrenormalised probabilities (0.5 < 0.6) would keep it.
    assert kept[4] == [0]


def test_truncate_keeps_unmasked_values():
    logits = jnp.array([[3.0, 1.0, 2.0, -1.0]])
    out = jax.jit(sampling.truncate_logits)(logits, jnp.array([2]), jnp.array([1.0]))
    np.testing.assert_array_equal(out, [[3.0, -np.inf, 2.0, -np.inf]])


@JIT_VARIANTS
def test_sample_tokens_logprob_is_before_truncation(maybe_jit):
    logits = jnp.log(jnp.asarray(np.tile(PROBS, (3, 1)))) * 2.0  # [3, 4]
    keys = _sample_keys(
        *(jnp.zeros((3,), d) for d in (jnp.uint32, jnp.uint32)),
        jnp.arange(3, dtype=jnp.int32),
        jnp.zeros((3,), jnp.int32),
    )
    temperature = jnp.array([0.0, 2.0, 2.0], jnp.float32)
    top_k = jnp.array([0, 1, 0], jnp.int32)
    top_p = jnp.array([1.0, 1.0, 1.0], jnp.float32)
    tokens, logprobs = maybe_jit(sampling.sample_tokens)(logits, keys, temperature, top_k, top_p)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)  # indexed on the host
    # Row 0 greedy: argmax with log_softmax(logits) (T := 1): log(0.5^2 / sum p^2).
    p2 = PROBS**2 / np.sum(PROBS**2)
    assert int(tokens[0]) == 0
    np.testing.assert_allclose(logprobs[0], np.log(p2[0]), rtol=1e-5)
    # Row 1, T=2 undoes the doubling, top_k=1 forces token 0; its log-prob is log 0.5 under
    # softmax(logits / T), not 0 (the truncated distribution's log-prob).
    assert int(tokens[1]) == 0
    np.testing.assert_allclose(logprobs[1], np.log(0.5), rtol=1e-5)
    # Row 2: whatever was drawn, its log-prob is log p under softmax(logits / 2) = PROBS.
    np.testing.assert_allclose(logprobs[2], np.log(PROBS[int(tokens[2])]), rtol=1e-5)


@JIT_VARIANTS
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_sample_tokens_logprob_is_log_softmax_at_the_token(maybe_jit, layout, monkeypatch):
    # sample_tokens reduces the logits to log Z instead of materialising the [N, V]
    # log-softmax (one pass less over the vocabulary each decode step); the log-prob must
    # still be jax.nn.log_softmax(logits / T)[token], greedy (T := 1) and sampled rows
    # alike, to float32 rounding: jit fuses the divisions differently from eager (1 ulp),
    # and down the columns of the vocabulary-major [V, N] layout Z is summed in another
    # order than log_softmax's row sums (a few ulps of log Z, about 7 here: atol 1e-6).
    # Both reductions are checked: along rows (few slots) and down columns (many).
    monkeypatch.setattr(sampling, "MIN_VOCAB_MAJOR_SLOTS", 1 if layout == "columns" else 10**9)

    def entry(logits, keys, temperature, top_k, top_p):  # a fresh function: traced anew
        # The decode step's entry point, on the [V, N] logits the out-major lm_head gives.
        return sampling.sample_tokens_vocab_major(logits.T, keys, temperature, top_k, top_p)

    n, v = 6, 1000
    logits = jax.random.normal(jax.random.key(0), (n, v)) * 4.0
    keys = _sample_keys(
        *(jnp.full((n,), 7, d) for d in (jnp.uint32, jnp.uint32)),
        jnp.arange(n, dtype=jnp.int32),
        jnp.zeros((n,), jnp.int32),
    )
    for temperature in ([0.0] * n, [0.0, 0.7, 1.0, 0.0, 1.3, 0.9]):
        t = jnp.asarray(temperature, jnp.float32)
        top_k = jnp.asarray([0, 5, 0, 0, 0, 0], jnp.int32)
        top_p = jnp.asarray([1.0, 1.0, 0.8, 1.0, 1.0, 1.0], jnp.float32)
        tokens, logprobs = maybe_jit(entry)(logits, keys, t, top_k, top_p)
        expected = _log_softmax_at(logits, t, tokens)
        np.testing.assert_allclose(logprobs, expected, rtol=3e-7, atol=1e-6)
        greedy = np.asarray(t) == 0
        np.testing.assert_array_equal(
            np.asarray(tokens)[greedy], np.argmax(np.asarray(logits), -1)[greedy]
        )
        # Sampled rows without truncation draw what jax.random.categorical draws at T.
        for i in np.flatnonzero((np.asarray(t) > 0) & (np.asarray(top_k) == 0)):
            if float(np.asarray(top_p)[i]) == 1.0:
                ref = _categorical_row(keys, logits, t, i)
                assert int(tokens[i]) == int(ref), i


@JIT_VARIANTS
def test_first_argmax_golden_and_equal_to_argmax(maybe_jit):
    """By hand: the first of tied maxima, a NaN wins (as in argmax), -inf rows are fine; then
    equal to `jnp.argmax` on random rows with planted ties, at float32 and bfloat16."""
    x = jnp.array(
        [
            [1.0, 3.0, 3.0, 2.0],
            [-jnp.inf, -jnp.inf, 0.5, -jnp.inf],
            [1.0, jnp.nan, 4.0, jnp.nan],
            [-jnp.inf, -jnp.inf, -jnp.inf, -jnp.inf],
        ]
    )
    np.testing.assert_array_equal(maybe_jit(sampling.first_argmax)(x), [1, 2, 1, 0])
    np.testing.assert_array_equal(_argmax(x), [1, 2, 1, 0])
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        y = rng.integers(0, 50, size=(64, 300)).astype(np.float32)  # many ties
        y = jnp.asarray(y, dtype)
        got = maybe_jit(sampling.first_argmax)(y)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, _argmax(y))
        # Down the columns of the vocabulary-major layout (the decode step's), likewise.
        got = maybe_jit(lambda a: sampling.first_argmax(a, axis=0))(y.T)
        np.testing.assert_array_equal(got, _argmax(y))
    cols = maybe_jit(lambda a: sampling.first_argmax(a, axis=0))(x.T)
    np.testing.assert_array_equal(cols, [1, 2, 1, 0])


def test_categorical_draws_what_jax_random_categorical_draws():
    """The same tokens as `jax.vmap(jax.random.categorical)` for the same keys: 40 batches of
    16 rows over 1000 tokens, with truncated (-inf) entries, at two temperatures."""
    draw = jax.jit(sampling.categorical)
    ref = jax.jit(jax.vmap(jax.random.categorical))
    rng = np.random.default_rng(1)
    for seed in range(40):
        rows = [jnp.arange(16, dtype=d) + seed for d in (jnp.uint32, jnp.uint32, jnp.int32)]
        z = _sample_keys(*rows, jnp.full((16,), seed, jnp.int32))
        logits = rng.standard_normal((16, 1000)).astype(np.float32) * (3.0 if seed % 2 else 0.3)
        logits[:, rng.integers(0, 1000, 200)] = -np.inf
        logits = jnp.asarray(logits)
        np.testing.assert_array_equal(draw(z, logits), ref(z, logits))


def test_sample_tokens_distribution():
    n = 4000
    logits = jnp.log(jnp.asarray(np.tile(PROBS, (n, 1))))
    keys = _sample_keys(
        jnp.zeros((n,), jnp.uint32),
        jnp.full((n,), 7, jnp.uint32),
        jnp.arange(n, dtype=jnp.int32),
        jnp.zeros((n,), jnp.int32),
    )
    ones = jnp.ones((n,), jnp.float32)
    tokens, _ = _sample_tokens(logits, keys, ones, jnp.zeros((n,), jnp.int32), ones)
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    np.testing.assert_allclose(freq, PROBS, atol=0.03)  # ~4 standard errors
    # top_k=2: only tokens 0 and 1, renormalised to [0.625, 0.375].
    tokens, _ = _sample_tokens(logits, keys, ones, jnp.full((n,), 2, jnp.int32), ones)
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.03)


def test_keys_depend_only_on_seed_index_step():
    hi = jnp.array([0, 0, 0, 1], jnp.uint32)
    lo = jnp.array([5, 5, 5, 5], jnp.uint32)
    idx = jnp.array([0, 0, 1, 0], jnp.int32)
    step = jnp.array([3, 3, 3, 3], jnp.int32)
    data = np.asarray(jax.random.key_data(_sample_keys(hi, lo, idx, step)))
    np.testing.assert_array_equal(data[0], data[1])  # same coordinates, same key
    assert not np.array_equal(data[0], data[2])  # sample index matters
    assert not np.array_equal(data[0], data[3])  # the seed's high word matters
    # The same coordinates alone in a batch of one give the same key (no batch dependence).
    alone = _sample_keys(hi[2:3], lo[2:3], idx[2:3], step[2:3])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(alone))[0], data[2])
    # key(seed) is PRNGKey(seed) for a seed below 2**32.
    ref = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(5), 1), 3)
    np.testing.assert_array_equal(data[2], np.asarray(ref))


def test_split_seed():
    assert sampling.split_seed(5) == (0, 5)
    assert sampling.split_seed(2**32 + 3) == (1, 3)
    with pytest.raises(ValueError, match="seed"):
        sampling.split_seed(-1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(stop_tokens=(1, -2)), "stop_tokens"),
        (dict(stop_tokens=3), "stop_tokens"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_from_dict():
    assert SamplingParams.from_dict({"temperature": 0.5, "stop_tokens": [2]}) == SamplingParams(
        temperature=0.5, stop_tokens=(2,)
    )
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt_tokens=()), "prompt_tokens"),
        (dict(prompt_tokens=(1, -1)), "prompt_tokens"),
        (dict(prompt_tokens="abc"), "prompt_tokens"),
        (dict(request_id=""), "request_id"),
        (dict(num_samples=0), "num_samples"),
        (dict(seed=-1), "seed"),
        (dict(sampling={"top_q": 0.9}), "top_q"),
    ],
)
def test_generate_request_errors_name_the_field(kwargs, field):
    args = dict(request_id="r", prompt_tokens=(1, 2))
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        GenerateRequest(**args)


def test_generate_request_normalises():
    r = GenerateRequest("r", np.array([3, 4]), sampling={"temperature": 0.0})
    assert r.prompt_tokens == (3, 4) and r.sampling.temperature == 0.0


def test_sample_result_checks_shapes():
    with pytest.raises(ValueError, match="same shape"):
        SampleResult("r", 0, [1], [1, 2], [0.0], [0], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        SampleResult("r", 0, [1], [1], [0.0], [0], "done")


def test_sample_result_error_kind_is_set_exactly_on_errors():
    with pytest.raises(ValueError, match="error_kind"):
        SampleResult("r", 0, [1], [], [], [], "error", error="boom")
    with pytest.raises(ValueError, match="error_kind"):
        SampleResult("r", 0, [1], [1], [0.0], [0], "stop", error_kind=ErrorKind.LOST)
    r = SampleResult("r", 0, [1], [], [], [], "error", error="x", error_kind="transport")
    assert r.error_kind is ErrorKind.TRANSPORT  # the wire value name is accepted


def test_to_rollout_is_the_one_conversion_to_the_cores_rollout():
    r = SampleResult("g7", 2, [5, 6], [7, 8, 9], [-0.5, -1.0, -2.0], [3, 3, 4], "length")
    rollout = r.to_rollout(
        prompt_id="p", group_id=7, reward=1.0, info={"k": 1}, admitted_at_version=3
    )
    assert isinstance(rollout, Rollout)
    assert (rollout.prompt_id, rollout.group_id, rollout.sample_index) == ("p", 7, 2)
    np.testing.assert_array_equal(rollout.prompt_tokens, [5, 6])
    np.testing.assert_array_equal(rollout.completion_tokens, [7, 8, 9])
    np.testing.assert_array_equal(rollout.behav_logprobs, [-0.5, -1.0, -2.0])
    np.testing.assert_array_equal(rollout.versions, [3, 3, 4])
    assert rollout.finish_reason == "length" and rollout.reward == 1.0
    assert rollout.info == {"k": 1} and rollout.admitted_at_version == 3
    # "stop" and "length" mean the same on both types; an error sample has no Rollout.
    assert set(FINISH_REASONS) - {"error"} <= set(CORE_FINISH_REASONS)
    failed = SampleResult("g7", 0, [5], [], [], [], "error", "gone", error_kind=ErrorKind.LOST)
    with pytest.raises(ValueError, match="lost: gone"):
        failed.to_rollout(prompt_id="p", group_id=7)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_error_kind_survives_the_grpc_message(kind):
    # The kind travels as its value name in the wire's finish_reason (an exact lookup).
    from a3po_jax.inference.remote.grpc_messages import result_from_proto, result_to_proto

    request = GenerateRequest("r", (1, 2))
    back = result_from_proto(result_to_proto(error_result(request, 0, kind, "why")))
    assert (back.finish_reason, back.error_kind, back.error) == ("error", kind, "why")
    ok = SampleResult("r", 1, [1, 2], [3], [-0.25], [5], "stop")
    back = result_from_proto(result_to_proto(ok))
    assert (back.finish_reason, back.error_kind, back.versions.tolist()) == ("stop", None, [5])


def test_package_import_does_not_load_jetstream_or_tensorflow():
    # The trainer and benchmarks import a3po_jax.inference; JetStream pulls in TensorFlow,
    # which the GPU machines do not have and which costs seconds to import.
    import subprocess
    import sys

    code = (
        "import sys, a3po_jax.inference\n"
        "bad = [m for m in ('jetstream', 'tensorflow', 'seqio', 'grpc') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------------------
# The engine's decode step runs on per-layer weights (`decode_layout.apply_decode`); it must
# compute what `model.apply` computes, with whichever weights it is handed at that step.


def test_engine_splits_weights_once_per_version():
    from helpers.inference_reference import CFG, scaled_params

    from a3po_jax.inference.engine.engine_core import EngineCore

    core = EngineCore(CFG, num_slots=1, capacity=16, prefill_buckets=(8,))
    a, b = scaled_params(0), scaled_params(1)
    split_a = core.decode_params(a)
    assert core.decode_params(a) is split_a  # every step of one version: no new copy
    assert core.decode_params(dict(a)) is split_a  # keyed on the arrays, not the dict
    split_b = core.decode_params(b)  # a weight update
    assert split_b is not split_a
    assert core.decode_params(split_b) is split_b  # already split: used as it is
    # Only the latest split is kept (one extra copy of the layers, not one per version).
    assert core.decode_params(a) is not split_a


def test_engine_lays_the_decode_weights_out_by_its_slot_count():
    """One slot: `apply`'s [I, O] kernels (a one-row product streams them faster); two or
    more: out-major `kernel_t` [O, I] (`decode_layout.out_major_dot`). The host's split is the
    engine's."""
    from helpers.inference_reference import CFG, scaled_params

    from a3po_jax.inference.engine.engine_core import EngineCore
    from a3po_jax.inference.host import InferenceHost

    params = scaled_params(0)
    for slots, key in ((1, "kernel"), (2, "kernel_t"), (8, "kernel_t")):
        core = EngineCore(CFG, num_slots=slots, capacity=16, prefill_buckets=(8,))
        layer = core.decode_params(params).layers[0]
        assert set(layer["mlp"]["gate_up"]) == {key}, slots
        assert set(layer["attn"]["o_proj"]) == {key}, slots
    host = InferenceHost(CFG, params, num_slots=4, prefill_buckets=(8,), max_cache_len=16)
    assert set(host._decode_params.layers[0]["mlp"]["down_proj"]) == {"kernel_t"}


@functools.partial(jax.jit, static_argnames="config")
def _reference_step(params, state, *, config):
    """A decode step's (tokens, behaviour log-probs) from `model.apply` (scanned layers,
    stacked params, [N, V] logits) and `sample_tokens`; the state is not donated."""
    from a3po_jax import model as M

    logits, _ = M.apply(
        params,
        state.tokens[:, None],
        state.cache.lengths[:, None],
        config=config,
        segment_ids=state.active.astype(jnp.int32)[:, None],
        kv_cache=state.cache,
    )
    keys = sampling.sample_keys(state.seed_hi, state.seed_lo, state.sample_index, state.step)
    return sampling.sample_tokens(logits[:, 0], keys, state.temperature, state.top_k, state.top_p)


def test_engine_step_equals_apply_across_a_weight_swap():
    """Each decode step's tokens and behaviour log-probs equal `model.apply` (scanned
    layers, stacked params) run on the same state with the weights of that step, before
    and after a swap between two steps, with no recompilation. A stale split would keep
    the old weights after the swap and give other log-probs."""
    from helpers.inference_reference import CFG, scaled_params

    from a3po_jax.inference.engine import engine_core, steps

    reference = functools.partial(_reference_step, config=CFG)

    core = engine_core.EngineCore(CFG, num_slots=2, capacity=32, prefill_buckets=(8,))
    a, b = scaled_params(0), scaled_params(1)
    state = core.init_decode_state()
    prefix = core.prefill(a, [5, 6, 7])
    sampled = steps.SlotSampling(temperature=0.8, top_k=20, seed=3)
    state, _, _ = core.insert(prefix, state, 0, sampled)
    state, _, _ = core.insert(prefix, state, 1, steps.SlotSampling())  # greedy
    state, _, _ = core.generate(a, state)  # compiles
    compiled = engine_core._ONE_DEVICE_JITS.generate._cache_size()
    for params in [a, a, b, b]:
        ref_tokens, ref_logprobs = reference(params, state)  # state is not donated here
        _, stale_logprobs = reference(a, state)
        state, tokens, lp = core.generate(params, state)
        np.testing.assert_array_equal(tokens, ref_tokens)
        np.testing.assert_allclose(lp, ref_logprobs, atol=1e-5)
        if params is b:  # the swap changed the model: a's log-probs would be far off
            assert np.abs(np.asarray(lp) - np.asarray(stale_logprobs)).max() > 1e-2
    assert engine_core._ONE_DEVICE_JITS.generate._cache_size() == compiled
    np.testing.assert_array_equal(state.cache.lengths, [3 + 5, 3 + 5])


@pytest.mark.parametrize("tied", [True, False])
def test_engine_step_equals_apply_with_many_slots(tied):
    """With 8 slots (`sampling.MIN_VOCAB_MAJOR_SLOTS`) the engine's step reduces the tied
    head's vocabulary-major logits down their columns; an untied head's are sampled as rows.
    Either way each step's tokens and log-probs equal `model.apply` + `sample_tokens` on
    [N, V] rows, for greedy slots, sampled slots and one with top-k and top-p."""
    from a3po_jax import model as M
    from a3po_jax.inference.engine import engine_core, steps

    config = M.ModelConfig.tiny(tie_embeddings=tied)
    params = jax.tree.map(
        lambda x: x * 8.0 if x.ndim >= 2 else x, M.init_params(config, jax.random.key(2))
    )
    n = sampling.MIN_VOCAB_MAJOR_SLOTS

    core = engine_core.EngineCore(config, num_slots=n, capacity=32, prefill_buckets=(8,))
    state = core.init_decode_state()
    for slot in range(n):
        prefix = core.prefill(params, [5 + slot, 6, 7])
        settings = (
            steps.SlotSampling()  # greedy
            if slot % 2 == 0
            else steps.SlotSampling(temperature=0.9, seed=slot)
        )
        if slot == 3:
            settings = steps.SlotSampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)
        state, _, _ = core.insert(prefix, state, slot, settings)
    for _ in range(4):
        ref_tokens, ref_logprobs = _reference_step(params, state, config=config)
        state, tokens, lp = core.generate(params, state)
        np.testing.assert_array_equal(tokens, ref_tokens)
        # Two programs (scanned apply, unrolled out-major apply_decode) round the logits
        # differently (2e-5 seen at |log p| = 4); a wrong slot's column is off by O(1).
        np.testing.assert_allclose(lp, ref_logprobs, atol=1e-4)


# one compiled program: eagerly every leaf's shape compiles its own copy
_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def test_engine_decode_windows():
    """The windows double from the smallest prefill bucket up to the capacity; a step's
    window is the smallest one past its longest slot, and a step run with it samples what a
    step attending to the whole cache samples."""
    from helpers.inference_reference import CFG, scaled_params

    from a3po_jax.inference.engine import engine_core, steps

    core = engine_core.EngineCore(CFG, num_slots=2, capacity=48, prefill_buckets=(8, 16))
    assert core.decode_windows == (8, 16, 32, 48)
    assert [core.window_for(n) for n in (0, 7, 8, 31, 32, 47)] == [8, 8, 16, 32, 48, 48]
    for bad in (-1, 48):
        with pytest.raises(ValueError, match="longest"):
            core.window_for(bad)
    with pytest.raises(ValueError, match="window must be one of"):
        core.generate(scaled_params(0), core.init_decode_state(), 12)

    params = scaled_params(0)
    state = core.init_decode_state()
    prefix = core.prefill(params, [5, 6, 7, 8, 9])
    state, _, _ = core.insert(prefix, state, 0, steps.SlotSampling(temperature=0.9, seed=2))
    state, _, _ = core.insert(prefix, state, 1, steps.SlotSampling())
    for _ in range(12):  # lengths 5 .. 16: windows 8, then 16, then 32
        longest = int(np.max(state.cache.lengths))
        ref_state = _copy(state)
        _, ref_tokens, ref_lp = core.generate(params, ref_state)  # whole cache
        state, tokens, lp = core.generate(params, state, core.window_for(longest))
        np.testing.assert_array_equal(tokens, ref_tokens)
        np.testing.assert_allclose(lp, ref_lp, atol=1e-6)
    np.testing.assert_array_equal(state.cache.lengths, [17, 17])
