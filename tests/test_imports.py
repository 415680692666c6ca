"""Imports run one way (docs/architecture.md): a module of swaserve imports its own part (its
folder, or itself for a top-level module) and the layers below its own, never a layer above
and never another part of its own layer. Every import counts: at the top, inside a function,
under TYPE_CHECKING, relative, and a module named in a string (importlib, `python -m`, Ray's
import paths)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "swaserve"

# bottom to top: each layer's parts may import the layers below; the parts of one layer
# are peers and import none of each other
LAYERS = [
    ["kernels"],
    ["config", "profile"],
    ["memory"],
    ["checkpoint"],
    ["models"],
    ["sampling"],
    ["distributed"],
    ["mlx"],
    ["engine"],
    ["chat"],
    ["server", "entrypoints"],
    ["ray"],
    ["cli"],
    ["__init__", "__main__"],
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
_NAMED = re.compile(r"swaserve(\.\w+)+(:\w+)?")  # "swaserve.ray.router:RoundRobinRouter"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _part_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _part_of_module(module: str) -> str:
    """'swaserve.engine.engine' -> 'engine'; 'swaserve' (its __init__.py) -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_submodule(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def imported_modules(path: Path, tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) for every swaserve module the file imports or names in a string."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                # `from swaserve import profile` imports the module profile.py; `from
                # swaserve import LLM` the package's own __init__.py
                whole = base == "swaserve" and _is_submodule(alias.name)
                yield node.lineno, f"swaserve.{alias.name}" if whole else base
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _NAMED.fullmatch(node.value):
                yield node.lineno, node.value.partition(":")[0]


def violations(path: Path, source: str) -> list[str]:
    """'file:line: arrow' for each import of `path`'s source that does not run down."""
    src = _part_of_file(path)
    rel = path.relative_to(PACKAGE.parent)
    out = []
    for line, module in sorted(imported_modules(path, ast.parse(source))):
        if module != "swaserve" and not module.startswith("swaserve."):
            continue
        dst = _part_of_module(module)
        if dst == src or RANK.get(dst, len(LAYERS)) < RANK[src]:
            continue
        where = ("a peer in its layer" if RANK.get(dst) == RANK[src]
                 else "not in LAYERS" if dst not in RANK else "a layer above")
        out.append(f"{rel}:{line}: {src} -> {dst} ({module}): {where}")
    return out


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_part_of_the_package_has_a_layer():
    parts = {_part_of_file(p) for p in _modules()}
    assert parts == set(RANK), (f"not in LAYERS: {sorted(parts - set(RANK))}; "
                                f"in LAYERS, not in swaserve/: {sorted(set(RANK) - parts)}")


def test_imports_run_down_the_layers():
    found = [v for p in _modules() for v in violations(p, p.read_text())]
    assert not found, "imports that climb:\n" + "\n".join(found)


def test_the_check_names_each_climbing_import():
    """The check itself: a kernel importing up (at the top, in a function, relatively, by
    name), a peer importing a peer, and the arrows that are fine."""
    source = '''
from swaserve.kernels import build
from swaserve.config import cache_root
from .. import engine

def f():
    from swaserve.sampling import params
    import swaserve.cli.serve

ROUTER = "swaserve.ray.router:RoundRobinRouter"
'''
    got = violations(PACKAGE / "kernels" / "example.py", source)
    assert got == [
        "swaserve/kernels/example.py:3: kernels -> config (swaserve.config): a layer above",
        "swaserve/kernels/example.py:4: kernels -> engine (swaserve.engine): a layer above",
        "swaserve/kernels/example.py:7: kernels -> sampling (swaserve.sampling): a layer above",
        "swaserve/kernels/example.py:8: kernels -> cli (swaserve.cli.serve): a layer above",
        "swaserve/kernels/example.py:10: kernels -> ray (swaserve.ray.router): a layer above",
    ]
    peer = violations(PACKAGE / "server" / "example.py",
                      "from swaserve.entrypoints.llm import LLM\nfrom swaserve import profile\n"
                      "from swaserve import LLM\n")
    assert peer == [
        "swaserve/server/example.py:1: server -> entrypoints (swaserve.entrypoints.llm): "
        "a peer in its layer",
        "swaserve/server/example.py:3: server -> __init__ (swaserve): a layer above",
    ]
