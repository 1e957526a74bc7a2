"""Typed, frozen run configuration, validated at construction.

Training layer (host-side shell).

A run is one :class:`TrainConfig` made of small sections. An experiment is a Python file
with a ``config()`` function returning one (see ``experiments/``); the CLI applies
``section.field=value`` overrides on top and validates the result before anything starts.
Every error names the field and, for choices, the allowed values.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import traceback
import types
import typing
from pathlib import Path
from typing import Any

from a3po_jax.core import advantages, importance, losses, prox
from a3po_jax.core.train_step import LOSS_TERMS

MODES = ("sync", "periodic", "one_step_off", "async")
# The algorithm choices are the keys of the core's tables: one list, where the code is.
PROX_MODES = tuple(prox.PROX_RULES)
LOSSES = tuple(LOSS_TERMS)
ADVANTAGES = tuple(advantages.ESTIMATORS)
AGGREGATIONS = losses.AGGREGATIONS
KL_KINDS = losses.KL_KINDS
CAP_MODES = losses.CAP_MODES
SEQ_CAP_MODES = importance.SEQ_CAP_MODES
SEQ_WEIGHT_FORMS = importance.SEQ_FORMS
DPO_KINDS = losses.DPO_KINDS
ZERO_STALENESS = prox.ZERO_STALENESS
UPDATE_POLICIES = ("in_flight", "drain")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or inconsistent."""


# η of the modes that fix it; "async" takes system.max_staleness (design §4).
_MODE_STALENESS = {"sync": 0, "periodic": 0, "one_step_off": 1}


def staleness_bound(mode: str, max_staleness: int) -> int:
    """The staleness bound η a run in ``mode`` is held to.

    ``sync`` and ``periodic`` train on fresh samples only (0), ``one_step_off`` on samples
    exactly one version old (1); only ``async`` takes the configured ``max_staleness``.
    The one place this rule lives: the trainer (through
    :attr:`SystemSection.effective_staleness`) and the results tables both ask it.
    """
    _choice("system", "mode", mode, MODES)
    return _MODE_STALENESS.get(mode, max_staleness)


def _choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name}={value!r} is not one of {', '.join(allowed)}")


