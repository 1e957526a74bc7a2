"""The system section's sub-sections, one per concern, and the flat names they replace.

Training layer (host-side shell).

:class:`~a3po_jax.training.config.SystemSection` keeps what every run sets (``mode``,
``max_staleness``, ``update_policy``, ``consume_order``, ``lockstep_decode_steps``) and
holds the rest in frozen, self-validating sub-sections, read as ``cfg.system.mesh.fsdp``:

* ``system.batch`` (:class:`BatchSection`): the step's batch geometry;
* ``system.placement`` (:class:`PlacementSection`): where the inference host runs;
* ``system.hosts`` (:class:`HostsSection`): deadlines and health checks of the hosts;
* ``system.mesh`` (:class:`MeshSection`): the trainer's mesh;
* ``system.run`` (:class:`RunSection`): recording, non-finite steps, heap trimming, the
  compilation cache.

Each sub-section checks its fields and the rules among them; the rules across sections
stay on ``SystemSection``. The flat names the fields had before (``system.inference_hosts``,
``system.mesh_fsdp``) still read, with a one-line deprecation notice: in an override
(:func:`parse_override`), as a ``SystemSection(...)`` keyword or ``dataclasses.replace``
change (:func:`with_flat_names`) and in a saved ``config.json`` (:data:`FLAT`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from a3po_jax.core.batch_plan import AUTO
from a3po_jax.training import compilation
from a3po_jax.training.config_values import (
    ConfigError,
    _check_address,
    _check_field,
    _check_types,
    _choice,
    _hints,
    _parse_value,
    _positive,
    announce_renamed,
)

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class BatchSection:
    """The step's batch geometry (:class:`a3po_jax.core.batch_plan.BatchPlan` reads it)."""

    micro_batch_size: int = 0  # sequences per micro-batch; 0 = whole batch at once
    length_bucket: int = 32  # sequence lengths are padded to multiples of this
    # Shared-prompt packing, one row [prompt | r_1 | … | r_G] per group (Periodic Async.),
    # exact and faster; "auto" packs wherever micro-batches hold whole groups (and split over
    # the mesh), else pads; true packs or is refused; false pads (docs/training.md)
    packed_prompts: bool | str = AUTO  # "auto", true or false
    # Groups packed into one row (shared-prompt packing): fewer padded slots, longer
    # attention rows; periodic mode folds one group at a time and always uses 1
    groups_per_row: int = 1  # groups per packed row (>= 1; > 1 packs, as packed_prompts=true)
    one_pass_old: bool = False  # prox=recompute with 1 minibatch: old = sg(current), no pass

    def __post_init__(self):
        where = "system.batch"
        _check_types(where, self)
        _positive(where, "micro_batch_size", self.micro_batch_size, allow_zero=True)
        _positive(where, "length_bucket", self.length_bucket)
        _positive(where, "groups_per_row", self.groups_per_row)


