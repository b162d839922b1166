"""The package's import graph: no module imports one that imports it back (also through imports
inside functions), and the layers below the driver (strategies, models, data, metrics) never import
Ray, so that an engine runs the same under Ray Train, torchrun and a plain process group; and the
worked example of a new strategy in docs/architecture.md trains as written."""

import ast

import pytest

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


# -- the worked example of docs/architecture.md ------------------------------------------------------

EXAMPLE_NAME = "ddp-fp16"


def _example_source() -> str:
    page = (REPO / "docs" / "architecture.md").read_text()
    section = page[page.index("### Adding a strategy"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]


def _register_example(directory: str) -> None:
    """The page's module under `directory`, and its registry line (in this process)."""
    import sys

    from raytrain_par import strategies

    if directory not in sys.path:
        sys.path.insert(0, directory)
    strategies.REGISTRY[EXAMPLE_NAME] = "ddp_fp16_example:CompressedDDPEngine"
    strategies.NAMES = tuple(strategies.REGISTRY)


def _train_example(rank, world, directory, cases):
    from engines import train_cases

    _register_example(directory)
    return train_cases(rank, world, cases)


def test_the_worked_example_of_a_new_strategy_trains(tmp_path, info, monkeypatch):
    """The strategy docs/architecture.md shows, as written there: parsed by its registry line, trained
    by the shared step (accumulation and clipping) on 2 gloo ranks, its fp16 all-reduce within fp16's
    rounding of ddp's losses and not equal to them."""
    from engines import KJV, experiment

    from raytrain_par import strategies
    from raytrain_par.local_group import run_ranks

    (tmp_path / "ddp_fp16_example.py").write_text(_example_source())
    monkeypatch.setattr(strategies, "REGISTRY", dict(strategies.REGISTRY))
    monkeypatch.setattr(strategies, "NAMES", strategies.NAMES)
    _register_example(str(tmp_path))
    train = {"gradient_accumulation_steps": 2, "grad_clip": 0.5, "lr": 3e-3}
    cases = [(experiment(data=KJV, strategy=name, workers=2, steps=4, **train), info(**KJV), 4)
             for name in ("ddp", EXAMPLE_NAME)]
    (ddp, example), _ = run_ranks(2, _train_example, str(tmp_path), cases)
    assert example["losses"][0] == ddp["losses"][0]  # the same rows and weights before any update
    assert example["losses"] == pytest.approx(ddp["losses"], rel=1e-2) and example["losses"] != ddp["losses"]
    assert example["losses"][-1] < example["losses"][0]
