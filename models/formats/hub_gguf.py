"""GGUF files from Hugging Face repos, named `REPO[:QUANT]` as llama.cpp's `-hf` takes them.

The quant tag picks the file (case-insensitive, as the tag in its name: `...-Q4_K_M.gguf`); without one,
Q4_K_M, then Q8_0, then the repo's first model file. The file lands in the hub cache, laid out as
huggingface_hub lays it out (blobs/, snapshots/<commit>/, refs/), where the model picker and other tools
find it. We download the blob ourselves into `blobs/<etag>.incomplete` so that a pull stopped by Ctrl+C,
a crash or a dropped connection resumes where it stopped (huggingface_hub's own download starts over in
each process); repo listing, URLs, headers (token) and errors are huggingface_hub's.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanochat.models.errors import ModelLoadError

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
# Files in GGUF repos that are not the language model itself (llama.cpp skips the same).
NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<tag>[\w.-]+))?$")
_SPLIT = re.compile(r"^(.+)-(\d{5})-of-(\d{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_CHUNK = 1 << 20
_RETRIES = 5            # attempts in a row that bring no new bytes before a pull gives up

# progress(done_bytes, total_bytes, filename); called as bytes arrive and once at the end
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class HubRef:
    repo: str
    tag: str | None


def parse_ref(text: str, any_repo: bool = False) -> HubRef | None:
    """`owner/name:TAG`, or `owner/name` for a repo whose name says GGUF (any repo with `any_repo`); None
    for anything else (a local path, the hub id of a Transformers checkpoint)."""
    m = _REF.match(text)
    if m is None or text.startswith((".", "~")):
        return None
    repo, tag = m["repo"], m["tag"]
    if tag is None and not any_repo and "gguf" not in repo.split("/")[1].lower():
        return None
    return HubRef(repo, tag.upper() if tag else None)


def file_tag(filename: str) -> tuple[str, int, int]:
    """(quant tag, split index, split count) of a GGUF file name, as llama.cpp reads them."""
    stem = Path(filename).name[:-len(".gguf")] if filename.lower().endswith(".gguf") else Path(filename).name
    index = count = 1
    if m := _SPLIT.match(stem):
        stem, index, count = m[1], int(m[2]), int(m[3])
    tag = _TAG.search(stem)
    return (tag[1].upper() if tag else ""), index, count


def model_files(files: list[str]) -> list[str]:
    return [f for f in files if f.lower().endswith(".gguf") and not any(k in Path(f).name for k in NOT_A_MODEL)]


def pick(repo: str, files: list[str], tag: str | None) -> str:
    """The file of `files` (a repo's file names) to load for `tag`; a ModelLoadError naming the tags the
    repo has when none fits."""
    models = [f for f in model_files(files) if file_tag(f)[1] == 1]
    for want in [tag] if tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(want) + r"[.-]", re.IGNORECASE)
        found = [f for f in models if pattern.search(Path(f).name)]
        if found:
            return found[0]
    if not tag and models:
        return models[0]
    tags = sorted({file_tag(f)[0] or Path(f).name for f in models})
    if not tags:
        raise ModelLoadError(f"{repo}: the repo has no GGUF model file")
    raise ModelLoadError(f"{repo}: no {tag} GGUF in the repo; it has {', '.join(tags)} "
                         f"(ask for one as {repo}:{tags[0]})")


def fetch(ref: HubRef, progress: Progress | None = None) -> Path:
    """The local path of the GGUF `ref` names: from the hub (downloaded or resumed), else, when the hub
    cannot be reached, from the cache."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    endpoint, cache = hub_endpoint(), hub_cache_dir()
    try:
        info = HfApi(endpoint=endpoint).model_info(ref.repo)
    except Exception as e:   # no network, refused, timed out: the cache may still have the file
        cached = None if isinstance(e, HfHubHTTPError) else _from_cache(cache, ref)
        if cached is not None:
            return cached
        raise hub_error(ref.repo, e, f"no {ref.tag or 'GGUF'} file of it is in the cache") from None
    files = [s.rfilename for s in info.siblings or []]
    name = pick(ref.repo, files, ref.tag)
    count = file_tag(name)[2]
    if count > 1:
        raise ModelLoadError(f"{ref.repo}: {name} is split into {count} files; nanochat reads single-file GGUFs "
                             f"(llama.cpp's `llama-gguf-split --merge` joins them)")
    return _download(cache, endpoint, ref.repo, info.sha, name, progress)


def _download(cache: Path, endpoint: str, repo: str, commit: str, filename: str, progress: Progress | None) -> Path:
    from filelock import FileLock
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    folder = cache / f"models--{repo.replace('/', '--')}"
    target = folder / "snapshots" / commit / filename
    if target.is_file():
        _write_ref(folder, commit)
        return target
    url = hf_hub_url(repo, filename, revision=commit, endpoint=endpoint)
    headers = build_hf_headers()
    meta = get_hf_file_metadata(url, headers=headers, endpoint=endpoint)
    etag, size = meta.etag, meta.size
    if not etag or size is None:
        raise ModelLoadError(f"{repo}: the hub gave no ETag or size for {filename}")
    blob = folder / "blobs" / etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock_dir = cache / ".locks" / folder.name
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"{etag}.lock")):   # the lock huggingface_hub takes for the same blob
        if not blob.is_file():
            part = blob.with_name(f"{etag}.incomplete")
            _resume(meta.location or url, part, size, headers, filename, progress)
            _check_digest(part, etag, repo, filename)
            os.replace(part, blob)
        elif progress is not None:
            progress(size, size, filename)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:
            target.symlink_to(os.path.relpath(blob, target.parent))
        except OSError:     # no symlinks here (some filesystems): a copy, as huggingface_hub does
            import shutil
            shutil.copyfile(blob, target)
    _write_ref(folder, commit)
    return target


