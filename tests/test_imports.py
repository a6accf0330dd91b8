"""Imports run one way (issue 43): the import graph of zerojax/, read from the source
with ``ast`` (module-level and function-level imports alike, as the planner's layer test
reads zerojax/analysis), has no circle, and no module imports one of a higher layer than
its own (the table below, the same as docs/architecture.md's "Layers"). The public names
the README and the docs import still import."""

import ast
import functools
import re
from pathlib import Path

import pytest

import zerojax

PACKAGE = Path(zerojax.__file__).parent
ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module's layer is its package's (issue 43's re-layout: one package a
# layer); a module may import its own layer's modules and lower layers' (a package's
# ``__init__`` is named by the package, ``zerojax.models``).
LAYERS = [
    ("core", ["zerojax.core", "zerojax.core.*"]),
    ("runtime", ["zerojax.runtime", "zerojax.runtime.*"]),
    ("tiers", ["zerojax.tiers", "zerojax.tiers.*"]),
    ("engine", ["zerojax.engine", "zerojax.engine.*"]),
    ("io", ["zerojax.io", "zerojax.io.*"]),
    ("api", ["zerojax.api", "zerojax.api.*"]),
    ("models", ["zerojax.models", "zerojax.models.*"]),
    ("analysis", ["zerojax.analysis", "zerojax.analysis.*"]),
    ("package", ["zerojax", "zerojax._aliases"]),
    ("CLI", ["zerojax.cli", "zerojax.cli.*", "zerojax.launch"]),
]


@functools.cache
def _modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module under zerojax/."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@functools.cache
def _graph() -> dict[str, dict[str, list[str]]]:
    """``{importer: {imported: ["file:line", ...]}}`` between zerojax's modules: every
    ``import`` and ``from ... import`` at any depth (inside functions too), relative ones
    resolved; ``from zerojax import x`` counts as importing the module ``zerojax.x``
    where that is a module, else the package ``zerojax``. Importing ``zerojax.a.b`` from
    outside ``zerojax.a`` runs ``zerojax/a/__init__.py`` too: an edge to ``zerojax.a``
    as well (the top package ``zerojax``, which every import runs first, is left out)."""
    modules = _modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            parents = set()
            for target in targets:
                while target and target not in modules:  # zerojax.x.attr -> zerojax.x
                    target = target.rpartition(".")[0]
                parent = target.rpartition(".")[0]
                while parent.count(".") >= 1 and not (name + ".").startswith(parent + "."):
                    parents.add(parent)  # a subpackage's __init__ (zerojax.models)
                    parent = parent.rpartition(".")[0]
            for target in [*targets, *sorted(parents)]:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    places = graph.setdefault(name, {}).setdefault(target, [])
                    if where not in places:
                        places.append(where)
    return graph


def _circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layer_of(module: str) -> int | None:
    hits = [i for i, (_, patterns) in enumerate(LAYERS) for p in patterns
            if module == p or (p.endswith(".*") and module.startswith(p[:-1]))]
    return hits[0] if len(hits) == 1 else None


def test_the_graph_sees_function_level_and_relative_imports():
    """The reader itself: it finds the imports the rules below are about."""
    graph = _graph()
    assert "zerojax.engine.step" in graph["zerojax.engine.nvme_step"]  # module level
    assert "zerojax.tiers.nvme" in graph["zerojax.api.config"]  # in ZeroConfig.__post_init__
    assert "zerojax.core" in graph["zerojax.api.config"]  # core/__init__.py runs
    assert "zerojax.cli.command" in graph["zerojax.cli.__main__"]  # relative or not
    assert "zerojax.models" in graph["zerojax.analysis.plan"]  # models/__init__.py runs
    assert len(_modules()) > 40 and sum(map(len, graph.values())) > 100


def test_no_import_circle():
    graph = _graph()
    circles = _circles(graph)
    assert not circles, "import circles (move the shared helper below both):\n" + "\n".join(
        f"{a} -> {b} ({', '.join(graph[a][b])})"
        for comp in circles for a in comp for b in graph.get(a, {}) if b in comp)


def test_circle_finder_names_a_circle():
    """A circle planted in a copy of the graph is found (the test above can fail)."""
    graph = {a: dict(bs) for a, bs in _graph().items()}
    graph.setdefault("zerojax.core.partition", {})["zerojax.io.checkpoint"] = ["planted"]
    assert any({"zerojax.core.partition", "zerojax.io.checkpoint"} <= set(c)
               for c in _circles(graph))


def test_every_module_has_one_layer():
    unplaced = sorted(m for m in _modules() if _layer_of(m) is None)
    assert not unplaced, (f"modules in no layer (or in two): {unplaced}; add each to one "
                          "layer of LAYERS here and of docs/architecture.md's table")


def _upward(graph) -> list[str]:
    return [f"{a} ({LAYERS[_layer_of(a)][0]}) imports {b} ({LAYERS[_layer_of(b)][0]}) at "
            f"{', '.join(where)}"
            for a, bs in sorted(graph.items()) for b, where in sorted(bs.items())
            if None not in (_layer_of(a), _layer_of(b)) and _layer_of(b) > _layer_of(a)]


def test_an_upward_import_is_named():
    """An import planted from the step to the checkpoints is reported with its place."""
    graph = {a: dict(bs) for a, bs in _graph().items()}
    graph["zerojax.engine.step"]["zerojax.io.checkpoint"] = ["zerojax/engine/step.py:1"]
    assert _upward(graph) == ["zerojax.engine.step (engine) imports zerojax.io.checkpoint "
                              "(io) at zerojax/engine/step.py:1"]


def test_imports_run_from_higher_layers_to_lower_ones():
    upward = _upward(_graph())
    assert not upward, ("imports from a lower layer to a higher one (move the helper "
                        "down, or the module up):\n" + "\n".join(upward))


def test_architecture_doc_lists_the_same_layers():
    """docs/architecture.md's "Layers" table: one row a layer, bottom first, naming the
    same packages and modules as LAYERS (written ``engine/``, ``launch.py``), and in its
    last column the modules each of its packages holds (``step.py``), as the tree has
    them."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("\n## Layers"):]
    section = section[: section.index("\n## ", 1)]
    rows = [r for r in section.splitlines() if re.match(r"\| \d+ \|", r)]

    def written(pattern):
        rel = pattern.removeprefix("zerojax").lstrip(".").replace(".", "/")
        if not rel:
            return "__init__.py"
        return rel[:-1] if rel.endswith("*") else (
            f"{rel}/" if (PACKAGE / rel).is_dir() else f"{rel}.py")

    def held(pats):  # a subpackage's modules as hf/config.py
        return sorted(p.relative_to(PACKAGE / written(pat)).as_posix()
                      for pat in pats if pat.endswith(".*")
                      for p in (PACKAGE / written(pat)).rglob("*.py") if p.name != "__init__.py")

    want = [(str(i + 1), name, sorted({written(p) for p in pats}), held(pats))
            for i, (name, pats) in enumerate(LAYERS)]
    got = [(cells[0], cells[1], sorted(re.findall(r"`([^`]+)`", cells[2])),
            sorted(re.findall(r"`([^`]+)`", cells[3])))
           for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)]
    assert got == want


# -- the public names ---------------------------------------------------------------------
# the README, the docs, and the complete programs the README's fragments link (examples/)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").glob("*.py"))]
# at a line's start (code blocks) or in running text (`from zerojax.x import y`)
FROM = re.compile(r"(?<![\w.])from (zerojax(?:\.\w+)*) import \(?(\w+(?:, *\w+)*)")
IMPORT = re.compile(r"(?<![\w.])import (zerojax(?:\.\w+)*)")


def _documented_imports():
    found = set()
    for doc in DOCS:
        text = doc.read_text()
        found |= {(m.group(1), n.strip()) for m in FROM.finditer(text)
                  for n in m.group(2).split(",") if n.strip()}
        found |= {(m, None) for m in IMPORT.findall(text)}
    return sorted(found, key=str)


# names kept where they were when their code moved below (issue 43)
MOVED = [("zerojax.checkpoint", n) for n in (
    "CheckpointManager", "CheckpointError", "export_params", "load_params")]


@pytest.mark.parametrize("module, name", _documented_imports() + MOVED + [
    ("zerojax", n) for n in zerojax.__all__])
def test_public_names_import(module, name):
    """Each ``from zerojax.x import y`` / ``import zerojax.x`` the README, the docs and
    the examples write, each name of ``zerojax.__all__``, and the old homes of moved
    code."""
    import importlib

    mod = importlib.import_module(module)
    if name is not None:
        assert getattr(mod, name) is not None


def test_documented_imports_are_found():
    found = _documented_imports()
    assert ("zerojax.models", "GPT") in found and ("zerojax.distributed", None) in found
