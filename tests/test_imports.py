"""The import graph of splash/ runs one way: every import goes to the importer's own layer or one below
it, in the order docs/architecture.md states (its "Import order" block, read here: the one statement
of it), no module imports itself in a circle, and the analytical core never imports the runtime. Every
import counts: a function's deferred one and one under `if TYPE_CHECKING:` too.

`python tests/test_imports.py` prints the layers, the edges against the order and the cycles (none).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "splash"
CORE = "splash.core"  # the analytical core's package
DOC = ROOT.parent / "docs" / "architecture.md"


def layers() -> list[list[str]]:
    """The stated order, lowest first: docs/architecture.md's lines `N. splash.x, splash.y ...` under
    its "Import order" heading (a module belongs to the longest prefix named)."""
    text = DOC.read_text(encoding="utf-8")
    block = text.split("## Import order", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in block.splitlines():
        m = re.match(r"\s*(\d+)\. (.*)", line)
        if m:
            out.append([n.strip().strip("`") for n in m.group(2).split(" — ")[0].split(",")])
    return out


def layer_of(module: str, order: list[list[str]]) -> int | None:
    """The index of the layer whose longest prefix names `module` (None: named nowhere). The root
    package "splash" names only itself (the facade), not everything below it."""
    best: tuple[int, int] | None = None
    for i, names in enumerate(order):
        for n in names:
            if module == n or (n != "splash" and module.startswith(n + ".")):
                if best is None or len(n) > best[1]:
                    best = (i, len(n))
    return None if best is None else best[0]


def against_order(graph: dict[str, set[str]], order: list[list[str]]) -> list[str]:
    """Every edge that runs up the order (an importer below what it imports), and modules no layer names."""
    bad = []
    for a in sorted(graph):
        la = layer_of(a, order)
        if la is None:
            bad.append(f"{a}: in no layer of docs/architecture.md's import order")
            continue
        for b in sorted(graph[a]):
            lb = layer_of(b, order)
            if lb is not None and lb > la:
                bad.append(f"{a} (layer {la + 1}) imports {b} (layer {lb + 1})")
    return bad


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module: top-level, inside functions, and under `if TYPE_CHECKING:`
    too (a type's home is a dependency like any other; a circle hidden there is still a circle)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


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


def test_imports_run_one_way():
    bad = against_order(import_graph(), layers())
    assert not bad, "imports against docs/architecture.md's order:\n" + "\n".join(bad)


def test_the_checker_sees_every_import_and_can_fail():
    """A function's import and a TYPE_CHECKING one are edges; an edge up the order is reported."""
    g = import_graph()
    assert "splash.step.plan" in g["splash.engine.scheduler"]
    core = sorted(p.stem for p in (ROOT / "core").glob("*.py") if p.stem != "__init__")
    assert sorted(m.split(".")[-1] for m in g if m.startswith(CORE + ".")) == core  # all seen
    src = "import typing\nif typing.TYPE_CHECKING:\n    import splash.a\ndef f():\n    import splash.b\n"
    names = sorted(a.name for n in _imports(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names)
    assert names == ["splash.a", "splash.b", "typing"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    order = [["splash.core"], ["splash.model"], ["splash.attention"]]
    assert against_order({"splash.model.x": {"splash.attention.y", "splash.core.z"}}, order) == [
        "splash.model.x (layer 2) imports splash.attention.y (layer 3)"]
    assert len(layers()) >= 10 and layer_of("splash.core.model_config", layers()) == 1
    assert layer_of("splash.nowhere", layers()) is None  # (the facade "splash" is no catch-all)


if __name__ == "__main__":
    g = import_graph()
    print(f"{len(g)} modules, {sum(map(len, g.values()))} import edges (deferred and TYPE_CHECKING "
          "imports included)")
    for i, names in enumerate(layers()):
        print(f"  {i + 1}. {', '.join(names)}")
    for line in against_order(g, layers()):
        print("  against the order:", line)
    cs = cycles(g)
    print(f"cycles: {len(cs)}")
    for c in cs:
        print("  " + " <-> ".join(c))
    print(f"core modules importing the runtime: {core_imports_of_runtime(g) or 'none'}")