def _resume(url: str, part: Path, size: int, headers: dict, filename: str, progress: Progress | None) -> None:
    """Fill `part` up to `size` bytes from `url`, asking only for what it lacks (HTTP Range)."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    failures = 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            part.unlink()
            have = 0
        if progress is not None:
            progress(have, size, filename)
        if have == size:
            return
        ask = dict(headers, **{"Range": f"bytes={have}-", "Accept-Encoding": "identity"})
        before = have
        try:
            with get_session().stream("GET", url, headers=ask, follow_redirects=True, timeout=30) as response:
                hf_raise_for_status(response)
                mode = "ab" if response.status_code == 206 else "wb"   # 200: the server sent it all again
                have = have if mode == "ab" else 0
                with open(part, mode) as out:
                    for chunk in response.iter_bytes(_CHUNK):
                        out.write(chunk)
                        have += len(chunk)
                        if progress is not None:
                            progress(min(have, size), size, filename)
        except Exception as e:   # a dropped connection, a timeout (the HTTP client's errors), a 5xx
            from huggingface_hub.errors import HfHubHTTPError
            if isinstance(e, HfHubHTTPError) and getattr(e.response, "status_code", 0) not in (408, 429, 500, 502,
                                                                                               503, 504):
                raise ModelLoadError(f"{filename}: download refused ({_reason(e)})") from None
            grown = (part.stat().st_size if part.exists() else 0) > before
            failures = 0 if grown else failures + 1
            if failures >= _RETRIES:
                raise ModelLoadError(f"{filename}: the download keeps failing ({_reason(e)}); run the same command "
                                     f"again to resume from {part.stat().st_size if part.exists() else 0} bytes") from None
            time.sleep(min(0.2 * 2 ** failures, 5.0))


def _check_digest(part: Path, etag: str, repo: str, filename: str) -> None:
    """An LFS file's ETag is its SHA-256: a resumed file must hash to it (else it is dropped)."""
    if not re.fullmatch(r"[0-9a-f]{64}", etag):
        return
    digest = hashlib.sha256()
    with open(part, "rb") as f:
        while chunk := f.read(_CHUNK * 8):
            digest.update(chunk)
    if digest.hexdigest() != etag:
        part.unlink()
        raise ModelLoadError(f"{repo}: {filename} arrived damaged (its SHA-256 does not match the hub's); "
                             f"run the command again to download it afresh")


def _write_ref(folder: Path, commit: str) -> None:
    ref = folder / "refs" / "main"
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.is_file() or ref.read_text().strip() != commit:
        ref.write_text(commit)


def _from_cache(cache: Path, ref: HubRef) -> Path | None:
    """The file `ref` would pick among the cached snapshots of its repo (the one refs/main names first)."""
    folder = cache / f"models--{ref.repo.replace('/', '--')}"
    snapshots = folder / "snapshots"
    try:
        main = (folder / "refs" / "main").read_text().strip()
    except OSError:
        main = None
    try:
        order = sorted(snapshots.iterdir(), key=lambda p: (p.name != main, -p.stat().st_mtime))
    except OSError:
        return None
    for snap in order:
        files = [str(p.relative_to(snap)) for p in snap.rglob("*.gguf") if p.is_file()]
        try:
            return snap / pick(ref.repo, files, ref.tag)
        except ModelLoadError:
            continue
    return None


def hub_endpoint() -> str:
    # Read per call, not at import as huggingface_hub does: a test or a caller may set it later.
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_cache_dir() -> Path:
    """The hub cache, HF_HUB_CACHE read now (huggingface_hub's modules bind it when they are imported)."""
    from huggingface_hub import constants
    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def hub_error(repo: str, e: Exception, offline: str) -> ModelLoadError:
    """The one line for a hub request about `repo` that failed with `e`; `offline`: what the cache lacks, said
    when the hub could not be reached."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    endpoint = hub_endpoint()
    if isinstance(e, GatedRepoError):   # (a RepositoryNotFoundError too: asked first)
        return ModelLoadError(f"{repo}: a gated repo; accept its terms on the hub and set HF_TOKEN")
    if isinstance(e, RepositoryNotFoundError):
        return ModelLoadError(f"{repo}: no such model repo on {endpoint} (a private repo needs HF_TOKEN)")
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return ModelLoadError(f"{repo}: the hub answered {status or 'an error'} ({endpoint})")
    # the HTTP client's own errors (no network, refused, timed out), or huggingface_hub's "not in the cache"
    # raised over the network error that is the reason
    if isinstance(e, LocalEntryNotFoundError):
        e = e.__cause__ or e.__context__ or e
    return ModelLoadError(f"{repo}: cannot reach the Hugging Face hub ({endpoint}: {_reason(e)}), and "
                          f"{offline} ({hub_cache_dir()})")


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:160]
