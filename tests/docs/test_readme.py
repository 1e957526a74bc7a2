"""The Python examples of the README and the docs pages run, and the paths, scripts and
modules they name exist.

Every ```python block of README.md and of every page under docs/ is executed as written,
each in a fresh namespace, with one substitution: functions that load real weights
(`load_model`, `load_hf_checkpoint`, `load_gguf`, `load_smollm2`) return the tiny random
model instead, so the examples run on any machine in seconds without the SmolLM2 cache or
a Qwen checkpoint. The substitution patches the functions by name, so a renamed loader
fails here too.

A block that cannot run (one that needs a pod, a remote host...) is exempted by an HTML
comment on the line just before its fence, with the reason:

    <!-- not run: needs a TPU pod -->

Keep exemptions few (the test allows at most `MAX_EXEMPT`); today there are none. The
shell commands of the same pages are run by `tests/docs/test_doc_commands.py`.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import jax
import pytest

from a3po_jax.model import assets, checkpoint_io, gguf_io, loader

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Every page a reader is sent to: the README and the pages of the documentation site.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_EXEMPT = 2
LOADS_WEIGHTS = re.compile(r"load_(model|hf_checkpoint|gguf|smollm2)\(")
EXEMPT = re.compile(r"<!--\s*not run:\s*(?P<reason>[^>]*?)\s*-->")


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def python_blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(line number of the fence, code, exemption reason or None) for each python block."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            previous = lines[i - 1].strip() if i else ""
            match = EXEMPT.fullmatch(previous)
            i += 1
            body = []
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start + 1, "\n".join(body) + "\n", match["reason"] if match else None))
        i += 1
    return blocks


BLOCKS = [(page_name(page), *block) for page in PAGES for block in python_blocks(page)]


@pytest.fixture
def tiny_weights(monkeypatch):
    """Every loader of real weights returns the tiny random model (what `load_model("tiny")`
    builds), with the call's shape of result."""
    real_load_model = loader.load_model
    tiny = real_load_model("tiny")
    calls = []

    def load_model(name, **kwargs):
        calls.append(name)
        return real_load_model("tiny", **kwargs)

    def load_checkpoint(path, **kwargs):
        calls.append(str(path))
        return tiny.config, tiny.params

    def load_smollm2(*args, **kwargs):
        calls.append("smollm2")
        return tiny.config, tiny.params, tiny.tokenizer

    monkeypatch.setattr(loader, "load_model", load_model)
    monkeypatch.setattr(checkpoint_io, "load_hf_checkpoint", load_checkpoint)
    monkeypatch.setattr(gguf_io, "load_gguf", load_checkpoint)
    monkeypatch.setattr(assets, "load_smollm2", load_smollm2)
    return calls


def test_the_pages_have_examples_and_few_exemptions():
    assert len([b for b in BLOCKS if b[0] == "README.md"]) >= 1, "no python example in README"
    assert len(BLOCKS) >= 4, "the docs' python examples were not found"
    exempt = [(page, line, reason) for page, line, _, reason in BLOCKS if reason is not None]
    assert all(reason for *_, reason in exempt), f"an exemption without a reason: {exempt}"
    assert len(exempt) <= MAX_EXEMPT, f"too many examples are not run: {exempt}"


@pytest.mark.parametrize(
    "page, line, code, reason", BLOCKS, ids=[f"{page}:{line}" for page, line, _, _ in BLOCKS]
)
def test_example_runs(page, line, code, reason, tiny_weights):
    where = f"{page}:{line}"
    if reason is not None:
        pytest.skip(f"{where} is marked not run: {reason}")
    namespace = {"__name__": f"example_{Path(page).stem}_{line}"}
    exec(compile(code, where, "exec"), namespace)  # noqa: S102
    if LOADS_WEIGHTS.search(code):
        # It ran on the tiny model: it did not load SmolLM2 or look for a checkpoint.
        assert tiny_weights, f"{where} loads weights but no patched loader was called"
    # What the examples promise, checked where they bind it.
    if "logits" in namespace:
        cfg = namespace["cfg"]
        assert namespace["logits"].shape == (*namespace["tokens"].shape, cfg.vocab_size)
    if "results" in namespace:
        results = namespace["results"]
        assert len(results) == 4 and all(len(r.tokens) == len(r.logprobs) for r in results)
    if "grad" in namespace:
        assert bool(jax.numpy.isfinite(namespace["loss"]))


