"""Fuzzing the run configuration and `a3po-train`'s checks: every bad value of every field
ends in one line naming the field and nothing written; valid values always build.

The fields are enumerated from the dataclasses, so a field added to a section is fuzzed
without a line here. What counts as bad without knowing the field: NaN and ±inf for a
float, a value outside int32 or below zero for a number (-1 is "all" or "automatic" in
the fields whose default is -1 and in `config.MINUS_ONE_FIELDS`), a duration past
`config.MAX_SECONDS`, a value of the wrong type (and text that does not parse as the
field's type), an unknown choice. Zero and text are
field-specific: they must build or be refused naming the field, never anything else.

Most of it runs in process through `a3po_jax.cli.train.validate` (what the CLI checks before
it announces a run); three subprocess runs check the CLI's whole answer (exit code 2, one
stderr line, no traceback, no run dir) for the cases the issue reported. Fixed example
budgets, derandomized: the whole file runs in well under a minute.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from helpers.processes import cpu_env
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from a3po_jax.cli.train import Refused, main, validate
from a3po_jax.core import objectives
from a3po_jax.tasks.jsonl_task import JsonlTask
from a3po_jax.training.config import (
    INT_LIMIT,
    MAX_SECONDS,
    MINUS_ONE_FIELDS,
    ConfigError,
    TrainConfig,
    apply_overrides,
)

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke_tiny.py")
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _fields() -> dict[str, type]:
    """Every config field as ``section.field`` (top-level fields bare) with its type; each
    objective's settings as ``algo.<objective>.<field>``, the system's sub-sections' fields
    as ``system.<sub-section>.<field>``."""
    found = {}
    for name, hint in typing.get_type_hints(TrainConfig).items():
        if dataclasses.is_dataclass(hint):
            for field, inner in typing.get_type_hints(hint).items():
                if not dataclasses.is_dataclass(inner):
                    found[f"{name}.{field}"] = inner
                    continue
                for part, innermost in typing.get_type_hints(inner).items():
                    found[f"{name}.{field}.{part}"] = innermost
        else:
            found[name] = hint
    del found["algo.settings"]
    for name, own in TrainConfig().algo.settings.items():
        for field, inner in typing.get_type_hints(type(own)).items():
            found[f"algo.{name}.{field}"] = inner
    return found


FIELDS = _fields()
NUMERIC = sorted(k for k, h in FIELDS.items() if h in (int, float))
TEXT = sorted(k for k, h in FIELDS.items() if h is str)
# Fields that name a file or directory (run_dir, host_token_file, ...), and model.name,
# which is one unless it is "tiny" or "smollm2".
PATHS = sorted(k for k in FIELDS if k.endswith(("_dir", "_file", "_path")) or k == "model.name")


def _replace(cfg: TrainConfig, key: str, value) -> TrainConfig:
    """``cfg`` with one field set to a Python value, as an experiment file could set it."""
    if "." not in key:
        return dataclasses.replace(cfg, **{key: value})
    if key.startswith("system.") and key.count(".") == 2:  # system.<sub-section>.<field>
        _, name, field = key.split(".")
        part = dataclasses.replace(getattr(cfg.system, name), **{field: value})
        return dataclasses.replace(cfg, system=dataclasses.replace(cfg.system, **{name: part}))
    if key.count(".") == 2:  # algo.<objective>.<field>
        _, name, field = key.split(".")
        own = {**dataclasses.asdict(cfg.algo.settings[name]), field: value}
        every = {**cfg.algo.settings, name: own}
        return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, settings=every))
    section, field = key.split(".")
    return dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})}
    )


def _names(key: str, message: str) -> bool:
    return key in message


def minus_one_means_something(key: str) -> bool:
    """-1 is a value of ``key`` ("all", "automatic"): named, or the field's default."""
    section, _, field = key.rpartition(".")
    owner = functools.reduce(getattr, section.split("."), TrainConfig()) if section else None
    owner = owner or TrainConfig()
    return key in MINUS_ONE_FIELDS or getattr(owner, field) == -1


