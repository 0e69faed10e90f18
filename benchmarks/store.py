"""Benchmark ``torch.ops.tq.store``: quantize 8192 bf16 tokens x 8 kv-heads x D=128 into a cache.

For every format, times one store of the whole batch into a paged cache (page size 16, twice the
pages needed) at a shuffled ``slot_mapping``, so the code rows land at scattered slots. Bytes
moved are the bf16 K and V read (``N * Hk * D * 2`` bytes each), the slot mapping read
(``N * 4``) and the cache bytes written (``N * Hk * bytes_per_token_head``); their ratio to the
time is the effective bandwidth, reported also as a fraction of the device-to-device copy
bandwidth measured in the same run.

Times are medians over many calls with L2 flushed before each (:func:`common.bench`): ``us``
replays the op from a CUDA graph (the kernel's own time, what a captured step pays), ``eager us``
calls it from Python (adding the op's dispatch and input checks where the GPU does not hide
them). Bandwidth is computed from the graph time.

Usage (CUDA only; ``custom_ops`` importable: installed, or the repository on PYTHONPATH)::

    python benchmarks/store.py [--formats k8v4 4bit_nc]

Prints a table and writes ``benchmarks/results/store.json``.
"""

from __future__ import annotations

import argparse

import torch
import triton
from common import bench, copy_bandwidth, gpu_name, print_table, require_cuda, write_json

from custom_ops import FORMATS, api, get_format

NUM_TOKENS = 8192
NUM_KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 16
SEED = 0


def random_kv(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 keys and values ``[N, Hk, D]``: per-token-head scales, an outlier channel."""
    shape = (NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM)
    scale = torch.rand(NUM_TOKENS, NUM_KV_HEADS, 1, generator=gen) * 4 + 0.1
    key = torch.randn(shape, generator=gen) * scale
    key[..., 3] *= 8
    value = torch.randn(shape, generator=gen) * scale + 0.5
    return key.to(torch.bfloat16), value.to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=list(FORMATS),
        default=list(FORMATS),
        metavar="FORMAT",
        help=f"formats to time (default: all of {', '.join(FORMATS)})",
    )
    args = parser.parse_args()
    require_cuda("benchmarks/store.py")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(SEED)
    key, value = (t.to(device) for t in random_kv(gen))
    num_pages = 2 * NUM_TOKENS // PAGE_SIZE
    slot_mapping = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:NUM_TOKENS]
    slot_mapping = slot_mapping.to(torch.int32).to(device)

    copy_bytes_per_s = copy_bandwidth(device)
    bytes_read = key.nbytes + value.nbytes + slot_mapping.nbytes
    rows = []
    for fmt_name in args.formats:
        fmt = get_format(fmt_name)
        cache = fmt.allocate(num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM, device)
        consts = api.make_constants(fmt, HEAD_DIM, seed=SEED, device=device)

        def store(cache=cache, consts=consts, name=fmt.name):
            torch.ops.tq.store(key, value, *cache, slot_mapping, *consts, name)

        store()  # compile the kernel for this format
        torch.cuda.synchronize()
        us = bench(store, cuda_graph=True)
        eager_us = bench(store)
        bytes_written = NUM_TOKENS * NUM_KV_HEADS * fmt.bytes_per_token_head(HEAD_DIM)
        bytes_moved = bytes_read + bytes_written
        bytes_per_s = bytes_moved / (us * 1e-6)
        rows.append(
            {
                "format": fmt_name,
                "bytes/token-head": fmt.bytes_per_token_head(HEAD_DIM),
                "us": us,
                "eager us": eager_us,
                "bytes moved": bytes_moved,
                "MB moved": bytes_moved / 1e6,
                "GB/s": bytes_per_s / 1e9,
                "of copy": bytes_per_s / copy_bytes_per_s,
            }
        )

    name = gpu_name(device)
    print(
        f"tq.store: {NUM_TOKENS} tokens x {NUM_KV_HEADS} kv-heads x D={HEAD_DIM} from bf16, "
        f"page size {PAGE_SIZE}, shuffled slots, on {name}"
    )
    print(f"copy bandwidth (read + write): {copy_bytes_per_s / 1e9:.0f} GB/s\n")
    print_table(
        rows,
        {
            "format": "",
            "bytes/token-head": "d",
            "us": ".1f",
            "eager us": ".1f",
            "MB moved": ".2f",
            "GB/s": ".0f",
            "of copy": ".0%",
        },
    )
    out = write_json(
        "store.json",
        {
            "benchmark": "tq.store",
            "gpu": name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "num_tokens": NUM_TOKENS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "page_size": PAGE_SIZE,
            "num_pages": num_pages,
            "input_dtype": "bfloat16",
            "slot_mapping": "shuffled",
            "timing": "median of triton.testing.do_bench, L2 flushed before each call; "
            "median_us replays a CUDA graph, eager_median_us calls the op from Python",
            "copy_bandwidth_bytes_per_s": copy_bytes_per_s,
            "results": [
                {
                    "format": r["format"],
                    "bytes_per_token_head": r["bytes/token-head"],
                    "median_us": r["us"],
                    "eager_median_us": r["eager us"],
                    "bytes_moved": r["bytes moved"],
                    "bandwidth_bytes_per_s": r["GB/s"] * 1e9,
                    "fraction_of_copy_bandwidth": r["of copy"],
                }
                for r in rows
            ],
        },
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
