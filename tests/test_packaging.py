"""pyproject.toml against what the code needs: no TensorFlow in the base install, every
extra installed by the test command, and grpcio/protobuf floors equal to what the checked-in
generated gRPC code checks at import."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
INFERENCE = ROOT / "a3po_jax" / "inference"

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
