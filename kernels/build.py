"""The set-up step (`python -m nanochat.kernels.build`, run by `make chat` / `make test`): build the CPU
kernels now rather than in the first model load."""

from __future__ import annotations

import sys
import warnings

from nanochat.kernels import cpu_qgemv, notices
from nanochat.kernels.cpp_build import build_root


def build_all() -> list[str]:
    """Build the host kernel library if this CPU lacks it; the warning if it could not be built (it says
    what falls back to what)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        cpu_qgemv.extension()
    return [str(w.message) for w in caught if str(w.message).startswith("nanochat:")]


def main() -> int:
    """The set-up step: build the kernels now rather than in the first model load. Never fails the
    set-up: without a compiler nanochat runs on its fallbacks, and says so."""
    with notices.listening(lambda text: print(f"nanochat: {text}", flush=True)):
        failed = build_all()
    for warning in failed:
        print(warning, file=sys.stderr)
    if not failed:
        print(f"nanochat: CPU kernels ready in {build_root()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
