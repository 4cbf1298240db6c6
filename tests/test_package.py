"""The package's shape: no import circle (lazy imports count too), frameworks at the edge."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "r3cache"
FRAMEWORKS = ("vllm", "sglang", "megatron", "verl", "nemo_rl", "slime")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, wherever the statement stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            # `from package import module` depends on the module; a name from a module,
            # on that module.
            if imported in modules:
                targets.add(imported)
        # `from a.b import c` lists both a.b and a.b.c: keep the most specific.
        graph[name] = {t for t in targets if t != name
                       and not any(o.startswith(t + ".") for o in targets)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_frameworks_are_imported_only_by_their_integrations():
    for name, path in _modules().items():
        if name.startswith("r3cache.integrations"):
            continue
        used = [i for i in _imports(path) if i.split(".")[0] in FRAMEWORKS]
        assert not used, f"{name} imports {used}: frameworks belong in r3cache/integrations"
