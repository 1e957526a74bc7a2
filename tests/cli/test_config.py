"""Config validation, overrides and the CLI's refusal to start half-configured."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a3po_jax.cli.train import main
from a3po_jax.training import config_values, system_config
from a3po_jax.training.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    import_experiment,
    load_experiment,
    staleness_bound,
)


def test_overrides_parse_types_and_sections():
    cfg = apply_overrides(
        TrainConfig(),
        [
            "algo.prox=recompute",
            "algo.clip_eps=0.1",
            "system.max_staleness=4",
            "algo.kl_in_reward=true",
            "rollout.prompt_buckets=64,128",
            "steps=7",
        ],
    )
    assert cfg.algo.prox == "recompute" and cfg.algo.clip_eps == 0.1
    assert cfg.system.max_staleness == 4 and cfg.algo.kl_in_reward is True
    assert cfg.rollout.prompt_buckets == (64, 128) and cfg.steps == 7


@pytest.mark.parametrize(
    "override,message",
    [
        ("algo.prox=magic", "algo.prox='magic' is not one of recompute, a3po, behav"),
        ("algo.nope=1", "unknown config field 'algo.nope'"),
        ("nosection.x=1", "unknown config section 'nosection'"),
        ("system.max_staleness=two", "system.max_staleness expects an int"),
        ("algo.kl_in_reward=maybe", "algo.kl_in_reward expects a bool"),
        (
            "system.batch.packed_prompts=maybe",
            "system.batch.packed_prompts expects true, false or auto",
        ),
        ("optim.learning_rate=0", "optim.learning_rate must be > 0"),
        ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1]"),
        ("task.options=[1]", "task.options must be a JSON object"),
        ("steps", "must look like section.field=value"),
    ],
)
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        apply_overrides(TrainConfig(), [override])
    assert message in str(err.value)


def test_impossible_combinations_are_refused():
    with pytest.raises(ConfigError, match="periodic.*max_staleness must be 0"):
        apply_overrides(TrainConfig(), ["system.mode=periodic", "system.max_staleness=2"])
    with pytest.raises(ConfigError, match="group_size must be 2"):
        apply_overrides(TrainConfig(), ["algo.loss=dpo"])
    with pytest.raises(ConfigError, match="micro_batch_size=5 must divide"):
        apply_overrides(TrainConfig(), ["system.batch.micro_batch_size=5"])
    with pytest.raises(ConfigError, match="one_pass_old"):
        apply_overrides(TrainConfig(), ["system.batch.one_pass_old=true", "algo.prox=a3po"])
    with pytest.raises(ConfigError, match="dual_clip must be > 1"):
        apply_overrides(TrainConfig(), ["algo.dual_clip=0.5"])
    lockstep = "system.lockstep_decode_steps=8"
    for other, named in (
        ("system.placement.inference_hosts=localhost:5000", "system.placement.inference_hosts"),
        ("system.placement.inference_cores=1", "system.placement.inference_cores"),
        ("system.mode=periodic", "system.mode='periodic'"),
    ):
        extra = ["system.max_staleness=0"] if "periodic" in other else []
        with pytest.raises(ConfigError, match=f"lockstep_decode_steps=8 .*not with {named}"):
            apply_overrides(TrainConfig(), [lockstep, other, *extra])
    # The embedded host on devices of its own can be driven all the same.
    apply_overrides(TrainConfig(), [lockstep, "system.placement.inference_devices=1"])


def test_staleness_bound_per_mode():
    # The one rule the trainer and the results tables share: only async reads η.
    assert [staleness_bound(m, 5) for m in ("sync", "periodic", "one_step_off", "async")] == [
        0,
        0,
        1,
        5,
    ]
    with pytest.raises(ConfigError, match="system.mode='lockstep' is not one of"):
        staleness_bound("lockstep", 1)


def test_experiment_files_that_fail_name_the_file_and_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\ny = x +\n")
    with pytest.raises(ConfigError, match=r"broken.py' line 2 failed to import: SyntaxError"):
        import_experiment(broken)
    raises = tmp_path / "raises.py"
    raises.write_text("def config():\n    return 1 / 0\n")
    with pytest.raises(ConfigError, match=r"raises.py' line 2: config\(\) raised ZeroDivision"):
        load_experiment(raises)
    nested = tmp_path / "child.py"  # a child whose parent is broken reports the parent's line
    nested.write_text(
        "from a3po_jax.training.config import load_experiment\n\n"
        f"def config():\n    return load_experiment({str(broken)!r})\n"
    )
    with pytest.raises(ConfigError, match="broken.py' line 2"):
        load_experiment(nested)


def test_modes_fix_staleness_and_update_policy():
    def sys(mode, eta=0):
        return dataclasses.replace(TrainConfig().system, mode=mode, max_staleness=eta)

    assert sys("sync", 0).effective_staleness == 0
    assert sys("one_step_off", 5).effective_staleness == 1
    assert sys("async", 3).effective_staleness == 3
    assert sys("one_step_off").effective_update_policy == "drain"
    assert sys("async").effective_update_policy == "in_flight"


def test_config_round_trips_through_json():
    cfg = apply_overrides(TrainConfig(), ["algo.prox=behav", "rollout.prompt_buckets=32,64"])
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ConfigError, match="unknown config field"):
        config_from_dict({**cfg.to_dict(), "bogus": 1})


def test_experiment_files_and_cli(tmp_path, capsys):
    cfg = load_experiment("experiments/quickstart_a3po.py")
    assert cfg.model.name == "smollm2" and cfg.algo.prox == "a3po"
    assert main(["experiments/smoke_tiny.py", "--print-config", "algo.prox=recompute"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["algo"]["prox"] == "recompute"
    # A bad override stops the CLI before anything loads, with exit code 2 and the field.
    assert main(["experiments/smoke_tiny.py", "algo.prox=nope"]) == 2
    assert "algo.prox='nope'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "missing.py")
    bad = tmp_path / "bad.py"
    bad.write_text("def something():\n    return 1\n")
    with pytest.raises(ConfigError, match="no config\\(\\) function"):
        load_experiment(bad)


def test_periodic_micro_batches_must_divide_the_group():
    periodic = ["system.mode=periodic", "system.max_staleness=0", "system.batch.micro_batch_size=8"]
    with pytest.raises(ConfigError, match="micro_batch_size=8 must divide rollout.group_size=4"):
        apply_overrides(TrainConfig(), [*periodic, "system.batch.packed_prompts=false"])
    # Packed, a group is one row whatever the micro-batch size: the default packs it.
    assert apply_overrides(TrainConfig(), periodic).batch_plan.packed


@pytest.mark.parametrize(
    "text,value",
    [("auto", "auto"), ("AUTO", "auto"), ("true", True), ("on", True), ("false", False)]
    + [("0", False), ("False", False)],
)
def test_packed_prompts_parses_auto_true_and_false(text, value):
    cfg = apply_overrides(TrainConfig(), [f"system.batch.packed_prompts={text}"])
    assert cfg.system.batch.packed_prompts == value and type(
        cfg.system.batch.packed_prompts
    ) is type(value)


@pytest.mark.parametrize("value", ["yes", "true", "Auto", "", None, 1, 0, 1.0])
def test_packed_prompts_refuses_anything_but_auto_true_and_false(value):
    with pytest.raises(
        ConfigError, match="system.batch.packed_prompts must be true, false or 'auto'"
    ):
        dataclasses.replace(TrainConfig().system.batch, packed_prompts=value)


def test_saved_configs_keep_their_packing_setting():
    """A run saved before the default was "auto" has ``false`` in its config.json: it loads
    (replay, evaluation) as false, and "auto" round-trips as itself."""
    saved = TrainConfig().to_dict()
    assert saved["system"]["batch"]["packed_prompts"] == "auto"
    assert config_from_dict(json.loads(json.dumps(saved))) == TrainConfig()
    old = json.loads(json.dumps(saved))
    old["system"]["batch"]["packed_prompts"] = False
    loaded = config_from_dict(old)
    assert loaded.system.batch.packed_prompts is False and not loaded.batch_plan.packed


def test_bad_task_options_stop_the_cli_before_the_model_loads(capsys):
    # letters takes no min_terms: the error names the task and its options, exit code 2.
    code = main(["experiments/smoke_tiny.py", "task.name=letters", 'task.options={"min_terms": 2}'])
    assert code == 2
    err = capsys.readouterr().err
    assert "task.name='letters'" in err and "min_terms" in err


def test_staleness_bound_counts_minibatches_and_refuses_before_loading():
    """With k minibatches the bound is in optimizer versions (k - 1 / 2k - 1 / η); an async
    η below k - 1 is refused when the config is built, before any model loads."""
    assert [staleness_bound(m, 3, 2) for m in ("sync", "periodic", "one_step_off", "async")] == [
        1,
        1,
        3,
        3,
    ]
    base = TrainConfig()
    ok = dataclasses.replace(
        base,
        algo=dataclasses.replace(base.algo, num_minibatches=2),
        system=dataclasses.replace(base.system, mode="sync", max_staleness=0),
    )
    assert ok.staleness_bound == 1  # sync, k = 2
    with pytest.raises(ConfigError, match=r"system.max_staleness=0 with algo.num_minibatches=2"):
        dataclasses.replace(
            ok, system=dataclasses.replace(base.system, mode="async", max_staleness=0)
        )


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter, so that what it imports is what `sys.modules` shows."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_importing_the_config_loads_no_optimizer_and_no_train_step():
    """The config validates every value (objective names come from the objectives'
    registry, the batch plan from core/batch_plan.py) without importing the jitted step or
    optax: a tool that only reads configs stays light."""
    heavy = ("optax", "a3po_jax.core.train_step", "a3po_jax.core.optim")
    code = (
        "import sys; import a3po_jax.training.config as c; c.TrainConfig(); "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    proc = _fresh_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_package_and_the_run_readers_start_without_jax():
    """`import a3po_jax` loads its re-exported losses on first use: the commands that only
    read a run directory (results, ledger) and every `--help` of theirs start without JAX,
    and `from a3po_jax import decoupled_ppo_loss` still gives the core's function."""
    code = (
        "import sys; import a3po_jax, a3po_jax.cli.results, a3po_jax.cli.ledger; "
        "print('jax' in sys.modules); from a3po_jax import decoupled_ppo_loss; "
        "from a3po_jax.core import losses; print(decoupled_ppo_loss is losses.decoupled_ppo_loss); "
        "print(all(getattr(a3po_jax, n) is getattr(losses, n) for n in a3po_jax.__all__)); "
        "print(sorted(a3po_jax.__all__) == sorted(set(dir(a3po_jax)) & set(a3po_jax.__all__)))"
    )
    proc = _fresh_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "True", "True"]
    with pytest.raises(AttributeError, match="no attribute 'not_a_loss'"):
        import a3po_jax

        a3po_jax.not_a_loss  # noqa: B018


