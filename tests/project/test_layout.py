"""The package's layering, read from the source with `ast` (docs/design.md §5).

* The pure core (`core/`, `model/`) depends on nothing but itself and `parallel/`: not
  directly, not through another module, not through a function-local import.
* Nothing outside `cli/` imports `cli/`: entry points sit on top of everything.
* No import cycle among `a3po_jax` modules.
* Every module docstring says which layer the module belongs to.
* The model knows one weight layout, the one it trains: the inference engine's serving
  layout is defined in `inference/engine/decode_layout.py` only, and no model code reads it.
* Inside inference/, the jitted engine (`engine/`) and the weight pushes (`transfer/`)
  reach no host, gRPC or each other's code.
* The module table of the design notes (docs/design.md §5) names only paths that exist,
  and every subpackage and every module of the package is in it.

Imports are read from every module's syntax tree, including imports inside functions and
under `if TYPE_CHECKING:` (a type-only dependency is still a dependency of the reader), so
a lazy import cannot hide a layering violation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "a3po_jax"
CORE_LAYERS = ("core", "model")
CORE_MAY_IMPORT = ("core", "model", "parallel")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every absolute dotted name the module imports, wherever the import statement is."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from a3po_jax import model` imports the submodule a3po_jax.model; `from
            # a3po_jax.core.losses import aggregate` resolves to a3po_jax.core.losses below.
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the a3po_jax modules it imports (a name that is not a module, such as
    `a3po_jax.core.losses.aggregate`, resolves to its longest module prefix)."""
    modules = all_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path, name):
            if imported != PACKAGE and not imported.startswith(PACKAGE + "."):
                continue
            parts = imported.split(".")
            while ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def path_to(graph: dict[str, set[str]], start: str, accept) -> list[str] | None:
    """Shortest import chain from `start` to a module where `accept(module)` holds."""
    previous = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target in previous:
                    continue
                previous[target] = node
                if accept(target):
                    chain = [target]
                    while previous[chain[-1]] is not None:
                        chain.append(previous[chain[-1]])
                    return chain[::-1]
                nxt.append(target)
        frontier = nxt
    return None


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    """The parser itself: a lazy import inside a function and a relative import count."""
    source = tmp_path / "a3po_jax" / "core" / "example.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "def f():\n    from a3po_jax.training import trainer\n\nfrom ..rollout import queue\n"
    )
    names = imported_names(source, "a3po_jax.core.example")
    assert "a3po_jax.training.trainer" in names
    assert "a3po_jax.rollout.queue" in names


def test_the_checks_find_cycles_and_transitive_chains():
    """The graph algorithms on a hand-made graph: the tests below pass on the real package
    only because there is nothing to find, not because the search is blind."""
    graph = {"x.core.a": {"x.core.b"}, "x.core.b": {"x.rollout.q"}, "x.rollout.q": {"x.core.a"}}
    graph["x.cli.t"] = {"x.core.a"}
    assert strongly_connected(graph) == [["x.core.a", "x.core.b", "x.rollout.q"]]
    chain = path_to(graph, "x.core.a", lambda m: layer(m) not in CORE_MAY_IMPORT)
    assert chain == ["x.core.a", "x.core.b", "x.rollout.q"]
    del graph["x.rollout.q"]
    graph["x.core.b"] = set()
    assert strongly_connected(graph) == []


def test_the_graph_covers_every_layer():
    graph = import_graph()
    layers = {layer(name) for name in graph}
    expected = {"core", "model", "parallel", "rollout", "inference", "training", "analysis"}
    assert expected | {"cli", "tasks"} <= layers
    # A graph with no edges would pass every test below.
    assert sum(len(t) for t in graph.values()) > 50


def test_the_core_imports_nothing_from_the_shell():
    """core/ and model/ reach only core/, model/ and parallel/, directly or transitively."""
    graph = import_graph()
    violations = []
    for name in sorted(graph):
        if layer(name) not in CORE_LAYERS:
            continue
        chain = path_to(graph, name, lambda m: layer(m) not in CORE_MAY_IMPORT)
        if chain:
            violations.append(" -> ".join(chain))
    assert not violations, "the core imports the shell:\n  " + "\n  ".join(violations)


def test_nothing_imports_the_cli():
    graph = import_graph()
    violations = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        if layer(name) != "cli"
        for target in sorted(targets)
        if layer(target) == "cli"
    ]
    assert not violations, "the CLI is imported by the library:\n  " + "\n  ".join(violations)


def test_no_import_cycle():
    graph = import_graph()
    cycles = []
    for component in strongly_connected(graph):
        inside = {m: graph[m] & set(component) for m in component}
        start = component[0]
        # The shortest cycle through `start`: the shortest chain from it to a module that
        # imports it back (one exists: the component is strongly connected).
        chains = [path_to(inside, start, m.__eq__) for m in component if start in inside[m]]
        best = min(chains, key=len)
        cycles.append(" -> ".join(best + [start]) + f"   ({len(component)} modules in the cycle)")
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


