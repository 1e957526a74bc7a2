"""Split devices: a weight push from the trainer's mesh to the host's copies device to
device, and no byte of it passes through host memory (`sharding.copy_to_sharding`, the
host's `EngineCore.place_params` and `split_params`).

Under `sharding.no_host_transfers` (`jax.transfer_guard("disallow")`, and host-to-device and
device-to-host transfers refused even when explicit; device-to-device copies allowed), a
`jax.device_put` from an FSDP trainer's shards onto a tensor-parallel host is refused: it
reads the array into host memory. The host's first build and every push go through, for
trainer FSDP 1 and 2 and host tensor 1 and 2, and serve the trainer's weights exactly.

The main pytest process has one CPU device, so `test_four_device_pushes_in_a_subprocess`
re-runs this file with 4 virtual devices, where the `test_four_devices_*` tests run.
"""

import jax
import numpy as np
import pytest
from helpers.processes import run_file_on_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from a3po_jax.inference.engine import decode_layout
from a3po_jax.inference.host import InferenceHost
from a3po_jax.model import ModelConfig, init_params
from a3po_jax.parallel import sharding
from a3po_jax.parallel.sharding import make_mesh

four_only = pytest.mark.skipif(jax.device_count() != 4, reason="runs in the 4-device subprocess")
CFG = ModelConfig.tiny()


@pytest.mark.skipif(jax.device_count() != 1, reason="runs in the main process")
@pytest.mark.multidevice
def test_four_device_pushes_in_a_subprocess():
    run_file_on_devices(__file__, 4, "four_devices")


def trainer_params(fsdp: int, seed: int = 0):
    """The tiny model's params as a trainer on the first `fsdp` devices holds them."""
    mesh = make_mesh(1, fsdp, 1, devices=jax.devices()[:fsdp])
    params = init_params(CFG, jax.random.key(seed))
    return jax.device_put(params, sharding.param_shardings(params, mesh, sharding.TRAIN_RULES))


