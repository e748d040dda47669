"""`nanochat pull REPO[:QUANT]` and `--model REPO:QUANT`: a GGUF from a hub repo (a real HTTP hub on loopback,
tests/hub_server.py), picked by its quant tag as llama.cpp's -hf does, laid out in the hub cache as
huggingface_hub lays it out, resumed after a dropped connection or a stopped process, and clear errors for a
missing tag, a missing repo, a damaged download and no network."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from hub_server import FakeHub, Repo
from nanochat.models.errors import ModelLoadError
from nanochat.models.formats.hub_gguf import HubRef, fetch, file_tag, parse_ref, pick

REPO = "tiny-org/Tiny-GGUF"
GATED = "tiny-org/Gated"
FOLDER = "tiny-org/Tiny"        # a Transformers checkpoint (its files are never read here)
FILES = ["README.md", "Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "mmproj-Tiny-F16.gguf", "Tiny.IQ4_XS.gguf",
         "Big-Q2_K-00001-of-00002.gguf", "Big-Q2_K-00002-of-00002.gguf"]


def test_references_and_file_choice_follow_llama_cpp():
    assert parse_ref("org/Model-GGUF:q8_0") == HubRef("org/Model-GGUF", "Q8_0")
    assert parse_ref("org/Model-GGUF") == HubRef("org/Model-GGUF", None)     # the name says GGUF
    assert parse_ref("Qwen/Qwen3-0.6B") is None                              # a Transformers checkpoint
    assert parse_ref("Qwen/Qwen3-0.6B", any_repo=True) == HubRef("Qwen/Qwen3-0.6B", None)
    assert parse_ref("./models/x") is None and parse_ref("/abs/x:Q4") is None and parse_ref("m.gguf") is None
    assert file_tag("Big-Q2_K-00001-of-00002.gguf") == ("Q2_K", 1, 2)
    assert file_tag("Tiny.IQ4_XS.gguf") == ("IQ4_XS", 1, 1)
    assert pick(REPO, FILES, None) == "Tiny-Q4_K_M.gguf"                     # the default tag first
    assert pick(REPO, [f for f in FILES if "Q4_K_M" not in f], None) == "Tiny-Q8_0.gguf"
    assert pick(REPO, ["a-F16.gguf", "mmproj-a-F16.gguf"], None) == "a-F16.gguf"   # else the first model file
    assert pick(REPO, FILES, "iq4_xs".upper()) == "Tiny.IQ4_XS.gguf"
    assert pick(REPO, FILES, "Q2_K") == "Big-Q2_K-00001-of-00002.gguf"       # a split model: its first part
    with pytest.raises(ModelLoadError, match=r"no Q5_K_M GGUF in the repo; it has IQ4_XS, Q2_K, Q4_K_M, Q8_0"):
        pick(REPO, FILES, "Q5_K_M")
    with pytest.raises(ModelLoadError, match="no GGUF model file"):
        pick(REPO, ["README.md", "mmproj-x-F16.gguf"], None)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    files = {name: os.urandom(3000 + 100 * i) for i, name in enumerate(FILES)}
    with FakeHub({REPO: Repo(files), GATED: Repo({"model.safetensors": b"x", "Gated-Q8_0.gguf": b"x"}, gated=True),
                  FOLDER: Repo({"config.json": b"{}", "model.safetensors": b"x"})}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr("nanochat.models.formats.hub_gguf._CHUNK", 512)    # several chunks per file
        yield server


def test_fetch_lays_the_file_out_as_huggingface_hub_does(hub, tmp_path):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    seen = []
    path = fetch(HubRef(REPO, "Q8_0"), lambda done, total, name: seen.append((done, total, name)))
    data = hub.repos[REPO].files["Tiny-Q8_0.gguf"]
    assert path.read_bytes() == data
    assert seen[0] == (0, len(data), "Tiny-Q8_0.gguf") and seen[-1] == (len(data), len(data), "Tiny-Q8_0.gguf")
    # huggingface_hub itself finds the file where we put it
    assert try_to_load_from_cache(REPO, "Tiny-Q8_0.gguf", cache_dir=tmp_path / "hub") == str(path)
    (repo,) = scan_cache_dir(tmp_path / "hub").repos
    assert repo.repo_id == REPO and {f.file_name for f in next(iter(repo.revisions)).files} == {"Tiny-Q8_0.gguf"}
    before = len(hub.gets)
    assert fetch(HubRef(REPO, "Q8_0")) == path and len(hub.gets) == before     # cached: nothing downloaded
    assert fetch(HubRef(REPO, None)).name == "Tiny-Q4_K_M.gguf"


def test_a_dropped_connection_resumes_where_it_stopped(hub):
    data = hub.repos[REPO].files["Tiny-Q8_0.gguf"]
    hub.cut_after, hub.cuts_left = 1000, 2
    path = fetch(HubRef(REPO, "Q8_0"))
    assert path.read_bytes() == data
    # each retry asks only for what is not on disk yet (whole chunks are written; a cut one is asked again)
    first, second, third = (start for _, start in hub.gets)
    assert first == 0 and 0 < second <= 1000 and second < third <= second + 1000
    assert hub.sent < 2 * len(data)


def test_a_stopped_pull_resumes_in_the_next_process_and_a_damaged_one_starts_over(hub, tmp_path):
    data = hub.repos[REPO].files["Tiny-Q4_K_M.gguf"]

    def stop_midway(done, total, name):
        if done >= 1536:
            raise KeyboardInterrupt   # Ctrl+C

    with pytest.raises(KeyboardInterrupt):
        fetch(HubRef(REPO, "Q4_K_M"), stop_midway)
    (part,) = (tmp_path / "hub").rglob("*.incomplete")
    kept = part.stat().st_size
    assert 0 < kept < len(data)
    path = fetch(HubRef(REPO, "Q4_K_M"))
    assert path.read_bytes() == data and hub.gets[-1] == ("Tiny-Q4_K_M.gguf", kept)
    assert not part.exists()

    # A partial file whose bytes are wrong (a disk error, another tool's leftovers): the SHA-256 check
    # refuses the result and drops it; the next pull downloads it afresh.
    other = hub.repos[REPO].files["Tiny.IQ4_XS.gguf"]
    blob_dir = path.parents[2] / "blobs"
    import hashlib
    bad = blob_dir / f"{hashlib.sha256(other).hexdigest()}.incomplete"
    bad.write_bytes(b"\0" * 1000)
    with pytest.raises(ModelLoadError, match="arrived damaged"):
        fetch(HubRef(REPO, "IQ4_XS"))
    assert not bad.exists()
    assert fetch(HubRef(REPO, "IQ4_XS")).read_bytes() == other


def test_clear_errors_for_a_missing_tag_repo_split_or_network(hub, tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match=r"^tiny-org/Tiny-GGUF: no Q6_K GGUF in the repo; it has"):
        fetch(HubRef(REPO, "Q6_K"))
    with pytest.raises(ModelLoadError, match="no such model repo"):
        fetch(HubRef("tiny-org/Nothing-GGUF", None))
    with pytest.raises(ModelLoadError, match="split into 2 files"):
        fetch(HubRef(REPO, "Q2_K"))
    with pytest.raises(ModelLoadError, match="^tiny-org/Gated: a gated repo; accept its terms"):
        fetch(HubRef(GATED, "Q8_0"))
    cached = fetch(HubRef(REPO, "Q8_0"))
    with socket.socket() as s:                # a port nothing listens on: no network
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    assert fetch(HubRef(REPO, "Q8_0")) == cached                                 # offline: the cache serves
    with pytest.raises(ModelLoadError, match=r"cannot reach the Hugging Face hub .* no Q4_K_M file of it is in the cache"):
        fetch(HubRef(REPO, "Q4_K_M"))


def test_a_checkpoint_hub_id_says_what_failed(hub, tmp_path, monkeypatch):
    """`--model org/name` of a Transformers checkpoint: the same one-line reasons as a pull, not an exception's name."""
    from nanochat.models.formats.hf_source import resolve_hub_id

    assert (Path(resolve_hub_id(FOLDER)) / "config.json").read_bytes() == b"{}"
    with pytest.raises(ModelLoadError, match="^tiny-org/Nothing: no such model repo on http://127"):
        resolve_hub_id("tiny-org/Nothing")
    with pytest.raises(ModelLoadError, match="^tiny-org/Gated: a gated repo; accept its terms"):
        resolve_hub_id(GATED)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    assert (Path(resolve_hub_id(FOLDER)) / "config.json").is_file()                   # offline: the cache serves
    offline = r"^tiny-org/Other: cannot reach the Hugging Face hub \(http://127\.0\.0\.1:\d+: .+\), and it is not"
    with pytest.raises(ModelLoadError, match=offline + r" a local path, nor in the cache \("):
        resolve_hub_id("tiny-org/Other")


