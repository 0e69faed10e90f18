#!/usr/bin/env bash
# SmolLM2-135M-Instruct's GGUF (98 MB) in two parts for the lent GPU machine, whose calls carry
# at most 64 MiB (/work/.library/device): `.gguf/part1` (60 MB) goes in one call
# (`scripts/gpu_check.sh gguf`, which keeps it in /tmp), `.gguf/part2` with the wheels in the
# next call to the same warm machine (`scripts/gpu_check.sh quality`, which joins the parts,
# checks their SHA-256 and points TQ_CACHE_DIR at the file). Downloads the GGUF here first if
# it is not cached (tq_compile.smollm2).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup_env.sh")"
GGUF="$(PYTHONPATH="$ROOT" "$PY" -c 'from tq_compile.smollm2 import smollm2_gguf
print(smollm2_gguf())')"
PART1_BYTES=60000000
rm -rf "$ROOT/.gguf"
mkdir -p "$ROOT/.gguf/part1" "$ROOT/.gguf/part2"
head -c "$PART1_BYTES" "$GGUF" >"$ROOT/.gguf/part1/gguf"
tail -c "+$((PART1_BYTES + 1))" "$GGUF" >"$ROOT/.gguf/part2/gguf"
sha256sum "$GGUF" | cut -d' ' -f1 >"$ROOT/.gguf/part2/sha256"
basename "$GGUF" >"$ROOT/.gguf/part2/name"
echo "carry .gguf/part1 in one call (gpu_check.sh gguf), then .gguf/part2 and .whl in the next"