def host_mesh(tensor: int) -> Mesh:
    """The host on the last 2 devices: data 2 / tensor x tensor."""
    return make_mesh(2 // tensor, 1, tensor, devices=jax.devices()[2:])


@four_only
def test_four_devices_the_guard_refuses_a_copy_through_host_memory():
    # What a push did before: device_put from FSDP shards onto tensor shards.
    params = trainer_params(2)
    target = sharding.param_shardings(params, host_mesh(2), sharding.INFERENCE_RULES)
    with pytest.raises(Exception, match="Disallowed host-to-device"), sharding.no_host_transfers():
        jax.block_until_ready(jax.device_put(params, target))


@four_only
@pytest.mark.parametrize("fsdp", [1, 2])
@pytest.mark.parametrize("tensor", [1, 2])
def test_four_devices_a_push_never_passes_through_host_memory(fsdp, tensor):
    first, second = trainer_params(fsdp, seed=0), trainer_params(fsdp, seed=1)
    mesh = host_mesh(tensor)
    with sharding.no_host_transfers():
        host = InferenceHost(CFG, first, num_slots=2, prefill_buckets=(8,), mesh=mesh)
        host.update_weights(second, 1)
    # The staged split is the second weights, laid out for the host's tensor size.
    staged, version = host._staged
    assert version == 1 and staged.shards == tensor
    expected = decode_layout.decode_params(
        jax.device_get(second), CFG, out_major=True, shards=tensor
    )
    for got, want in zip(jax.tree.leaves(staged), jax.tree.leaves(expected), strict=True):
        assert got.sharding.device_set == set(mesh.devices.flat)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    host.close()


@four_only
@pytest.mark.parametrize(
    "source_devices,source_spec,target_devices,spec",
    [
        ((0, 1), P("fsdp"), (2, 3), P(None, "tensor")),  # FSDP rows -> tensor columns
        ((0, 1), P("fsdp"), (2, 3), P("tensor")),  # the same blocks: whole shards move
        ((0, 1, 2), P("fsdp"), (3,), P()),  # three shards put together on one device
        ((0, 1, 2), P(None, "fsdp"), (3, 1), P("tensor")),  # 3 shards into 2 across
        ((0,), P(), (1, 2, 3), P(None, "tensor")),  # one device, cut there
        ((0, 1), P(), (2, 3), P("tensor")),  # replicas: each block copied once
        ((0, 1, 2, 3), P("fsdp"), (0,), P()),  # the shared host: device 0 among them
    ],
)
def test_four_devices_copy_to_sharding_is_device_to_device(
    source_devices, source_spec, target_devices, spec
):
    devices = jax.devices()
    x = np.arange(12 * 12, dtype=np.float32).reshape(12, 12)
    source_mesh = Mesh(np.asarray([devices[i] for i in source_devices]), ("fsdp",))
    placed = jax.device_put(x, NamedSharding(source_mesh, source_spec))
    target_mesh = Mesh(np.asarray([devices[i] for i in target_devices]), ("tensor",))
    target = NamedSharding(target_mesh, spec)
    with sharding.no_host_transfers():
        got = jax.block_until_ready(sharding.copy_to_sharding(placed, target))
    assert got.sharding.is_equivalent_to(target, 2)
    np.testing.assert_array_equal(np.asarray(got), x)


@four_only
def test_four_devices_blocks_split_two_ways_are_put_together_on_the_target():
    # A trainer with FSDP x tensor: each host shard overlaps blocks along both axes.
    devices = jax.devices()
    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    source = Mesh(np.asarray(devices[:4]).reshape(2, 2), ("fsdp", "tensor"))
    placed = jax.device_put(x, NamedSharding(source, P("fsdp", "tensor")))
    for target_devices, spec in (((3,), P()), ((2, 3), P(None, "t")), ((1, 2), P("t"))):
        mesh = Mesh(np.asarray([devices[i] for i in target_devices]), ("t",))
        target = NamedSharding(mesh, spec)
        with sharding.no_host_transfers():
            got = jax.block_until_ready(sharding.copy_to_sharding(placed, target))
        np.testing.assert_array_equal(np.asarray(got), x)


def live_bytes(devices) -> dict:
    """Bytes of every live array's shards, per device of ``devices``."""
    out, seen = dict.fromkeys(devices, 0), set()
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffer = (shard.device, shard.data.unsafe_buffer_pointer())
            if shard.device in out and buffer not in seen:  # a shard is an array too
                seen.add(buffer)
                out[shard.device] += shard.data.nbytes
    return out


@four_only
@pytest.mark.parametrize("tensor", [1, 2])
def test_four_devices_a_push_holds_a_devices_share_of_the_model_not_the_whole(tensor, monkeypatch):
    """Per host device, what a push adds beside the copy it serves stays within 1/T of the
    model plus one layer in transit (0.1 of it here, 8 layers + the embedding): the placed
    model is never whole on a device beside its split. Measured at every program boundary
    of the push (each layer placed), from the live arrays' shards."""
    cfg = ModelConfig.tiny(n_layers=8)
    mesh = host_mesh(tensor)
    trainer = make_mesh(1, 2, 1, devices=jax.devices()[:2])
    first, second = (
        jax.device_put(p, sharding.param_shardings(p, trainer, sharding.TRAIN_RULES))
        for p in (init_params(cfg, jax.random.key(s)) for s in (0, 1))
    )
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(second))
    host = InferenceHost(cfg, first, num_slots=2, prefill_buckets=(8,), mesh=mesh)
    core, devices = host._core, list(mesh.devices.flat)
    seen = []
    place = type(core).place_params

    def place_and_measure(self, params):
        placed = jax.block_until_ready(place(self, params))
        seen.append(live_bytes(devices))
        return placed

    monkeypatch.setattr(type(core), "place_params", place_and_measure)
    before = live_bytes(devices)
    split = jax.block_until_ready(core.place_and_split(second))
    seen.append(live_bytes(devices))
    assert len(seen) == cfg.n_layers + 1  # a layer at a time, then the split whole
    peak = max(max(s[d] - before[d] for d in devices) for s in seen)
    bound = model_bytes / tensor + 0.1 * model_bytes
    assert peak <= bound, f"{peak / model_bytes:.2f} of the model per device at tensor {tensor}"
    # The split itself is the device's share (with the replicated norms).
    share = max(s[d] - before[d] for s in seen[-1:] for d in devices)
    assert share <= model_bytes / tensor + 0.02 * model_bytes
    expected = decode_layout.decode_params(jax.device_get(second), cfg, shards=tensor)
    for got, want in zip(jax.tree.leaves(split), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    host.close()
