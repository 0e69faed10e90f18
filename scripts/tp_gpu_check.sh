#!/usr/bin/env bash
# Issue 23's two-GPU run (a machine with 2 CUDA GPUs, e.g. nvidia-h200-x2; meant to take under
# 8 minutes there):
#   1. tests/examples/test_tp.py's GPU test: 2 NCCL ranks, 200 greedy TP decode steps under CUDA
#      graphs (torch.compile mode="reduce-overhead") equal eager;
#   2. benchmarks/tp.py: the 8b-shape model at B16 x 32k tokens under TP=2, bf16 cache (SDPA
#      enable_gqa) vs 4bit_nc, reduce-overhead, 20 timed steps (caches filled with random K/V,
#      no prefill), then rank 0 alone on one GPU at B8: the same cache per GPU.
# Usage: bash scripts/tp_gpu_check.sh [OUT_DIR]    (default benchmarks/results)
# OUT_DIR gets tp_pytest.log, tp_bench.log, tp.json and tp.png. Environment:
#   TQ_PYTHON       the interpreter (default python3: the machine's CUDA torch + triton)
#   SINGLE_BATCHES  one-GPU batches (default "8"; "8 16" adds the same total work on one GPU,
#                   two more compilations of the 8b-shape step)
# torchao and expecttest come from .whl/ when the interpreter lacks them (installed into
# /tmp/site); the repository is put on PYTHONPATH. Exits non-zero if either step fails.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=$(realpath -m "${1:-benchmarks/results}")
PY=${TQ_PYTHON:-python3}
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())") || exit 1
if [ "$gpus" -lt 2 ]; then
  echo "tp_gpu_check.sh: needs 2 CUDA devices, found $gpus" >&2
  exit 1
fi
mkdir -p "$OUT"
if ! "$PY" -c "import torchao" 2>/dev/null && compgen -G ".whl/torchao-*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/torchao-*.whl .whl/expecttest-*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
nvidia-smi --query-gpu=name,memory.total --format=csv
status=0

echo "== test_tp.py GPU test (2 ranks, NCCL, CUDA graphs vs eager)"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/examples/test_tp.py 2>&1 \
  | tee "$OUT/tp_pytest.log" | tail -20 || status=1

echo "== benchmarks/tp.py: 8b-shape, B16 x 32k, TP=2 vs one GPU"
# shellcheck disable=SC2086  # SINGLE_BATCHES is a list of numbers
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp.py \
  --device cuda --preset 8b-shape --batch 16 --context 32768 --modes reduce-overhead \
  --formats 4bit_nc --steps 20 --single-batches ${SINGLE_BATCHES:-8} --out "$OUT/tp.json" 2>&1 \
  | tee "$OUT/tp_bench.log" | grep -v "^W[0-9]" | tail -30 || status=1
exit $status
