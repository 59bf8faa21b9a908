"""The import graph of ``libs/`` and ``services/``, read from the source with ``ast`` (nothing
is imported): the engine depends on neither the wire protocol nor the fleet's settings, no
module reaches itself through imports, and no folder of ``libs/`` or ``services/`` reaches itself
through another (``libs/engine`` → ``libs/models`` → ``libs/engine`` is a cycle of the layout even
when no single module closes it).

Every ``import`` statement counts, at module level or inside a function: a function-local
import only postpones a dependency, so a cycle through one is still a cycle of the design
(``quant/blocks`` ↔ ``quant/int4`` was one). Imports under ``if TYPE_CHECKING:`` are left out:
they never run and exist for annotations only. An import is an arrow to the module it names
(or, for a name defined in a package, to the package), not to the packages above it: Python
runs those ``__init__`` files too, but a package importing its own submodules is not a cycle
of the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("libs", "services")
ENGINE = "libs.engine"
FORBIDDEN_FROM_ENGINE = ("libs.protocol", "libs.settings")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    """Module name → file, for every ``.py`` file under the packages."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(target: str) -> str | None:
        # The deepest known module the dotted name lies in (``libs.engine.metrics`` or, for a
        # name defined in a package's __init__, the package).
        while target:
            if target in modules:
                return target
            target = target.rpartition(".")[0]
        return None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = resolve(alias.name)
                if hit:
                    found.add(hit)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                drop = node.level - 1 if is_package else node.level
                anchor = anchor[: len(anchor) - drop] if drop else anchor
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                hit = resolve(f"{base}.{alias.name}") or resolve(base)
                if hit:
                    found.add(hit)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _sources()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
            connect(v)
    return found


def test_the_graph_sees_known_edges() -> None:
    graph = import_graph()
    assert "libs.engine.scheduler" in graph["libs.engine.engine"]  # module level
    assert "libs.engine.params" in graph["libs.protocol"]  # the wire imports the engine
    assert "libs.engine.engine" in graph["libs.models.warm"]  # inside warm's main()
    assert "libs.protocol" not in graph["libs.engine.tools"]  # only under TYPE_CHECKING
    assert "libs.engine.converted" in graph["libs.models.convert"]


def test_engine_imports_neither_protocol_nor_settings() -> None:
    graph = import_graph()
    arrows = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m == ENGINE or m.startswith(ENGINE + ".")
        for t in targets
        if any(t == f or t.startswith(f + ".") for f in FORBIDDEN_FROM_ENGINE)
    )
    assert arrows == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def folder_of(module: str) -> str:
    """The top-level folder of ``libs/`` or ``services/`` a module belongs to (``libs.engine``
    for ``libs.engine.quant.gguf``); a module at the root is a unit of its own."""
    return ".".join(module.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with every module replaced by its folder (arrows within a folder dropped)."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = folder_of(module)
        folders.setdefault(here, set()).update(folder_of(t) for t in targets)
        folders[here].discard(here)
    return folders


def test_no_cycles_between_folders() -> None:
    assert cycles(folder_graph(import_graph())) == []


def test_folder_graph_sees_a_cycle_through_two_modules() -> None:
    graph = {"libs.a.x": {"libs.b.y"}, "libs.b.z": {"libs.a.w"}, "libs.a.w": set()}
    assert cycles(folder_graph(graph)) == [["libs.a", "libs.b"]]


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
