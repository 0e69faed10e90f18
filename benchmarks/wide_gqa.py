"""Decode attention of wide GQA groups (multi-query models) over a TurboQuant cache.

transformers' eager/compiled ``sdpa`` attention packs a decode step's head group as query rows
(``pack_gqa``: ``q [B, Hk, group, D]`` under one mask row). ``TurboQuantKVTensor`` folds those
rows into the query heads of one ``tq.decode``; until issue 51 it did so only up to 16 rows per
kv-head and dequantized the whole cache for wider groups (StarCoder 48:1, Falcon-7B 71:1). This
times one layer's attention of one decode step three ways, per group size:

* ``tq.decode``: SDPA over the views (the folded decode, what a model gets now);
* ``dequantize``: the former route, both views dequantized then masked bf16 SDPA;
* ``bf16``: SDPA with ``enable_gqa`` over a dense bf16 cache of the same tokens (the baseline
  a careful user of a static cache would run).

Each is replayed from a CUDA graph (GPU time only), L2 flushed before each call.

    python benchmarks/wide_gqa.py                                  # groups 8..64, B 8, 8k
    python benchmarks/wide_gqa.py --groups 32 64 --batch 1 --context 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402

from tq_compile import TurboQuantKVCache  # noqa: E402

ROUTES = ("tq.decode", "dequantize", "bf16")


def time_group(group: int, args) -> dict:
    """Microseconds of each route for one layer of ``args.kv_heads`` kv-heads times ``group``
    query heads each, ``args.batch`` sequences of ``args.context`` cached tokens."""
    batch, kv_heads, context, head_dim = args.batch, args.kv_heads, args.context, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(batch, kv_heads, context, head_dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, kv_heads, context, head_dim, device="cuda", generator=gen).bfloat16()
    cache = TurboQuantKVCache(batch, kv_heads, context, head_dim, preset=args.fmt, device="cuda")
    with torch.no_grad():
        keys, values = cache.update(torch.arange(context, device="cuda"), k, v)
        q = torch.randn(batch, kv_heads, group, head_dim, device="cuda", generator=gen).bfloat16()
        mask = torch.ones(batch, 1, 1, context, dtype=torch.bool, device="cuda")
        q_heads = q.reshape(batch, kv_heads * group, 1, head_dim)

        def folded():
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

        def dequantized():
            dense_k, dense_v = keys.dequantize(), values.dequantize()
            return F.scaled_dot_product_attention(
                q_heads, dense_k, dense_v, attn_mask=mask, enable_gqa=True
            )

        def dense():
            return F.scaled_dot_product_attention(q_heads, k, v, attn_mask=mask, enable_gqa=True)

        exact = dense().float()
        error = (folded().reshape(q_heads.shape).float() - exact).norm() / exact.norm()
        routes = zip(ROUTES, (folded, dequantized, dense), strict=True)
        times = {name: common.bench(fn, cuda_graph=True) for name, fn in routes}
    return {
        "group": group,
        **times,
        "vs_dequantize": times["dequantize"] / times["tq.decode"],
        "vs_bf16": times["bf16"] / times["tq.decode"],
        "rel_error": error.item(),
    }


def plot(payload: dict, path: Path) -> None:
    """Draw each route's time against the group size (log-log) to ``path``."""
    plt = common.pyplot()
    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for route in ROUTES:
        ax.plot([r["group"] for r in rows], [r[route] for r in rows], marker="o", label=route)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("query heads per kv-head")
    ax.set_ylabel("us per layer (one decode step)")
    cfg = payload["config"]
    ax.set_title(
        f"{cfg['fmt']}, B{cfg['batch']}, {cfg['context']} tokens, "
        f"Hk {cfg['kv_heads']}, D {cfg['head_dim']}\n{payload['gpu']}",
        fontsize=9,
    )
    ax.legend()
    common.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16, 32, 48, 64])
    parser.add_argument("--fmt", default="4bit_nc")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", default="wide_gqa.json")
    args = parser.parse_args()
    common.require_cuda("wide_gqa.py")
    rows = [time_group(group, args) for group in args.groups]
    print(
        f"{common.gpu_name()}: {args.fmt}, B {args.batch}, {args.context} tokens, "
        f"{args.kv_heads} kv-heads of dim {args.head_dim}; us per layer"
    )
    common.print_table(
        rows,
        {
            "group": "",
            "tq.decode": ".1f",
            "dequantize": ".1f",
            "bf16": ".1f",
            "vs_dequantize": ".2f",
            "vs_bf16": ".2f",
            "rel_error": ".1e",
        },
    )
    payload = {"gpu": common.gpu_name(), "config": vars(args), "rows": rows}
    out = common.write_json(args.out, payload)
    print(f"wrote {out}")
    plot(payload, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
