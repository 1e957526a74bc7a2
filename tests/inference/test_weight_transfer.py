"""Weight pushes over the host's weight port (`inference/transfer/`) and the reusable staging
buffers they are copied into (`weight_sync.StagingBuffers`).

An in-process host serves the tiny model behind a `WeightReceiver`; the tests push through
`WeightSender` and check what the host then serves (its split weights, and greedy tokens
against a full recomputation), and that every refusal or broken push leaves the serving
weights as they were.
"""

import functools
import os
import socket
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.inference_reference import CFG, collect, recompute_greedy, scaled_params

from a3po_jax.inference.host import InferenceHost
from a3po_jax.inference.transfer import framing, shared_memory, weight_sync
from a3po_jax.inference.transfer import receiver as receiver_module
from a3po_jax.inference.transfer.framing import WeightAuthError
from a3po_jax.inference.transfer.receiver import WeightReceiver
from a3po_jax.inference.transfer.sender import WeightSender
from a3po_jax.inference.types import GenerateRequest, SamplingParams

TOKEN = "weight-token"
SHARED_ONLY = pytest.mark.skipif(
    not shared_memory.SHARED_MEMORY, reason="shared-memory pushes need Linux"
)
PROMPT = (5, 6, 7, 8)


TRANSPORTS = ["tcp", pytest.param("shared", marks=SHARED_ONLY)]


def connect(receiver, transport, token=TOKEN):
    """A sender to `receiver` over its TCP port, or through its shared sets."""
    local = receiver.local_socket if transport == "shared" else ""
    return WeightSender("127.0.0.1", receiver.port, token, local_socket=local)


@pytest.fixture(params=TRANSPORTS)
def served(request):
    """A started float32 host at version 0 with its receiver; yields (host, receiver,
    sender factory) for each transport."""
    host = InferenceHost(CFG, scaled_params(0), num_slots=2, prefill_buckets=(8,)).start()
    receiver = WeightReceiver(host, TOKEN)
    yield host, receiver, functools.partial(connect, receiver, request.param)
    receiver.close()
    host.close()


def greedy(host, request_id, n=6):
    host.submit(GenerateRequest(request_id, PROMPT, sampling=SamplingParams(0.0, max_new_tokens=n)))
    return collect(host, 1)[(request_id, 0)]


def test_a_push_installs_the_weights_whole_and_the_host_generates_with_them(served):
    host, receiver, connect = served
    sender = connect()
    new = scaled_params(1)
    report = sender.push(new, 1)
    assert report["version"] == 1 and report["bytes"] == sum(x.nbytes for x in jax.tree.leaves(new))
    assert report["transport"] == ("shared_memory" if sender.local_socket else "tcp")
    assert host.wait_serving(1, timeout=30)
    result = greedy(host, "after")
    np.testing.assert_array_equal(result.tokens, recompute_greedy(new, PROMPT, 6))
    assert set(result.versions.tolist()) == {1}
    assert receiver.stats()["pushes"] == 1
    # The spec lists the params a push takes, with their dtypes and shapes.
    assert [s.name for s in sender.specs()] == list(weight_sync.flatten_params(new))