DECODE_LAYOUT = "a3po_jax.inference.engine.decode_layout"
# What makes up the serving layout: its tree, its builders and runners, its reader.
DECODE_LAYOUT_NAMES = {
    "DecodeParams",
    "FusedWeights",
    "decode_params",
    "apply_decode",
    "out_major_dot",
    "out_major_product",
    "decode_logical_axes",
    "decode_shardings",
    "OUT_MAJOR_GEMM_MAX_ROWS",
}
# The layout's own keys (the model's are q_proj, k_proj, v_proj, gate_proj, ... and kernel).
DECODE_LAYOUT_KEYS = {"kernel_t", "qkv", "gate_up"}


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_the_decode_layout_lives_beside_the_inference_code():
    """The serving layout is defined once, in `inference/engine/decode_layout.py`; nothing in
    `model/` imports `inference/` (directly or not), names the layout, or reads its keys
    (a string constant "kernel_t", "qkv" or "gate_up"): adding an architecture means
    touching the model, and the layout follows through its `WeightReader`."""
    graph = import_graph()
    assert DECODE_LAYOUT in graph
    chains = [
        " -> ".join(chain)
        for name in sorted(graph)
        if layer(name) == "model"
        for chain in [path_to(graph, name, lambda m: layer(m) == "inference")]
        if chain
    ]
    assert not chains, "the model imports the inference code:\n  " + "\n  ".join(chains)

    defined_in: dict[str, list[str]] = {}
    for name, path in all_modules().items():
        tree = ast.parse(path.read_text())
        for defined in _defined_names(tree) & DECODE_LAYOUT_NAMES:
            defined_in.setdefault(defined, []).append(name)
        if layer(name) != "model":
            continue
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        keys = {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        assert not used & DECODE_LAYOUT_NAMES, f"{name} names {used & DECODE_LAYOUT_NAMES}"
        assert not keys & DECODE_LAYOUT_KEYS, f"{name} reads the keys {keys & DECODE_LAYOUT_KEYS}"
    assert defined_in == {n: [DECODE_LAYOUT] for n in DECODE_LAYOUT_NAMES}, defined_in


def test_every_module_docstring_names_its_layer():
    """A reader opening any module learns its layer from the first lines ("Core layer",
    "Inference layer (host-side shell)", ...). Generated protobuf modules are exempt."""
    unnamed = []
    for name, path in sorted(all_modules().items()):
        if not layer(name) or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not re.search(rf"\b{layer(name)} layer\b", docstring, re.IGNORECASE):
            unnamed.append(str(path.relative_to(ROOT)))
    assert not unnamed, f"module docstrings that do not say '<layer> layer': {unnamed}"


# --- the design notes' module table ------------------------------------------------------------


def layout_rows() -> list[tuple[str, str]]:
    """(first cell, the rest) of every row of the table under the design notes' '### The
    modules'."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n### The modules", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], " | ".join(cells[1:])))
    return rows[1:]  # the header


def test_the_readme_layout_table_matches_the_tree():
    rows = layout_rows()
    assert len(rows) >= 9
    missing, named = [], set()
    for first, rest in rows:
        paths = re.findall(r"`([^`]+)`", first)
        assert paths, f"layout row without a path in its first cell: {first!r}"
        for path in paths:
            if not (ROOT / path).exists():
                missing.append(path)
            named.add(path.rstrip("/"))
            if path.endswith("/") and path.startswith(PACKAGE):
                # The row's description names the subpackage's modules by file name.
                for module in re.findall(r"`([A-Za-z_0-9]+\.py)`", rest):
                    if not (ROOT / path / module).exists():
                        missing.append(path + module)
                    named.add(path + module)
    assert not missing, f"docs/design.md's module table names paths that do not exist: {missing}"

    package = ROOT / PACKAGE
    subpackages = sorted(str(p.parent.relative_to(ROOT)) for p in package.glob("*/__init__.py"))
    absent = [p + "/" for p in subpackages if p not in named]
    assert not absent, f"subpackages missing from the module table (docs/design.md): {absent}"
    modules = sorted(
        str(p.relative_to(ROOT)) for p in package.glob("*/*.py") if p.name != "__init__.py"
    )
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"modules the module table (docs/design.md) does not name: {unnamed}"


def test_the_inference_engine_and_transfer_stand_alone():
    """Inside inference/: the jitted engine (`engine/`) reaches no host, transport or weight
    push code, and the weight pushes (`transfer/`) reach no engine, host or gRPC code, directly
    or transitively (both may use `types`, the model and `parallel/`)."""
    graph = import_graph()
    allowed = {
        "engine": ("a3po_jax.inference.engine", "a3po_jax.inference.types"),
        "transfer": ("a3po_jax.inference.transfer", "a3po_jax.inference.types"),
    }
    violations = []
    for part, keep in allowed.items():
        prefix = f"a3po_jax.inference.{part}"
        for name in sorted(graph):
            if name != prefix and not name.startswith(prefix + "."):
                continue
            chain = path_to(
                graph,
                name,
                lambda m, keep=keep: (
                    layer(m) == "inference" and m != "a3po_jax.inference" and not m.startswith(keep)
                ),
            )
            if chain:
                violations.append(" -> ".join(chain))
    assert not violations, "inference/ layers cross:\n  " + "\n  ".join(violations)
