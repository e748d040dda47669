"""Build the project's C++ kernels once per CPU, cached under nanochat's cache dir.

The host kernels (csrc/*.cpp, one library: kernels/cpu_qgemv.py loads it) are a plain shared library
loaded with ctypes; the build is keyed by the sources, their headers and the CPU's feature flags, since
-march=native code only runs on CPUs with the same features. The library lives in a `LazyLibrary`:
built on first use, once.
A build announces itself (kernels/notices.py): the front end says why this load is slow.

    python -m nanochat.kernels.cpp_build     builds them all ahead (the set-up step: `make venv`)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path
from typing import Callable

from nanochat.kernels.notices import announce

# What a load says while the kernels compile (once per CPU and source).
COMPILING = "compiling the CPU kernels for this machine (once, a minute or two)…"


def cache_root() -> Path:
    """nanochat's cache dir ($NANOCHAT_HOME/cache, else the platformdirs user cache dir): the kernels'
    builds, the packed weights and app/paths.py's `cache_dir` are all under it."""
    home = os.environ.get("NANOCHAT_HOME")
    if home:
        return Path(home).expanduser() / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("nanochat"))


def build_root() -> Path:
    """Where the compiled kernels live: $NANOCHAT_KERNEL_DIR, else under the cache dir. One folder can
    serve several homes (the builds are keyed by source and CPU), so a fresh NANOCHAT_HOME need not
    compile them again: a minute or more of g++ on 2 cores."""
    shared = os.environ.get("NANOCHAT_KERNEL_DIR")
    return Path(shared).expanduser() if shared else cache_root() / "torch_extensions"


def cpu_fingerprint() -> str:
    flags = platform.machine()
    if platform.system() == "Darwin":  # no /proc/cpuinfo: the features the build's flags depend on
        return flags + " " + " ".join(sorted(arm_features("Darwin")))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags += line
                    break
    except OSError:
        pass
    return flags


def arm_features(system: str | None = None, cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The AArch64 features the kernels use that this CPU has: "dotprod" (SDOT) and "i8mm" (SMMLA). Linux: the
    Features line of /proc/cpuinfo (asimddp, i8mm); macOS: sysctl hw.optional.arm.FEAT_DotProd / FEAT_I8MM. Empty
    where neither answers (another OS, or a CPU without them)."""
    system = system or platform.system()
    found = set()
    if system == "Darwin":
        import subprocess

        for name, key in (("dotprod", "FEAT_DotProd"), ("i8mm", "FEAT_I8MM")):
            try:
                r = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{key}"], capture_output=True, text=True,
                                   timeout=5)
            except (OSError, subprocess.SubprocessError):
                continue
            if r.returncode == 0 and r.stdout.strip() == "1":
                found.add(name)
        return frozenset(found)
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("Features"):
                    words = set(line.split(":", 1)[1].split())
                    found |= {name for name, flag in (("dotprod", "asimddp"), ("i8mm", "i8mm")) if flag in words}
                    break
    except OSError:
        pass
    return frozenset(found)


def build_library(sources: Path | list[Path], variants: list[tuple[str, list[str], list[str]]]) -> str:
    """Path of the shared library built from `sources` with the first (name, cflags, ldflags) variant
    the compiler accepts. Raises RuntimeError naming each variant's failure."""
    sources = [sources] if isinstance(sources, Path) else list(sources)
    # The headers beside the sources are part of the build: an edit of one must rebuild.
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    tag = hashlib.sha256(b"".join(f.read_bytes() for f in [*sources, *headers])
                         + cpu_fingerprint().encode()).hexdigest()[:16]
    build_dirs = [build_root() / f"{name}-{tag}" for name, _, _ in variants]
    for (name, _, _), build_dir in zip(variants, build_dirs):
        # Built before (the directory is keyed by the sources and the CPU): no need for torch's
        # cpp_extension, whose import (setuptools and all) is ~50 ms of a model's load.
        if (build_dir / f"{name}.so").is_file():
            return str(build_dir / f"{name}.so")
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()
    announce(COMPILING)
    errors = []
    for (name, flags, ldflags), build_dir in zip(variants, build_dirs):
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            return cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=flags, extra_ldflags=ldflags,
                                      build_directory=str(build_dir), is_python_module=False, verbose=False)
        except Exception as e:  # compiler errors come as RuntimeError / CalledProcessError / OSError
            errors.append(f"{name}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")
    raise RuntimeError("; ".join(errors))


class LazyLibrary:
    """A library built on first use, at most once per process: `lib` once built, else `error` (the
    build failed; it is not retried) with `warned` set after the one warning.

    `lib` may be read without the lock (it is only ever set once): `x.lib or x.get(...)` is the fast path."""

    __slots__ = ("lib", "error", "warned", "_lock")

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self.warned = False
        self._lock = threading.Lock()

    def replace(self, lib: ctypes.CDLL) -> None:
        """Use `lib` from now on (another build of the same sources)."""
        with self._lock:
            self.lib, self.error = lib, None

    def get(self, load: Callable[[], ctypes.CDLL], warning: str) -> ctypes.CDLL | None:
        """The library, built with `load()` on the first call; None when that raised, after one
        RuntimeWarning `warning.format(error=...)` on the first such call. Meant to be called from a
        module's `extension()`: the warning names the line that called the caller of extension()."""
        lib = self.lib
        if lib is not None:
            return lib
        with self._lock:
            if self.lib is None and self.error is None:
                try:
                    self.lib = load()
                except Exception as e:
                    self.error = str(e) or type(e).__name__
            if self.lib is None and not self.warned:
                self.warned = True
                warnings.warn(warning.format(error=self.error), RuntimeWarning, stacklevel=4)
            return self.lib
