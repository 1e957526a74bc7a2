"""The documentation site's hook (scripts/mkdocs_hooks.py) and the strict build around it.

`scripts/run_tests.sh` builds the site with `mkdocs build --strict`; these tests check
that it fails where it should: a link to a heading that does not exist, an API entry for a
module that does not exist, and a docstring whose Sphinx role names a missing function
(the hook's check, tested on a small package of its own). Needs the `docs` extra.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def test_the_readme_becomes_the_front_page_with_links_into_docs_made_relative():
    text = "See [training](docs/training.md#scaling-out) and `docs/x.md` and [c](CITATION.cff)."
    assert hooks.readme_as_index(text) == (
        "See [training](training.md#scaling-out) and `docs/x.md` and [c](CITATION.cff)."
    )


def _package(tmp_path: Path, source: str):
    """A package of one module, read by griffe as the hook reads a3po_jax (a name of its
    own: under pytest a3po_jax is imported, and griffe would read that one)."""
    pkg = tmp_path / "docs_hook_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Package."""\n')
    (pkg / "mod.py").write_text(source)
    return griffe.load("docs_hook_pkg", search_paths=[str(tmp_path)], resolve_aliases=False)


def test_a_docstring_role_to_a_missing_function_is_reported(tmp_path):
    package = _package(
        tmp_path,
        '"""Module: see :func:`helper`, :class:`Thing`, :func:`docs_hook_pkg.mod.helper`,\n'
        ':meth:`Thing.run`, :exc:`ValueError` and :func:`gone`."""\n\n'
        "def helper():\n"
        '    """Calls :func:`missing_too` and :meth:`Thing.run`."""\n\n'
        "class Thing:\n"
        '    """Has :meth:`run`, not :meth:`walk`."""\n\n'
        "    def run(self):\n"
        "        pass\n",
    )
    problems = hooks.unresolved_references(package)
    assert len(problems) == 3, problems
    assert any(":func:`gone`" in p for p in problems)
    assert any(":func:`missing_too`" in p for p in problems)
    assert any(":meth:`walk`" in p for p in problems)


def test_the_package_docstrings_name_only_what_exists():
    package = griffe.load("a3po_jax", search_paths=[str(ROOT)], resolve_aliases=False)
    assert hooks.unresolved_references(package) == []


BREAKAGES = {
    "a link to a missing heading": (
        "losses.md",
        "\nSee [the modes](training.md#no-such-heading).\n",
        "no-such-heading",
    ),
    "an API entry for a missing module": (
        "api.md",
        "\n::: a3po_jax.core.no_such_module\n",
        "no_such_module",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_strict_build_fails_on(breakage, tmp_path):
    page_name, addition, expected = BREAKAGES[breakage]
    site = tmp_path / "repo"
    site.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, site / name)
    shutil.copytree(ROOT / "docs", site / "docs")
    (site / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", site / "scripts")
    for name in ("a3po_jax", "results"):
        (site / name).symlink_to(ROOT / name, target_is_directory=True)
    with (site / "docs" / page_name).open("a") as page:
        page.write(addition)
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "out")],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert expected in result.stderr


def test_every_module_of_the_package_is_on_the_api_page():
    """docs/api.md is the one list of modules: a new module that is not on it fails here."""
    listed = set()
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if line.startswith("::: "):
            listed.add(line[4:].strip())
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "a3po_jax").rglob("*.py")
        if path.name != "__init__.py" and not path.stem.endswith(("_pb2", "_pb2_grpc"))
    }
    assert modules - listed == set(), "modules missing from docs/api.md"
    assert listed - modules - {"a3po_jax"} == set(), "docs/api.md lists modules that do not exist"
