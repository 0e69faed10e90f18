"""End-to-end decode speed of the example model: TurboQuant caches vs the bf16 cache.

For each cache format, batch size and context length: the example model (``examples/model.py``,
random weights, default the ~1B ``1b-shape``: 16 layers, Hq=32, Hk=8, D=128) gets caches of
``context`` slots per sequence holding ``context - steps - 4`` random tokens, so the timed steps
attend to about ``context`` tokens; its decode step is compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs), and ``--steps`` steps
are timed with CUDA events after warm-up. Reports ms per step, tokens/s (batch / step time),
KV-cache bytes, speed-up over bf16 in the same run, and the largest context per sequence whose
KV cache fits ``--kv-budget-gb`` at that batch size.

    python benchmarks/e2e.py --batches 8 --contexts 8192           # one point
    python benchmarks/e2e.py --batches 1 16 --contexts 4096 32768  # the grid
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import gpu_name, print_table, require_cuda, write_json  # noqa: E402

from examples.model import ModelArgs, Transformer, decode_one_token, init_weights  # noqa: E402
from tq_compile import TurboQuantKVCache, kv_cache_nbytes  # noqa: E402

FILL_CHUNK = 2048


@torch.no_grad()
def fill_caches(model: Transformer, batch: int, context: int, gen: torch.Generator) -> None:
    """Put ``context`` random tokens in every layer's cache (what a prefill would leave)."""
    cfg = model.config
    for layer in model.layers:
        cache = layer.attention.kv_cache
        for start in range(0, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - start)
            shape = (batch, cfg.n_local_heads, n, cfg.head_dim)
            k = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
            v = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
            cache.update(torch.arange(start, start + n, device="cuda"), k, v)


@torch.no_grad()
def time_decode(model: Transformer, batch: int, context: int, steps: int) -> float:
    """Milliseconds per compiled decode step at positions context, context + 1, ..."""
    torch._dynamo.reset()
    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    tok = torch.zeros(batch, 1, dtype=torch.int64, device="cuda")
    pos = context
    for _ in range(3):  # compile, record the CUDA graph, replay
        tok, _ = step(model, tok, torch.tensor([pos], device="cuda"))
        tok = tok.clone()
        pos += 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        tok, _ = step(model, tok, torch.tensor([pos], device="cuda"))
        tok = tok.clone()
        pos += 1
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def run(args) -> dict:
    cfg = ModelArgs.from_name(args.preset)
    with torch.device("cuda"):
        model = init_weights(Transformer(cfg), seed=0).to(torch.bfloat16).eval()
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            base_ms = None
            for fmt in args.formats:
                factory = None if fmt == "bf16" else functools.partial(TurboQuantKVCache, fmt=fmt)
                # caches of `context` slots, filled so that the timed steps end near the top
                model.setup_caches(batch, context, cache_factory=factory)
                filled = context - args.steps - 4
                fill_caches(model, batch, filled, torch.Generator("cuda").manual_seed(1))
                ms = time_decode(model, batch, filled, args.steps)
                nbytes = kv_cache_nbytes(model)
                per_token = nbytes / (batch * context)
                base_ms = ms if fmt == "bf16" else base_ms
                rows.append(dict(
                    batch=batch, context=context, format=fmt, ms=ms, tok_s=batch / ms * 1e3,
                    speedup=(base_ms / ms) if base_ms else float("nan"),
                    kv_gb=nbytes / 1e9,
                    max_context=int(args.kv_budget_gb * 1e9 / (per_token * batch)),
                ))  # fmt: skip
                print(rows[-1], flush=True)
                for layer in model.layers:
                    layer.attention.kv_cache = None
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    print(
        f"{gpu_name()}, {args.preset}, decode step compiled with reduce-overhead; "
        f"max_context: tokens per sequence whose KV cache fits {args.kv_budget_gb} GB"
    )
    print_table(rows, dict(batch="d", context="d", format="", ms=".2f", tok_s=".0f",
                           speedup=".2f", kv_gb=".2f", max_context="d"))  # fmt: skip
    return dict(gpu=gpu_name(), preset=args.preset, kv_budget_gb=args.kv_budget_gb, rows=rows)


def plot(payload: dict, path: Path) -> None:
    """Tokens/s per (batch, context) cell, one bar per cache format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    cells = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(formats)
    for i, fmt in enumerate(formats):
        rate = {(r["batch"], r["context"]): r["tok_s"] for r in rows if r["format"] == fmt}
        xs = [j + i * width for j in range(len(cells))]
        bars = ax.bar(xs, [rate.get(c, 0) for c in cells], width, label=fmt)
        if fmt != "bf16":
            speed = {(r["batch"], r["context"]): r["speedup"] for r in rows if r["format"] == fmt}
            ax.bar_label(bars, [f"{speed[c]:.1f}x" for c in cells], fontsize=7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))],
                  [f"B={b}, {c // 1024}K ctx" for b, c in cells])  # fmt: skip
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"{payload['preset']} decode (reduce-overhead) on {payload['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b-shape")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--formats", nargs="+", default=["bf16", "4bit_nc", "k8v4"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--kv-budget-gb", type=float, default=40.0)
    parser.add_argument("--out", default="e2e.json")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of a saved JSON run")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    require_cuda("benchmarks/e2e.py")
    payload = run(args)
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    try:
        plot(payload, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG (python benchmarks/e2e.py --plot JSON later)")


if __name__ == "__main__":
    main()