def test_receive_buffers_are_reused_only_once_nothing_holds_them(served, monkeypatch):
    # The host serves from the receive buffers as they are (aliased on a CPU). A set still
    # held (here: the v1 split kept alive, as a computation reading it would) must never be
    # refilled by a later push; sets nothing holds are, so pushes do not grow memory.
    host, receiver, connect = served
    sender = connect()
    sender.push(scaled_params(1), 1)
    assert host.wait_serving(1, timeout=30)
    held = host._decode_params
    v1 = {n: np.array(a) for n, a in weight_sync.flatten_params(held).items()}
    allocated = []
    real_empty, real_shared = weight_sync.aligned_empty, receiver_module.SharedSet
    monkeypatch.setattr(
        weight_sync, "aligned_empty", lambda *a: allocated.append(a) or real_empty(*a)
    )
    monkeypatch.setattr(
        receiver_module,
        "SharedSet",
        lambda specs, *rest: allocated.extend(specs) or real_shared(specs, *rest),
    )
    fds = []  # open descriptors once the sets exist: a push must not add any
    for version in range(2, 7):
        sender.push(scaled_params(version), version)
        assert host.wait_serving(version, timeout=30)
        if os.path.isdir("/proc/self/fd"):
            fds.append(len(os.listdir("/proc/self/fd")))
    for name, array in weight_sync.flatten_params(held).items():
        np.testing.assert_array_equal(np.asarray(array), v1[name], name)
    # Five pushes, two new sets: v2's (v1's is held), v3's (v2's serves); then by turns.
    assert len(allocated) == 2 * len(host.serving_specs())
    # The pusher closes each descriptor it was sent (one may be a connection still closing).
    assert not fds or max(fds[2:]) - fds[1] <= 1, fds
    np.testing.assert_array_equal(
        greedy(host, "v6").tokens, recompute_greedy(scaled_params(6), PROMPT, 6)
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("num_slots", [2, 1])  # out-major, and in-major (one slot)
def test_weights_pushed_in_the_serving_layout_serve_as_an_in_process_update(num_slots, transport):
    # The pusher lays the weights out as the host serves them (fused, transposed), the host
    # installs the received bytes as they are. Against a host that made its split itself
    # from the same weights (`update_weights`): the same arrays bit for bit, hence the same
    # sampled tokens and log-probs at temperature 1 (a layout that differed in one element
    # or one row order would change the log-probs).
    new = scaled_params(6)
    hosts = [
        InferenceHost(CFG, scaled_params(0), num_slots=num_slots, prefill_buckets=(8,)).start()
        for _ in range(2)
    ]
    receiver = WeightReceiver(hosts[0], TOKEN)
    try:
        report = connect(receiver, transport).push(new, 1)
        # Through shared memory the idle host lays out its share of the layers itself.
        assert (report["host_layout_s"] > 0) == (transport == "shared")
        hosts[1].update_weights(new, 1)
        for host in hosts:
            assert host.wait_serving(1, timeout=30)
        pushed, local = (weight_sync.flatten_params(h._decode_params) for h in hosts)
        assert list(pushed) == list(local)
        for name in local:
            np.testing.assert_array_equal(np.asarray(pushed[name]), np.asarray(local[name]), name)
        sampling = SamplingParams(1.0, max_new_tokens=12)
        results = []
        for host in hosts:
            host.submit(GenerateRequest("r", PROMPT, num_samples=3, sampling=sampling, seed=11))
            results.append(collect(host, 3))
        for key, result in results[1].items():
            np.testing.assert_array_equal(results[0][key].tokens, result.tokens)
            np.testing.assert_array_equal(results[0][key].logprobs, result.logprobs)
            assert set(results[0][key].versions.tolist()) == {1}
    finally:
        receiver.close()
        for host in hosts:
            host.close()


def test_staged_numpy_and_device_arrays_push_the_same_weights(served):
    # Numpy arrays in the host's dtypes go on the wire as they lie; device arrays are first
    # copied into the sender's buffers. Both must serve the same weights.
    host, receiver, connect = served
    sender = connect()
    new = scaled_params(2)
    staging = weight_sync.StagingBuffers(sender.specs(), sets=1)
    staged = staging.stage(new)
    sender.push(staged.arrays, 1)
    assert host.wait_serving(1, timeout=30)
    by_staged = greedy(host, "staged").tokens
    sender.push(new, 2)
    assert host.wait_serving(2, timeout=30)
    np.testing.assert_array_equal(greedy(host, "device").tokens, by_staged)
    np.testing.assert_array_equal(by_staged, recompute_greedy(new, PROMPT, 6))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_bfloat16_host_receives_bfloat16_bytes(transport):
    # The pusher casts to the host's dtype on its own device: half the bytes of float32.
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), scaled_params(0))
    host = InferenceHost(CFG, params16, num_slots=2, prefill_buckets=(8,)).start()
    receiver = WeightReceiver(host, TOKEN)
    try:
        sender = connect(receiver, transport)
        new32 = scaled_params(3)
        report = sender.push(new32, 1)
        assert report["bytes"] == sum(x.size * 2 for x in jax.tree.leaves(new32))
        assert host.wait_serving(1, timeout=30)
        # What it serves is the cast of what was pushed, bit for bit.
        expected = host._serving_split(jax.tree.map(lambda x: x.astype(jnp.bfloat16), new32))
        for got, want in zip(
            jax.tree.leaves(host._decode_params), jax.tree.leaves(expected), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    finally:
        receiver.close()
        host.close()


def test_refusals_name_what_is_wrong_and_change_nothing(served):
    host, receiver, connect = served
    before = greedy(host, "before").tokens
    with pytest.raises(WeightAuthError, match="wrong host token"):
        connect(token="not-the-token").push(scaled_params(4), 7)
    sender = connect()
    bad = scaled_params(4)
    bad["layers"]["attn"]["q_proj"]["kernel"] = jnp.zeros((2, 64, 4, 8))
    with pytest.raises(ValueError, match=r"layers/attn/q_proj/kernel.*\(2, 64, 4, 8\)"):
        sender.push(bad, 7)
    with pytest.raises(ValueError, match="dtype int32"):  # only floating point is cast
        sender.push(jax.tree.map(lambda x: x.astype(jnp.int32), scaled_params(4)), 7)
    with pytest.raises(ValueError, match="missing tensors.*final_norm/scale"):
        sender.push({k: v for k, v in scaled_params(4).items() if k != "final_norm"}, 7)
    with pytest.raises(ValueError, match="version must be an int"):
        sender.push(scaled_params(4), "7")
    # The receiver checks the manifest itself too: a pusher that skips the client's checks.
    with raw_push(receiver.port) as (conn, specs, layout):
        specs[0] = [specs[0][0], specs[0][1], [1, 2, 3]]
        header = {"version": 7, "layout": layout, "tensors": specs}
        framing.send_json(conn, b"PUSH", header)
        kind, payload = framing.recv_frame(conn)
        assert kind == b"ERR " and specs[0][0] in payload.decode() and b"shape" in payload
    # A pusher of another layout (an older one sends the stacked params) is refused by name.
    with raw_push(receiver.port) as (conn, specs, layout):
        header = {"version": 7, "layout": {**layout, "name": "stacked"}, "tensors": specs}
        framing.send_json(conn, b"PUSH", header)
        kind, payload = framing.recv_frame(conn)
        assert kind == b"ERR " and b"'stacked'" in payload and b"decode-params-v1" in payload
    # ... and so is a host of another layout, by the pusher, before a byte is sent.
    real_layout = host.serving_layout
    host.serving_layout = lambda: {**real_layout(), "name": "stacked"}
    try:
        with pytest.raises(ValueError, match="receives layout 'stacked'.*decode-params-v1"):
            connect().push(scaled_params(4), 7)
    finally:
        host.serving_layout = real_layout
    assert host.version == 0
    np.testing.assert_array_equal(greedy(host, "after").tokens, before)


def test_a_push_that_breaks_off_leaves_the_old_weights_and_the_receiver_serving(served):
    host, receiver, connect = served
    before = greedy(host, "before").tokens
    with raw_push(receiver.port) as (conn, specs, layout):
        header = {"version": 9, "layout": layout, "tensors": specs}
        framing.send_json(conn, b"PUSH", header)
        assert framing.recv_frame(conn)[0] == b"GO  "
        conn.sendall(b"\x01" * 1000)  # part of the first tensor, then the pusher dies
    # A later good push still lands; nothing of the broken one was installed meanwhile.
    new = scaled_params(5)
    connect().push(new, 1)
    assert host.wait_serving(1, timeout=30)
    np.testing.assert_array_equal(greedy(host, "after").tokens, recompute_greedy(new, PROMPT, 6))
    assert not np.array_equal(before, recompute_greedy(new, PROMPT, 6))


@SHARED_ONLY
def test_shared_memory_pushes_need_the_local_socket_and_a_broken_one_changes_nothing(served):
    host, receiver, _ = served
    before = greedy(host, "before").tokens
    # Over TCP the host offers no shared set, and refuses a pusher that asks for one.
    with raw_push(receiver.port) as (conn, specs, layout):
        header = {"version": 3, "layout": layout, "tensors": specs, "transport": "shared_memory"}
        framing.send_json(conn, b"PUSH", header)
        kind, payload = framing.recv_frame(conn)
        assert kind == b"ERR " and b"only over the host's local socket" in payload
    # A pusher that gets a shared set, scribbles over part of it and dies before SENT.
    with raw_push(receiver.local_socket) as (conn, specs, layout):
        header = {"version": 3, "layout": layout, "tensors": specs, "transport": "shared_memory"}
        framing.send_json(conn, b"PUSH", header)
        (kind, payload), fds = framing.recv_frame_with_fds(conn)
        assert kind == b"GO  " and len(fds) == 2  # the set, and the raw region (an idle host)
        size = framing.parse_json(payload, "GO")["size"]
        os.pwrite(fds[0], b"\x7f" * min(size, 4096), 0)
        for fd in fds:
            os.close(fd)
    # ... or dies after copying the raw layers the host lays out, before SENT.
    with raw_push(receiver.local_socket) as (conn, specs, layout):
        header = {"version": 3, "layout": layout, "tensors": specs, "transport": "shared_memory"}
        framing.send_json(conn, b"PUSH", header)
        (kind, payload), fds = framing.recv_frame_with_fds(conn)
        for fd in fds:
            os.close(fd)
        assert framing.parse_json(payload, "GO")["host_layers"][0] < CFG.n_layers
        framing.send_frame(conn, b"RAW ")
    assert host.version == 0
    np.testing.assert_array_equal(greedy(host, "broken").tokens, before)
    # A host that is generating lays out nothing itself: its core stays with its samples.
    long = SamplingParams(0.0, max_new_tokens=40)
    host.submit(GenerateRequest("busy", PROMPT, sampling=long))
    busy = connect(receiver, "shared").push(scaled_params(7), 4)
    assert busy["transport"] == "shared_memory" and busy["host_layout_s"] == 0
    collect(host, 1)
    assert host.wait_serving(4, timeout=30)
    # A sender whose local socket does not answer (a host on another machine) takes TCP.
    away = WeightSender("127.0.0.1", receiver.port, TOKEN, local_socket="a3po-weights-gone")
    assert away.push(scaled_params(5), 1)["transport"] == "tcp" and away.local_socket == ""
    report = connect(receiver, "shared").push(scaled_params(6), 2)
    assert report["transport"] == "shared_memory"
    assert host.wait_serving(2, timeout=30)
    np.testing.assert_array_equal(
        greedy(host, "after").tokens, recompute_greedy(scaled_params(6), PROMPT, 6)
    )


@SHARED_ONLY
def test_a_host_where_memfd_is_refused_takes_pushes_over_tcp(monkeypatch):
    # A sandbox (seccomp) may refuse memfd_create: the receiver then offers no local socket
    # and a sender that has the platform's support pushes over TCP instead of failing.
    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "memfd_create", refused)
    host = InferenceHost(CFG, scaled_params(0), num_slots=2, prefill_buckets=(8,)).start()
    receiver = WeightReceiver(host, TOKEN)
    try:
        assert receiver.local_socket == ""
        sender = WeightSender("127.0.0.1", receiver.port, TOKEN, local_socket=receiver.local_socket)
        assert sender.push(scaled_params(1), 1)["transport"] == "tcp"
        assert host.wait_serving(1, timeout=30)
        np.testing.assert_array_equal(
            greedy(host, "after").tokens, recompute_greedy(scaled_params(1), PROMPT, 6)
        )
    finally:
        receiver.close()
        host.close()