@dataclasses.dataclass(frozen=True)
class PlacementSection:
    """Where the inference host runs: embedded (the default), on devices of its own, on
    cores of its own, or remote (docs/scale-out.md); one of them at a time."""

    inference_hosts: str = ""  # comma-separated gRPC addresses; empty = a host this run starts
    host_token_file: str = ""  # file holding the remote hosts' token
    # Hosts joining and leaving during the run (docs/scale-out.md): a file of host:port
    # lines, re-read when it changes; a host added joins, a host removed leaves. It starts
    # as inference_hosts (written if absent); "" = the hosts stay those of inference_hosts
    hosts_file: str = ""  # membership file of the remote hosts (needs inference_hosts)
    host_leave_grace_s: float = 60.0  # a leaving host finishes what it holds for this long
    # Split cores (docs/scale-out.md): a local host process pinned to this many cores, the
    # trainer on the rest, weights pushed in the background; 0 = the embedded host
    inference_cores: int = 0  # cores of the local host process (0 = none)
    # Split devices: the embedded host serves on the last N devices (a mesh of its own,
    # tensor-parallel over inference_mesh_tensor), the trainer's mesh takes the others
    inference_devices: int = 0  # devices of the embedded host (0 = it shares device 0)
    inference_mesh_tensor: int = 1  # tensor-parallel size of the host's mesh (divides N)
    inference_dtype: str = ""  # serving dtype of a host this run starts; "" = model's

    def __post_init__(self):
        where = "system.placement"
        _check_types(where, self)
        for name in ("host_leave_grace_s", "inference_cores", "inference_devices"):
            _positive(where, name, getattr(self, name), allow_zero=True)
        _positive(where, "inference_mesh_tensor", self.inference_mesh_tensor)
        if self.inference_dtype:
            _choice(where, "inference_dtype", self.inference_dtype, DTYPES)
        for address in self.inference_hosts.split(","):
            _check_address(address.strip())
        if self.inference_hosts and not self.inference_hosts.replace(",", "").strip():
            raise ConfigError(
                f"{where}.inference_hosts={self.inference_hosts!r} lists no host:port (leave "
                "it empty for a host this run starts)"
            )
        if self.hosts_file and not self.inference_hosts:
            raise ConfigError(
                f"{where}.hosts_file={self.hosts_file!r} changes the remote hosts of a run: "
                f"it needs {where}.inference_hosts (the hosts it starts with)"
            )
        if len(self.placements) > 1:
            raise ConfigError(
                f"{where}.{f' and {where}.'.join(self.placements)} both place the inference "
                "host: set one of them (docs/scale-out.md)"
            )
        if self.inference_devices and self.inference_devices % self.inference_mesh_tensor:
            raise ConfigError(
                f"{where}.inference_mesh_tensor={self.inference_mesh_tensor} must divide "
                f"{where}.inference_devices={self.inference_devices}"
            )

    @property
    def placements(self) -> list[str]:
        """The fields that place the host away from the trainer's device 0 (at most one)."""
        on = {
            "inference_hosts": bool(self.inference_hosts),
            "inference_cores": self.inference_cores > 0,
            "inference_devices": self.inference_devices > 0,
        }
        return [name for name, placed in on.items() if placed]


