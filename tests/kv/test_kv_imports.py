"""The runtime import graph of pdserve.kv has no cycle (issue 9), and transports never see the agent: they get a
TransportContext."""

import ast
from pathlib import Path

import pdserve.kv

ROOT = Path(pdserve.kv.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT.parent.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, mods: set[str], runtime_only: bool) -> set[str]:
    """Modules of pdserve.kv imported anywhere in `tree` (functions included: lazy imports run too), leaving out
    `if TYPE_CHECKING:` blocks when `runtime_only`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if runtime_only and isinstance(node, ast.If) and _is_type_checking(node):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in mods:
                    found.add(sub)
                elif node.module in mods:
                    found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(runtime_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    names = set(mods)
    return {m: _imports(ast.parse(p.read_text()), names, runtime_only) - {m} for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := dfs(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := dfs(m)):
            return c
    return None


def test_runtime_import_graph_of_pdserve_kv_is_acyclic():
    g = _graph(runtime_only=True)
    assert "pdserve.kv.agent" in g and "pdserve.kv.transports.tcp" in g["pdserve.kv.transports"]
    assert _cycle(g) is None, " -> ".join(_cycle(g) or [])


def test_transports_do_not_import_the_agent_even_for_types():
    g = _graph(runtime_only=False)
    for m, deps in g.items():
        if m.startswith("pdserve.kv.transports"):
            assert "pdserve.kv.agent" not in deps and "pdserve.kv" not in deps and "pdserve.kv.threaded" not in deps, m


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
