"""SVG snapshots (pytest-textual-snapshot) of the main screen, the model picker and the bench results.

Deterministic content: a client that starts no engine and reports a fixed model and frozen stats, a
chat store seeded with fixed messages and timestamps, a fixed model list, and a fixed bench report.
Update the snapshots after an intended UI change with `pytest tests/test_tui_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import pytest

from nanochat.app.paths import get_paths
from nanochat.app.settings import Settings
from nanochat.app.store import ChatStore
from nanochat.app.tui.app import NanochatApp
from nanochat.app.tui.screens import BenchScreen
from nanochat.app.tui.widgets import ChatInput
from nanochat.engine.output import EngineStats, RequestStats
from nanochat.engine.serve.client import EngineClient
from nanochat.engine.serve.protocol import ModelInfo
from nanochat.models.formats.catalog import ModelEntry

SIZE = (130, 40)
MODEL = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"


class FrozenClient(EngineClient):
    """An EngineClient with a 'loaded' model and frozen stats that never starts an engine."""

    def __init__(self):
        super().__init__()
        self.model = ModelInfo(model=MODEL, arch="llama", device="cpu", dtype="float32", max_model_len=2048,
                               load_seconds=0.5)

    @property
    def alive(self) -> bool:
        return True

    def start(self) -> None:
        raise AssertionError("the snapshot client starts no engine")

    def stats(self) -> EngineStats:
        return EngineStats(prefill_tok_s=812.0, decode_tok_s=41.5, running=1, waiting=0, kv_blocks_total=1456,
                           kv_blocks_used=12, kv_blocks_cached=30, kv_blocks_free=1414, prefix_hit_rate=0.62)

    def load_model(self, model: str, progress=None, **config) -> ModelInfo:
        raise ValueError(f"{model}: frozen")

    def shutdown(self, timeout: float = 10.0) -> None:
        pass


REPLY = """Here is a function that adds two numbers:

```python
def add(a, b):
    return a + b
```

Call it as `add(2, 3)`, which returns **5**."""

STATS_1 = RequestStats(prompt_tokens=42, cached_tokens=0, completion_tokens=31, ttft=0.084, decode_tok_s=38.2,
                       finish_reason="stop")
STATS_2 = RequestStats(prompt_tokens=95, cached_tokens=64, completion_tokens=12, ttft=0.031, decode_tok_s=40.7,
                       finish_reason="stop")

REPORT = {
    "spec": {"num_seqs": 8, "max_input_len": 64, "max_output_len": 64, "max_model_len": 128, "tier": "fast"},
    "model": "SmolLM2-135M-Instruct", "device": "cpu",
    "engine": {"dtype": "float32", "num_kvcache_blocks": 1456},
    "iterations": [{"iteration": 0, "num_requests": 8, "prompt_tokens": 262, "cached_tokens": 0,
                    "generated_tokens": 301, "elapsed_s": 4.21, "throughput_tok_s": 71.5, "prefill_tok_s": 905.3,
                    "decode_tok_s": 88.6, "ttft_ms": {"mean": 120.4, "p50": 118.0, "p90": 140.2, "p99": 141.9},
                    "tpot_ms": {"mean": 11.3, "p50": 11.1, "p90": 12.0, "p99": 12.4}, "preemptions": 0}],
}
REPORT["mean"] = {k: v for k, v in REPORT["iterations"][0].items() if k not in ("iteration", "num_requests")}


@pytest.fixture
def seeded_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    paths = get_paths().ensure()
    store = ChatStore(paths.chat_db)
    old = store.create_conversation("Weekend plans", created=1_700_000_000.0)
    store.add_message(old, "user", "Any ideas for Saturday?", created=1_700_000_001.0)
    cid = store.create_conversation("Adding numbers in Python", model=MODEL, created=1_700_000_100.0)
    store.add_message(cid, "user", "Write a Python function that adds two numbers.", created=1_700_000_101.0)
    store.add_message(cid, "assistant", REPLY, STATS_1, created=1_700_000_102.0)
    store.add_message(cid, "user", "Thanks! And for three numbers?", created=1_700_000_103.0)
    store.add_message(cid, "assistant", "Use `add(add(a, b), c)` or `sum((a, b, c))`.", STATS_2,
                      created=1_700_000_104.0)
    store.close()
    return paths


def make_app(paths, theme: str | None = None, **kw) -> NanochatApp:
    settings = Settings.load(paths.settings_file)
    if theme:
        settings.theme = theme
    return NanochatApp(client=FrozenClient(), paths=paths, settings=settings, **kw)


async def steady(pilot) -> None:
    await pilot.pause()                  # the chat screen (the app's default screen) composes first
    pilot.app.query_one(ChatInput).cursor_blink = False
    await pilot.pause()


def test_main_screen(seeded_home, snap_compare):
    assert snap_compare(make_app(seeded_home), terminal_size=SIZE, run_before=steady)


def test_main_screen_light_theme(seeded_home, snap_compare):
    assert snap_compare(make_app(seeded_home, theme="nanochat-light"), terminal_size=SIZE, run_before=steady)


def test_model_picker(seeded_home, snap_compare):
    entries = [
        ModelEntry("SmolLM2-135M-Instruct (Q4_1, built in)", MODEL, "gguf", "llama", 96_000_000, "Q4_1", "embedded"),
        ModelEntry("Qwen3-0.6B", "/home/me/models/Qwen3-0.6B", "hf", "qwen3", 1_503_300_000, "bfloat16", "dir"),
        ModelEntry("Qwen/Qwen2.5-0.5B-Instruct", "/cache/hub/qwen2.5", "hf", "qwen2", 988_000_000, "bfloat16", "hub"),
    ]

    async def open_picker(pilot):
        await steady(pilot)
        await pilot.app.chat_screen.commands.run("/model")
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()

    app = make_app(seeded_home, discover=lambda: entries)
    assert snap_compare(app, terminal_size=SIZE, run_before=open_picker)


def test_bench_results(seeded_home, snap_compare):
    async def open_bench(pilot):
        await steady(pilot)
        await pilot.app.push_screen(BenchScreen(pilot.app.client, "fast", report=REPORT))
        await pilot.pause()

    assert snap_compare(make_app(seeded_home), terminal_size=SIZE, run_before=open_bench)
