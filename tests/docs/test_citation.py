"""CITATION.cff: valid YAML with the keys CFF 1.2.0 requires, and in step with the project."""

import re
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cff():
    return yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))


def test_required_keys(cff):
    # CFF 1.2.0 requires cff-version, message, title and authors (each a person or entity).
    assert cff["cff-version"] == "1.2.0"
    for key in ("message", "title"):
        assert isinstance(cff[key], str) and cff[key].strip()
    assert cff["authors"] and all("name" in a or "family-names" in a for a in cff["authors"]), cff[
        "authors"
    ]
    assert str(cff["date-released"]) == "2026-11-24"


def test_version_and_license_match_pyproject(cff):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert cff["version"] == project["version"]
    assert cff["license"] == project["license"]  # an SPDX string


def test_references_are_the_three_papers(cff):
    arxiv = {}
    for ref in cff["references"]:
        assert ref["type"] and ref["title"] and ref["authors"], ref
        (ident,) = [i["value"] for i in ref["identifiers"]]
        assert re.fullmatch(r"arXiv:\d{4}\.\d{5}", ident), ident
        arxiv[ident] = ref["title"]
    assert set(arxiv) == {"arXiv:2512.06547", "arXiv:2511.18871", "arXiv:2410.18252"}
    assert arxiv["arXiv:2410.18252"].startswith("Asynchronous RLHF")
    assert arxiv["arXiv:2512.06547"].startswith("A-3PO")
    assert arxiv["arXiv:2511.18871"].startswith("Periodic Asynchrony")


def test_readme_says_how_to_cite():
    assert "CITATION.cff" in (ROOT / "README.md").read_text()