def _positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        field = f"{section}.{name}" if section else name  # top-level fields have no section
        raise ConfigError(f"{field} must be {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which policy model to train."""

    name: str = "smollm2"  # "smollm2", "tiny" (random, for tests) or a HF dir / .gguf path
    param_dtype: str = "float32"  # parameter storage dtype
    compute_dtype: str = "float32"  # matmul dtype (logits and softmax are always float32)
    remat: bool = False  # rematerialise layer activations in the backward pass
    seed: int = 0  # init seed for random ("tiny") models

    def __post_init__(self):
        _choice("model", "param_dtype", self.param_dtype, DTYPES)
        _choice("model", "compute_dtype", self.compute_dtype, DTYPES)
        if not self.name:
            raise ConfigError("model.name must be 'smollm2', 'tiny' or a checkpoint path")


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """Where prompts and rewards come from."""

    name: str = "chain_sum"  # a name from a3po_jax.tasks.make_task
    options: str = "{}"  # JSON object of task keyword arguments (difficulty etc.)
    split: str = "train"  # split the trainer draws prompts from
    format_reward: float = 0.0  # bonus for answering in the expected format
    no_eos_penalty: float = 0.0  # subtracted when a sample hits max_new_tokens

    def __post_init__(self):
        try:
            opts = json.loads(self.options)
        except json.JSONDecodeError as err:
            raise ConfigError(f"task.options is not valid JSON: {err}") from None
        if not isinstance(opts, dict):
            raise ConfigError(f"task.options must be a JSON object, got {self.options!r}")

    @property
    def kwargs(self) -> dict[str, Any]:
        return json.loads(self.options)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """How rollouts are sampled."""

    group_size: int = 4  # G samples per prompt
    groups_per_step: int = 8  # B prompts (groups) consumed per optimizer step
    max_new_tokens: int = 48  # generation budget per sample
    temperature: float = 1.0  # sampling temperature (the loss uses logits / temperature)
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # top-k sampling (0 = off)
    num_slots: int = 32  # concurrent sequences in the embedded inference host
    prompt_buckets: tuple[int, ...] = (64, 128, 256)  # prompt padding buckets (compiles)

    def __post_init__(self):
        for name in ("group_size", "groups_per_step", "max_new_tokens", "num_slots"):
            _positive("rollout", name, getattr(self, name))
        _positive("rollout", "temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        _positive("rollout", "top_k", self.top_k, allow_zero=True)
        if not self.prompt_buckets or list(self.prompt_buckets) != sorted(self.prompt_buckets):
            raise ConfigError(
                f"rollout.prompt_buckets must be increasing, got {self.prompt_buckets}"
            )


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    """The loss and where its pieces come from."""

    loss: str = "ppo"  # "ppo" (clip family) or "dpo" (Online DPO)
    prox: str = "a3po"  # proximal policy: "recompute", "a3po" or "behav" (naive)
    a3po_zero_staleness: str = "current"  # A-3PO at d=0: "current" (paper) or "behav" (AReaL)
    advantage: str = "grpo"  # "grpo", "drgrpo" (no std division) or "rloo"
    aggregation: str = "token_mean"  # loss aggregation (design §3)
    clip_eps: float = 0.2  # ε_low
    clip_eps_high: float = 0.0  # ε_high; 0 means = clip_eps
    dual_clip: float = 0.0  # c > 1 enables dual clipping; 0 = off
    behav_weight_cap: float = 0.0  # cap on w = π_prox/π_behav; 0 = off
    cap_mode: str = "mask"  # "mask" or "truncate" (token-level MIS / TIS, Yao et al. 2025)
    seq_weight_cap: float = 0.0  # C > 1 on the sequence weight Π w_t (Liu, Li 2025); 0 = off
    seq_cap_mode: str = "truncate"  # "truncate" (seq-TIS), "mask" (seq-MIS), "mask_both"
    seq_weight_form: str = "product"  # sequence weight: "product" or "geometric_mean"
    kl_coef: float = 0.0  # reference KL coefficient; 0 = no reference model
    kl_kind: str = "k3"  # "k1", "k2", "k3"
    kl_in_reward: bool = False  # subtract β·KL from rewards instead of adding it to the loss
    dpo_beta: float = 0.1  # Online DPO β
    dpo_kind: str = "sigmoid"  # "sigmoid" or "ipo"
    num_minibatches: int = 1  # optimizer steps per batch (each is one version)

    def __post_init__(self):
        _choice("algo", "loss", self.loss, LOSSES)
        _choice("algo", "prox", self.prox, PROX_MODES)
        _choice("algo", "a3po_zero_staleness", self.a3po_zero_staleness, ZERO_STALENESS)
        _choice("algo", "advantage", self.advantage, ADVANTAGES)
        _choice("algo", "aggregation", self.aggregation, AGGREGATIONS)
        _choice("algo", "cap_mode", self.cap_mode, CAP_MODES)
        _choice("algo", "seq_cap_mode", self.seq_cap_mode, SEQ_CAP_MODES)
        _choice("algo", "seq_weight_form", self.seq_weight_form, SEQ_WEIGHT_FORMS)
        if self.seq_weight_cap and self.seq_weight_cap <= 1:
            raise ConfigError(
                f"algo.seq_weight_cap must be > 1 (or 0 = off), got {self.seq_weight_cap}"
            )
        if self.seq_weight_cap and self.behav_weight_cap:
            raise ConfigError(
                "algo.behav_weight_cap (token level) and algo.seq_weight_cap (sequence level) "
                "are alternatives: set one of them to 0"
            )
        _choice("algo", "kl_kind", self.kl_kind, KL_KINDS)
        _choice("algo", "dpo_kind", self.dpo_kind, DPO_KINDS)
        _positive("algo", "clip_eps", self.clip_eps)
        for name in ("clip_eps_high", "behav_weight_cap", "kl_coef"):
            _positive("algo", name, getattr(self, name), allow_zero=True)
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"algo.dual_clip must be > 1 (or 0 = off), got {self.dual_clip}")
        _positive("algo", "dpo_beta", self.dpo_beta)
        _positive("algo", "num_minibatches", self.num_minibatches)


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """AdamW with linear warm-up and global-norm clipping."""

    learning_rate: float = 1e-5  # peak learning rate
    warmup_steps: int = 0  # linear warm-up length (optimizer steps)
    weight_decay: float = 0.0  # decoupled weight decay
    b1: float = 0.9  # Adam β1
    b2: float = 0.999  # Adam β2
    eps: float = 1e-8  # Adam ε
    grad_clip: float = 1.0  # max global gradient norm; 0 = off

    def __post_init__(self):
        _positive("optim", "learning_rate", self.learning_rate)
        _positive("optim", "warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optim", "grad_clip", self.grad_clip, allow_zero=True)
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SystemSection:
    """Training mode, staleness, and the machinery around the step."""

    mode: str = "async"  # "sync", "periodic", "one_step_off" or "async" (design §4)
    max_staleness: int = 2  # η for "async"; fixed to 0 / 1 by the other modes
    update_policy: str = "in_flight"  # weight updates on the host: "in_flight" or "drain"
    micro_batch_size: int = 0  # sequences per micro-batch; 0 = whole batch at once
    length_bucket: int = 32  # sequence lengths are padded to multiples of this
    inference_hosts: str = ""  # comma-separated gRPC addresses; empty = embedded host
    host_token_file: str = ""  # file holding the remote hosts' token
    rollout_timeout_s: float = 600.0  # give up waiting for a batch after this long
    host_timeout_s: float = 60.0  # remote hosts: stats/health call deadline (frozen host)
    host_hang_timeout_s: float = 300.0  # remote host with work and no new token: hung
    host_health_interval_s: float = 2.0  # remote hosts: seconds between health checks
    max_reissues: int = 2  # re-issues of a request after host failures before it is lost
    max_nonfinite_steps: int = 3  # stop after this many non-finite steps in a row
    packed_prompts: bool = False  # shared-prompt packing: one row per group (Periodic Async.)
    one_pass_old: bool = False  # prox=recompute with 1 minibatch: old = sg(current), no pass
    mesh_data: int = 1  # trainer mesh: data-parallel axis size
    mesh_fsdp: int = -1  # trainer mesh: FSDP axis size (-1 = all remaining devices)
    mesh_tensor: int = 1  # trainer mesh: tensor-parallel axis size

    def __post_init__(self):
        _choice("system", "mode", self.mode, MODES)
        _choice("system", "update_policy", self.update_policy, UPDATE_POLICIES)
        _positive("system", "max_staleness", self.max_staleness, allow_zero=True)
        _positive("system", "micro_batch_size", self.micro_batch_size, allow_zero=True)
        _positive("system", "length_bucket", self.length_bucket)
        _positive("system", "rollout_timeout_s", self.rollout_timeout_s)
        _positive("system", "max_nonfinite_steps", self.max_nonfinite_steps)
        _positive("system", "host_timeout_s", self.host_timeout_s)
        _positive("system", "host_hang_timeout_s", self.host_hang_timeout_s)
        _positive("system", "host_health_interval_s", self.host_health_interval_s)
        _positive("system", "max_reissues", self.max_reissues, allow_zero=True)
        for name in ("mesh_data", "mesh_fsdp", "mesh_tensor"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                raise ConfigError(f"system.{name} must be a positive int or -1, got {value}")
        if self.mode == "periodic" and self.max_staleness > 0:
            raise ConfigError(
                "system.mode='periodic' is strictly on-policy: system.max_staleness must be 0, "
                f"got {self.max_staleness}"
            )

    @property
    def effective_staleness(self) -> int:
        """η the producer is held to: 0 for sync/periodic, 1 for one_step_off."""
        return staleness_bound(self.mode, self.max_staleness)

    @property
    def effective_update_policy(self) -> str:
        """Only "async" may update weights in flight; the others need whole-version samples."""
        return self.update_policy if self.mode == "async" else "drain"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run."""

    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    algo: AlgoSection = AlgoSection()
    optim: OptimSection = OptimSection()
    system: SystemSection = SystemSection()
    steps: int = 20  # optimizer steps (versions) to train
    seed: int = 0  # seeds data order, sampling and everything else
    run_dir: str = "runs/default"  # where metrics, config and checkpoints go
    checkpoint_every: int = 10  # save every N steps (and on SIGTERM / at the end); 0 = off
    # Greedy pass@1 on the task's test split every N steps and at the end (eval/* metrics,
    # on an embedded evaluation host of its own); 0 = off.
    eval_every: int = 0
    eval_prompts: int = 64  # test prompts per evaluation (the first N of the split)

    def __post_init__(self):
        _positive("", "steps", self.steps)
        _positive("", "checkpoint_every", self.checkpoint_every, allow_zero=True)
        _positive("", "eval_every", self.eval_every, allow_zero=True)
        _positive("", "eval_prompts", self.eval_prompts)
        if self.algo.loss == "dpo" and self.rollout.group_size != 2:
            raise ConfigError(
                "algo.loss='dpo' compares 2 samples per prompt: rollout.group_size must be 2, "
                f"got {self.rollout.group_size}"
            )
        if self.algo.advantage == "rloo" and self.rollout.group_size < 2:
            raise ConfigError("algo.advantage='rloo' needs rollout.group_size >= 2")
        batch = self.rollout.group_size * self.rollout.groups_per_step
        if batch % self.algo.num_minibatches:
            raise ConfigError(
                f"algo.num_minibatches={self.algo.num_minibatches} must divide the batch of "
                f"{batch} sequences (rollout.group_size x rollout.groups_per_step)"
            )
        mb = self.system.micro_batch_size
        if mb and (batch // self.algo.num_minibatches) % mb:
            raise ConfigError(
                f"system.micro_batch_size={mb} must divide the minibatch of "
                f"{batch // self.algo.num_minibatches} sequences"
            )
        if self.system.one_pass_old and (
            self.algo.prox != "recompute" or self.algo.num_minibatches != 1
        ):
            raise ConfigError(
                "system.one_pass_old=true reuses the current log-probs as the old policy's, "
                "which is exact only with algo.prox='recompute' and algo.num_minibatches=1"
            )
        if self.system.packed_prompts and mb and (mb % self.rollout.group_size):
            raise ConfigError(
                f"system.packed_prompts packs whole groups: system.micro_batch_size={mb} must "
                f"be a multiple of rollout.group_size={self.rollout.group_size}"
            )
        if (
            self.system.mode == "periodic"
            and mb
            and not self.system.packed_prompts
            and self.rollout.group_size % mb
        ):
            raise ConfigError(
                "system.mode='periodic' folds each group into the gradient as it arrives: "
                f"system.micro_batch_size={mb} must divide rollout.group_size="
                f"{self.rollout.group_size}"
            )
        if self.system.mode == "periodic" and self.algo.num_minibatches != 1:
            raise ConfigError(
                "system.mode='periodic' takes one optimizer step per iteration: "
                "algo.num_minibatches must be 1"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------
# Overrides and experiment files.
# --------------------------------------------------------------------------------------


def _parse_value(text: str, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} expects a bool (true/false), got {text!r}")
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where} expects an int, got {text!r}") from None
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where} expects a float, got {text!r}") from None
    if origin is tuple:
        parts = [p for p in text.replace("(", "").replace(")", "").split(",") if p.strip()]
        (elem,) = {a for a in typing.get_args(annotation) if a is not Ellipsis}
        return tuple(_parse_value(p.strip(), elem, where) for p in parts)
    if annotation is str or origin in (types.UnionType, typing.Union):
        return text
    raise ConfigError(f"{where}: cannot parse a value of type {annotation}")


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Apply ``section.field=value`` (or top-level ``field=value``) strings.

    Unknown sections or fields and unparsable values raise :class:`ConfigError` naming them;
    the result is re-validated as a whole.
    """
    top_hints = typing.get_type_hints(TrainConfig)
    changes: dict[str, dict[str, Any]] = {}
    top_changes: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if "." in key:
            section, field = key.split(".", 1)
            if section not in top_hints or not dataclasses.is_dataclass(top_hints[section]):
                sections = [k for k, v in top_hints.items() if dataclasses.is_dataclass(v)]
                raise ConfigError(f"unknown config section {section!r}; sections: {sections}")
            hints = typing.get_type_hints(top_hints[section])
            if field not in hints:
                raise ConfigError(
                    f"unknown config field {key!r}; {section} has: {', '.join(hints)}"
                )
            changes.setdefault(section, {})[field] = _parse_value(text, hints[field], key)
        else:
            if key not in top_hints or dataclasses.is_dataclass(top_hints[key]):
                raise ConfigError(f"unknown config field {key!r}")
            top_changes[key] = _parse_value(text, top_hints[key], key)
    updated = {s: dataclasses.replace(getattr(config, s), **f) for s, f in changes.items()}
    return dataclasses.replace(config, **updated, **top_changes)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved with ``to_dict`` (e.g. a run's ``config.json``)."""
    top_hints = typing.get_type_hints(TrainConfig)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in top_hints:
            raise ConfigError(f"unknown config field {key!r}")
        hint = top_hints[key]
        if dataclasses.is_dataclass(hint):
            known = {f.name for f in dataclasses.fields(hint)}
            unknown = set(value) - known
            if unknown:
                raise ConfigError(f"unknown config field(s) {sorted(unknown)} in section {key!r}")
            value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
            kwargs[key] = hint(**value)
        else:
            kwargs[key] = value
    return TrainConfig(**kwargs)


def import_experiment(path: str | Path) -> types.ModuleType:
    """Import an experiment file as a module (its ``config()``, maybe its ``SWEEP``).

    Raises:
      ConfigError: the file does not exist, or importing it raised; the message names the
        file, the error and the line of the experiment file it came from.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ConfigError(
            f"experiment file {_where(path, err)} failed to import: {_describe(err)}"
        ) from err
    return module


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _where(path: Path, err: BaseException) -> str:
    """``'experiments/x.py' line 12``: the innermost line of ``path`` in ``err``'s traceback."""
    line = None
    if (
        isinstance(err, SyntaxError)
        and err.filename
        and Path(err.filename).resolve() == path.resolve()
    ):
        line = err.lineno  # raised while compiling the file: no frame of it to point at
    for frame in traceback.extract_tb(err.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    return f"{str(path)!r}" + (f" line {line}" if line else "")


def load_experiment(path: str | Path) -> TrainConfig:
    """Import an experiment file and call its ``config()``.

    Raises:
      ConfigError: for a missing file, one that fails to import, has no ``config()``, or
        whose ``config()`` raises or returns something other than a :class:`TrainConfig`.
    """
    path = Path(path)
    module = import_experiment(path)
    if not hasattr(module, "config"):
        raise ConfigError(f"experiment file {str(path)!r} has no config() function")
    try:
        config = module.config()
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"experiment file {_where(path, err)}: config() raised {_describe(err)}"
        ) from err
    if not isinstance(config, TrainConfig):
        raise ConfigError(f"{path}: config() returned {type(config).__name__}, not TrainConfig")
    return config
