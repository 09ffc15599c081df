"""The package's import graph has no cycle, counting every import of a jaxgrpo module (at the
top of a file or inside a function: a function-level import must not hide one), except those
under ``if TYPE_CHECKING:``, which never run."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxgrpo"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the jaxgrpo modules it imports (``from a import b`` counts ``a.b`` when it is
    a module, else ``a``), with the packages whose ``__init__`` such an import runs."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {  # imports under `if TYPE_CHECKING:` never run
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("jaxgrpo") else None
                if not target or target == module:
                    continue
                graph[module].add(target)
                # Importing a.b.c runs a/b/__init__.py first, unless it is already running
                # because it is one of this module's own packages.
                parts = target.split(".")
                for depth in range(2, len(parts)):
                    parent = ".".join(parts[:depth])
                    if parent in mods and not module.startswith(parent + "."):
                        graph[module].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_imports_have_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the walk found no imports"
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The package's folders bottom-up (DESIGN.md, "Package layout"): each may import only what lies
# below it, and the root's `python -m jaxgrpo.X` entry points sit above them all.
LAYERS = (
    ("core",),
    ("grading", "configs"),
    ("data", "models"),
    ("sampling",),
    ("rewards",),
    ("agents",),
    ("eval",),
    ("rl",),
    ("settings",),
    ("run", "planning"),
    ("studies",),
)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto the package's folders and top-level modules (``jaxgrpo.rl``
    for every module under rl/, ``jaxgrpo.train`` for the root's train.py)."""

    def node(module: str) -> str:
        return ".".join(module.split(".")[:2])

    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = node(module)
        edges = folded.setdefault(here, set())
        edges.update(node(t) for t in targets if node(t) not in (here, "jaxgrpo"))
    return folded


def test_the_folders_import_each_other_without_a_cycle():
    folders = folder_graph(import_graph())
    assert {"jaxgrpo.rl", "jaxgrpo.models", "jaxgrpo.run"} <= set(folders)
    assert cycles(folders) == [], "folders that import each other in a ring"


def test_each_folder_imports_only_what_lies_below_it():
    """Every import between folders points down the layers, so each folder reads knowing only
    what lies below it; the root holds only the entry points, which nothing imports."""
    level = {f"jaxgrpo.{name}": i for i, names in enumerate(LAYERS) for name in names}
    folders = folder_graph(import_graph())
    entry_points = {f"jaxgrpo.{p.stem}" for p in ROOT.glob("*.py")} - {"jaxgrpo.__init__"}
    assert set(folders) - {"jaxgrpo"} == set(level) | entry_points, "a folder missing from LAYERS"
    wrong = [
        f"{a} -> {b}"
        for a, targets in folders.items()
        if a in level
        for b in targets
        if b not in level or level[b] >= level[a]
    ]
    assert wrong == [], "imports that point up the layers (or at an entry point)"
