#!/usr/bin/env bash
# What one call on the lent GPU machine runs (see /work/.library/device): install the carried
# wheels (torchao, expecttest, pytest-xdist are not on the image), then the requested stages:
#   tests  - the kernel and op tests on CUDA (the CPU-only suites run in CI)
#   bench  - benchmarks/store.py and benchmarks/decode.py
#   sweep  - the decode kernel's tuning sweep
#   verify - decode of several query tokens (a verify step): its sweep, then T = 1, 4, 8
#   e2e    - benchmarks/e2e.py with $E2E_ARGS
#   hf     - benchmarks/hf_generate.py with $HF_ARGS (carry the transformers 5.23 wheel)
#   quality - benchmarks/quality.py with $QUALITY_ARGS (trains the byte model once per machine)
#   compare - benchmarks/compare_decode.py: this tree's decode vs the tree at $COMPARE_BASE
#             (default .ab/base, a carried export of the base commit) with $COMPARE_ARGS
# Logs and JSON/PNG results go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/tq-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
for stage in "${@:-tests bench}"; do
  case "$stage" in
    tests)
      # TQ_TESTS narrows the selection (default: every suite with CUDA tests: the kernels'
      # and ops' tests, and tq_compile's); TQ_WORKERS sets pytest-xdist's worker count (default
      # 8; Triton's compilation is CPU-bound, and with 10 formats the full selection took over
      # 570 s at 8 workers on an H200 host, and 97% of it in 560 s at 16 on an H100 host). A
      # test still running after 200 s has its stacks dumped to the log (a hang, or where the
      # time goes)
      python3 -m pytest -q -n "${TQ_WORKERS:-8}" --durations=10 -o faulthandler_timeout=200 \
        -p no:cacheprovider ${TQ_TESTS:-tests/custom_ops/triton \
        tests/custom_ops/test_ops.py tests/custom_ops/test_validate.py tests/tq_compile} 2>&1 | tee "$OUT/pytest.log" | tail -25
      ;;
    bench)
      python3 benchmarks/store.py 2>&1 | tee "$OUT/store.log"
      python3 benchmarks/decode.py 2>&1 | tee "$OUT/decode.log"
      ;;
    e2e)
      python3 benchmarks/e2e.py ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | tail -30
      ;;
    hf)
      python3 benchmarks/hf_generate.py ${HF_ARGS:-} 2>&1 | tee "$OUT/hf.log" | tail -30
      ;;
    quality)
      python3 benchmarks/quality.py ${QUALITY_ARGS:-} 2>&1 | tee "$OUT/quality.log" | tail -40
      ;;
    compare)
      python3 benchmarks/compare_decode.py --base "${COMPARE_BASE:-.ab/base}" ${COMPARE_ARGS:-} \
        2>&1 | tee "$OUT/compare.log" | tail -70
      ;;
    verify)
      # a speculative-decoding verify step (issue 20): the split kernel's warps x register caps
      # at T = 4 and 8, then the default plan's T = 1, 4, 8 against bf16 SDPA
      python3 benchmarks/decode.py --formats 4bit_nc --shapes 1x32768 16x8192 --tokens 4 8 \
        --sweep --out verify_sweep.json 2>&1 | tee "$OUT/verify_sweep.log" | tail -40
      python3 benchmarks/decode.py --formats 4bit_nc k8v4 --shapes 1x32768 16x8192 \
        --tokens 1 4 8 --windows 0 128 --out verify.json 2>&1 | tee "$OUT/verify.log" | tail -40
      ;;
    sweep)
      python3 benchmarks/decode.py --formats 4bit_nc k8v4 3bit_nc int8 --shapes 1x131072 \
        --sweep --out sweep.json 2>&1 | tee "$OUT/sweep.log" | tail -60
      ;;
  esac
done
cp benchmarks/results/*.json benchmarks/results/*.png "$OUT"/ 2>/dev/null || true
