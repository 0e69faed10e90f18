#!/usr/bin/env bash
# Create (on first use) the project's environment and print the path of its Python.
#
#   PY="$(bash scripts/setup_env.sh)"
#
# Without TQ_PYTHON: creates .venv with `python3 -m venv` if it is missing, installs the pinned
# requirements and the package (editable, no deps) into it, and records a hash of the
# requirements and pyproject.toml in .venv/.tq-ready; later calls with the same hash install
# nothing. With TQ_PYTHON=/path/to/python (e.g. a CUDA machine's own torch): uses that
# interpreter as it is and creates nothing; the callers put the repository on PYTHONPATH.
# Progress goes to stderr; stdout is only the interpreter's path.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -n "${TQ_PYTHON:-}" ]]; then
    if ! command -v "$TQ_PYTHON" >/dev/null 2>&1; then
        echo "setup_env: TQ_PYTHON=$TQ_PYTHON is not an executable" >&2
        exit 1
    fi
    command -v "$TQ_PYTHON"
    exit 0
fi

REQUIREMENTS=(
    "torch==2.13.0"
    "triton==3.6.0"
    "torchao==0.18.0"
    "numpy<2.4"
    # pytest 9.2 drops the group suffix pytest-xdist 3.8's --dist loadgroup schedules by
    # (pytest-xdist#1386): the xdist_group modules then load their model on every worker
    "pytest>=8,<9.2"
    "pytest-xdist==3.8.0"
    "expecttest==0.3.0"
    # the formatter and linter the tests hold the code to (tests/test_format.py)
    "ruff==0.17.6"
    # the [hf] extra: tq_compile.hf, the real model, the main job
    "transformers==5.23.0"
    "gguf==0.19.0"
    "accelerate==1.15.0"
)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
MARKER="$VENV/.tq-ready"
HASH="$( { printf '%s\n' "${REQUIREMENTS[@]}"; cat "$ROOT/pyproject.toml"; } \
    | sha256sum | cut -d' ' -f1)"

if [[ -x "$PY" && -f "$MARKER" && "$(cat "$MARKER")" == "$HASH" ]]; then
    echo "$PY"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    echo "setup_env: creating $VENV" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
fi
echo "setup_env: installing ${REQUIREMENTS[*]} (first run: about a minute)" >&2
rm -f "$MARKER"
"$PY" -m pip install --quiet "${REQUIREMENTS[@]}" >&2
"$PY" -m pip install --quiet --no-deps -e "$ROOT" >&2
echo "$HASH" >"$MARKER"
echo "setup_env: ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))" >&2
echo "$PY"
