"""Where generation runs relative to training: the run's inference host, placed.

Training layer (host-side shell). One setting of ``system`` picks the placement
(docs/scale-out.md):

* **shared** (default): an embedded `InferenceHost` on this process's first device, which is
  also in the trainer's mesh; generation and training take turns on the same hardware.
* **split devices** (``system.placement.inference_devices=N``): the embedded host serves on
  the last N devices, a mesh of its own; the trainer's mesh takes the others (`device_split`).
* **split cores** (``system.placement.inference_cores=N``): a local host process pinned to N
  cores (`LocalHostProcess`), the trainer pinned to the rest; weights go over the host's weight
  port in the background while the host keeps generating (`HostPool(background_push=True)`).
* **remote hosts** (``system.placement.inference_hosts=a:p,b:q``): gRPC hosts started elsewhere
  (``python -m a3po_jax.cli.serve``, `scripts/launch.py`), also pushed in the background;
  with ``system.placement.hosts_file`` hosts join and leave during the run (`host_pool`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from a3po_jax.inference.remote.pool import HostPool
from a3po_jax.parallel import sharding
from a3po_jax.parallel.sharding import make_mesh

log = logging.getLogger(__name__)

# The split of this process's cores (host cores, trainer cores), made once: after the
# trainer pins itself, its own affinity no longer shows the host's cores.
_CORE_SPLIT: tuple[list[int], list[int]] | None = None


def split_cores(host_cores: int) -> tuple[list[int], list[int]]:
    """(cores for the local host, cores for the trainer): the first `host_cores` of the
    cores this process may run on, and the rest. ValueError if none would be left."""
    global _CORE_SPLIT
    if _CORE_SPLIT is None or len(_CORE_SPLIT[0]) != host_cores:
        allowed = sorted(os.sched_getaffinity(0)) if _CORE_SPLIT is None else sum(_CORE_SPLIT, [])
        if not 0 < host_cores < len(allowed):
            raise ValueError(
                f"system.placement.inference_cores={host_cores} must leave the trainer at least "
                f"one of the {len(allowed)} cores this process may use ({allowed})"
            )
        _CORE_SPLIT = (allowed[:host_cores], allowed[host_cores:])
    return _CORE_SPLIT


def pin_trainer(host_cores: int) -> list[int]:
    """Pins this process to the trainer's share of the cores (`split_cores`); call it before
    JAX starts, so that XLA sizes its thread pool to them. Returns those cores."""
    _, trainer = split_cores(host_cores)
    if sorted(os.sched_getaffinity(0)) != trainer:
        os.sched_setaffinity(0, trainer)
        log.info("trainer pinned to cores %s", trainer)
    return trainer


def start_local_host(cfg, *, num_slots: int, prefill_buckets: Sequence[int], max_cache_len: int):
    """A started `LocalHostProcess` for the run's model on its cores (`split_cores`), with
    the update policy the mode needs and the run's serving dtype."""
    from a3po_jax.inference.remote.local_process import LocalHostProcess

    host_cores, _ = split_cores(cfg.system.placement.inference_cores)
    return LocalHostProcess(
        model=cfg.model.name,
        cores=host_cores,
        update_policy=cfg.system.effective_update_policy,
        param_dtype=cfg.system.placement.inference_dtype or cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype,
        init_seed=cfg.model.seed,
        num_slots=num_slots,
        prefill_buckets=prefill_buckets,
        max_cache_len=max_cache_len,
        batch_invariant=cfg.rollout.batch_invariant,
        compile_cache_dir=cfg.system.run.compile_cache_dir,
    ).start()


def host_pool(addresses: Sequence[str], token: str, system) -> HostPool:
    """A `HostPool` over gRPC hosts, with the run's health settings and background pushes.

    Requests spread over the hosts; one that dies or hangs is taken out and its work
    re-issued to the others, and it is taken back (current weights first) when it answers
    again. Every host must be up at start. With ``system.placement.hosts_file`` the pool
    watches that file: a ``host:port`` line added joins that host (same token), a line
    removed makes it leave (`check_hosts_file` sets the file up first).
    """
    from a3po_jax.inference.remote.grpc_client import GrpcInferenceClient

    def connect(address: str) -> GrpcInferenceClient:
        return GrpcInferenceClient(address, token, timeout=system.hosts.timeout_s)

    clients = []
    try:
        for address in addresses:
            clients.append(connect(address))
        return HostPool(
            clients,
            health_interval_s=system.hosts.health_interval_s,
            hang_timeout_s=system.hosts.hang_timeout_s,
            max_reissues=system.hosts.max_reissues,
            background_push=True,
            hosts_file=system.placement.hosts_file or None,
            leave_grace_s=system.placement.host_leave_grace_s,
            connect=connect,
        )
    except BaseException:
        for client in clients:
            client.close()
        raise


