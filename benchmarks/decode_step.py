"""One decode step's cache work per layer under CUDA graphs: ``tq.store_window`` then ``tq.decode``
against the fused ``tq.decode_step``.

Each cell holds ``--layers`` TurboQuant caches of the 1b shape (Hq 32, Hk 8, D 128, the cache's
default window and sinks) filled to ``context - 300`` tokens. A step runs every layer's append
and attention of one token, then moves the position on, so that every step sends a token from
the ring to its page, as a real decode does. Steps are captured in a CUDA graph, and each
variant is timed twice, interleaved (store + decode, fused, store + decode, fused), over 50
replays. The result is microseconds per layer: the chain a one-sequence step waits for beside
the model's own kernels (``benchmarks/e2e.py`` times the whole model).

    python benchmarks/decode_step.py --batches 1 16 --contexts 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture, gpu_name, print_table, pyplot, require_cuda, save_figure, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from custom_ops import api  # noqa: E402
from custom_ops.formats import PagedKVCache, RecentWindow  # noqa: E402
from tq_compile import TurboQuantKVCache  # noqa: E402

NUM_KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128
# tokens left free after the fill: warm-up, capture and the timed replays of both variants
ROOM = 300
REPLAYS = 50


def _operands(cache: TurboQuantKVCache, batch: int):
    """``(planes, window, block table, constants)`` of ``cache``'s first ``batch`` sequences."""
    planes = PagedKVCache(cache.k_codes, cache.v_codes, cache.meta)
    window = RecentWindow(cache.k_window, cache.v_window, cache.window_pos, cache.sinks)
    return planes, window, cache.block_table[:batch], api.KVConstants(cache.rotation)


def time_cell(fmt: str, batch: int, context: int, layers: int) -> dict:
    """Microseconds per layer of each variant, two rounds each."""
    caches = [
        TurboQuantKVCache(batch, NUM_KV_HEADS, context, HEAD_DIM, preset=fmt, device="cuda")
        for _ in range(layers)
    ]
    gen = torch.Generator("cuda").manual_seed(0)
    filled = context - ROOM
    for cache in caches:
        for start in range(0, filled, 1024):
            n = min(1024, filled - start)
            shape = (batch, NUM_KV_HEADS, n, HEAD_DIM)
            kv = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
            cache.update(torch.arange(start, start + n, device="cuda"), kv, kv)
    shape = (batch, NUM_KV_HEADS * GROUP, HEAD_DIM)
    q = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    token = torch.randn(batch, NUM_KV_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    position = torch.tensor([filled], device="cuda")
    operands = [_operands(cache, batch) for cache in caches]

    def separate() -> None:
        start = position[:1].expand(batch)
        for cache, (planes, window, table, consts) in zip(caches, operands, strict=True):
            lens = api.store_window(fmt, planes, token, token, window, table, start, consts)
            api.decode(fmt, q, planes, table, lens, consts, cache.num_splits, window=window)
        position.add_(1)

    def fused() -> None:
        start = position[:1].expand(batch)
        for cache, (planes, window, table, consts) in zip(caches, operands, strict=True):
            api.decode_step(
                fmt, q, token, token, planes, window, table, start, consts, cache.num_splits
            )
        position.add_(1)

    rounds = {"store_window + decode": [], "decode_step": []}
    for _ in range(2):
        for name, step in (("store_window + decode", separate), ("decode_step", fused)):
            graph = capture(step)
            graph.replay()
            begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
            begin.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            rounds[name].append(begin.elapsed_time(end) * 1e3 / REPLAYS / layers)
    return dict(
        format=fmt,
        batch=batch,
        context=context,
        separate_us=rounds["store_window + decode"],
        fused_us=rounds["decode_step"],
    )


def plot(payload: dict, path: Path) -> None:
    plt = pyplot()
    rows = payload["rows"]
    labels = [f"{r['format']}\nB{r['batch']} {r['context'] // 1024}k" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4))
    ax.bar(
        [i - 0.2 for i in x], [min(r["separate_us"]) for r in rows], 0.4, label="store + decode"
    )
    ax.bar([i + 0.2 for i in x], [min(r["fused_us"]) for r in rows], 0.4, label="decode_step")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("us per layer (faster round)")
    ax.set_title(f"one decode step's cache work per layer, {payload['gpu']}")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["4bit_nc", "k8v4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", default="decode_step.json")
    args = parser.parse_args()
    require_cuda("benchmarks/decode_step.py")
    for fmt in args.formats:
        # (a cache of each format on the meta device: its default window, no memory)
        shape_only = TurboQuantKVCache(1, NUM_KV_HEADS, 4096, HEAD_DIM, preset=fmt, device="meta")
        if not api.step_supported(shape_only.kv_format, shape_only.window, 1):
            parser.error(f"tq.decode_step does not serve {fmt} (rotated values or no window)")
    if min(args.contexts) <= ROOM + 1024:
        parser.error(f"contexts must exceed {ROOM + 1024} tokens, got {args.contexts}")
    rows = [
        time_cell(fmt, batch, context, args.layers)
        for fmt in args.formats
        for batch in args.batches
        for context in args.contexts
    ]
    print(f"{gpu_name()}: us per layer, two rounds each, {args.layers} layers under CUDA graphs")
    shown = [
        dict(
            format=r["format"],
            batch=r["batch"],
            context=r["context"],
            separate=" / ".join(f"{t:.2f}" for t in r["separate_us"]),
            fused=" / ".join(f"{t:.2f}" for t in r["fused_us"]),
            ratio=min(r["separate_us"]) / min(r["fused_us"]),
        )
        for r in rows
    ]
    print_table(shown, dict(format="", batch="d", context="d", separate="", fused="", ratio=".2f"))
    payload = dict(gpu=gpu_name(), layers=args.layers, rows=rows)
    write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