def generic_bad_values(key: str) -> list:
    """Python values bad for ``key`` whatever the field means."""
    hint = FIELDS[key]
    wrong_type = [None, [], {}, object(), b"1"]
    if hint is float:
        bad = [math.nan, math.inf, -math.inf, "0.5", True, 1j, -1e-9, -1.5, -1e300]
        if not minus_one_means_something(key):
            bad.append(-1.0)
        if key.endswith("_s"):
            bad += [MAX_SECONDS * 2, 1e300]
        return wrong_type + bad
    if hint is int:
        bad = [INT_LIMIT, -INT_LIMIT - 1, 10**40, 1.0, 2.5, "3", True, math.nan]
        bad += [-2, -(10**6)] + ([] if minus_one_means_something(key) else [-1])
        return wrong_type + bad
    if hint is bool:
        return wrong_type + [0, 1, "true", 1.0]
    if hint == bool | str:  # true, false or "auto"
        return wrong_type + [0, 1, "true", "Auto", "", 1.0]
    if hint is str:
        return wrong_type + [1, 1.5, True, "a\x00b"]
    if hint == tuple[int, ...]:
        return wrong_type + [[64, 128], (64, "128"), (64, 2.5), (True,), (INT_LIMIT,)]
    return wrong_type


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_every_field_refuses_values_bad_for_any_field(key):
    """Set in Python (an experiment file's config()): each refused naming the field."""
    base = TrainConfig()
    for value in generic_bad_values(key):
        with pytest.raises(ConfigError) as err:
            _replace(base, key, value)
        assert _names(key, str(err.value)), (key, value, str(err.value))


def test_the_enumeration_sees_every_section():
    # A guard for the enumeration itself: sections and fields of all kinds are found.
    assert {"algo.clip_eps", "system.hosts.rollout_timeout_s", "run_dir", "model.name"} <= set(
        FIELDS
    )
    assert "rollout.prompt_buckets" in FIELDS and "steps" in NUMERIC and "run_dir" in PATHS
    assert {"algo.m2po.tau", "algo.dpo.kind"} <= set(FIELDS)  # each objective's settings


# --------------------------------------------------------------------------------------
# Override text, through the CLI's own checks (in process).
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def check_refused_or_valid(workdir: Path, key: str, text: str, *, must_refuse: bool) -> None:
    """``a3po-train SMOKE run_dir=<fresh> key=text``'s checks: refused naming ``key`` (or
    accepted, unless ``must_refuse``), and nothing written in either case."""
    run_dir = workdir / "run"
    before = sorted(workdir.rglob("*"))
    try:
        validate(SMOKE, [f"run_dir={run_dir}", "steps=2", f"{key}={text}"])
    except Refused as err:
        message = str(err)
        assert "\n" not in message, message
        assert _names(key, message), (key, text, message)
    else:
        assert not must_refuse, f"{key}={text!r} was accepted"
    assert sorted(workdir.rglob("*")) == before, "a refused or checked run wrote files"


def _numeric_text(key: str):
    """Override text for a number field: non-finite, out of int32, negative, not a number."""
    hint = FIELDS[key]
    bad = st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "", " ", "x"])
    big = st.integers(min_value=INT_LIMIT, max_value=10**30).map(str)
    neg = st.integers(max_value=-2 if minus_one_means_something(key) else -1, min_value=-(10**30))
    neg = neg.map(str)
    junk = st.text(min_size=1, max_size=8).filter(lambda t: not _parses(t, key))
    options = [bad, big, neg, junk]
    if hint is int:
        options.append(st.floats(allow_nan=False, allow_infinity=False).map(repr))
    if key.endswith("_s"):
        options.append(st.sampled_from(["1e300", repr(MAX_SECONDS * 4)]))
    return st.one_of(options)


def _parses(text: str, key: str) -> bool:
    """Whether ``text`` is a number of ``key``'s type that no field refuses outright."""
    try:
        value = FIELDS[key](text)
    except (ValueError, OverflowError):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value >= 0 or (value == -1 and minus_one_means_something(key))


