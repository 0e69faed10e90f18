#!/usr/bin/env bash
# Main job: set up the environment if needed, then run examples/chat.py (SmolLM2-135M-Instruct
# answering with a bf16 and a TurboQuant cache) with the given
# arguments (e.g. `bash scripts/run.sh --format 3bit_nc`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES="${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-1}"
exec "$PY" "$ROOT/examples/chat.py" "$@"
