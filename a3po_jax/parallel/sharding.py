"""Device mesh and the one table that maps the model's logical axes to mesh axes.

Parallel layer (core side): meshes, sharding and processes, used by the core and the shell.

The model names logical axes only (`model.PARAM_LOGICAL_AXES`: "embed", "heads", ...).
Here a rules table maps each logical name to a mesh axis (or a tuple of them, or None for
replicated), one preset per role:

* `TRAIN_RULES`: FSDP + tensor parallel. Weights are split over `fsdp` along d_model and
  over `tensor` along heads / ffn / vocab; the batch is split over `data` and `fsdp`.
* `INFERENCE_RULES`: tensor parallel only; weights are replicated over `data` (and `fsdp`,
  normally size 1 on an inference host) so each decode step reads local weights.

A logical axis with no rule, or a dimension the mesh does not divide, is an error that
names the parameter and both numbers: silently replicating a 8B weight is not an option.

Mesh axes: ("data", "fsdp", "tensor").
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from a3po_jax.model import (
    KV_CACHE_LOGICAL_AXES,
    TOKENS_LOGICAL_AXES,
    KVCache,
    Params,
    logical_axes,
    tree_path_str,
)

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("cache_length", None),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("labels", None),  # a reward head's single output: nothing to split
)

# The training table with d_model not split over `fsdp`: each decode step reads local weights.
INFERENCE_RULES: Rules = tuple(
    (name, None if name == "embed" else axes) for name, axes in TRAIN_RULES
)


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all).

    One size may be -1: it takes whatever the others leave. Sizes whose product is not the
    device count are an error naming each axis (`mesh_sizes`).
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = mesh_sizes({"data": data, "fsdp": fsdp, "tensor": tensor}, len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    try:
        # Lays axes out along the physical interconnect on TPU/GPU (tensor innermost).
        grid = mesh_utils.create_device_mesh(shape, devices)
    except Exception:  # CPU or an irregular device list: plain order is as good as any
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


class IndivisibleError(ValueError):
    """A dimension that the mesh axes it is split over do not divide (``mesh_axes``: their
    names), so a caller can name the setting behind each axis."""

    def __init__(self, mesh_axes: tuple[str, ...], message: str):
        super().__init__(message)
        self.mesh_axes = tuple(mesh_axes)


def mesh_sizes(
    sizes: dict[str, int],
    num_devices: int,
    *,
    names: dict[str, str] | None = None,
    where: str = "make_mesh",
    devices: str = "devices",
) -> dict[str, int]:
    """The axis sizes of a mesh over `num_devices` devices, -1 resolved, without devices:
    what `make_mesh` would build, checked before any device is touched.

    `names` labels each axis in the error (default: the axis name; a config passes its
    fields); `where` starts the message and `devices` says whose devices they are.

    Raises:
      ValueError: naming each axis, for a size that is not a positive int or -1, two sizes of -1,
        a -1 the other sizes leave no whole number for, or a product that is not
        `num_devices`.
    """
    names = names or {}
    label = {axis: names.get(axis, axis) for axis in sizes}
    sizes = dict(sizes)
    for name, size in sizes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"{where}: {label[name]}={size!r} must be a positive int or -1")
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(f"{where}: only one axis may be -1, got {[label[n] for n in inferred]}")
    known = math.prod(size for size in sizes.values() if size != -1)
    described = ", ".join(f"{label[k]}={v}" for k, v in sizes.items())
    if inferred:
        if num_devices % known:
            raise ValueError(
                f"{where}: {label[inferred[0]]}=-1 cannot be inferred: {num_devices} {devices} "
                f"are not divisible by the other axes ({described})"
            )
        sizes[inferred[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        product = " x ".join(f"{label[k]}={v}" for k, v in sizes.items())
        raise ValueError(
            f"{where}: {product} = {math.prod(sizes.values())} but there are {num_devices} "
            f"{devices}"
        )
    return sizes


def _rule_table(rules: Rules) -> dict[str, MeshAxes]:
    table: dict[str, MeshAxes] = {}
    for logical, mesh_axes in rules:
        if logical in table:
            raise ValueError(f"rules map logical axis {logical!r} twice")
        table[logical] = mesh_axes
    return table


def _mesh_axes_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def rule_axes(rules: Rules) -> dict[str, tuple[str, ...]]:
    """The mesh axes each logical axis of `rules` is split over (() for replicated)."""
    return {logical: _mesh_axes_tuple(axes) for logical, axes in _rule_table(rules).items()}


def logical_to_spec(
    axes: Sequence[str],
    rules: Rules,
    *,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
    name: str = "array",
) -> PartitionSpec:
    """PartitionSpec of an array whose dimensions have logical names `axes`.

    With `mesh` and `shape`, also checks every sharded dimension divides evenly.
    Raises ValueError naming `name` for a logical axis with no rule, a mesh axis the mesh
    does not have, a mesh axis used twice, or an indivisible dimension (both sizes given).
    """
    table = _rule_table(rules)
    spec, used = [], set()
    for dim, logical in enumerate(axes):
        if logical not in table:
            raise ValueError(
                f"{name}: logical axis {logical!r} (dimension {dim}) has no sharding rule; "
                f"rules cover {sorted(table)}"
            )
        mesh_axes = _mesh_axes_tuple(table[logical])
        for axis in mesh_axes:
            if mesh is not None and axis not in mesh.shape:
                raise ValueError(f"{name}: rule {logical!r} -> {axis!r} names no mesh axis")
            if axis in used:
                raise ValueError(f"{name}: mesh axis {axis!r} would shard two dimensions")
            used.add(axis)
        if mesh is not None and shape is not None and mesh_axes:
            parts = math.prod(mesh.shape[axis] for axis in mesh_axes)
            if shape[dim] % parts:
                raise IndivisibleError(
                    mesh_axes,
                    f"{name}: {logical} = {shape[dim]} (dimension {dim}) is not divisible by "
                    f"mesh axes {mesh_axes} of size {parts}",
                )
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def param_shardings(
    params_or_shapes: Params, mesh: Mesh, rules: Rules, axes: Params | None = None
) -> Params:
    """A `NamedSharding` for every parameter (arrays or `jax.ShapeDtypeStruct`s).

    `axes` defaults to `model.logical_axes(params_or_shapes)`; pass it for trees the model
    does not know (e.g. extra heads).
    """
    axes = logical_axes(params_or_shapes) if axes is None else axes
    flat_axes = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params_or_shapes)
    shardings = [
        NamedSharding(
            mesh,
            logical_to_spec(
                leaf_axes, rules, mesh=mesh, shape=np.shape(leaf), name=tree_path_str(path)
            ),
        )
        for (path, leaf), leaf_axes in zip(leaves, flat_axes, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, shardings)


def check_batch_divisible(batch_size: int, mesh: Mesh, rules: Rules = TRAIN_RULES) -> None:
    """Error naming both numbers when the batch does not split evenly over its mesh axes."""
    logical_to_spec(("batch",), rules, mesh=mesh, shape=(batch_size,), name="batch")


def batch_shards(mesh: Mesh, rules: Rules = TRAIN_RULES) -> int:
    """How many parts ``rules`` split the batch axis into on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in _mesh_axes_tuple(_rule_table(rules)["batch"]))


