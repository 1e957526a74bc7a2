"""pyproject.toml against what the code needs: no TensorFlow in the base install, every
extra installed by the test command, and grpcio/protobuf floors equal to what the checked-in
generated gRPC code checks at import."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
INFERENCE = ROOT / "a3po_jax" / "inference" / "remote"

# Distributions that pull TensorFlow (google-jetstream through seqio; tfds directly).
TENSORFLOW_PULLERS = ("tensorflow", "tensorflow-datasets", "google-jetstream", "seqio")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _floor(requirement_name: str) -> str:
    (req,) = [r for r in PYPROJECT["dependencies"] if _name(r) == requirement_name]
    match = re.fullmatch(rf"{requirement_name}\s*>=\s*([0-9.]+)", req.strip())
    assert match, f"{req!r}: expected a plain '>=' floor"
    return match.group(1)


def test_the_base_install_pulls_no_tensorflow():
    base = {_name(r) for r in PYPROJECT["dependencies"]}
    assert not base & set(TENSORFLOW_PULLERS), sorted(base & set(TENSORFLOW_PULLERS))
    extras = PYPROJECT["optional-dependencies"]
    assert {_name(r) for r in extras["jetstream"]} == {"google-jetstream"}
    assert "tensorflow-datasets" in {_name(r) for r in extras["gsm8k"]}
    assert {"pandas", "matplotlib", "nbclient"} <= {_name(r) for r in extras["analysis"]}


def test_the_test_command_installs_every_feature_extra():
    # scripts/run_tests.sh runs setup.sh --test: the extras' tests must run in CI, not skip.
    text = (ROOT / "scripts" / "setup.sh").read_text()
    (line,) = [x for x in text.splitlines() if '"--test"' in x and "extras=" in x]
    installed = set(re.search(r'extras="\[([^\]]*)\]"', line).group(1).split(","))
    features = set(PYPROJECT["optional-dependencies"]) - {"cuda", "tpu"}  # hardware-specific
    assert features <= installed, sorted(features - installed)


def test_grpc_and_protobuf_floors_equal_the_generated_code_checks():
    # The generated modules refuse to import below these versions; a higher floor would
    # turn away environments that work, a lower one would install and then fail at import.
    grpc_code = (INFERENCE / "inference_pb2_grpc.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_code).group(1)
    assert _floor("grpcio") == grpc_version

    pb2 = (INFERENCE / "inference_pb2.py").read_text()
    check = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*"
        r"(\d+),\s*(\d+),",
        pb2,
    )
    assert check, "inference_pb2.py has no runtime version check"
    assert _floor("protobuf") == ".".join(check.groups())


# --- a quiet set-up that still fails loudly -----------------------------------------------


def test_the_licence_is_an_spdx_string_the_build_backend_reads_without_warning():
    # A TOML table ({ text = ... }) makes setuptools >= 77 print a deprecation banner on
    # every install; the SPDX string and license-files (PEP 639) need setuptools >= 77 in
    # the build requirements, and every licence file named must exist (else the build fails).
    assert PYPROJECT["license"] == "Apache-2.0"
    assert PYPROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    (setuptools,) = [r for r in build if _name(r) == "setuptools"]
    floor = re.fullmatch(r"setuptools\s*>=\s*(\d+)", setuptools.strip())
    assert floor and int(floor.group(1)) >= 77, setuptools


def _run_pip_install(tmp_path, fake_pip_exit: int, *, problem: str = "no matching distribution"):
    """setup.sh's `pip_install` function, run against a stand-in `.venv/bin/python` that
    prints pip-like noise, an "ERROR: `problem`" line, and exits with `fake_pip_exit`."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    function = re.search(r"^pip_install\(\) \{\n.*?^\}\n", text, re.MULTILINE | re.DOTALL)
    assert function, "scripts/setup.sh has no pip_install() function"
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.write_text(
        "#!/bin/sh\necho 'BuildBackendWarning: pages of noise'\n"
        + (f"echo 'ERROR: {problem}' >&2\n" if problem else "")
        + f"exit {fake_pip_exit}\n"
    )
    fake.chmod(0o755)
    script = "set -euo pipefail\nLOG=.venv/setup-pip.log\n: >$LOG\n"
    script += f"{function.group(0)}pip_install -e .\n"
    script += "echo after\n"
    return subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_setup_hides_pip_output_on_success(tmp_path):
    result = _run_pip_install(tmp_path, 0, problem="")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "after\n" and result.stderr == ""
    assert "pages of noise" in (tmp_path / ".venv" / "setup-pip.log").read_text()


def test_setup_shows_a_dependency_conflict_pip_reports_with_exit_code_0(tmp_path):
    # pip's resolver conflicts ("ERROR: pip's dependency resolver ... x requires y, which is
    # not installed.") come with exit code 0: shown, the set-up goes on, the noise stays out.
    conflict = "dependency conflicts: flax requires jax>=0.7, but you have jax 0.4 ..."
    result = _run_pip_install(tmp_path, 0, problem=conflict)
    assert result.returncode == 0 and result.stdout == "after\n"
    assert f"ERROR: {conflict}" in result.stderr and "pages of noise" not in result.stderr
    assert "finished with the problems above" in result.stderr


def test_setup_stops_and_shows_the_error_on_a_pip_failure(tmp_path):
    result = _run_pip_install(tmp_path, 1)
    assert result.returncode != 0
    assert "after" not in result.stdout
    assert "FAILED: pip install -e ." in result.stderr
    assert "ERROR: no matching distribution" in result.stderr