# --------------------------------------------------------------------------------------
# Each objective's settings, and the flat names they had before.
# --------------------------------------------------------------------------------------

FLAT = {  # the fields' flat names before they moved to their objective
    "dpo_beta": ("dpo", "beta"),
    "dpo_kind": ("dpo", "kind"),
    "m2po_tau": ("m2po", "tau"),
    "m2po_reading": ("m2po", "reading"),
    "gspo_clip_low": ("gspo", "clip_low"),
    "gspo_clip_high": ("gspo", "clip_high"),
    "icepop_low": ("icepop", "low"),
    "icepop_high": ("icepop", "high"),
}


def test_objective_settings_are_nested_fields_that_round_trip():
    cfg = apply_overrides(TrainConfig(), ["algo.loss=m2po", "algo.m2po.tau=0.02"])
    assert cfg.algo.m2po.tau == 0.02 and cfg.algo.m2po.reading == "all_tokens_mask"
    assert cfg.algo.dpo.beta == 0.1  # the others keep their defaults
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved["algo"]["m2po"] == {"tau": 0.02, "reading": "all_tokens_mask"}
    assert config_from_dict(saved) == cfg
    with pytest.raises(ConfigError, match="algo.m2po.tau must be > 0"):
        apply_overrides(cfg, ["algo.m2po.tau=0"])
    with pytest.raises(ConfigError, match="unknown config field 'algo.m2po.bogus'"):
        apply_overrides(cfg, ["algo.m2po.bogus=1"])


