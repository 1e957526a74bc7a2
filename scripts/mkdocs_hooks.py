"""MkDocs hooks for the documentation site (mkdocs.yml): the README as the front page and
the committed figures the pages show.

* The README is the repository's front page, so it is the site's too: it is added as
  ``index.md``, with its links into ``docs/`` made relative to ``docs/`` (``docs/x.md`` ->
  ``x.md``). Its other links are left as they are, so the strict build checks them like any
  page's. A page under ``docs/`` links the README as ``../README.md`` (the path that works
  on the repository's own page view), rewritten to ``index.md`` for the site.
* A page under ``docs/`` shows figures from ``results/`` as ``../results/...png`` (the path
  that works on the repository's own page view). Those files are added to the site under
  ``results/`` and the links rewritten to match; a figure that does not exist is reported
  as a warning, which fails ``mkdocs build --strict``.
* The package's docstrings name functions, classes and modules with Sphinx roles
  (``:func:`load_runs```, ``:class:`a3po_jax.core.types.Rollout```), which mkdocstrings
  shows as code without resolving them. Before the build every such reference is looked up
  in the package as griffe reads it (the object's own members, then its parents', then the
  package root for ``a3po_jax.`` paths); one that names nothing is a warning, so a
  docstring that names a missing function fails the strict build.
"""

from __future__ import annotations

import builtins
import logging
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.a3po_jax")
ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"\]\(\.\./(results/[^)\s]+\.png)\)")
README_LINK = re.compile(r"\]\(\.\./README\.md(#[^)\s]*)?\)")
ROLE = re.compile(r":(?:py:)?(func|class|mod|meth|data|attr|exc|obj|const):`~?\.?([^`<>\s]+)`")
PACKAGE = "a3po_jax"


def readme_as_index(text: str) -> str:
    """The README's markdown with its ``docs/`` links made relative to ``docs/``."""
    return re.sub(r"\]\(docs/", "](", text)


def on_files(files: Files, config) -> Files:
    files.append(
        File.generated(
            config, "index.md", content=readme_as_index((ROOT / "README.md").read_text())
        )
    )
    figures = set()
    for page in Path(config["docs_dir"]).glob("*.md"):
        figures.update(FIGURE.findall(page.read_text()))
    for figure in sorted(figures):
        if not (ROOT / figure).is_file():
            log.warning("docs name a figure that does not exist: %s", figure)
            continue
        files.append(File.generated(config, figure, abs_src_path=str(ROOT / figure)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = README_LINK.sub(lambda m: f"](index.md{m.group(1) or ''})", markdown)
    return FIGURE.sub(r"](\1)", markdown)


def _resolves(obj, target: str, package) -> bool:
    """Whether a role's target names an object, seen from the docstring of ``obj``."""
    if target.startswith(package.name + "."):
        scopes = [package]
        target = target.removeprefix(package.name + ".")
    else:
        scopes = []
        while obj is not None:
            scopes.append(obj)
            obj = obj.parent
    for scope in scopes:
        try:
            scope[target]
        except (KeyError, ValueError, AttributeError):
            continue
        return True
    return False


def unresolved_references(package) -> list[str]:
    """``path:line: role target`` for every Sphinx-role reference in the package's
    docstrings that names nothing (builtin exceptions count as found)."""
    missing: list[str] = []

    def walk(obj) -> None:
        if obj.docstring is not None:
            for kind, target in ROLE.findall(obj.docstring.value):
                if kind == "exc" and hasattr(builtins, target):
                    continue
                if not _resolves(obj, target, package):
                    where = f"{obj.relative_filepath}:{obj.docstring.lineno}"
                    missing.append(f"{where}: :{kind}:`{target}` names nothing")
        for member in obj.members.values():
            if not member.is_alias:
                walk(member)

    walk(package)
    return missing


def on_pre_build(config) -> None:
    import griffe

    package = griffe.load(PACKAGE, search_paths=[str(ROOT)], resolve_aliases=False)
    for problem in unresolved_references(package):
        log.warning("docstring reference: %s", problem)
