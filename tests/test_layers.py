"""The import direction between canzona's layers, checked on the source with ast."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "canzona"

# layer -> canzona layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "plan": set(),
    "updates": set(),
    "runtime": {"plan"},
    "optim": {"plan", "updates", "runtime"},
    "testing": {"updates", "plan"},
    "integrations": {"optim", "plan", "runtime", "updates"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _all_modules() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(SRC.rglob("*.py"))}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_layers_import_only_downward() -> None:
    violations = []
    for module, imports in _all_modules().items():
        layer = _layer(module)
        if layer is None:
            continue
        for imp in imports:
            other = _layer(imp)
            if (
                imp.startswith("canzona.")
                and other is not None
                and other != layer
                and other not in ALLOWED[layer]
            ):
                violations.append(f"{module} imports {imp}")
    assert not violations, "\n".join(violations)


def _closure(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for imp in graph.get(mod, set()):
            # an import of canzona.x.y pulls in canzona, canzona.x and canzona.x.y
            parts = imp.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in graph:
                    todo.append(prefix)
    return seen


def test_plan_never_reaches_torch() -> None:
    graph = _all_modules()
    plan_modules = [m for m in graph if m == "canzona.plan" or m.startswith("canzona.plan.")]
    assert plan_modules, "canzona.plan has no modules"
    for start in plan_modules:
        for mod in _closure(start, graph):
            torchy = sorted(i for i in graph[mod] if i == "torch" or i.startswith("torch."))
            assert not torchy, f"{start} reaches {mod}, which imports {torchy}"


def test_updates_never_import_torch_distributed() -> None:
    graph = _all_modules()
    for module, imports in graph.items():
        if module.startswith("canzona.updates"):
            bad = sorted(i for i in imports if i.startswith("torch.distributed"))
            assert not bad, f"{module} imports {bad}"


def test_runtime_never_imports_updates() -> None:
    for module, imports in _all_modules().items():
        if module.startswith("canzona.runtime"):
            assert not any(i.startswith("canzona.updates") for i in imports), module


def test_import_plan_leaves_torch_unloaded() -> None:
    code = (
        "import sys, canzona, canzona.plan\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