def batch_sharding(
    mesh: Mesh, rules: Rules = TRAIN_RULES, batch_size: int | None = None
) -> NamedSharding:
    """Sharding of [B, T] inputs (tokens, positions, masks, per-token losses)."""
    shape = None if batch_size is None else (batch_size, 1)
    spec = logical_to_spec(TOKENS_LOGICAL_AXES, rules, mesh=mesh, shape=shape, name="batch")
    return NamedSharding(mesh, spec)


def kv_cache_shardings(
    mesh: Mesh, rules: Rules = INFERENCE_RULES, cache: KVCache | None = None
) -> KVCache:
    """Shardings of a `KVCache` (pass `cache`, or its shapes, to check divisibility)."""
    k_shape = None if cache is None else np.shape(cache.k)
    len_shape = None if cache is None else np.shape(cache.lengths)
    kv = NamedSharding(
        mesh, logical_to_spec(KV_CACHE_LOGICAL_AXES, rules, mesh=mesh, shape=k_shape, name="kv")
    )
    lengths = NamedSharding(
        mesh, logical_to_spec(("batch",), rules, mesh=mesh, shape=len_shape, name="lengths")
    )
    return KVCache(k=kv, v=kv, lengths=lengths)


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated (scalars, PRNG keys, small tables)."""
    return NamedSharding(mesh, PartitionSpec())


def shard_params(params: Params, shardings: Params) -> Params:
    """Place (or re-place) every parameter with its sharding."""
    return jax.device_put(params, shardings)


def device_to_device(tree, shardings):
    """Every array of `tree` copied onto its sharding in `shardings` (a matching tree of
    `NamedSharding`s, on these or other devices) without a byte passing through host memory
    (`copy_to_sharding`)."""
    return jax.tree.map(copy_to_sharding, tree, shardings)


def copy_to_sharding(x: jax.Array, target: NamedSharding) -> jax.Array:
    """`x` placed as `target` says, device to device.

    `jax.device_put` copies between device sets device to device only where each of the
    target's shards is a whole shard of the source (or the source is on one device); for
    any other pair (an FSDP trainer's shards against a tensor-parallel host's) it reads the
    whole array into host memory and copies it back. Here each target shard is made from
    the source shards it overlaps: each overlap is cut out on its source device (a compiled
    slice, skipped where the whole shard is needed), copied device to device, and the parts
    are put together on the target device (a compiled program). Each byte a target device
    needs crosses once, and no collective runs. On the same devices it is one compiled
    reshard.
    """
    if not isinstance(x, jax.Array):  # host data (a checkpoint read into numpy): a load
        return jax.device_put(x, target)
    source = x.sharding
    if source.device_set == target.device_set:
        return x if source.is_equivalent_to(target, x.ndim) else _resharder(target)(x)
    shards = {}  # one source shard per distinct block: a replica is not copied twice
    for shard in x.addressable_shards:
        shards.setdefault(_block(shard.index, x.shape), shard.data)
    pieces = []
    for device, index in target.addressable_devices_indices_map(x.shape).items():
        block = _block(index, x.shape)
        parts = []
        for held, data in shards.items():
            overlap = tuple(
                (max(a, c), min(b, d)) for (a, b), (c, d) in zip(block, held, strict=True)
            )
            if all(lo < hi for lo, hi in overlap) or not block:
                if overlap != held:  # only the overlap leaves its device
                    data = _slicer(
                        tuple(
                            (lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, held, strict=True)
                        )
                    )(data)
                at = tuple(lo - a for (lo, _), (a, _) in zip(overlap, block, strict=True))
                parts.append((jax.device_put(data, device), at))
        if len(parts) == 1 and parts[0][0].shape == tuple(b - a for a, b in block):
            pieces.append(parts[0][0])
        else:
            shape = tuple(b - a for a, b in block)
            offsets = tuple(at for _, at in parts)
            pieces.append(_assembler(shape, offsets)(*(data for data, _ in parts)))
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


def _block(index: tuple[slice, ...], shape) -> tuple[tuple[int, int], ...]:
    """A shard's index as (start, stop) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=1024)