@FUZZ
@given(data=st.data())
def test_bad_numbers_from_the_command_line_are_refused_naming_the_field(workdir, data):
    key = data.draw(st.sampled_from(NUMERIC), label="field")
    text = data.draw(_numeric_text(key), label="text")
    must = not _parses(text.strip(), key) or FIELDS[key] is int and int(text) >= INT_LIMIT
    check_refused_or_valid(workdir, key, text, must_refuse=must)


@FUZZ
@example(key="algo.clip_eps", text="0")
@example(key="steps", text="0")
@example(key="optim.eps", text="0")
# Placements this process's one device cannot take, refused before the model loads.
@example(key="system.placement.inference_devices", text="1")
@example(key="system.mesh.fsdp", text="2")
@example(key="system.mesh.data", text="2147483647")
@given(
    key=st.sampled_from(NUMERIC),
    text=st.sampled_from(["0", "0.0", "1", "1e-30", "1e30", "2147483647"]),
)
def test_zero_tiny_and_huge_numbers_build_or_are_refused_naming_the_field(workdir, key, text):
    """Zero, tiny and huge valid numbers: field-specific, so either outcome, but a refusal
    names the field and nothing else escapes (no TypeError, no OverflowError)."""
    if FIELDS[key] is int and not re.fullmatch(r"-?\d+", text):
        text = "1"
    check_refused_or_valid(workdir, key, text, must_refuse=False)


@FUZZ
@example(key="task.name", text="gsm9k")
@example(key="task.split", text="validation")
@example(key="model.name", text="/no/such/model")
@example(key="system.placement.inference_hosts", text="localhost")
# No address: once passed, then the token.
@example(key="system.placement.inference_hosts", text=" ")
@example(key="algo.loss", text="")
@example(key="algo.loss", text="\n")  # once echoed raw in the registry's hint: two lines
@example(key="run_dir", text="")
@given(
    key=st.sampled_from(TEXT),
    text=st.one_of(
        st.sampled_from(["", " ", "é", "日本語", "\u202e", "a" * 300, "../..", "x,y"]),
        st.text(max_size=12).filter(lambda t: "\x00" not in t),
    ),
)
def test_any_text_builds_or_is_refused_naming_the_field(workdir, key, text):
    """Empty, non-ASCII, long and random text for every string field."""
    if key == "run_dir":  # a run dir under the fuzz dir: an accepted one is still not made
        text = str(workdir / "runs" / text) if text.strip() else text
    check_refused_or_valid(workdir, key, text, must_refuse=False)


