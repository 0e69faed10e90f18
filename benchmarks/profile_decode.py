"""One ``tq.decode`` call to profile, after warm-up calls: a target for Nsight Compute.

    ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python benchmarks/profile_decode.py --format 4bit_nc --batch 1 --seq 131072

The cache is filled like ``benchmarks/decode.py``'s (random bf16 tokens, shuffled pages, Hq=32,
Hk=8, D=128, page 16), with the default split count; ``--warm`` calls run before the profiled
one, so ``--launch-skip`` = ``--warm`` skips their split kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402
from common import require_cuda  # noqa: E402

from custom_ops import api  # noqa: E402
from custom_ops.formats import get_format  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="4bit_nc")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--warm", type=int, default=3)
    args = parser.parse_args()
    require_cuda("benchmarks/profile_decode.py")
    fmt = get_format(args.format)
    cache, consts, table, lens = bench.filled_cache(fmt, args.batch, args.seq)
    q = torch.randn(
        args.batch, bench.NUM_Q_HEADS, bench.HEAD_DIM, device="cuda", dtype=torch.bfloat16
    )
    splits = bench.default_splits(args.batch, args.seq)
    for _ in range(args.warm + 1):
        api.decode(fmt, q, cache, table, lens, consts, splits)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
