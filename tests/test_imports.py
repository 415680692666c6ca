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
    ["models"],
    ["checkpoint"],
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


def _from_base(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` reads from, relative ones resolved in `package`."""
    base = node.module or ""
    if node.level:
        up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(up + ([node.module] if node.module else []))
    return base


def imported_modules(path: Path, tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) for every swaserve module the file imports or names in a string."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
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


def _module_files() -> dict[str, Path]:
    return {_module_name(p): p for p in _modules()}


def _resolve(module: str, files: dict[str, Path]) -> str | None:
    """The swaserve module a name means: itself, or the nearest package above it that is one
    (`swaserve.kernels.q8.matmul` -> `swaserve.kernels.q8`)."""
    while module not in files:
        if (PACKAGE.parent / module.replace(".", "/")).is_dir():
            return None  # a folder without __init__.py: importing it runs nothing
        module = module.rpartition(".")[0]
    return module


def import_graph() -> dict[str, set[str]]:
    """module -> the swaserve modules it imports (every import: top, in a function, under
    TYPE_CHECKING, named in a string); `from pkg import mod` names the module mod."""
    files = _module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text())
        for _, module in imported_modules(path, tree):
            if module == "swaserve" or module.startswith("swaserve."):
                edges.add(_resolve(module, files))
        for node in ast.walk(tree):  # `from swaserve.kernels import q8` imports q8.py
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                edges.update(f"{node.module}.{a.name}" for a in node.names
                             if f"{node.module}.{a.name}" in files)
        edges.discard(None)
        edges.discard(name)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# -- a model family is one package -----------------------------------------------------------

MODELS = PACKAGE / "models"
# the modules outside a family that import it: its config side, its network
REGISTRIES = (MODELS / "registry.py", MODELS / "networks.py")


def _families() -> set[str]:
    return {p.name for p in MODELS.iterdir() if (p / "__init__.py").is_file()}


def _named_modules(path: Path, tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Like imported_modules, with `from PACKAGE import NAME` also as PACKAGE.NAME (the
    module NAME, or a name inside PACKAGE: either way PACKAGE's part)."""
    yield from imported_modules(path, tree)
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield node.lineno, f"{_from_base(node, package)}.{alias.name}"


def family_violations(path: Path, source: str, families: set[str]) -> list[str]:
    """'file:line: module' for each import of a family's package (`swaserve.models.<family>`)
    from outside that package and the registries."""
    rel = path.relative_to(PACKAGE)
    own = rel.parts[1] if len(rel.parts) > 2 and rel.parts[0] == "models" else None
    if path in REGISTRIES:
        return []
    first: dict[int, str] = {}  # per line, its shortest name of a family's module
    for line, module in sorted(set(_named_modules(path, ast.parse(source)))):
        parts = module.split(".")
        if parts[:2] == ["swaserve", "models"] and len(parts) > 2 and parts[2] in families:
            if parts[2] != own:
                first.setdefault(line, module)
    return [f"swaserve/{rel}:{line}: {module}" for line, module in sorted(first.items())]


def test_only_the_registry_imports_a_family():
    """Generic code asks a family through models/registry.py (or models/networks.py) and
    models/family.py's protocol; only those and the family's own package import it."""
    families = _families()
    found = [v for p in _modules() for v in family_violations(p, p.read_text(), families)]
    assert not found, "imports of a family's package from outside it:\n" + "\n".join(found)


def test_the_family_check_names_each_import_from_outside():
    """The check itself: imports at the top, of the package, inside a function, by name."""
    source = '''
from swaserve.models.gemma4.model import Gemma4ForCausalLM
from swaserve.models import llama
from swaserve.models.config import ModelConfig
from swaserve.models.gemma4 import config

def f():
    import swaserve.models.qwen3_5.gated_delta

MODEL = "swaserve.models.gpt_oss.model:GptOssForCausalLM"
'''
    families = {"gemma4", "llama", "qwen3_5", "gpt_oss"}
    got = family_violations(PACKAGE / "mlx" / "example.py", source, families)
    assert got == [
        "swaserve/mlx/example.py:2: swaserve.models.gemma4.model",
        "swaserve/mlx/example.py:3: swaserve.models.llama",
        "swaserve/mlx/example.py:5: swaserve.models.gemma4",
        "swaserve/mlx/example.py:8: swaserve.models.qwen3_5.gated_delta",
        "swaserve/mlx/example.py:10: swaserve.models.gpt_oss.model",
    ]
    # inside its own package a family imports itself, never another family
    inside = family_violations(PACKAGE / "models" / "gemma4" / "example.py", source, families)
    assert inside == [
        "swaserve/models/gemma4/example.py:3: swaserve.models.llama",
        "swaserve/models/gemma4/example.py:8: swaserve.models.qwen3_5.gated_delta",
        "swaserve/models/gemma4/example.py:10: swaserve.models.gpt_oss.model",
    ]
    assert family_violations(REGISTRIES[0], source, families) == []
