"""The prefill op alone: a chunk after a compressed prefix, against bf16 SDPA over the same
positions.

For each ``--shapes`` entry ``PREFIXxCHUNK`` (tokens already cached, tokens in the chunk) and
format, one sequence of ``--heads`` 32 query / 8 kv heads of dim 128 (the 1b-shape model's
attention) holds ``PREFIX`` random tokens in a TurboQuant cache (window 128, 4 sinks, pages of
16) and then stores the chunk; ``tq.prefill`` of the chunk's queries under gpt-fast's causal
mask is timed (CUDA events, L2 flushed, median), beside bf16 SDPA of the same queries over a
dense cache of ``PREFIX + CHUNK`` positions, causal over the chunk (cuDNN under a
``[T, PREFIX + CHUNK]`` boolean mask: what the bf16 model runs), and beside the same SDPA
with the chunk's keys alone and ``is_causal`` (what ``tq.prefill`` runs first). Throughput
counts ``4 * T * (PREFIX + T / 2) * D * Hq`` FLOPs (QK and PV, the causal half of the
chunk). Both ways of reading the prefix are timed (``--paths``): ``dense`` (dequantized into a
workspace, then the dense kernel; the default) and ``fused`` (the prefill kernel, what CUDA-graph
capture runs); ``--sweep`` times the fused kernel's launch configurations. Writes
``results/prefill.json``.

    python benchmarks/prefill.py
    python benchmarks/prefill.py --shapes 30720x2048 --formats 4bit_nc --sweep
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import bench, gpu_name, print_table, require_cuda, write_json  # noqa: E402

from custom_ops import api, sdpa_lse  # noqa: E402
from custom_ops.formats import FORMATS, RecentWindow, get_format  # noqa: E402
from custom_ops.triton import prefill as triton_prefill  # noqa: E402
from custom_ops.triton.prefill import PrefillConfig  # noqa: E402

WINDOW, SINKS, PAGE_SIZE, HEAD_DIM = 128, 4, 16, 128
SWEEP = [
    PrefillConfig(m, n, w, s) for m in (64, 128) for n in (32, 64) for w in (4, 8) for s in (1, 2)
]


def setup(fmt_name: str, prefix: int, tokens: int, heads: tuple[int, int]) -> dict:
    """A cache holding ``prefix`` tokens then a stored chunk of ``tokens``, and the prefill's
    arguments."""
    fmt = get_format(fmt_name)
    num_q_heads, num_kv_heads = heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-(prefix + tokens) // PAGE_SIZE) + 1
    cache = fmt.allocate(pages, num_kv_heads, PAGE_SIZE, HEAD_DIM, "cuda")
    table = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    ring = (1, num_kv_heads, WINDOW + SINKS, HEAD_DIM)
    window = RecentWindow(
        torch.zeros(ring, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(ring, dtype=torch.bfloat16, device="cuda"),
        torch.full(ring[:3], -1, dtype=torch.int32, device="cuda"),
        SINKS,
    )
    consts = api.make_constants(fmt, HEAD_DIM, device="cuda")
    keys = torch.randn(1, num_kv_heads, prefix + tokens, HEAD_DIM, device="cuda", generator=gen)
    values = torch.randn(keys.shape, device="cuda", generator=gen)
    keys, values = keys.bfloat16(), values.bfloat16()
    # the prefix in pieces, then the chunk in one write: what a chunked prefill leaves
    pieces = [(a, min(a + 8192, prefix)) for a in range(0, prefix, 8192)]
    for start, end in [*pieces, (prefix, prefix + tokens)]:
        api.store_window(
            fmt,
            cache,
            keys[:, :, start:end].contiguous(),
            values[:, :, start:end].contiguous(),
            window,
            table,
            torch.tensor([start], dtype=torch.int32, device="cuda"),
            consts,
        )
    q = torch.randn(1, num_q_heads, tokens, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    lens = torch.tensor([prefix + tokens], dtype=torch.int32, device="cuda")
    rows = prefix + torch.arange(tokens, device="cuda")
    mask = (torch.arange(prefix + tokens, device="cuda")[None, :] <= rows[:, None])[None, None]
    return dict(
        fmt=fmt,
        q=q,
        keys=keys,
        values=values,
        cache=cache,
        table=table,
        lens=lens,
        rotation=consts.rotation,
        window=window,
        mask=mask,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["2048x2048", "14336x2048", "30720x2048", "0x32768"]
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        default=["4bit_nc", "k8v4", "3bit_nc", "tqk5v3_nc"],
        choices=sorted(FORMATS),
    )
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8])
    parser.add_argument(
        "--paths", nargs="+", default=["dense", "fused"], choices=["dense", "fused"]
    )
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default="prefill.json")
    args = parser.parse_args()
    require_cuda("prefill.py")
    rows = []
    for shape in args.shapes:
        prefix, tokens = (int(x) for x in shape.split("x"))
        flops = 4 * tokens * (prefix + tokens / 2) * HEAD_DIM * args.heads[0]
        for fmt_name in args.formats:
            s = setup(fmt_name, prefix, tokens, tuple(args.heads))
            chunk_k = s["keys"][:, :, prefix:].contiguous()
            chunk_v = s["values"][:, :, prefix:].contiguous()
            call = (
                s["fmt"],
                s["q"],
                chunk_k,
                chunk_v,
                s["cache"],
                s["table"],
                s["lens"],
                s["rotation"],
                HEAD_DIM**-0.5,
                False,
                prefix + tokens,
                s["mask"],
                s["window"],
            )
            runs = [("dense", None)] if "dense" in args.paths else []
            if "fused" in args.paths:
                runs += [("fused", c) for c in (SWEEP if args.sweep else [PrefillConfig()])]
            for path, config in runs:
                fused = path == "fused"
                with triton_prefill.fused_prefix() if fused else contextlib.nullcontext():
                    us = bench(lambda c=config, a=call: triton_prefill.prefill(*a, config=c))
                label = "dense" if config is None else "fused " + " ".join(map(str, config))
                rows.append(
                    dict(
                        shape=shape, format=fmt_name, config=label, us=us, tflops=flops / us / 1e6
                    )
                )
                print(f"  {rows[-1]}", flush=True)
        dense = dict(q=s["q"], k=s["keys"], v=s["values"], mask=s["mask"])
        us = bench(
            lambda d=dense: F.scaled_dot_product_attention(
                d["q"], d["k"], d["v"], attn_mask=d["mask"], enable_gqa=True
            )
        )
        rows.append(
            dict(shape=shape, format="bf16 SDPA, mask", config="", us=us, tflops=flops / us / 1e6)
        )
        us = bench(
            lambda c=(s["q"], chunk_k, chunk_v): sdpa_lse.attention_lse(*c, True, HEAD_DIM**-0.5)
        )
        rows.append(
            dict(
                shape=shape,
                format="bf16 SDPA, chunk causal",
                config="",
                us=us,
                tflops=2 * tokens * tokens * HEAD_DIM * args.heads[0] / us / 1e6,
            )
        )
    for row in rows:
        mask_row = next(
            r for r in rows if r["shape"] == row["shape"] and r["format"] == "bf16 SDPA, mask"
        )
        row["vs_bf16_mask"] = mask_row["us"] / row["us"]
    device = gpu_name()
    print(
        f"\n{device}, Hq {args.heads[0]}, Hk {args.heads[1]}, D {HEAD_DIM}, window {WINDOW}, "
        f"sinks {SINKS}; config: dense, or fused block_m block_n warps stages"
    )
    print_table(
        rows, dict(shape="", format="", config="", us=".1f", tflops=".1f", vs_bf16_mask=".3f")
    )
    out = write_json(args.out, dict(device=device, torch=torch.__version__, rows=rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
