"""The client is the only door: front ends (app/) reach the engine through engine/serve/client.py and
the public types, never its internals; and imports flow app -> engine -> models -> kernels."""

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
    "nanochat.models.formats.catalog", "nanochat.models.errors",
    "nanochat.models.formats.weight_map",            # convert-model writes a weight map; no engine involved
    "nanochat.models.formats.hub_gguf",              # pull fetches a model file before any engine starts
    "nanochat.kernels.cpp_build",                    # cache_root: the one definition of the cache dir
}
PUBLIC_ENGINE_NAMES = {"SamplingParams", "TokenEvent", "RequestStats", "EngineStats", "Reply", "RequestError",
                       "RequestResult"}
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
