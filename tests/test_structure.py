"""The package's shape, checked: no import cycle among pdserve's modules nor among its subpackages (lazy imports
inside functions count: a cycle deferred to call time is still a cycle), and flag defaults equal to the config
dataclasses' (no default written twice)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pdserve"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """pdserve modules `path` imports anywhere (functions included), except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            out.update(subs)
            if base in modules and len(subs) < len(node.names):  # names from the package itself, not submodules
                out.add(base)
    out.discard(me)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    mods = set(files)
    g = {m: imports_of(p, mods) for m, p in files.items()}
    g["pdserve"] = set()  # the root's lazy `pdserve.LLM` facade is the public entry, not a dependency
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def package_of(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_modules():
    assert cycles(graph()) == []


def test_no_import_cycle_between_subpackages():
    g = graph()
    pg: dict[str, set[str]] = {}
    for m, deps in g.items():
        pg.setdefault(package_of(m), set()).update(package_of(d) for d in deps if package_of(d) != package_of(m))
    pg["pdserve"] = set()
    assert cycles(pg) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_instance_flag_defaults_are_the_config_defaults(monkeypatch):
    import argparse

    for name in ("PDSERVE_DEPLOYMENT_SECRET", "PDSERVE_DEPLOYMENT_SECRET_FILE", "PDSERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)

    from pdserve.config import EngineConfig, KVTransferConfig, ServerConfig
    from pdserve.server.main import add_arguments, build_config

    cfg = build_config(add_arguments(argparse.ArgumentParser()).parse_args([]))
    assert cfg == ServerConfig()
    assert cfg.engine == EngineConfig() and cfg.engine.kv_transfer == KVTransferConfig()
    # and every engine field has a flag (nothing configurable only from Python by accident)
    parser = add_arguments(argparse.ArgumentParser())
    dests = {a.dest for a in parser._actions}
    missing = {f.name for f in dataclasses.fields(EngineConfig)} - dests - {"kv_transfer"}
    assert missing == set()


def test_config_argv_reproduces_the_config():
    import argparse

    from pdserve.server.main import add_arguments, build_config, config_argv

    argv = ["--max-model-len", "256", "--no-enable-prefix-caching", "--enforce-eager", "--role", "decode",
            "--kv-lease", "5.0", "--kv-transport", "tcp", "--request-timeout", "9.0", "--log-level", "debug"]
    parser = add_arguments(argparse.ArgumentParser())
    cfg = build_config(parser.parse_args(argv))
    assert build_config(parser.parse_args(config_argv(cfg))) == cfg
    assert sorted(config_argv(cfg)) == sorted(argv)


def test_docs_modules_lists_every_module():
    import importlib.util

    repo = ROOT.parent
    spec = importlib.util.spec_from_file_location("gen_modules", repo / "docs" / "gen_modules.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (repo / "docs" / "modules.md").read_text() == gen.render(), "run `python docs/gen_modules.py`"


def test_the_http_frontend_does_not_import_torch():
    """The server process serves HTTP and talks to the engine process: importing torch there (seconds) delayed
    every start before the engine was spawned. The engine process imports it."""
    code = ("import sys; import pdserve.server.main, pdserve.server.app, pdserve.disagg.routes, "
            "pdserve.engine.async_llm, pdserve.router.main; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1]).returncode == 0
