"""The client is the only door: front ends (app/) reach the engine through engine/serve/client.py and
the public types, never its internals; imports flow app -> engine -> models -> kernels; and no module
imports itself back through others (no import cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What app/ may import from the engine: the client, its messages and errors, and plain data types.
APP_MAY_IMPORT = {
    "nanochat.engine",                       # only the public names below
    "nanochat.engine.serve.client", "nanochat.engine.serve.protocol",
    "nanochat.engine.serve.bench",           # bench specs and reports (the bench runs in the engine process)
    "nanochat.engine.output", "nanochat.engine.sampling_params",
    "nanochat.engine.config",                # option names and checks, shared with the CLI
    "nanochat.engine.rules",                 # the one table of value rules
    "nanochat.models.formats.catalog", "nanochat.models.errors",
    "nanochat.models.formats.weight_map",            # convert-model writes a weight map; no engine involved
    "nanochat.models.formats.hub_gguf",              # pull fetches a model file before any engine starts
    "nanochat.kernels.cpp_build",                    # cache_root: the one definition of the cache dir
}
PUBLIC_ENGINE_NAMES = {"SamplingParams", "TokenEvent", "RequestStats", "EngineStats", "Reply", "RequestError",
                       "RequestResult", "PoolingParams"}
LAYERS = ["app", "engine", "models", "kernels"]


def imports(path: Path):
    """(module, names) of every `import` / `from ... import` in a file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, set()


def test_app_reaches_the_engine_only_through_the_client():
    bad = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        for module, names in imports(path):
            if not module.startswith(("nanochat.engine", "nanochat.models", "nanochat.kernels")):
                continue
            if module not in APP_MAY_IMPORT:
                bad.append(f"{path.relative_to(ROOT)}: {module}")
            elif module == "nanochat.engine" and not names <= PUBLIC_ENGINE_NAMES:
                bad.append(f"{path.relative_to(ROOT)}: nanochat.engine.{sorted(names - PUBLIC_ENGINE_NAMES)}")
    assert not bad, "app/ reaches into engine internals:\n" + "\n".join(bad)


def test_imports_flow_down_the_layers():
    bad = []
    for i, layer in enumerate(LAYERS):
        above = tuple(f"nanochat.{name}" for name in LAYERS[:i])
        for path in sorted((ROOT / layer).rglob("*.py")):
            for module, _ in imports(path):
                if module.startswith(above):
                    bad.append(f"{path.relative_to(ROOT)}: {module}")
    assert not bad, "imports that flow up:\n" + "\n".join(bad)


def module_graph() -> dict[str, set[str]]:
    """Every module of the package (tests and benchmarks aside) and the modules it imports, at any
    depth (in functions and TYPE_CHECKING blocks too). `from pkg import mod` imports pkg.mod, not pkg."""
    paths = {}
    packages = [d for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name not in ("tests", "benchmarks")]
    for path in [ROOT / "__init__.py", *(p for d in packages for p in d.rglob("*.py"))]:
        rel = path.relative_to(ROOT)
        parts = ["nanochat", *rel.with_suffix("").parts]
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        deps = set()
        for module, names in imports(path):
            subs = {f"{module}.{n}" for n in names} & paths.keys()
            deps |= subs if names and len(subs) == len(names) else ({module} & paths.keys()) | subs
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = module_graph()
    assert {"nanochat.app.tui.chat_screen", "nanochat.app.tui.chat_commands", "nanochat.engine"} <= set(graph)
    new = [sorted(c) for c in cycles(graph)]
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in new)


def test_the_cycle_finder_sees_function_level_and_type_checking_imports(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    import x\n"
                     "def f():\n    from y import z\n")
    assert [m for m, _ in imports(probe)] == ["typing", "x", "y"]