class raw_push:
    """A connection that has proved the token and read the host's spec: (connection, serving
    tensors as JSON lists, layout)."""

    def __init__(self, port):
        if isinstance(port, str):  # the receiver's abstract Unix socket
            self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.conn.settimeout(30)
            self.conn.connect("\0" + port)
        else:
            self.conn = socket.create_connection(("127.0.0.1", port), timeout=30)

    def __enter__(self):
        hello = framing.recv_exact(self.conn, len(framing.MAGIC) + 32)
        self.conn.sendall(framing.mac(TOKEN.encode(), hello[len(framing.MAGIC) :]))
        kind, payload = framing.recv_frame(self.conn)
        assert kind == b"SPEC"
        spec = framing.parse_json(payload, "SPEC")
        return self.conn, spec["tensors"], spec["layout"]

    def __exit__(self, *exc):
        self.conn.close()


def test_staging_buffers_are_reused_and_a_held_set_is_never_overwritten():
    params = scaled_params(0)
    specs = weight_sync.tensor_specs(params)
    staging = weight_sync.StagingBuffers(specs, sets=2)
    a = staging.stage(params)
    b = staging.stage(scaled_params(1))  # a is held: b takes the other set
    assert a.slot != b.slot
    for name, array in a.arrays.items():
        np.testing.assert_array_equal(array, np.asarray(weight_sync.flatten_params(params)[name]))
        assert array.ctypes.data % weight_sync.ALIGNMENT == 0
    # Both held: a third stage waits until one is released, then reuses its buffers.
    got = []
    waiter = threading.Thread(target=lambda: got.append(staging.stage(scaled_params(2))))
    waiter.start()
    waiter.join(timeout=0.3)
    assert waiter.is_alive() and not got
    staging.release(a)
    waiter.join(timeout=30)
    (c,) = got
    assert c.slot == a.slot
    assert all(c.arrays[n] is a.arrays[n] for n in c.arrays)  # the same buffers, refilled
    with pytest.raises(TimeoutError):
        staging.stage(params, timeout=0.01)
    staging.hold(b)
    staging.release(b)
    staging.release(b)
    staging.release(c)
    with pytest.raises(RuntimeError, match="not held"):
        staging.release(c)
    with pytest.raises(ValueError, match="missing tensors"):
        staging.stage({"embed": params["embed"]})


def test_staging_buffers_grow_up_to_max_sets_before_waiting():
    params = scaled_params(0)
    staging = weight_sync.StagingBuffers(weight_sync.tensor_specs(params), sets=2, max_sets=3)
    held = [staging.stage(scaled_params(i)) for i in range(3)]  # the third set is new
    assert sorted(s.slot for s in held) == [0, 1, 2] and staging.num_sets == 3
    for i, staged in enumerate(held):  # each keeps its own values
        expected = weight_sync.flatten_params(scaled_params(i))
        for name, array in staged.arrays.items():
            np.testing.assert_array_equal(array, np.asarray(expected[name]))
    with pytest.raises(TimeoutError):  # at max_sets, all held: it waits
        staging.stage(params, timeout=0.01)
    staging.release(held[1])
    assert staging.stage(params).slot == 1 and staging.num_sets == 3
    with pytest.raises(ValueError, match="max_sets"):
        weight_sync.StagingBuffers(staging.specs, sets=2, max_sets=1)
