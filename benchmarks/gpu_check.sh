#!/usr/bin/env bash
# The GPU check: one script for a CUDA machine, under 8 minutes, one JSON report.
#
#   benchmarks/gpu_check.sh [REPORT [--smoke] [--tests EXPR]]
#       REPORT: $OUT/gpu_check.json when OUT is set, else ./gpu_check.json; pytest's output lands beside it
#       (REPORT.tests.log); --smoke: a dry run without a GPU; --tests: only the GPU tests a pytest -k
#       expression selects (a rerun of what failed)
#
# On a bare machine with only this repository: makes a venv (.gpu-venv) that sees the packages of the
# python it starts from (a venv's too), so a CUDA build of torch already there is used as it is; installs
# torch (PyPI's CUDA build) only when there is none; installs nanochat itself and what it and the GPU tests
# lack from the package index, or, with no network, from wheels in .whl/ (`pip download` them elsewhere).
# Then benchmarks/gpu_check.py runs the GPU tests and nano-vllm's bench workload (see its docstring) and
# writes the report.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT="${1:-${OUT:-.}/gpu_check.json}"
[ $# -gt 0 ] && shift
VENV="${GPU_VENV:-.gpu-venv}"
BUDGET="${GPU_CHECK_BUDGET:-420}"      # seconds for the checks themselves, after the set-up
started=$(date +%s)

BASE="${PYTHON:-python3}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    # pip too comes from the base (no ensurepip needed); a base python that is itself a venv (GPU images
    # keep torch in one) lends its packages through a .pth: --system-site-packages sees only the interpreter's
    "$BASE" -m venv --system-site-packages --without-pip "$VENV" || exit 1
    "$BASE" -c 'import site; print("\n".join(site.getsitepackages()))' \
        > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-check-base.pth" || exit 1
fi
pip_get() {   # the index first (short timeouts: an offline machine fails fast), then local wheels
    "$PY" -m pip install -q --disable-pip-version-check --timeout 10 --retries 0 "$@" 2>/dev/null ||
        "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links .whl "$@"
}
"$PY" -c "import torch" 2>/dev/null || pip_get torch || { echo "gpu_check: cannot install torch" >&2; exit 1; }
log=$(mktemp)
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . >"$log" 2>&1 ||
    { cat "$log" >&2; echo "gpu_check: cannot install nanochat" >&2; exit 1; }
# import name -> distribution, for what nanochat and the GPU tests need beside torch
missing=$("$PY" - <<'PY'
import importlib.util
need = {"gguf": "gguf", "platformdirs": "platformdirs", "safetensors": "safetensors", "tokenizers": "tokenizers",
        "textual": "textual", "prompt_toolkit": "prompt_toolkit", "starlette": "starlette", "uvicorn": "uvicorn",
        "jinja2": "jinja2", "numpy": "numpy", "rich": "rich", "huggingface_hub": "huggingface_hub",
        "pytest": "pytest", "transformers": "transformers", "triton": "triton"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
    pip_get $missing || echo "gpu_check: could not install: $missing (the report says what failed)" >&2
fi
echo "gpu_check: set up in $(( $(date +%s) - started )) s; running the checks" >&2
PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_check.py "$REPORT" --budget "$BUDGET" "$@"
status=$?
echo "gpu_check: report in $REPORT after $(( $(date +%s) - started )) s" >&2
exit $status