def test_pull_and_model_ref_from_the_command_line(tiny_models, tmp_path):
    from gguf_writer import MetaValue, byte_tokenizer_metadata, write_gguf_from_hf

    model = tmp_path / "src" / "tiny.gguf"
    model.parent.mkdir()
    # a file that stands alone (no tokenizer.json beside it in a hub snapshot): the byte vocab and one merge
    VT = gguf.GGUFValueType
    vocab = byte_tokenizer_metadata(320, None, None)
    tokens, types = list(vocab["tokenizer.ggml.tokens"].value), list(vocab["tokenizer.ggml.token_type"].value)
    tokens[256], types[256] = "\u0120t", int(gguf.TokenType.NORMAL)
    vocab.update({"tokenizer.ggml.tokens": MetaValue(tokens, VT.ARRAY, VT.STRING),
                  "tokenizer.ggml.token_type": MetaValue(types, VT.ARRAY, VT.INT32),
                  "tokenizer.ggml.merges": MetaValue(["\u0120 t"], VT.ARRAY, VT.STRING)})
    write_gguf_from_hf(tiny_models["qwen3"], model, "qwen3", gguf.GGMLQuantizationType.Q8_0, tokenizer=vocab)
    files = {"Tiny-Q8_0.gguf": model.read_bytes(), "README.md": b"tiny"}
    with FakeHub({REPO: Repo(files)}) as server:
        env = dict(os.environ, HF_ENDPOINT=server.url, HF_HUB_CACHE=str(tmp_path / "hub"),
                   NANOCHAT_HOME=str(tmp_path / "home"))

        def cli(*args):
            return subprocess.run([sys.executable, "-m", "nanochat.app.cli", *args], env=env, text=True,
                                  capture_output=True, timeout=300, stdin=subprocess.DEVNULL)

        r = cli("pull", f"{REPO}:q8_0")
        assert r.returncode == 0, r.stderr
        path = r.stdout.strip()
        assert open(path, "rb").read() == files["Tiny-Q8_0.gguf"]
        assert "fetching Tiny-Q8_0.gguf" in r.stderr and "fetched Tiny-Q8_0.gguf" in r.stderr   # not a terminal
        r = cli("pull", f"{REPO}:Q5_K_M")
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [
            f"nanochat pull: error: {REPO}: no Q5_K_M GGUF in the repo; it has Q8_0 (ask for one as {REPO}:Q8_0)"]
        r = cli("pull", "not a repo")
        assert r.returncode == 2 and "is not REPO[:QUANT]" in r.stderr
        r = cli("--model", f"{REPO}:Q8_0", "--prompt", "hi", "--max-tokens", "4", "--temperature", "0", "--json")
        assert r.returncode == 0, r.stderr
        assert '"finish_reason"' in r.stdout and server.gets == [("Tiny-Q8_0.gguf", 0)]   # fetched once only