@dataclasses.dataclass(frozen=True)
class HostsSection:
    """How long the trainer waits on its hosts, and how it checks remote ones."""

    rollout_timeout_s: float = 600.0  # give up waiting for a batch after this long
    timeout_s: float = 60.0  # remote hosts: stats/health call deadline (frozen host)
    hang_timeout_s: float = 300.0  # remote host with work and no new token: hung
    health_interval_s: float = 2.0  # remote hosts: seconds between health checks
    max_reissues: int = 2  # re-issues of a request after host failures before it is lost

    def __post_init__(self):
        where = "system.hosts"
        _check_types(where, self)
        for name in ("rollout_timeout_s", "timeout_s", "hang_timeout_s", "health_interval_s"):
            _positive(where, name, getattr(self, name))
        _positive(where, "max_reissues", self.max_reissues, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The trainer's mesh: each axis' size, -1 for all the devices the others leave."""

    data: int = 1  # data-parallel axis size
    fsdp: int = -1  # FSDP axis size (-1 = all remaining devices)
    tensor: int = 1  # tensor-parallel axis size

    def __post_init__(self):
        _check_types("system.mesh", self)
        for name in ("data", "fsdp", "tensor"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                raise ConfigError(f"system.mesh.{name} must be a positive int or -1, got {value}")


@dataclasses.dataclass(frozen=True)
class RunSection:
    """The machinery around the steps: recording, a guard on non-finite steps, the heap."""

    # Every consumed batch to run_dir/rollouts/ for a3po-train --replay (training/recording.py)
    record_rollouts: bool = False  # write each step's consumed groups, in consumption order
    max_nonfinite_steps: int = 3  # stop after this many non-finite steps in a row
    # Freed heap memory back to the OS every this many seconds (glibc malloc_trim, a thread;
    # training/heap.py): a CPU run's RSS stays near its live memory instead of creeping up
    trim_heap_every_s: float = 1.0  # 0 = never
    # With the trimmer on, blocks from this many MiB up are mmapped and go back at free (a
    # lower, steadier peak); 0 keeps glibc's own threshold (fewer page faults, faster steps:
    # docs/performance.md, "Memory of the main job").
    mmap_threshold_mib: int = 1
    # JAX's persistent compilation cache (training/compilation.py): a re-run, a resumed run
    # or the split host loads what an earlier process compiled; "" = none. A cache the
    # process already has (JAX_COMPILATION_CACHE_DIR) is kept.
    compile_cache_dir: str = compilation.DEFAULT_DIR
    # Compiled train-step programs kept in memory, one per packed shape met: a new shape past
    # this many drops them, and the shapes after compile again or load from the cache above
    # (compilation.ProgramBound: a lower peak on a CPU; docs/performance.md). 0 = keep all.
    max_train_programs: int = 3

    def __post_init__(self):
        _check_types("system.run", self)
        _positive("system.run", "max_nonfinite_steps", self.max_nonfinite_steps)
        _positive("system.run", "trim_heap_every_s", self.trim_heap_every_s, allow_zero=True)
        _positive("system.run", "mmap_threshold_mib", self.mmap_threshold_mib, allow_zero=True)
        _positive("system.run", "max_train_programs", self.max_train_programs, allow_zero=True)


# The sub-sections by their name in the system section.
SECTIONS: dict[str, type] = {
    "batch": BatchSection,
    "placement": PlacementSection,
    "hosts": HostsSection,
    "mesh": MeshSection,
    "run": RunSection,
}
# Each field's flat name before the split -> (sub-section, field).
FLAT: dict[str, tuple[str, str]] = {
    **{name: ("batch", name) for name in _hints(BatchSection)},
    **{name: ("placement", name) for name in _hints(PlacementSection)},
    "rollout_timeout_s": ("hosts", "rollout_timeout_s"),
    "host_timeout_s": ("hosts", "timeout_s"),
    "host_hang_timeout_s": ("hosts", "hang_timeout_s"),
    "host_health_interval_s": ("hosts", "health_interval_s"),
    "max_reissues": ("hosts", "max_reissues"),
    "mesh_data": ("mesh", "data"),
    "mesh_fsdp": ("mesh", "fsdp"),
    "mesh_tensor": ("mesh", "tensor"),
    **{name: ("run", name) for name in _hints(RunSection)},
}


def flat(key: str) -> tuple[str, str] | None:
    """``(sub-section, field)`` of a flat name (``inference_hosts``), or None; announces it
    once per process."""
    found = FLAT.get(key)
    if found is not None:
        announce_renamed(f"system.{key}", "system.{}.{}".format(*found))
    return found


def build(name: str, value: Any) -> Any:
    """The sub-section ``name`` from an instance of its class or a mapping of its fields
    (the others default); every error names ``system.<name>.<field>``."""
    cls, where = SECTIONS[name], f"system.{name}"
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a {cls.__name__} section or a mapping, got {value!r}")
    known = list(_hints(cls))
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"unknown config field(s) {unknown} in {where}; {where} has: {known}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, item in value.items():  # types first: the range checks compare numbers
        _check_field(f"{where}.{key}", _hints(cls)[key], item, defaults[key])
    return cls(**value)


def nested(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``SystemSection`` keyword arguments with each flat name (announced) moved into its
    sub-section, over what that sub-section's own argument sets."""
    moved: dict[str, dict[str, Any]] = {}
    out = {}
    for key, value in kwargs.items():
        found = flat(key) if key not in SECTIONS else None
        if found is None:
            out[key] = value
        else:
            moved.setdefault(found[0], {})[found[1]] = value
    for name, fields in moved.items():
        given = out.get(name, {})
        if isinstance(given, SECTIONS[name]):
            given = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)}
        out[name] = {**given, **fields} if isinstance(given, Mapping) else given
    return out


def with_flat_names(cls: type) -> type:
    """Class decorator: ``cls(...)`` (and ``dataclasses.replace``, which calls it) also
    takes the flat names of the sub-sections' fields, with a deprecation notice."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **nested(kwargs))

    cls.__init__ = __init__
    return cls


def parse_override(key: str, text: str) -> tuple[str, str, Any] | None:
    """``(sub-section, field, value)`` of an override ``system.<key>=<text>`` that sets a
    sub-section's field (``placement.inference_hosts``, or the flat ``inference_hosts``),
    else None."""
    name, _, field = key.partition(".")
    if name in SECTIONS and field:
        hints = _hints(SECTIONS[name])
        if field not in hints:
            raise ConfigError(
                f"unknown config field 'system.{key}'; system.{name} has: {', '.join(hints)}"
            )
    elif (found := flat(key)) is not None:
        name, field = found
        hints = _hints(SECTIONS[name])
    else:
        return None
    return name, field, _parse_value(text, hints[field], f"system.{name}.{field}")
