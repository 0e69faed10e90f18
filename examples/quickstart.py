"""Quick start: what each KV-cache format costs in bytes and in accuracy.

For every format in ``custom_ops.FORMATS`` this script

1. builds random bf16 keys and values ``[N, Hk, D]`` shaped like a real model's: a random scale
   per token-head, an outlier channel in the keys (as post-RoPE keys have) and an offset in the
   values;
2. allocates a paged cache of that format (page size 16), stores the tokens into it at shuffled
   slots with ``torch.ops.tq.store`` and reads them back with ``torch.ops.tq.dequantize``
   through a shuffled block table;
3. prints one row per format: bytes per token-head (keys, values and their per-token-head
   scalars together), compression against bf16 (``4 * D`` bytes: K and V of 2 bytes each,
   512 at D = 128), the relative reconstruction error ``||X' - X|| / ||X||`` of K and of V, and
   the relative error of attention scores ``q . k`` for random queries against the dequantized
   keys, with the exact bf16 keys in float64 as the reference.

On CPU the ops run the pure-torch reference codec (a few seconds); on CUDA they run the Triton
kernels. Usage::

    python examples/quickstart.py [--head-dim 128] [--tokens 4096] [--device cuda] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.arguments import (  # noqa: E402
    add_device_argument,
    check_arguments,
    head_dims,
    resolve_device,
)


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked arguments (torch is not imported: a bad one fails at once)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128, choices=head_dims())
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per kv-head")
    add_device_argument(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and rotation")
    args = parser.parse_args(argv)
    check_arguments(parser, args, "tokens")
    return parser, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # before the imports below, which take seconds

import torch  # noqa: E402

from custom_ops import FORMATS, api, get_format  # noqa: E402

NUM_KV_HEADS = 4
PAGE_SIZE = 16
NUM_QUERIES = 32  # random queries per kv-head for the score error


def random_kv(
    n_tokens: int, head_dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[N, Hk, D] bf16`` keys and values with per-token-head scales and an outlier."""
    scale = torch.rand(n_tokens, NUM_KV_HEADS, 1, generator=gen) * 4 + 0.1
    key = torch.randn(n_tokens, NUM_KV_HEADS, head_dim, generator=gen) * scale
    key[..., 3] *= 8  # one outlier channel
    value = torch.randn(n_tokens, NUM_KV_HEADS, head_dim, generator=gen) * scale + 0.5
    return key.to(torch.bfloat16), value.to(torch.bfloat16)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius), computed in float64."""
    approx, exact = approx.to(torch.float64), exact.to(torch.float64)
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact))


def round_trip(
    fmt_name: str,
    key: torch.Tensor,
    value: torch.Tensor,
    seed: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store ``key``/``value`` ``[N, Hk, D]`` into a fresh paged cache and dequantize them.

    Returns:
        K and V ``[Hk, N, D] float64`` on the CPU as read back from the cache, in token order.
    """
    fmt = get_format(fmt_name)
    n_tokens, num_kv_heads, head_dim = key.shape
    device = key.device
    num_pages = -(-n_tokens // PAGE_SIZE)
    cache = fmt.allocate(num_pages, num_kv_heads, PAGE_SIZE, head_dim, device)
    consts = api.make_constants(fmt, head_dim, seed=seed, device=device)

    # The sequence's pages are a random permutation of the cache's pages (as a paged allocator
    # hands them out); token t lives at offset t % PAGE_SIZE of page block_table[t // PAGE_SIZE].
    pages = torch.randperm(num_pages, generator=gen).to(torch.int32)
    positions = torch.arange(n_tokens, dtype=torch.int32)
    slot_mapping = pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE

    api.store(fmt, cache, key, value, slot_mapping.to(device), consts)
    block_table = pages[None, :].to(device)
    seq_lens = torch.tensor([n_tokens], dtype=torch.int32, device=device)
    k_hat, v_hat = api.dequantize(
        fmt, cache, block_table, seq_lens, consts, n_tokens, torch.float32
    )
    return k_hat[0].cpu().to(torch.float64), v_hat[0].cpu().to(torch.float64)


def format_row(cells: tuple[str, ...], widths: list[int]) -> str:
    """One table row: the first cell left-aligned, the numbers right-aligned."""
    first, *rest = (cell.rjust(width) for cell, width in zip(cells, widths, strict=True))
    return "  ".join([cells[0].ljust(widths[0]), *rest])


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    device = torch.device(resolve_device(parser, args))

    head_dim = args.head_dim
    gen = torch.Generator().manual_seed(args.seed)
    key, value = random_kv(args.tokens, head_dim, gen)
    queries = torch.randn(NUM_KV_HEADS, NUM_QUERIES, head_dim, generator=gen, dtype=torch.float64)
    exact_k = key.to(torch.float64).transpose(0, 1)  # [Hk, N, D]
    exact_v = value.to(torch.float64).transpose(0, 1)
    exact_scores = queries @ exact_k.transpose(1, 2)  # [Hk, Q, N]
    key, value = key.to(device), value.to(device)

    kernels = "Triton kernels" if device.type == "cuda" else "pure-torch reference"
    bf16_bytes = 4 * head_dim
    print(
        f"tq-compile quickstart: {args.tokens} tokens x {NUM_KV_HEADS} kv-heads, "
        f"head dim {head_dim}, page size {PAGE_SIZE}, on {device} ({kernels})"
    )
    print(f"bf16 K+V: {bf16_bytes} bytes per token-head\n")

    columns = ("format", "bytes/token-head", "vs bf16", "K rel err", "V rel err", "q.k rel err")
    rows = []
    start = time.perf_counter()
    for fmt_name in FORMATS:
        k_hat, v_hat = round_trip(fmt_name, key, value, args.seed, gen)
        scores = queries @ k_hat.transpose(1, 2)
        nbytes = get_format(fmt_name).bytes_per_token_head(head_dim)
        rows.append(
            (
                fmt_name,
                str(nbytes),
                f"{bf16_bytes / nbytes:.2f}x",
                f"{relative_error(k_hat, exact_k):.4f}",
                f"{relative_error(v_hat, exact_v):.4f}",
                f"{relative_error(scores, exact_scores):.4f}",
            )
        )
    elapsed = time.perf_counter() - start

    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    print(format_row(columns, widths))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(format_row(row, widths))
    print(
        f"\nErrors are ||x' - x|| / ||x|| over all tokens and heads; q.k uses {NUM_QUERIES} "
        f"random queries per kv-head. {len(rows)} formats in {elapsed:.1f} s."
    )


if __name__ == "__main__":
    main(PARSER, ARGS)