@pytest.mark.parametrize("flat, new", sorted(FLAT.items()))
def test_flat_names_still_read_with_a_notice(flat, new, caplog, monkeypatch):
    name, field = new
    value = {"dpo_kind": "ipo", "m2po_reading": "derived_clip", "icepop_high": "1.5"}
    value = value.get(flat, "0.75")
    monkeypatch.setattr(config_values, "RENAMED_READ", set())  # once per process
    with caplog.at_level("WARNING"):
        cfg = apply_overrides(TrainConfig(), [f"algo.{flat}={value}"])
    assert caplog.messages == [f"algo.{flat} is deprecated: write algo.{name}.{field}"]
    want = apply_overrides(TrainConfig(), [f"algo.{name}.{field}={value}"])
    assert cfg == want and getattr(cfg.algo.settings[name], field) != getattr(
        TrainConfig().algo.settings[name], field
    )
    saved = TrainConfig().to_dict()
    del saved["algo"][name]
    saved["algo"][flat] = getattr(want.algo.settings[name], field)
    assert config_from_dict(saved) == want  # a config.json saved before the move


def test_a_flat_name_in_an_experiment_file_is_refused_naming_the_new_one(tmp_path):
    path = tmp_path / "old.py"
    path.write_text(
        "from a3po_jax.training.config import AlgoSection, TrainConfig\n"
        "def config():\n    return TrainConfig(algo=AlgoSection(m2po_tau=0.02))\n"
    )
    with pytest.raises(ConfigError, match=r"m2po_tau' \(now algo.m2po.tau"):
        load_experiment(path)


