"""The package's layers, as a rule a test can check: each module imports only its own layer and the
layers below it (never upward), there is no import circle anywhere (imports inside functions and
under ``TYPE_CHECKING`` included, and the package ``__init__`` an import runs), and every layer
package says in its docstring what it owns and what it may import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "fully_shard"

# Lower number = lower layer. A module's layer is that of its longest matching prefix.
LAYERS = {
    "fully_shard.layouts": 0,
    "fully_shard.runtime": 1,
    "fully_shard.features": 2,
    "fully_shard.quant": 2,
    "fully_shard.api": 3,
    "fully_shard.tools": 4,
    "fully_shard.debug": 4,
    "fully_shard.plan": 4,
    "fully_shard.pipelining": 4,
    "fully_shard.fsdp1": 5,
    "fully_shard": 6,  # the package's own __init__: public names only
}
LAYER_PACKAGES = ("layouts", "runtime", "features", "api", "tools")


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = ("fully_shard",) + path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package ``module`` imports, anywhere in the file, plus the package
    ``__init__`` each such import runs first (the packages it is not itself inside)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not name.startswith("fully_shard"):
                continue
            for alias in node.names:  # `from . import x`: x may be a module
                sub = f"{name}.{alias.name}"
                targets.add(sub if sub in modules else name)
        elif isinstance(node, ast.Import):
            targets |= {a.name for a in node.names if a.name.startswith("fully_shard")}
    ran = set()
    for t in targets:
        parts = t.split(".")
        for i in range(2, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg in modules and not (module == pkg or module.startswith(pkg + ".")):
                ran.add(pkg)
    return {t for t in targets | ran if t in modules and t != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_imports_go_only_downward() -> None:
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m, targets in _graph().items()
        for t in sorted(targets)
        if _layer(t) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


@pytest.mark.parametrize("package", LAYER_PACKAGES)
def test_each_layer_says_what_it_owns_and_may_import(package: str) -> None:
    init = SRC / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert "May import:" in doc and len(doc.split()) > 15, f"{init}: say what it owns and what it may import"
    tree = ast.parse(init.read_text())
    assert all(isinstance(n, ast.Expr) for n in tree.body), f"{init}: a layer's __init__ holds its docstring only"


def test_no_line_over_110_characters_in_src() -> None:
    long = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        for n, line in enumerate(path.read_text().split("\n"), 1)
        if len(line) > 110
    ]
    assert not long, long


def _runtime_private_names() -> set[str]:
    """Names of private attributes and methods of the runtime's classes."""
    names = set()
    for path in (SRC / "runtime").rglob("*.py"):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef):
                    names.add(node.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)  # dataclass fields
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":  # not torch's
                        names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_nothing_above_the_runtime_reads_its_private_fields() -> None:
    """Features, the API and tools use the runtime's documented methods (e.g. `live_buffers`,
    `update_settings`), never its private attributes or methods."""
    private = _runtime_private_names()
    assert {"_all_gather", "_stash", "_post_forward_shard", "_set_dtype"} <= private  # the scan sees them
    reads = [
        f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}"
        for path in SRC.rglob("*.py")
        if "runtime" not in path.relative_to(SRC).parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in private
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert not reads, reads
