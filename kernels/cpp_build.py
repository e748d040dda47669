"""Build the project's C++ kernels once per CPU, cached under nanochat's cache dir.

Both host kernel libraries (cpu_qgemv, moe_cpu) are plain shared libraries loaded with ctypes; the
build is keyed by the source and the CPU's feature flags, since -march=native code only runs on CPUs
with the same features.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path


def cache_root() -> Path:
    home = os.environ.get("NANOCHAT_HOME")
    if home:
        return Path(home).expanduser() / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("nanochat"))


def cpu_fingerprint() -> str:
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags += line
                    break
    except OSError:
        pass
    return flags


def build_library(sources: Path | list[Path], variants: list[tuple[str, list[str], list[str]]]) -> str:
    """Path of the shared library built from `sources` with the first (name, cflags, ldflags) variant
    the compiler accepts. Raises RuntimeError naming each variant's failure."""
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()
    sources = [sources] if isinstance(sources, Path) else list(sources)
    tag = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + cpu_fingerprint().encode()).hexdigest()[:16]
    errors = []
    for name, flags, ldflags in variants:
        build_dir = cache_root() / "torch_extensions" / f"{name}-{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            return cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=flags, extra_ldflags=ldflags,
                                      build_directory=str(build_dir), is_python_module=False, verbose=False)
        except Exception as e:  # compiler errors come as RuntimeError / CalledProcessError / OSError
            errors.append(f"{name}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")
    raise RuntimeError("; ".join(errors))
