"""The package's layers: a module imports only from lower layers or from its own unit; and no
module imports itself back through others.

Read from the source with ``ast``, every ``import`` counted, function-level ones too (a lazy
import still makes the lower layer depend on the higher one). A unit is a top-level module or
subpackage of ``rnnify``; units that share a layer may not import each other either (sideways).
Within a unit, modules may import each other, but never in a cycle, lazily or not: a cycle makes
the import order decide what works, and hides which module is the lower one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rnnify"

# Lowest first. errors: the error types every layer raises; choices: the names and defaults the
# command line offers, torch-free, which the layers that implement them import; progress: a command's
# stages as they run; lazy: the packages' names that import on first use; original: the original
# model and its attention, which evaluation and distillation both compare against.
LAYERS = [
    {"errors", "choices", "progress", "lazy"},
    {"kernels"},
    {"cells"},
    {"runtime"},
    {"compiler"},  # load the source (GGUF too), capture it, plan, run the passes, convert
    {"arguments"},  # the command line's value checks (distill's flags too), before a command runs
    {"data", "probes"},  # probes: pass-key prompt families, torch-free
    {"original"},
    {"eval", "distillation", "verify", "bench", "chat", "passkey"},
    {"auto"},  # per-head choice: scores with the original, converts with the choice
    {"__init__"},  # the package's public API, over everything it exports
    {"cli", "integrations"},  # transformers and lm-evaluation-harness over the public API
    {"__main__"},
]
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """``rnnify.cells.gated`` -> ``cells``; ``rnnify`` (the package itself) -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def imports(path: Path, source: str | None = None, typing: bool = True) -> list[tuple[int, str]]:
    """``(line, module)`` for every rnnify module ``path`` (or ``source`` as if it were there) imports,
    anywhere in the file; ``typing=False`` leaves out those under ``if TYPE_CHECKING:``, which never run."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if not typing and id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # ``from rnnify import kernels`` imports the module rnnify.kernels
                full = f"{base}.{alias.name}"
                if full == "rnnify.__version__":
                    continue  # the root is imported before any of its modules: its metadata adds no dependency
                found.append((node.lineno, full if is_module(full) else base))
    return [(line, name) for line, name in found if name == "rnnify" or name.startswith("rnnify.")]


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = unit_of(module_name(path))
        for line, name in imports(path):
            there = unit_of(name)
            if there != here and LEVEL[there] >= LEVEL[here]:
                where = f"rnnify/{path.relative_to(PACKAGE)}:{line}"
                kind = "upward" if LEVEL[there] > LEVEL[here] else "sideways"
                found.append(f"{where} imports {name} ({kind}: {here} is layer {LEVEL[here]}, {there} {LEVEL[there]})")
    return sorted(set(found))


def import_graph() -> dict[str, dict[str, str]]:
    """Every rnnify module -> the rnnify modules it imports when it runs, anywhere in its file (a
    package is its ``__init__``; annotations-only imports left out), each with where it first does
    (``rnnify/<path>:<line>``)."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        edges = graph.setdefault(here, {})
        for line, name in sorted(imports(path, typing=False)):
            if name != here:
                edges.setdefault(name, f"rnnify/{path.relative_to(PACKAGE)}:{line}")
    return graph


def import_cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The modules of each cycle in ``graph`` (module -> the modules it imports): its strongly
    connected components of more than one module, each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(LEVEL), f"add to LAYERS: {sorted(units - set(LEVEL))}"


def test_no_module_imports_a_higher_or_sibling_layer():
    assert violations() == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from rnnify.cells.window import ring_index", ["rnnify.cells.window"]),
        ("def f():\n    from rnnify import distillation", ["rnnify.distillation"]),
        ("import rnnify", ["rnnify"]),
        ("from rnnify import RnnifyError", ["rnnify"]),
        ("from ...cells import gated", ["rnnify.cells.gated"]),
        ("from . import common", ["rnnify.kernels.linear_attn.common"]),
        ("import torch\nfrom torch import nn", []),
        ("from rnnify import __version__", []),
    ],
)
def test_imports_are_all_found(source, expected):
    """The parser sees function-level and relative imports (read as if in kernels/linear_attn/naive.py)."""
    path = PACKAGE / "kernels" / "linear_attn" / "naive.py"
    assert [name for _, name in imports(path, source)] == expected


def test_no_module_imports_itself_back():
    """No cycle among rnnify's modules, through function-level imports too."""
    graph = import_graph()
    found = [
        [f"{graph[module][other]} imports {other}" for module in cycle for other in cycle if other in graph[module]]
        for cycle in import_cycles(graph)
    ]
    assert found == []


def test_annotation_imports_count_for_layers_not_for_cycles():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rnnify.cells import gated\n"
    path = PACKAGE / "kernels" / "linear_attn" / "naive.py"
    assert [name for _, name in imports(path, source)] == ["rnnify.cells.gated"]
    assert imports(path, source, typing=False) == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_import_cycles_are_all_found(graph, expected):
    assert import_cycles(graph) == expected
