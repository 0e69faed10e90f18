#!/usr/bin/env bash
# Tests: set up the environment if needed, then run the whole suite, one pytest-xdist worker per
# core. Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets
# TRITON_INTERPRET=1). Arguments replace the default `tests` (e.g. `bash scripts/test.sh
# tests/test_store.py -x`); options alone, such as `-k store`, apply to the whole suite
# (pyproject's testpaths).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
# --quick: the representative tier (about 4 minutes on two cores): every test not marked slow
# (tests/conftest.py SLOW)
QUICK=()
if [[ "${1:-}" == "--quick" ]]; then
    shift
    QUICK=(-m "not slow")
fi
if [[ $# -eq 0 ]]; then
    set -- tests
fi
# One pytest-xdist worker per core (TQ_TEST_WORKERS overrides; 0 runs in this process): most
# tests are the interpreter's single-threaded Python. An interpreter without xdist (TQ_PYTHON)
# runs them in one process.
WORKERS=()
if "$PY" -c "import xdist" 2>/dev/null; then
    # loadgroup: a module marked xdist_group (a model loaded once per module) stays on one worker
    WORKERS=(-n "${TQ_TEST_WORKERS:-auto}" --dist loadgroup)
fi
exec "$PY" -m pytest -q ${WORKERS[@]+"${WORKERS[@]}"} ${QUICK[@]+"${QUICK[@]}"} "$@"
