"""The package's import graph: no module imports one that imports it back (also through imports
inside functions), and the layers below the driver (strategies, models, data, metrics) never import
Ray, so that an engine runs the same under Ray Train, torchrun and a plain process group."""

import ast

from conftest import REPO

PACKAGE = REPO / "raytrain_par"
NO_RAY = ("raytrain_par.strategies", "raytrain_par.models", "raytrain_par.data", "raytrain_par.metrics")


def modules() -> dict[str, tuple[ast.Module, bool]]:
    """Dotted name -> (parsed source, whether it is a package's __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (ast.parse(path.read_text(), str(path)), package)
    return out


def imports(name: str, tree: ast.Module, package: bool, known: set[str]) -> set[str]:
    """The modules of the package that `name` imports anywhere in its source. A package that holds
    `name` is left out: importing a submodule has started its package already."""
    here = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found |= {target, *(f"{target}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found & known if m != name and not name.startswith(m + ".")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def graph_of(found: dict[str, tuple[ast.Module, bool]]) -> dict[str, set[str]]:
    return {name: imports(name, tree, package, set(found)) for name, (tree, package) in found.items()}


def test_no_import_cycle_inside_the_package():
    assert cycles(graph_of(modules())) == []


def test_the_cycle_check_sees_a_lazy_import_back():
    found = {"p.a": (ast.parse("from . import b"), False),
             "p.b": (ast.parse("def f():\n    from .a import x"), False),
             "p.c": (ast.parse("from .a import y"), False)}
    assert cycles(graph_of(found)) == [["p.a", "p.b"]]


def test_the_layers_below_the_driver_never_import_ray():
    offenders = {}
    for name, (tree, _) in modules().items():
        if not name.startswith(NO_RAY):
            continue
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders.update({name: m for m in mods if m == "ray" or m.startswith("ray.")})
    assert not offenders, f"import Ray only in the driver, worker and tuning layers: {offenders}"
