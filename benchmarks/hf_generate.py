"""Hugging Face ``generate`` decode speed: TurboQuantCache vs transformers' StaticCache.

Two Llama architectures with random weights (speed does not depend on them): SmolLM2-135M's
(``smollm2``: 30 layers, 9 query / 3 kv heads of dim 64) and the example model's ``1b-shape``
(16 layers, 32 / 8 heads of dim 128). Each cache serves ``model.generate`` on ``--batch``
sequences whose prompts fill the cache to ``--context`` tokens minus the generated ones, greedy,
with the decode forward compiled the way transformers does for static caches
(``CompileConfig(mode=...)``; ``eager`` disables it). The prompt is prefilled in one forward
(``--prefill-chunk``: transformers' ``prefill_chunk_size``, for both caches).

``static-gqa`` is StaticCache with ``TRANSFORMERS_SDPA_FORCE_GQA=1``: transformers' switch that
makes its ``sdpa`` attention pass ``enable_gqa=True`` with a mask instead of copying K and V to
every query head (``repeat_kv``), what a careful user of a static cache can still turn on.

Decode speed: a logits processor records the time of every step (after a synchronization);
tokens/s is ``batch x steps / time`` over the steps after the first ``--skip`` (compilation and
CUDA-graph recording happen in the first ones). KV bytes: what each cache holds. Each
``reduce-overhead`` cell runs in a process of its own (``--one-process``: all in this one),
since a CUDA graph captured after another one in the same process runs slower, which favoured
the first cell, the StaticCache baseline (``benchmarks/common.py``'s ``time_in_process``).

    python benchmarks/hf_generate.py                                   # B=32, 8k, both models
    python benchmarks/hf_generate.py --models smollm2 --batch 4 --context 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import (  # noqa: E402
    gpu_name,
    print_table,
    pyplot,
    report_cell,
    require_cuda,
    save_figure,
    time_in_process,
    write_json,
)

from examples.hf_eval import StepTimer  # noqa: E402
from tq_compile.hf import TurboQuantCache  # noqa: E402
from tq_compile.smollm2 import smollm2_config  # noqa: E402

BASELINE = "static"
# StaticCache variants timed besides the baseline
DENSE_VARIANTS = ("static-gqa",)
MODES = ("reduce-overhead", "default", "eager")
# the arguments of a cell timed in a process of its own (--cell), besides its coordinates
CELL_ARGS = ("batch", "context", "new_tokens", "skip", "window", "prefill_chunk")
CELL_TIMEOUT_S = 1800


def model_config(name: str):
    """The ``transformers`` config of ``name``: ``smollm2`` or ``1b-shape``."""
    from transformers import LlamaConfig

    if name == "smollm2":
        return smollm2_config()
    if name == "1b-shape":  # examples/model.py's 1b-shape
        return LlamaConfig(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=32768,
            rope_theta=500000.0,
            attn_implementation="sdpa",
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
    raise ValueError(f"unknown model {name!r}: expected smollm2 or 1b-shape")


def time_generate(model, cache, prompt, new_tokens: int, mode: str, chunk: int, skip: int):
    """Tokens/s of the steps after ``skip`` of one ``generate`` (and the step time in ms)."""
    from transformers import CompileConfig, GenerationConfig

    timer = StepTimer()
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        prefill_chunk_size=chunk,
        disable_compile=mode == "eager",
        pad_token_id=2,
        compile_config=None
        if mode == "eager"
        else CompileConfig(mode=None if mode == "default" else mode, fullgraph=True),
    )
    model.generate(
        prompt, past_key_values=cache, generation_config=config, logits_processor=[timer]
    )
    tok_s = timer.tokens_per_second(prompt.shape[0], skip)
    return tok_s, prompt.shape[0] / tok_s * 1e3


def build(name: str, args):
    """``(model, config, prompt)``: the random-weight bf16 model ``name`` on the GPU (seed 0)
    and ``args.batch`` random prompts that fill the cache to ``args.context`` tokens minus the
    generated ones."""
    from transformers import LlamaForCausalLM

    config = model_config(name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(
        3,
        config.vocab_size,
        (args.batch, args.context - args.new_tokens),
        device="cuda",
        generator=gen,
    )
    return model, config, prompt


def time_cell(model, config, prompt, cache_name: str, mode: str, args) -> dict:
    """``tok_s``, ``ms`` (None where the GPU ran out of memory) and ``kv_gb`` of one
    ``generate`` with the cache ``cache_name`` in ``mode``."""
    from transformers import StaticCache

    dense = cache_name in (BASELINE, *DENSE_VARIANTS)
    if dense:
        cache = StaticCache(config, max_cache_len=args.context)
    else:
        cache = TurboQuantCache(config, args.context, preset=cache_name, window=args.window)
    torch._dynamo.reset()
    # static-gqa: transformers' switch for SDPA with enable_gqa despite the mask
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1" if cache_name == "static-gqa" else "0"
    try:
        tok_s, ms = time_generate(
            model, cache, prompt, args.new_tokens, mode, args.prefill_chunk, args.skip
        )
    except torch.OutOfMemoryError:
        tok_s = ms = None
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "0"
    kv_bytes = (
        cache.nbytes()
        if not dense
        else sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    )
    del cache
    torch.cuda.empty_cache()
    return dict(tok_s=tok_s, ms=ms, kv_gb=kv_bytes / 1e9)


def _time_cell_here(cell_json: str) -> None:
    """The ``--cell`` process: build the cell's model and prompts, time its one ``generate``
    and report the result (:func:`common.report_cell`)."""
    cell = json.loads(cell_json)
    args = argparse.Namespace(**{name: cell[name] for name in CELL_ARGS})
    model, config, prompt = build(cell["model"], args)
    report_cell(time_cell(model, config, prompt, cell["cache"], cell["mode"], args))


def run(args) -> list[dict]:
    rows = []
    for name in args.models:
        built = None  # this process's model, built for the first cell timed here
        for mode in args.modes:
            baseline = None
            for cache_name in [BASELINE, *args.dense, *args.presets]:
                if mode == "reduce-overhead" and not args.one_process:
                    cell = dict(model=name, mode=mode, cache=cache_name)
                    cell.update((field, getattr(args, field)) for field in CELL_ARGS)
                    timed = dict(tok_s=None, ms=None, kv_gb=None)
                    timed.update(time_in_process(__file__, cell, CELL_TIMEOUT_S))
                else:
                    built = built or build(name, args)
                    timed = time_cell(*built, cache_name, mode, args)
                tok_s = timed["tok_s"]
                if cache_name == BASELINE:
                    baseline = tok_s
                speedup = tok_s / baseline if tok_s and baseline else None
                rows.append(
                    dict(
                        model=name,
                        mode=mode,
                        batch=args.batch,
                        context=args.context,
                        cache=cache_name,
                        **timed,
                        speedup=speedup,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
        del built
        torch.cuda.empty_cache()
    return rows


def plot(payload: dict, path: Path) -> None:
    """Tokens/s per cache, one panel per model and mode."""
    plt = pyplot()

    panels = list(dict.fromkeys((r["model"], r["mode"]) for r in payload["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, (model, mode) in zip(axes[0], panels, strict=True):
        rows = [r for r in payload["rows"] if (r["model"], r["mode"]) == (model, mode)]
        bars = ax.bar([r["cache"] for r in rows], [r["tok_s"] or 0 for r in rows])
        ax.bar_label(bars, [f"{r['speedup'] or 0:.2f}x" for r in rows], fontsize=7)
        ax.set_title(f"{model}, {mode}")
        ax.set_ylabel("decode tokens/s")
    fig.suptitle(
        f"generate, B={payload['batch']}, {payload['context']} tokens, on {payload['gpu']}"
    )
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "1b-shape"])
    parser.add_argument("--presets", nargs="+", default=["4bit_nc", "k8v4"])
    parser.add_argument(
        "--dense",
        nargs="*",
        default=list(DENSE_VARIANTS),
        choices=DENSE_VARIANTS,
        help="StaticCache variants besides the "
        "baseline (static-gqa: TRANSFORMERS_SDPA_FORCE_GQA=1)",
    )
    parser.add_argument("--modes", nargs="+", default=["reduce-overhead"], choices=MODES)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--skip", type=int, default=16, help="steps left out of the timing")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="transformers' prefill_chunk_size (default: none)",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="time reduce-overhead cells in this process too (the first cell's graph is favoured)",
    )
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # (a cell's own process)
    parser.add_argument("--out", default="hf_generate.json")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of a saved JSON run")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    require_cuda("benchmarks/hf_generate.py")
    if args.cell:
        _time_cell_here(args.cell)
        return
    if args.new_tokens <= args.skip + 1:
        parser.error(f"--new-tokens ({args.new_tokens}) must exceed --skip + 1 ({args.skip + 1})")
    payload = dict(
        gpu=gpu_name(),
        batch=args.batch,
        context=args.context,
        window=args.window,
        fresh_processes=not args.one_process,
        rows=run(args),
    )
    print(
        f"{payload['gpu']}: generate, B={args.batch}, context {args.context}, window "
        f"{args.window}; speed-up over StaticCache in the same mode"
    )
    specs = dict(tok_s=".0f", ms=".2f", speedup=".2f", kv_gb=".2f")
    printable = [
        {
            **row,
            **{
                key: ("failed" if "error" in row else "oom")
                if row[key] is None
                else format(row[key], spec)
                for key, spec in specs.items()
            },
        }
        for row in payload["rows"]
    ]
    print_table(
        printable, dict(model="", mode="", cache="", tok_s="", ms="", speedup="", kv_gb="")
    )
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    try:
        plot(payload, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG (python benchmarks/hf_generate.py --plot JSON)")


if __name__ == "__main__":
    main()
