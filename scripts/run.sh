#!/usr/bin/env bash
# Main job: set up the environment if needed, then run examples/quickstart.py with the
# given arguments (e.g. `bash scripts/run.sh --head-dim 64`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES="${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-1}"
exec "$PY" "$ROOT/examples/quickstart.py" "$@"