# --- what the pages' prose and commands name ------------------------------------------------


def github_anchor(heading: str) -> str:
    """The id GitHub gives a markdown heading: lower case, punctuation dropped, '-' for ' '."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_the_links_and_paths_a_page_names_exist(page):
    """Links resolve from the page's folder (anchors to headings that exist); paths named in
    the text (`a3po_jax/...`, `scripts/...`, `results/...`) from the repository root."""
    text = page.read_text()
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]
    top = "a3po_jax|scripts|experiments|tests|docs|notebooks|results"
    # A path that goes on with a glob or a placeholder (`results/x/mode-sync_*`) is not a file.
    paths = [
        m.group(1)
        for m in re.finditer(rf"(?<![\w/.~-])((?:{top})/[\w./-]+)", text)
        if text[m.end() : m.end() + 1] not in ("*", "<")
    ]
    base = page.parent
    missing = sorted(
        {
            t.split("#")[0]
            for t in links
            if t.split("#")[0] and not (base / t.split("#")[0]).exists()
        }
        | {p for p in (p.rstrip(".,:;") for p in paths) if not (ROOT / p).exists()}
    )
    assert "../shared" not in text, f"{page_name(page)} points outside the repository"
    assert not missing, f"{page_name(page)} names files that do not exist: {missing}"
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        target_file = base / target if target else page
        if anchor and target_file.is_file():
            headings = re.findall(r"^#+ (.+)$", target_file.read_text(), re.MULTILINE)
            if anchor not in {github_anchor(h) for h in headings}:
                broken.append(link)
    assert not broken, f"{page_name(page)} links headings that do not exist: {broken}"


def test_the_readme_links_the_design_notes_and_every_page():
    links = set(re.findall(r"\]\((docs/[\w.-]+\.md)", README.read_text()))
    pages = {page_name(p) for p in PAGES if p != README}
    assert "docs/design.md" in links, "the README does not link the design notes"
    assert pages <= links, f"docs pages the README does not link: {sorted(pages - links)}"


def test_the_python_m_modules_the_pages_run_exist():
    text = "\n".join(page.read_text() for page in PAGES)
    modules = sorted(set(re.findall(r"python -m (a3po_jax(?:\.\w+)+)", text)))
    assert modules, "no `python -m a3po_jax...` command found"
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not missing, f"the docs run modules that do not exist: {missing}"


# --- the design notes name what exists -------------------------------------------------------


def test_the_design_notes_name_only_what_exists():
    """Every `a3po_jax.x.y` name and every module path in docs/design.md resolves, so the
    notes cannot silently drift from the code they describe."""
    text = (ROOT / "docs" / "design.md").read_text()
    unresolved = []
    for dotted in sorted(set(re.findall(r"`(a3po_jax(?:\.\w+)+)`", text))):
        parts = dotted.split(".")
        obj = None
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr, None)
            break
        if obj is None:
            unresolved.append(dotted)
    paths = set(re.findall(r"(?<![\w/])((?:a3po_jax/)?[a-z_]+/[a-z_0-9]+\.py)", text))
    for path in sorted(paths):
        full = path if path.startswith("a3po_jax/") else f"a3po_jax/{path}"
        if not (ROOT / full).exists() and not (ROOT / path).exists():
            unresolved.append(path)
    assert not unresolved, f"docs/design.md names what does not exist: {unresolved}"
