"""Time to first token: a long prompt through the 1b-shape model with a bf16 and a TurboQuant
cache, in one forward and in chunks; time and peak GPU memory.

The model is ``examples/model.py``'s ``1b-shape`` (16 layers, 32 query / 8 kv heads of dim 128,
random bf16 weights), its caches allocated for the prompt plus ``--new`` tokens. Each row
prefills ``--prompts`` tokens x ``--batches`` sequences, eagerly, the logits of the last
position only, either in one forward or in chunks of ``--chunk`` tokens, through:

* ``bf16``: gpt-fast's dense ``KVCache``;
* each ``--formats`` TurboQuant cache (``--window``, default sinks), whose prompt attends over
  its own exact keys and values and each later chunk over the compressed prefix (``tq.prefill``).

and with each attention style the model offers (``--styles``): ``mask``, gpt-fast's boolean
causal mask over the cache (``causal_mask[input_pos]``, ``[1, 1, T, S_max]``: SDPA then takes
cuDNN's masked kernel), and ``causal``, SDPA's ``is_causal`` over the prompt's own positions,
no mask (Hugging Face's prefill into an empty static cache; cuDNN's causal kernel, the fastest
bf16 baseline; one forward only). Each row reports the median of ``--reps`` prefills after a
warm-up one, the speed-up over the bf16 row of the same style and over the fastest bf16 row of
the same prompt and batch, and the peak memory the prefill allocated (weights, cache,
activations) against bf16's. Writes ``results/ttft.json`` and ``results/ttft.png``.

    python benchmarks/ttft.py                      # 4k and 32k, B 1 and 8, 4bit_nc
    python benchmarks/ttft.py --prompts 131072 --batches 1 --styles causal --chunk 0
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import gpu_name, print_table, pyplot, require_cuda, save_figure, write_json  # noqa: E402

from custom_ops.formats import FORMATS  # noqa: E402
from examples.model import KVCache, ModelArgs, Transformer, init_weights  # noqa: E402
from tq_compile.cache import TurboQuantKVCache  # noqa: E402

STYLES = ("mask", "causal")


@torch.no_grad()
def prefill(model: Transformer, prompt: torch.Tensor, chunk: int, style: str) -> None:
    """Run ``prompt [B, T]`` through the model in chunks of ``chunk`` tokens (0: one forward),
    the last position's logits only."""
    length = prompt.shape[1]
    step = chunk or length
    for start in range(0, length, step):
        end = min(start + step, length)
        positions = torch.arange(start, end, device=prompt.device)
        model(prompt[:, start:end], positions, causal_prompt=style == "causal", last_only=True)


def measure(
    model: Transformer, cache: str, args, batch: int, length: int, chunk: int, style: str
) -> dict:
    """Set up ``cache`` caches for ``batch`` x (``length`` + ``--new``) tokens, then time
    prefills of a random prompt; the median seconds and the peak memory one prefill
    allocated."""
    factory = (
        KVCache
        if cache == "bf16"
        else functools.partial(TurboQuantKVCache, preset=cache, window=args.window)
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model.setup_caches(batch, length + args.new, cache_factory=factory)
    if style == "causal":
        model.causal_mask = None  # the causal style needs no [S, S] mask
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(
        0, model.config.vocab_size, (batch, length), device="cuda", generator=gen
    )
    prefill(model, prompt, chunk, style)  # warm-up: kernels compiled, allocator primed
    torch.cuda.synchronize()
    seconds = []
    for _ in range(args.reps):
        start = time.perf_counter()
        prefill(model, prompt, chunk, style)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    for layer in model.layers:  # free the caches before the next row's
        layer.attention.kv_cache = None
    model.causal_mask = None
    return dict(
        cache=cache,
        style=style,
        batch=batch,
        prompt=length,
        chunk=chunk,
        ms=1e3 * statistics.median(seconds),
        peak_gb=peak / 1e9,
    )


def plot(payload: dict, path: Path) -> None:
    """Speed-up over the fastest bf16 prefill of the same prompt and batch, per row."""
    plt = pyplot()
    rows = [r for r in payload["rows"] if r["cache"] != "bf16"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [
        f"{r['cache']} {r['style']}\nB{r['batch']} {r['prompt'] // 1024}k "
        f"{'chunks of ' + str(r['chunk']) if r['chunk'] else 'one forward'}"
        for r in rows
    ]
    ax.bar(range(len(rows)), [r["vs_best_bf16"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=60, ha="right")
    ax.set_ylabel("TTFT speed-up over the fastest bf16")
    ax.set_title(f"1b-shape prefill, {payload['device']}", fontsize=9)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--chunk",
        type=int,
        nargs="+",
        default=[0, 2048],
        help="tokens per forward (0: the whole prompt in one forward)",
    )
    parser.add_argument("--formats", nargs="+", default=["4bit_nc"], choices=sorted(FORMATS))
    parser.add_argument("--styles", nargs="+", default=list(STYLES), choices=STYLES)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--new", type=int, default=256, help="room for generated tokens")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="ttft.json")
    args = parser.parse_args()
    require_cuda("ttft.py")
    config = dataclasses.replace(
        ModelArgs.from_name("1b-shape"), block_size=max(args.prompts) + args.new
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = init_weights(Transformer(config), seed=0).to(torch.bfloat16).eval()
    rows = []
    for length in args.prompts:
        for batch in args.batches:
            for chunk in args.chunk:
                if chunk >= length:
                    continue
                for style in args.styles:
                    if style == "causal" and chunk:
                        continue  # is_causal over the prompt holds for a first chunk only
                    for cache in ["bf16", *args.formats]:
                        rows.append(measure(model, cache, args, batch, length, chunk, style))
                        print(f"  {rows[-1]}", flush=True)
    for row in rows:
        same = [
            r
            for r in rows
            if (r["batch"], r["prompt"], r["chunk"]) == (row["batch"], row["prompt"], row["chunk"])
            and r["cache"] == "bf16"
        ]
        fastest = min(
            r["ms"]
            for r in rows
            if r["cache"] == "bf16" and (r["batch"], r["prompt"]) == (row["batch"], row["prompt"])
        )
        own = next(r for r in same if r["style"] == row["style"])
        row.update(
            vs_bf16=own["ms"] / row["ms"],
            vs_best_bf16=fastest / row["ms"],
            peak_vs_bf16=row["peak_gb"] / own["peak_gb"],
        )
    device = gpu_name()
    print(
        f"\n{device}, 1b-shape, bf16 weights, eager prefill (last position's logits only); "
        f"TurboQuant window {args.window}; median of {args.reps}"
    )
    print_table(
        rows,
        dict(
            cache="",
            style="",
            batch="d",
            prompt="d",
            chunk="d",
            ms=".1f",
            vs_bf16=".3f",
            vs_best_bf16=".3f",
            peak_gb=".2f",
            peak_vs_bf16=".3f",
        ),
    )
    payload = dict(device=device, torch=torch.__version__, window=args.window, rows=rows)
    out = write_json(args.out, payload)
    print(f"wrote {out}")
    plot(payload, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