def _slicer(block: tuple[tuple[int, int], ...]):
    """A compiled cut of `block` out of an array, on the array's device."""
    return jax.jit(lambda a: a[tuple(slice(lo, hi) for lo, hi in block)])


@functools.lru_cache(maxsize=1024)
def _assembler(shape: tuple[int, ...], offsets: tuple[tuple[int, ...], ...]):
    """A compiled program putting parts together into one array of `shape`, part i at
    `offsets[i]`, on the parts' device."""

    def assemble(*parts):
        # Parts side by side along one axis (an FSDP split): one concatenation, no fill.
        axes = {i for at in offsets for i, o in enumerate(at) if o}
        if len(axes) == 1:
            (axis,) = axes
            order = sorted(range(len(parts)), key=lambda i: offsets[i][axis])
            if sum(parts[i].shape[axis] for i in order) == shape[axis] and all(
                parts[i].shape[:axis] + parts[i].shape[axis + 1 :]
                == shape[:axis] + shape[axis + 1 :]
                for i in order
            ):
                return jnp.concatenate([parts[i] for i in order], axis=axis)
        out = jnp.zeros(shape, parts[0].dtype)
        for part, at in zip(parts, offsets, strict=True):
            out = jax.lax.dynamic_update_slice(out, part, at)
        return out

    return jax.jit(assemble)


@contextlib.contextmanager
def no_host_transfers() -> Iterator[None]:
    """Inside: every transfer between host memory and a device is refused, explicit ones
    included (`jax.transfer_guard`); copies from device to device are allowed. What a push
    between meshes runs under in the tests and `scripts/bench_weight_push.py`."""
    with (
        jax.transfer_guard("disallow"),
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        yield


@functools.lru_cache(maxsize=256)
def _resharder(target: NamedSharding):
    """A compiled identity whose output lies as `target` says (a reshard on the devices)."""
    return jax.jit(lambda x: x, out_shardings=target)