def check_hosts_file(addresses: Sequence[str], path: str) -> None:
    """The membership file a run starts with lists the run's starting hosts: written so if
    absent; ValueError naming both lists if it lists others (the run would make the hosts
    it does not list leave at its first look); the ended mark of a run resumed is dropped."""
    from a3po_jax.inference.remote import membership_file

    membership_file.start_run(path, addresses)


def meshes(system) -> tuple[Mesh, Mesh | None]:
    """(the trainer's mesh, the embedded host's mesh or None): with
    ``system.placement.inference_devices`` the host takes the last N devices (``data`` x
    ``tensor``, tensor = ``system.placement.inference_mesh_tensor``) and the trainer the
    others; else the trainer takes them all and the host shares the first."""
    trainer_devices, host_mesh = None, None
    if system.placement.inference_devices:
        host_devices, trainer_devices = device_split(system.placement.inference_devices)
        tensor = system.placement.inference_mesh_tensor
        host_mesh = make_mesh(len(host_devices) // tensor, 1, tensor, devices=host_devices)
    mesh = make_mesh(
        system.mesh.data, system.mesh.fsdp, system.mesh.tensor, devices=trainer_devices
    )
    return mesh, host_mesh


# The model's dimension each logical axis a sharding rule splits, as a ModelConfig field.
MODEL_DIMENSIONS = {
    "vocab": "vocab_size",
    "embed": "d_model",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "head_dim": "head_dim",
    "mlp": "ffn_dim",
}
# The config fields behind the trainer's mesh axes.
TRAINER_AXES = {
    "data": "system.mesh.data",
    "fsdp": "system.mesh.fsdp",
    "tensor": "system.mesh.tensor",
}


def check_placement(cfg, model_config, num_devices: int, *, processes: int = 1) -> None:
    """Every placement `meshes`, the placed train state, the batch and the embedded host
    would refuse, checked from the config, the model's config (no weights) and the device
    count, before anything loads: the devices ``system.placement.inference_devices`` leaves the
    trainer, the trainer's ``system.mesh.*`` sizes against them, each mesh axis against the
    model's dimensions it splits (`sharding.TRAIN_RULES` / `INFERENCE_RULES`), a micro-batch
    against the trainer's batch parts, and the host's slots against its ``data`` axis.

    Raises:
      ValueError: one line naming the fields (and the model dimension) that do not fit.
    """
    system = cfg.system
    host = system.placement.inference_devices
    if host and processes > 1:
        raise ValueError(
            f"system.placement.inference_devices={host} runs in one process so far; this job "
            f"has {processes} processes (serve from hosts of their own: "
            "system.placement.inference_hosts, scripts/launch.py)"
        )
    if host and not 0 < host < num_devices:
        raise ValueError(
            f"system.placement.inference_devices={host} must leave the trainer at least one of the "
            f"{num_devices} devices ({jax.default_backend()}; on a CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    trainer_devices = num_devices - host
    whose = "devices"
    if host:
        whose = f"devices left to the trainer by system.placement.inference_devices={host}"
    requested = {"data": system.mesh.data, "fsdp": system.mesh.fsdp, "tensor": system.mesh.tensor}
    sizes = sharding.mesh_sizes(
        requested, trainer_devices, names=TRAINER_AXES, where="the trainer's mesh", devices=whose
    )
    described = {axis: f"{TRAINER_AXES[axis]}={sizes[axis]}" for axis in sizes}
    _check_dimensions(model_config, cfg.model.name, sizes, described, sharding.TRAIN_RULES)
    _check_batch(cfg, sizes, described)
    if host:
        tensor = system.placement.inference_mesh_tensor
        host_sizes = {"data": host // tensor, "fsdp": 1, "tensor": tensor}
        data = (
            f"system.placement.inference_devices={host} / "
            f"system.placement.inference_mesh_tensor={tensor}"
        )
        host_described = {
            "data": f"the host's data axis ({data} = {host // tensor})",
            "fsdp": "the host's fsdp axis (1)",
            "tensor": f"system.placement.inference_mesh_tensor={tensor}",
        }
        _check_dimensions(
            model_config, cfg.model.name, host_sizes, host_described, sharding.INFERENCE_RULES
        )
        slots = cfg.rollout.num_slots
        if slots % host_sizes["data"]:
            raise ValueError(
                f"rollout.num_slots={slots} must be a multiple of the host's data axis ({data} "
                f"= {host_sizes['data']}): the slots are split over it"
            )


def _check_dimensions(model_config, model_name, sizes, described, rules) -> None:
    """ValueError naming the mesh's fields and the model's dimension they do not divide."""
    for logical, axes in sharding.rule_axes(rules).items():
        parts = math.prod(sizes[axis] for axis in axes)
        if parts == 1 or logical not in MODEL_DIMENSIONS:
            continue
        field = MODEL_DIMENSIONS[logical]
        value = getattr(model_config, field)
        if value % parts:
            fields = " x ".join(described[axis] for axis in axes)
            raise ValueError(
                f"{fields} does not divide the model's {field}={value} "
                f"(model.name={model_name!r}): the {logical!r} axis of its weights is split "
                f"over it"
            )


def _check_batch(cfg, sizes, described) -> None:
    """ValueError naming the fields when a micro-batch does not split over the trainer's
    batch parts (its data x fsdp axes)."""
    from a3po_jax.core.batch_plan import BatchPlan

    axes = sharding.rule_axes(sharding.TRAIN_RULES)["batch"]
    parts = math.prod(sizes[axis] for axis in axes)
    plan = cfg.batch_plan if parts == 1 else BatchPlan.from_config(cfg, batch_shards=parts)
    rows = plan.leading_rows_per_micro_batch
    if rows % parts:
        kind = "packed rows" if plan.packed else "sequences"
        raise ValueError(
            f"a micro-batch's {rows} {kind} (rollout.group_size={cfg.rollout.group_size}, "
            f"rollout.groups_per_step={cfg.rollout.groups_per_step}, "
            f"algo.num_minibatches={cfg.algo.num_minibatches}, "
            f"system.batch.micro_batch_size={cfg.system.batch.micro_batch_size}) do not split "
            f"over the trainer's {parts} batch parts ({' x '.join(described[a] for a in axes)})"
        )


def device_split(num_inference: int) -> tuple[list[jax.Device], list[jax.Device]]:
    """(the host's devices, the trainer's devices): the last `num_inference` of this
    process's devices and the others. ValueError if none would be left for training."""
    devices = jax.devices()
    if not 0 < num_inference < len(devices):
        raise ValueError(
            f"system.placement.inference_devices={num_inference} must leave the trainer at "
            f"least one of the {len(devices)} devices ({jax.default_backend()}; on a CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    return devices[-num_inference:], devices[:-num_inference]


def start_run_host(cfg, model_config, params, host_mesh):
    """(the run's own inference host, the local host process behind it or None), placed as
    ``system`` says: a local host process on cores of its own behind a pool
    (``system.placement.inference_cores``), or an embedded host (on ``host_mesh`` with split
    devices)."""
    system, rollout = cfg.system, cfg.rollout
    if not system.placement.inference_cores:
        # Lockstep: the trainer's thread drives it (not started).
        start = system.lockstep_decode_steps == 0
        return embedded_host(cfg, model_config, params, host_mesh, start=start), None
    pin_trainer(system.placement.inference_cores)  # the CLI did, before JAX started
    local = start_local_host(
        cfg,
        num_slots=rollout.num_slots,
        prefill_buckets=tuple(rollout.prompt_buckets),
        max_cache_len=cfg.host_cache_len,
    )
    try:
        return host_pool([local.address], local.token, system), local
    except BaseException:
        local.close()
        raise


def embedded_host(
    cfg, model_config, params, host_mesh, *, start: bool, version: int = 0, update_policy=None
):
    """An in-process inference host sized by the rollout settings, serving ``params`` as
    ``version`` under ``update_policy`` (None: the mode's); started if ``start``."""
    from a3po_jax.inference.host import InferenceHost

    rollout = cfg.rollout
    host = InferenceHost(
        model_config,
        params,
        mesh=host_mesh,
        num_slots=rollout.num_slots,
        prefill_buckets=tuple(rollout.prompt_buckets),
        max_cache_len=cfg.host_cache_len,
        version=version,
        update_policy=update_policy or cfg.system.effective_update_policy,
        seed=0,
        batch_invariant=rollout.batch_invariant,
    )
    return host.start() if start else host