@FUZZ
@given(
    options=st.dictionaries(
        st.sampled_from(["letters", "seed", "train_size", "test_size", "bogus"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(min_value=-(10**12), max_value=10**12),
            st.floats(),
            st.text(max_size=6),
            st.lists(st.integers(), max_size=2),
        ),
        max_size=3,
    )
)
def test_task_options_build_or_are_refused_naming_the_task(workdir, options):
    text = json.dumps(options)  # NaN and Infinity included: Python's JSON reads them
    run_dir = workdir / "run"
    try:
        validate(SMOKE, [f"run_dir={run_dir}", "task.name=letters", f"task.options={text}"])
    except Refused as err:
        assert "task.options" in str(err) and "\n" not in str(err)
    assert not run_dir.exists()


@pytest.mark.parametrize("key", PATHS)
def test_paths_that_cannot_be_used_are_refused_naming_the_field(workdir, key):
    """Unwritable (run dir) or unreadable (files) paths, and a file where a directory goes."""
    a_file = workdir / "a_file"
    a_file.write_text("")
    bad = [str(a_file / "below"), "/proc/forbidden/x"]
    # A directory (the run's, the compilation cache) must be one it can make; a file must
    # exist and be a file.
    bad += (
        [str(a_file)] if key.endswith("_dir") else [str(workdir / "missing" / "file"), str(workdir)]
    )
    for text in bad:
        extra = (
            ["system.placement.inference_hosts=localhost:1"]
            if key == "system.placement.host_token_file"
            else []
        )
        run_dir = workdir / "run"
        args = [f"run_dir={run_dir}", *extra, f"{key}={text}"]
        with pytest.raises(Refused) as err:
            validate(SMOKE, args)
        assert key in str(err.value), (text, str(err.value))
        assert not run_dir.exists() and a_file.read_text() == ""
    a_file.unlink()


# --------------------------------------------------------------------------------------
# Valid values: any combination builds.
# --------------------------------------------------------------------------------------


def choices_of(key: str) -> tuple[str, ...] | None:
    """The allowed values of a choice field, read from its own refusal (None: free text)."""
    try:
        _replace(TrainConfig(), key, "\x01")
    except ConfigError as err:
        found = re.search(r"is not one of (.*)$", str(err))
        # "... is not one of a, b, c" and maybe " (a hint)" after the names
        return tuple(found.group(1).split(" (")[0].split(", ")) if found else None
    return None


CHOICES = {k: c for k in TEXT if (c := choices_of(k))}


@st.composite
def valid_configs(draw) -> dict[str, object]:
    """Choice fields from their allowed values, bools free, numbers inside their ranges;
    then the combination rules the config documents (periodic is on-policy, a loss may
    fix the group size (DPO trains pairs) or the prox rules it takes (IcePop: not behav),
    async η >= k - 1, one_pass_old needs recompute with one minibatch, the two weight caps
    are alternatives, an unpacked periodic fold's micro-batches divide the group)."""
    values: dict[str, object] = {k: draw(st.sampled_from(c)) for k, c in CHOICES.items()}
    for key, hint in FIELDS.items():
        if hint is bool:
            values[key] = draw(st.booleans())
    values.update(
        {
            "algo.clip_eps": draw(st.floats(0.01, 10.0)),
            "algo.clip_eps_high": draw(st.sampled_from([0.0, 0.1, 0.3])),
            "algo.dual_clip": draw(st.sampled_from([0.0, 1.5, 3.0])),
            "algo.kl_coef": draw(st.floats(0.0, 1.0)),
            "algo.num_minibatches": draw(st.sampled_from([1, 2])),
            "rollout.temperature": draw(st.floats(0.05, 4.0)),
            "rollout.top_p": draw(st.floats(0.05, 1.0)),
            "rollout.top_k": draw(st.integers(0, 50)),
            "rollout.group_size": draw(st.sampled_from([2, 4, 8])),
            "optim.learning_rate": draw(st.floats(1e-8, 1.0)),
            "optim.b1": draw(st.floats(0.0, 0.99)),
            "optim.b2": draw(st.floats(0.0, 0.999)),
            "system.max_staleness": draw(st.integers(0, 8)),
            "system.hosts.rollout_timeout_s": draw(st.floats(0.001, 1e6)),
            "seed": draw(st.integers(0, INT_LIMIT - 1)),
            "steps": draw(st.integers(1, 10**6)),
        }
    )
    cap = draw(st.sampled_from(["none", "token", "seq"]))
    values["algo.behav_weight_cap"] = 2.0 if cap == "token" else 0.0
    values["algo.seq_weight_cap"] = 2.0 if cap == "seq" else 0.0
    pairs = objectives.get(values["algo.loss"]).layout.group_size  # DPO: 2 (a pair)
    if pairs is not None:
        values["rollout.group_size"] = pairs
    rules = objectives.get(values["algo.loss"]).prox_rules  # IcePop: recompute or a3po
    if rules is not None and values["algo.prox"] not in rules:
        values["algo.prox"] = draw(st.sampled_from(rules))
    if values["system.mode"] == "periodic":
        values["system.max_staleness"] = 0
    k = values["algo.num_minibatches"]
    values["system.max_staleness"] = max(values["system.max_staleness"], k - 1)
    if values["system.mode"] == "periodic":
        values["algo.num_minibatches"], values["system.max_staleness"] = 1, 0
    if values["algo.prox"] != "recompute" or values["algo.num_minibatches"] != 1:
        values["system.batch.one_pass_old"] = False
    # The default packs wherever micro-batches hold whole groups, else pads: never refused
    # where false builds (a periodic fold's micro-batches must divide the group unpacked).
    values["system.batch.packed_prompts"] = draw(st.sampled_from(["auto", False]))
    mb = draw(st.sampled_from([0, 1, 2, 4, 8]))  # divides every minibatch drawn here
    unpacked_periodic = (
        values["system.mode"] == "periodic" and values["system.batch.packed_prompts"] is False
    )
    if unpacked_periodic and mb and values["rollout.group_size"] % mb:
        mb = 0
    values["system.batch.micro_batch_size"] = mb
    return values


@settings(max_examples=200, deadline=None, derandomize=True)
@given(values=valid_configs())
def test_any_combination_of_valid_values_builds(values):
    overrides = [f"{k}={_text(v)}" for k, v in values.items()]
    cfg = apply_overrides(TrainConfig(), overrides)
    assert cfg.algo.loss == values["algo.loss"] and cfg.system.mode == values["system.mode"]


def _text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------------------
# Experiment files and JSONL data.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,message",
    [
        ("raise RuntimeError('at import')\n", "line 1 failed to import: RuntimeError: at import"),
        ("import no_such_package_xyz\n", "ModuleNotFoundError"),
        ("def config():\n    return 1 / 0\n", "config() raised ZeroDivisionError"),
        ("def config():\n    return {'steps': 2}\n", "config() returned dict, not TrainConfig"),
        ("def config():\n    return None\n", "config() returned NoneType"),
        ("config = 3\n", "config"),
        ("def config(:\n", "failed to import: SyntaxError"),
        (
            "from a3po_jax.training.config import TrainConfig, AlgoSection\n"
            "def config():\n    return TrainConfig(algo=AlgoSection(clip_eps=float('nan')))\n",
            "algo.clip_eps must be a finite number",
        ),
        (
            "from a3po_jax.training.config import TrainConfig\n"
            "def config():\n    return TrainConfig(steps='20')\n",
            "steps must be an int, got '20'",
        ),
    ],
)
def test_broken_experiment_files_are_one_line_and_exit_2(tmp_path, capsys, source, message):
    path = tmp_path / "experiment.py"
    path.write_text(source)
    run_dir = tmp_path / "run"
    assert main([str(path), f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("a3po-train: ") and message in err, err
    assert not run_dir.exists()


GOOD_RECORD = json.dumps({"prompt": "2+2?", "answer": 4})


@settings(max_examples=150, deadline=None, derandomize=True)
@example(bad=b'{"prompt": "a", "answer": ', where=1)
@example(bad=b"\xff\xfe not utf-8", where=1)
@example(bad=b'{"prompt": "a"}', where=1)
@example(bad=b"[" * 5000, where=1)
@example(bad=b'{"prompt": ["x"], "answer": 1}', where=1)
@given(
    bad=st.one_of(
        st.binary(min_size=1, max_size=40),
        st.text(min_size=1, max_size=40).map(str.encode),
        st.builds(
            lambda d: json.dumps(d).encode(),
            st.dictionaries(
                st.sampled_from(["prompt", "answer", "id", "other"]),
                st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.text())),
            ),
        ),
    ),
    where=st.integers(0, 3),
)
def test_malformed_jsonl_lines_are_named_with_file_and_line(tmp_path_factory, bad, where):
    """One generated line among good records: it loads, or the error names the file and
    the line the bad record is on (never an error from deeper down)."""
    path = tmp_path_factory.mktemp("jsonl") / "data.jsonl"
    lines = [GOOD_RECORD.encode()] * 4
    lines.insert(where, bad.replace(b"\n", b" ").replace(b"\r", b" "))
    path.write_bytes(b"\n".join(lines) + b"\n")
    try:
        prompts = JsonlTask(str(path)).prompts("train")
    except ValueError as err:
        assert f"{path} line {where + 1}" in str(err), str(err)
    else:
        assert len(prompts) in (4, 5)