def test_every_committed_run_config_loads_to_its_saved_values(flat_system_names):
    root = Path(__file__).resolve().parents[2] / "results"
    paths = sorted(root.rglob("config.json"))
    assert paths
    for path in paths:
        saved = json.loads(path.read_text())
        cfg = config_from_dict(saved)
        for flat, (name, field) in FLAT.items():
            if flat in saved["algo"]:
                assert getattr(cfg.algo.settings[name], field) == saved["algo"][flat], (path, flat)
        # The system's fields, saved flat before they moved to their sub-section.
        for flat, (name, field) in system_config.FLAT.items():
            want = saved["system"].get(flat, saved["system"].get(name, {}).get(field))
            if want is not None:
                got = getattr(getattr(cfg.system, name), field)
                assert got == want, (path, flat, got, want)


def test_the_hosts_file_needs_remote_hosts_and_starts_as_they_are(tmp_path):
    from a3po_jax.training.host_placement import check_hosts_file

    with pytest.raises(
        ConfigError, match="system.placement.hosts_file=.*needs system.placement.inference_hosts"
    ):
        apply_overrides(TrainConfig(), [f"system.placement.hosts_file={tmp_path / 'hosts'}"])
    path = tmp_path / "hosts"
    check_hosts_file(["a:1", "b:2"], str(path))  # absent: written with the starting hosts
    assert path.read_text() == "a:1\nb:2\n"
    check_hosts_file(["b:2", "a:1"], str(path))  # the same hosts in another order
    path.write_text("a:1\n")
    with pytest.raises(ValueError, match=r"lists \['a:1'\], but the run starts with .*a:1,b:2"):
        check_hosts_file(["a:1", "b:2"], str(path))
    path.write_text("a:1\nnot-an-address\n")
    with pytest.raises(ValueError, match="line 2: 'not-an-address' is not host:port"):
        check_hosts_file(["a:1"], str(path))
