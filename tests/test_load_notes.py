"""A model load says what makes it slow (kernels/notices.py): compiling the C++ kernels for this machine
(kernels/cpp_build.py) and repacking a new GGUF file's weights into the pack cache (models/formats/pack_cache.py),
from the engine process through the client's `status` callback to a one-shot's stderr on a terminal; and
the set-up step (`python -m nanochat.kernels.build`) builds the kernels ahead without ever failing."""

from __future__ import annotations

import ctypes
import os
import pty
import select
import shutil
import subprocess
import sys
import threading
import time

import gguf
import pytest

from nanochat.engine.serve.client import EngineClient
from nanochat.kernels import cpp_build, cpu_qgemv, notices
from nanochat.kernels.cpp_build import COMPILING
from nanochat.models.formats import pack_cache
from nanochat.models.formats.pack_cache import REPACKING

T = gguf.GGMLQuantizationType
needs_kernels = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")


def test_announcements_go_to_the_listener_of_their_own_thread():
    heard = []
    with notices.listening(heard.append):
        other = threading.Thread(target=notices.announce, args=("another load",))
        other.start()
        other.join()
        notices.announce("this load")
    notices.announce("after it")
    assert heard == ["this load"]


def test_a_kernel_build_says_so_and_a_built_one_says_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_KERNEL_DIR", str(tmp_path / "kernels"))
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int nc_answer() { return 42; }\n')
    variants = [("nc_answer", ["-O1"], [])]
    heard = []
    with notices.listening(heard.append):
        path = cpp_build.build_library(source, variants)
        assert heard == [COMPILING]
        assert cpp_build.build_library(source, variants) == path   # cached: nothing to say
    assert heard == [COMPILING]
    assert ctypes.CDLL(path).nc_answer() == 42


def test_the_set_up_step_goes_on_without_a_compiler(tmp_path):
    env = dict(os.environ, NANOCHAT_KERNEL_DIR=str(tmp_path / "kernels"), CXX="/bin/false")
    out = subprocess.run([sys.executable, "-m", "nanochat.kernels.build"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"nanochat: {COMPILING}")
    warnings = out.stderr.splitlines()
    assert len(warnings) == 1 and "Traceback" not in out.stderr   # one library for every kernel
    assert "int8 matmul kernels could not be built" in warnings[0] and "torch's int4 kernel instead" in warnings[0]
    assert "routed MoE experts dequantize + matmul in torch" in warnings[0]


@pytest.fixture
def q8_gguf(tmp_path):
    """A tiny GGUF whose weights the CPU kernels repack (and the pack cache keeps)."""
    from conftest import CHATML, make_hf_model
    from gguf_writer import write_gguf_from_hf

    src = make_hf_model("qwen3", tmp_path / "hf", seed=3)
    (tmp_path / "m").mkdir()
    shutil.copy(src / "tokenizer.json", tmp_path / "m" / "tokenizer.json")
    return str(write_gguf_from_hf(src, tmp_path / "m" / "model.gguf", "qwen3", T.Q8_0, chat_template=CHATML))


@needs_kernels
def test_a_new_files_first_load_says_it_repacks(q8_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(pack_cache, "cache_dir", lambda: tmp_path / "packed")
    client = EngineClient(in_process=True)
    try:
        for expected in ([REPACKING], []):   # the second load maps what the first packed
            heard = []
            client.load_model(q8_gguf, status=heard.append, dtype="float32", max_model_len=64, pack_cache=True)
            assert heard == expected
    finally:
        client.shutdown()


def on_a_terminal(args: list[str], env: dict, timeout: float = 300) -> tuple[int, str]:
    """Run the CLI with its stderr on a pseudo-terminal (stdout a pipe): its exit code and what the
    terminal got."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "nanochat.app.cli", *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    got, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and select.select([master], [], [], deadline - time.monotonic())[0]:
            try:
                data = os.read(master, 65536)
            except OSError:   # EIO: the CLI closed the terminal
                break
            if not data:
                break
            got.append(data)
        return proc.wait(10), b"".join(got).decode("utf-8", "replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def one_shot_env(home, **more) -> dict:
    env = dict(os.environ, NANOCHAT_HOME=str(home), NANOCHAT_PACK_CACHE="1", COLUMNS="200", **more)
    env.pop("NANOCHAT_DEBUG", None)
    return env


@needs_kernels
def test_a_one_shot_on_a_terminal_says_it_repacks_a_new_file(q8_gguf, tmp_path):
    args = ["--model", q8_gguf, "--prompt", "hi", "--max-tokens", "2", "--dtype", "float32",
            "--max-model-len", "64"]
    code, first = on_a_terminal(args, one_shot_env(tmp_path / "home"))
    assert code == 0, first
    assert REPACKING in first   # at once, though the load takes less than the loading bar's delay
    code, second = on_a_terminal(args, one_shot_env(tmp_path / "home"))
    assert code == 0 and "repacking" not in second, second


@pytest.mark.slow   # a full compile of the kernels: about 60 s on 2 idle cores
@needs_kernels
def test_a_one_shot_on_a_terminal_says_it_compiles_the_kernels(q8_gguf, tmp_path):
    env = one_shot_env(tmp_path / "home", NANOCHAT_KERNEL_DIR=str(tmp_path / "kernels"))
    code, shown = on_a_terminal(["--model", q8_gguf, "--prompt", "hi", "--max-tokens", "2", "--max-model-len", "64"],
                                env)
    assert code == 0, shown
    assert COMPILING in shown