def test_malformed_jsonl_through_the_cli_checks_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(f"{GOOD_RECORD}\n{{not json\n")
    options = json.dumps({"path": str(path)})
    with pytest.raises(Refused, match=rf"task.split='train'.*{re.escape(str(path))} line 2"):
        validate(
            SMOKE, [f"run_dir={tmp_path / 'run'}", "task.name=jsonl", f"task.options={options}"]
        )
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------
# The reported cases, end to end.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        # Before: accepted; config.json, ledger, metrics and TensorBoard events written, then
        # a JAX traceback at step 1.
        ("algo.clip_eps=nan", "config error: algo.clip_eps must be a finite number, got nan"),
        # Before: a FileNotFoundError traceback and exit code 1.
        ("run_dir=/proc/forbidden/x", "config error: run_dir='/proc/forbidden/x' cannot be"),
        # Before: refused after the header line announced the run.
        ("task.name=gsm9k", "config error: task.name='gsm9k' with task.options={}: unknown"),
    ],
)
def test_reported_bad_values_end_in_one_line_and_exit_2(tmp_path, override, message):
    run_dir = tmp_path / "x"
    argv = [SMOKE, f"run_dir={run_dir}", "steps=2", override]
    proc = subprocess.run(
        [sys.executable, "-m", "a3po_jax.cli.train", *argv],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr  # one line only
    assert proc.stderr.startswith(f"a3po-train: {message}"), proc.stderr
    assert proc.stdout == ""
    assert not run_dir.exists()


# What split devices were refused with once the model had loaded and the run was announced,
# on 4 virtual devices; now one line naming the fields, before the start-up line.
PLACEMENTS = [
    (
        ["system.placement.inference_devices=3", "system.placement.inference_mesh_tensor=3"],
        "config error: system.placement.inference_mesh_tensor=3 does not divide the model's "
        "vocab_size=128",
    ),
    (
        ["system.placement.inference_devices=2", "system.mesh.fsdp=4"],
        "config error: the trainer's mesh: system.mesh.data=1 x system.mesh.fsdp=4 x "
        "system.mesh.tensor=1 = 4 but there are 2 devices left to the trainer by "
        "system.placement.inference_devices=2",
    ),
]
# The other placements refused after the load before, each through validate() on 4 devices.
MORE_PLACEMENTS = [
    (["system.placement.inference_devices=4"], "system.placement.inference_devices"),
    (["system.mesh.data=3"], "system.mesh.fsdp=-1"),
    (["system.placement.inference_devices=1", "system.mesh.fsdp=3"], "system.mesh.fsdp=3"),
    (["system.mesh.tensor=4"], "system.mesh.tensor=4"),
    (["system.placement.inference_devices=2", "rollout.num_slots=3"], "rollout.num_slots=3"),
    (["system.mesh.fsdp=4", "rollout.group_size=2", "rollout.groups_per_step=1"], "mesh.fsdp=4"),
]


@pytest.mark.multidevice
def test_split_device_placements_are_refused_before_the_model_loads(tmp_path):
    """On 4 virtual devices: exit 2, one stderr line naming the fields and no other line
    (no start-up line, no "loading model"), no run dir; then every other placement refused
    through the CLI's checks, naming its fields."""
    env = cpu_env(4)
    for overrides, message in PLACEMENTS:
        run_dir = tmp_path / "x"
        argv = [SMOKE, f"run_dir={run_dir}", "steps=2", *overrides]
        proc = subprocess.run(
            [sys.executable, "-m", "a3po_jax.cli.train", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr  # one line only
        assert proc.stderr.startswith(f"a3po-train: {message}"), proc.stderr
        assert proc.stdout == "" and not run_dir.exists()
    script = (
        "import json, sys\n"
        "from a3po_jax.cli.train import Refused, validate\n"
        "out = []\n"
        "for overrides in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        validate(sys.argv[2], [f'run_dir={sys.argv[3]}', *overrides])\n"
        "        out.append(None)\n"
        "    except Refused as err:\n"
        "        out.append(str(err))\n"
        "print(json.dumps(out))\n"
    )
    cases = [overrides for overrides, _ in MORE_PLACEMENTS]
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases), SMOKE, str(tmp_path / "y")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    for (overrides, field), answer in zip(MORE_PLACEMENTS, answers, strict=True):
        assert answer is not None, f"{overrides} was accepted on 4 devices"
        assert field in answer and "\n" not in answer, (overrides, answer)
    assert not (tmp_path / "y").exists()
