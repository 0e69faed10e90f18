#!/usr/bin/env bash
# What one call on the lent GPU machine runs (see /work/.library/device): install the carried
# wheels (torchao, expecttest, pytest-xdist are not on the image), then the requested stages:
#   tests  - the kernel and op tests on CUDA (the CPU-only suites run in CI)
#   bench  - benchmarks/store.py and benchmarks/decode.py
#   sweep  - the decode kernel's tuning sweep
#   verify - decode of several query tokens (a verify step): its sweep, then T = 1, 4, 8
#   e2e    - benchmarks/e2e.py with $E2E_ARGS
#   hf     - benchmarks/hf_generate.py with $HF_ARGS (carry the transformers 5.23 wheel)
#   gguf    - keep the carried first part of SmolLM2's GGUF (scripts/smollm2_parts.sh) in /tmp
#   quality - benchmarks/quality.py with $QUALITY_ARGS (trains the byte model once per machine;
#             with .gguf/part2 carried, joins SmolLM2's GGUF for --model smollm2)
#   compare - benchmarks/compare_decode.py: this tree's decode vs the tree at $COMPARE_BASE
#             (default .ab/base, a carried export of the base commit) with $COMPARE_ARGS
#   stages  - compare_decode of the split kernel with $STAGES (default 5) pipeline stages in
#             every launch against this tree's plan, with $COMPARE_ARGS
#   profile - Nsight Compute on the split kernel at 1 x 131072, per $PROFILE_FORMATS
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
    gguf)
      # the first part of SmolLM2's GGUF (scripts/smollm2_parts.sh), kept for the next call
      mkdir -p /tmp/tq-gguf && cp .gguf/part1/gguf /tmp/tq-gguf/part1 || exit 1
      ;;
    quality)
      if [[ -f .gguf/part2/gguf ]]; then
        # join the parts (the first from an earlier `gguf` call to this machine)
        mkdir -p /tmp/tq-cache
        joined="/tmp/tq-cache/$(cat .gguf/part2/name)"
        cat /tmp/tq-gguf/part1 .gguf/part2/gguf >"$joined" || exit 1
        [[ "$(sha256sum "$joined" | cut -d' ' -f1)" == "$(cat .gguf/part2/sha256)" ]] \
          || { echo "gpu_check: the joined GGUF's SHA-256 differs"; exit 1; }
        export TQ_CACHE_DIR=/tmp/tq-cache
      fi
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
    stages)
      # the split kernel with $STAGES pipeline stages (default 5: the codes double-buffered,
      # docs/design/decode.md) in every launch, the formats' tuned stages of streaming splits
      # (custom_ops.tuning.DecodeTuning.stages) included, against this tree's plan, by
      # compare_decode ($COMPARE_ARGS)
      rm -rf /tmp/tq-stages && mkdir -p /tmp/tq-stages
      cp -r custom_ops benchmarks tq_compile /tmp/tq-stages/
      sed -i -e "s/^DEFAULT_STAGES = .*/DEFAULT_STAGES = ${STAGES:-5}/" \
        -e "s/^\( *streaming_stages = \)tuning.stages /\1${STAGES:-5} /" \
        /tmp/tq-stages/custom_ops/triton/decode/plan.py
      grep -q "streaming_stages = ${STAGES:-5} " /tmp/tq-stages/custom_ops/triton/decode/plan.py \
        || { echo "stages: plan.py's streaming_stages line not found" >&2; exit 1; }
      python3 benchmarks/compare_decode.py --head /tmp/tq-stages --base . ${COMPARE_ARGS:-} \
        2>&1 | tee "$OUT/stages.log" | tail -40
      ;;
    profile)
      # Nsight Compute on one split kernel per format ($PROFILE_FORMATS, default 4bit_nc and
      # tq3_nc) at 1 x 131072: where the streaming loop's warps stall (WarpStateStats, and
      # SourceCounters' top stall locations), its issue rate and occupancy
      for fmt in ${PROFILE_FORMATS:-4bit_nc tq3_nc}; do
        ncu --clock-control none -k regex:split_kernel --launch-skip 3 --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats \
          --section SchedulerStats --section SourceCounters \
          python3 benchmarks/profile_decode.py --format "$fmt" --batch 1 --seq 131072 \
          >"$OUT/ncu_$fmt.txt" 2>&1
        grep -E "Duration|DRAM Throughput|Issued Warp|Active Warps|Eligible Warps|Stall" \
          "$OUT/ncu_$fmt.txt" | head -30
      done
      ;;
  esac
done
cp benchmarks/results/*.json benchmarks/results/*.png "$OUT"/ 2>/dev/null || true
