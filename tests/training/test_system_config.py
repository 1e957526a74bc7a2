"""The system section's sub-sections (`training/system_config.py`): read nested, saved
nested, every error naming the field's full spelling; the flat names the fields had before
still read with a one-line notice; and nothing in the repository uses them any more."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from a3po_jax.cli.train import main
from a3po_jax.training.config import (
    ConfigError,
    MeshSection,
    PlacementSection,
    SystemSection,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    load_experiment,
)
from a3po_jax.training.system_config import FLAT, SECTIONS

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke_tiny.py")
# A value other than the default for each flat name, and what else it needs to build.
VALUES = {
    "micro_batch_size": ("4", ()),
    "length_bucket": ("16", ()),
    "packed_prompts": ("false", ()),
    "groups_per_row": ("2", ()),
    "one_pass_old": ("true", ("algo.prox=recompute",)),
    "inference_hosts": ("h:1", ()),
    "host_token_file": ("token", ()),
    "hosts_file": ("hosts.txt", ("system.placement.inference_hosts=h:1",)),
    "host_leave_grace_s": ("5.0", ()),
    "inference_cores": ("1", ()),
    "inference_devices": ("1", ()),
    "inference_mesh_tensor": ("2", ()),
    "inference_dtype": ("bfloat16", ()),
    "rollout_timeout_s": ("5.0", ()),
    "host_timeout_s": ("5.0", ()),
    "host_hang_timeout_s": ("5.0", ()),
    "host_health_interval_s": ("0.5", ()),
    "max_reissues": ("0", ()),
    "mesh_data": ("2", ()),
    "mesh_fsdp": ("1", ()),
    "mesh_tensor": ("2", ()),
    "record_rollouts": ("true", ()),
    "max_nonfinite_steps": ("5", ()),
    "trim_heap_every_s": ("0.0", ()),
    "mmap_threshold_mib": ("0", ()),
    "compile_cache_dir": ("/tmp/jax-cache", ()),
    "max_train_programs": ("0", ()),
}


def test_every_field_of_the_split_has_one_flat_name():
    fields = {(n, f.name) for n, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert sorted(FLAT.values()) == sorted(fields) and set(VALUES) == set(FLAT)


def test_sub_sections_read_nested_save_nested_and_round_trip(capsys):
    cfg = apply_overrides(
        TrainConfig(),
        [
            "system.placement.inference_cores=1",
            "system.mesh.fsdp=2",
            "system.hosts.hang_timeout_s=30",
            "system.batch.micro_batch_size=4",
            "system.run.record_rollouts=true",
        ],
    )
    system = cfg.system
    assert system.placement.inference_cores == 1 and system.mesh == MeshSection(fsdp=2)
    assert system.hosts.hang_timeout_s == 30 and system.hosts.timeout_s == 60  # others kept
    assert system.batch.micro_batch_size == 4 and system.run.record_rollouts is True
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved["system"]["placement"]["inference_cores"] == 1
    assert "inference_cores" not in saved["system"]
    assert config_from_dict(saved) == cfg
    # A sub-section is its class or a mapping of its fields.
    assert SystemSection(placement={"inference_cores": 1}).placement == PlacementSection(
        inference_cores=1
    )
    assert main([SMOKE, "--print-config", "system.mesh.data=2"]) == 0
    printed = json.loads(capsys.readouterr().out)["system"]
    assert printed["mesh"] == {"data": 2, "fsdp": -1, "tensor": 1} and "mesh_data" not in printed


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["system.placement.inference_cores=-1"], "system.placement.inference_cores must be >= 0"),
        (["system.mesh.fsdp=0"], "system.mesh.fsdp must be a positive int or -1, got 0"),
        (["system.hosts.timeout_s=0"], "system.hosts.timeout_s must be > 0"),
        (["system.run.max_nonfinite_steps=0"], "system.run.max_nonfinite_steps must be > 0"),
        (["system.batch.length_bucket=x"], "system.batch.length_bucket expects an int"),
        (["system.placement.inference_dtype=f16"], "system.placement.inference_dtype='f16'"),
        (
            ["system.placement.inference_hosts=nohost"],
            "system.placement.inference_hosts entry 'nohost' is not host:port",
        ),
        (
            ["system.placement.inference_hosts=a:1", "system.placement.inference_cores=1"],
            "system.placement.inference_hosts and system.placement.inference_cores both place",
        ),
        (
            ["system.placement.hosts_file=h.txt"],
            "system.placement.hosts_file='h.txt' changes the remote hosts of a run: it needs "
            "system.placement.inference_hosts",
        ),
        (
            ["system.placement.inference_devices=3", "system.placement.inference_mesh_tensor=2"],
            "system.placement.inference_mesh_tensor=2 must divide "
            "system.placement.inference_devices=3",
        ),
        (
            ["system.lockstep_decode_steps=2", "system.placement.inference_hosts=a:1"],
            "not with system.placement.inference_hosts",
        ),
        (["system.placement.bogus=1"], "unknown config field 'system.placement.bogus'"),
        (["system.bogus=1"], "unknown config field 'system.bogus'"),
        (["system.batch.one_pass_old=true"], "system.batch.one_pass_old=true reuses"),
    ],
)
def test_errors_name_the_full_spelling(overrides, message):
    with pytest.raises(ConfigError) as err:
        apply_overrides(TrainConfig(), overrides)
    assert message in str(err.value)


def test_a_sub_section_given_as_a_mapping_is_checked_by_name():
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['bogus'\] in system.mesh"):
        SystemSection(mesh={"bogus": 1})
    with pytest.raises(ConfigError, match="system.hosts.max_reissues must be an int"):
        SystemSection(hosts={"max_reissues": "2"})
    with pytest.raises(ConfigError, match="system.run must be a RunSection section or a mapping"):
        SystemSection(run=3)


# --------------------------------------------------------------------------------------
# The flat names: still read, announced once.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flat", sorted(FLAT))
def test_each_flat_name_reads_with_a_notice_everywhere(flat, caplog, flat_system_names):
    name, field = FLAT[flat]
    text, needs = VALUES[flat]
    want = apply_overrides(TrainConfig(), [*needs, f"system.{name}.{field}={text}"])
    value = getattr(getattr(want.system, name), field)
    assert value != getattr(getattr(TrainConfig().system, name), field)
    base = apply_overrides(TrainConfig(), list(needs))
    with caplog.at_level("WARNING"):
        by_override = apply_overrides(TrainConfig(), [*needs, f"system.{flat}={text}"])
    assert caplog.messages == [f"system.{flat} is deprecated: write system.{name}.{field}"]
    assert by_override == want
    # An experiment file's keywords, and dataclasses.replace, which calls the class.
    by_replace = dataclasses.replace(base.system, **{flat: value})
    assert dataclasses.replace(base, system=by_replace) == want
    if not needs:
        assert SystemSection(**{flat: value}) == want.system
    # A config.json saved before the split.
    saved = json.loads(json.dumps(want.to_dict()))
    del saved["system"][name][field]
    saved["system"][flat] = json.loads(json.dumps(value))
    assert config_from_dict(saved) == want
    assert len(caplog.messages) == 1  # once per process


def test_flat_names_in_an_old_experiment_file_and_config_json_keep_loading(
    tmp_path, flat_system_names
):
    path = tmp_path / "old.py"
    path.write_text(
        "from a3po_jax.training.config import SystemSection, TrainConfig\n"
        "def config():\n"
        "    return TrainConfig(system=SystemSection(\n"
        "        mode='sync', inference_cores=1, mesh_fsdp=2, host_timeout_s=5.0))\n"
    )
    cfg = load_experiment(path)
    assert cfg.system.placement.inference_cores == 1 and cfg.system.mesh.fsdp == 2
    assert cfg.system.hosts.timeout_s == 5.0 and cfg.system.mode == "sync"
    # A flat name sets its field over what the sub-section given beside it says.
    system = SystemSection(
        placement=PlacementSection(inference_dtype="bfloat16"), inference_cores=1
    )
    assert system.placement == PlacementSection(inference_dtype="bfloat16", inference_cores=1)
    flat = {k: v for k, v in TrainConfig().to_dict()["system"].items() if k not in SECTIONS}
    old = {**TrainConfig().to_dict(), "system": {**flat, "micro_batch_size": 4}}
    assert config_from_dict(old).system.batch.micro_batch_size == 4
    with pytest.raises(ConfigError, match="system.placement.inference_cores must be >= 0"):
        apply_overrides(TrainConfig(), ["system.inference_cores=-1"])  # named as it is now


# --------------------------------------------------------------------------------------
# Nothing in the repository uses a flat name.
# --------------------------------------------------------------------------------------

# This file and the module that reads the flat names; the measurement log, whose entries
# are not edited once written.
EXEMPT = {
    "tests/training/test_system_config.py",
    "a3po_jax/training/system_config.py",
    "docs/log.md",
}
FLAT_TEXT = re.compile(r"\bsystem\.(" + "|".join(sorted(FLAT, key=len, reverse=True)) + r")\b")


def _sources() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("a3po_jax", "experiments", "scripts", "tests", "notebooks"):
        found += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb"))
    return [p for p in found if str(p.relative_to(ROOT)) not in EXEMPT]


def _flat_keywords(tree: ast.AST) -> list[tuple[int, str]]:
    """``SystemSection(inference_hosts=...)`` and ``replace(cfg.system, inference_hosts=...)``
    calls, with literal ``**{...}`` keywords."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        of_system = name == "replace" and node.args and ast.unparse(node.args[0]).endswith("system")
        if name != "SystemSection" and not of_system:
            continue
        keys = [k.arg for k in node.keywords if k.arg is not None]
        for k in node.keywords:
            if k.arg is None and isinstance(k.value, ast.Dict):
                keys += [key.value for key in k.value.keys if isinstance(key, ast.Constant)]
        found += [(node.lineno, key) for key in keys if key in FLAT]
    return found


def test_no_file_in_the_repository_uses_a_flat_system_name():
    uses = []
    for path in _sources():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for number, line in enumerate(text.splitlines(), 1):
            uses += [f"{where}:{number}: {m.group(0)}" for m in FLAT_TEXT.finditer(line)]
        if path.suffix == ".py":
            uses += [f"{where}:{n}: {key}=" for n, key in _flat_keywords(ast.parse(text))]
    assert not uses, "flat system names (write system.<section>.<field>):\n" + "\n".join(uses)


def test_the_scan_finds_each_kind_of_use():
    tree = ast.parse(
        "SystemSection(mode='sync', inference_hosts='a:1')\n"
        "dataclasses.replace(cfg.system, **{'mesh_fsdp': 2})\n"
        "dataclasses.replace(cfg.system, placement=PlacementSection(inference_hosts='a:1'))\n"
    )
    assert _flat_keywords(tree) == [(1, "inference_hosts"), (2, "mesh_fsdp")]
    assert FLAT_TEXT.findall("a3po-train x.py system.mesh_fsdp=2 system.mesh.fsdp=2") == [
        "mesh_fsdp"
    ]
