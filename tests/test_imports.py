"""The import graph of splash/: no module imports itself in a circle, and the analytical core never
imports the runtime (docs/architecture.md). Every import counts, a function's deferred one too (it
still runs); only imports under `if TYPE_CHECKING:` are left out (they never run).

`python tests/test_imports.py` prints the graph's cycles (none) and the core's runtime imports (none).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "splash"
CORE = "splash.core"  # the analytical core's package


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere in the module but under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            stack.append(child)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the splash modules it imports (`from pkg import name` imports pkg.name if that is a
    module, else pkg itself)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import splash.x.y` imports splash.x.y; keep the module part
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("splash"):
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def core_imports_of_runtime(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Core module -> the runtime modules it imports (should be none)."""
    def runtime(t: str) -> bool:
        return t != "splash" and t != CORE and not t.startswith(CORE + ".")

    core = sorted(m for m in graph if m == CORE or m.startswith(CORE + "."))
    return {m: sorted(filter(runtime, graph[m])) for m in core if any(map(runtime, graph[m]))}


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (break them; see docs/architecture.md): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_core_never_imports_the_runtime():
    bad = core_imports_of_runtime(import_graph())
    assert not bad, f"the analytical core imports the runtime: {bad}"


def test_the_graph_sees_deferred_imports_and_skips_typing_ones():
    """The checker must be able to fail: a function's import is an edge, a TYPE_CHECKING one is not."""
    g = import_graph()
    assert "splash.step.plan" in g["splash.engine.scheduler"]
    core = sorted(p.stem for p in (ROOT / "core").glob("*.py") if p.stem != "__init__")
    assert sorted(m.split(".")[-1] for m in g if m.startswith(CORE + ".")) == core  # all seen
    src = "import typing\nif typing.TYPE_CHECKING:\n    import splash.a\ndef f():\n    import splash.b\n"
    names = [a.name for n in _imports(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names]
    assert names == ["typing", "splash.b"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


if __name__ == "__main__":
    g = import_graph()
    print(f"{len(g)} modules, {sum(map(len, g.values()))} import edges (deferred imports included, "
          "TYPE_CHECKING ones left out)")
    cs = cycles(g)
    print(f"cycles: {len(cs)}")
    for c in cs:
        print("  " + " <-> ".join(c))
    print(f"core modules importing the runtime: {core_imports_of_runtime(g) or 'none'}")
