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

``--kernels N`` generates N more tokens after the timed ones and profiles them: GPU time per step
of each kernel, the idle time before its launches and the attention kernels per layer, as in
``e2e.py`` (``benchmarks/profiling.py``).

``--capacity-gb GB`` gives each cache the largest batch whose KV cache fits ``GB`` instead of
``--batch`` (StaticCache too, at its own), so ``speedup`` is what a serving user gets from the
same memory. Such a batch fills the budget with KV alone, and the prompt, prefilled in one
forward, adds activations in proportion to ``batch x context`` beside it: ``peak_gb`` is the
most GPU memory the cell's ``generate`` held (``torch.cuda.max_memory_allocated``, weights
included; at the failure where it ran out; with ``--one-process``, memory earlier cells still
hold counts too). ``--prefill-chunk`` bounds the activations; transformers then compiles the
prefill chunks too, so each cache is built first (``early_initialization``).

    python benchmarks/hf_generate.py                                   # B=32, 8k, both models
    python benchmarks/hf_generate.py --models smollm2 --batch 4 --context 2048
    python benchmarks/hf_generate.py --models 1b-shape --presets 4bit_nc tqk5v3_nc --capacity-gb 24
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import (  # noqa: E402
    gpu_name,
    kv_cache_bytes,
    largest_batch,
    print_table,
    pyplot,
    report_cell,
    require_cuda,
    save_figure,
    time_in_process,
    write_results,
)
from profiling import attention_kernels, kernel_table  # noqa: E402

from examples.hf_eval import StepTimer  # noqa: E402
from tq_compile.hf import TurboQuantCache  # noqa: E402
from tq_compile.smollm2 import smollm2_config  # noqa: E402

BASELINE = "static"
# StaticCache variants timed besides the baseline
DENSE_VARIANTS = ("static-gqa",)
MODES = ("reduce-overhead", "default", "eager")
# the arguments of a cell timed in a process of its own (--cell), besides its coordinates
CELL_ARGS = ("batch", "context", "new_tokens", "skip", "window", "prefill_chunk", "kernels")
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


class StepProfiler:
    """A ``generate`` logits processor that profiles the GPU's work of the ``steps`` decode steps
    after its ``start``-th call (``torch.profiler``, CUDA activity; synchronized at both
    ends)."""

    def __init__(self, start: int, steps: int):
        self.start, self.steps, self.calls = start, steps, 0
        self.prof = profile(activities=[ProfilerActivity.CUDA])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls in (self.start, self.start + self.steps):
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)
            (self.prof.start if self.calls == self.start else self.prof.stop)()
        return scores


def time_generate(
    model, cache, prompt, new_tokens: int, mode: str, chunk: int, skip: int, kernels: int = 0
):
    """Tokens/s of the steps after ``skip`` of one ``generate`` of ``new_tokens`` tokens, the
    step time in ms and, with ``kernels``, :func:`profiling.kernel_table` of that many more
    steps (generated after the timed ones, not timed)."""
    from transformers import CompileConfig, GenerationConfig

    timer = StepTimer()
    profiler = StepProfiler(new_tokens, kernels) if kernels else None
    processors = [timer] if profiler is None else [timer, profiler]
    config = GenerationConfig(
        max_new_tokens=new_tokens + kernels,
        min_new_tokens=new_tokens + kernels,
        do_sample=False,
        prefill_chunk_size=chunk,
        disable_compile=mode == "eager",
        pad_token_id=2,
        compile_config=None
        if mode == "eager"
        else CompileConfig(mode=None if mode == "default" else mode, fullgraph=True),
    )
    model.generate(
        prompt, past_key_values=cache, generation_config=config, logits_processor=processors
    )
    tok_s = timer.tokens_per_second(prompt.shape[0], skip, stop=new_tokens)
    table = None if profiler is None else kernel_table(profiler.prof, kernels)
    return tok_s, prompt.shape[0] / tok_s * 1e3, table


def build(name: str):
    """``(model, config)``: the random-weight bf16 model ``name`` on the GPU (seed 0)."""
    from transformers import LlamaForCausalLM

    config = model_config(name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model, config


def prompts(config, args) -> torch.Tensor:
    """``args.batch`` random prompts (seed 0) that fill the cache to ``args.context`` tokens
    minus the generated ones (the timed and the profiled)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(
        3,
        config.vocab_size,
        (args.batch, args.context - args.new_tokens - args.kernels),
        device="cuda",
        generator=gen,
    )


def capacity_batch(config, cache_name: str, args) -> int:
    """The most sequences of ``args.context`` slots whose cache ``cache_name`` fits
    ``args.capacity_gb`` (0 where not even one does)."""
    dense = cache_name in (BASELINE, *DENSE_VARIANTS)

    def kv_bytes(batch: int) -> int:
        return kv_cache_bytes(
            None if dense else cache_name,
            config.num_hidden_layers,
            config.num_key_value_heads,
            _head_dim(config),
            batch,
            args.context,
            **({} if dense else dict(window=args.window)),
        )

    return largest_batch(kv_bytes, args.capacity_gb * 1e9)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def time_cell(model, config, prompt, cache_name: str, mode: str, args) -> dict:
    """``tok_s``, ``ms`` (None where the GPU ran out of memory), ``kv_gb`` and ``peak_gb`` (the
    most GPU memory held, at the failure where it ran out) of one ``generate`` with the cache
    ``cache_name`` in ``mode``; with ``args.kernels``, also
    ``kernels`` and ``timeline`` (:func:`profiling.kernel_table`) and ``attn_kernels`` (kernels
    per layer per step of the cache's attention work)."""
    from transformers import StaticCache

    dense = cache_name in (BASELINE, *DENSE_VARIANTS)
    if dense:
        cache = StaticCache(config, max_cache_len=args.context)
    else:
        cache = TurboQuantCache(config, args.context, preset=cache_name, window=args.window)
    if args.prefill_chunk:
        # chunked prefill runs compiled: the cache is built before it, as generate builds its
        # own caches (StaticCache built inside the first CUDA-graphed chunk failed on the H200,
        # likely because buffers created in a traced graph are not marked static)
        cache.early_initialization(
            prompt.shape[0],
            config.num_key_value_heads,
            _head_dim(config),
            torch.bfloat16,
            prompt.device,
        )
    torch._dynamo.reset()
    # static-gqa: transformers' switch for SDPA with enable_gqa despite the mask
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1" if cache_name == "static-gqa" else "0"
    profiled = {}
    torch.cuda.reset_peak_memory_stats()
    try:
        tok_s, ms, table = time_generate(
            model,
            cache,
            prompt,
            args.new_tokens,
            mode,
            args.prefill_chunk,
            args.skip,
            args.kernels,
        )
        if table:
            kernels, timeline = table
            layers = config.num_hidden_layers
            profiled = dict(
                kernels=kernels,
                timeline=timeline,
                attn_kernels=attention_kernels(kernels, dense, layers),
            )
    except torch.OutOfMemoryError:
        tok_s = ms = None
    peak_gb = torch.cuda.max_memory_allocated() / 1e9
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "0"
    kv_bytes = (
        cache.nbytes()
        if not dense
        else sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    )
    del cache
    torch.cuda.empty_cache()
    return dict(tok_s=tok_s, ms=ms, kv_gb=kv_bytes / 1e9, peak_gb=peak_gb, **profiled)


def _time_cell_here(cell_json: str) -> None:
    """The ``--cell`` process: build the cell's model and prompts, time its one ``generate``
    and report the result (:func:`common.report_cell`)."""
    cell = json.loads(cell_json)
    args = argparse.Namespace(**{name: cell[name] for name in CELL_ARGS})
    model, config = build(cell["model"])
    report_cell(time_cell(model, config, prompts(config, args), cell["cache"], cell["mode"], args))


def run(args) -> list[dict]:
    """Every cell (models x modes x the baseline, ``args.dense`` and ``args.presets``), each
    at ``args.batch`` sequences or, with ``args.capacity_gb``, at its cache's
    :func:`capacity_batch`; ``speedup`` is tokens/s over the baseline's."""
    rows = []
    for name in args.models:
        built = None  # this process's model, built for the first cell timed here
        for mode in args.modes:
            baseline = None
            for cache_name in [BASELINE, *args.dense, *args.presets]:
                cell_args = argparse.Namespace(**vars(args))
                if args.capacity_gb:
                    cell_args.batch = capacity_batch(model_config(name), cache_name, args)
                timed = dict(tok_s=None, ms=None, kv_gb=None, peak_gb=None)
                if cell_args.batch == 0:  # not even one sequence fits the budget
                    timed.update(over_budget=True)
                elif mode == "reduce-overhead" and not args.one_process:
                    cell = dict(model=name, mode=mode, cache=cache_name)
                    cell.update((field, getattr(cell_args, field)) for field in CELL_ARGS)
                    timed.update(time_in_process(__file__, cell, CELL_TIMEOUT_S))
                else:
                    built = built or build(name)
                    model, config = built
                    prompt = prompts(config, cell_args)
                    timed = time_cell(model, config, prompt, cache_name, mode, cell_args)
                tok_s = timed["tok_s"]
                if cache_name == BASELINE:
                    baseline = tok_s
                speedup = tok_s / baseline if tok_s and baseline else None
                rows.append(
                    dict(
                        model=name,
                        mode=mode,
                        batch=cell_args.batch,
                        context=args.context,
                        cache=cache_name,
                        **timed,
                        speedup=speedup,
                    )
                )
                shown = {k: v for k, v in rows[-1].items() if k not in ("kernels", "timeline")}
                print(json.dumps(shown), flush=True)
                _print_kernels(rows[-1])
        del built
        torch.cuda.empty_cache()
    return rows


def _print_kernels(row: dict) -> None:
    """A profiled row's GPU time per step by kernel, the largest first (``--kernels``)."""
    if not row.get("kernels"):
        return
    total = sum(r["us"] for r in row["kernels"])
    idle = sum(r["idle_us"] for r in row["kernels"])
    print(
        f"  {row['cache']}: GPU time per step {total:.1f} us, {idle:.1f} us idle between "
        f"kernels, {row['attn_kernels']:.1f} attention kernels per layer",
        flush=True,
    )
    top = [dict(r, kernel=r["kernel"][:90]) for r in row["kernels"][:24]]
    print_table(top, dict(kernel="", us=".1f", launches=".0f", idle_us=".1f"))


def _printable(row: dict, specs: dict[str, str]) -> dict[str, str]:
    """``row``'s ``specs`` fields as text: ``failed`` (its process gave no result), ``over
    budget`` (a capacity run where not one sequence fits) or ``oom`` where missing, and ``-``
    for the speed-up of a row timed without a baseline."""
    missing = "failed" if "error" in row else "over budget" if row.get("over_budget") else "oom"
    text = {
        key: missing if row[key] is None else format(row[key], spec) for key, spec in specs.items()
    }
    if row["tok_s"] is not None and row["speedup"] is None:
        text["speedup"] = "-"
    return text


def plot(payload: dict, path: Path) -> None:
    """Tokens/s per cache, one panel per model and mode (in a capacity run each bar also names
    its batch)."""
    plt = pyplot()
    capacity = payload.get("capacity_gb")

    panels = list(dict.fromkeys((r["model"], r["mode"]) for r in payload["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for ax, (model, mode) in zip(axes[0], panels, strict=True):
        rows = [r for r in payload["rows"] if (r["model"], r["mode"]) == (model, mode)]
        bars = ax.bar([r["cache"] for r in rows], [r["tok_s"] or 0 for r in rows])
        ax.bar_label(
            bars,
            [f"{r['speedup'] or 0:.2f}x" + (f"\nB{r['batch']}" if capacity else "") for r in rows],
            fontsize=7,
        )
        ax.set_title(f"{model}, {mode}")
        ax.set_ylabel("decode tokens/s")
    batch = f"largest batch in {capacity:g} GB" if capacity else f"B={payload['batch']}"
    fig.suptitle(f"generate, {batch}, {payload['context']} tokens, on {payload['gpu']}")
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
    parser.add_argument(
        "--capacity-gb",
        type=float,
        metavar="GB",
        help="each cache at the largest batch whose KV cache fits GB (instead of --batch)",
    )
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--skip", type=int, default=16, help="steps left out of the timing")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also profile N decode steps after the timed ones: GPU time per kernel",
    )
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
    if args.capacity_gb is not None and args.capacity_gb <= 0:
        parser.error(f"--capacity-gb must be > 0, got {args.capacity_gb}")
    payload = dict(
        gpu=gpu_name(),
        batch=None if args.capacity_gb else args.batch,
        capacity_gb=args.capacity_gb,
        context=args.context,
        window=args.window,
        prefill_chunk=args.prefill_chunk,
        fresh_processes=not args.one_process,
        rows=run(args),
    )
    batch = (
        f"each cache at its largest batch in {args.capacity_gb:g} GB"
        if args.capacity_gb
        else f"B={args.batch}"
    )
    print(
        f"{payload['gpu']}: generate, {batch}, context {args.context}, window "
        f"{args.window}; speed-up: tokens/s over StaticCache in the same mode"
    )
    specs = dict(tok_s=".0f", ms=".2f", speedup=".2f", kv_gb=".2f", peak_gb=".1f")
    printable = [{**row, **_printable(row, specs)} for row in payload["rows"]]
    print_table(
        printable,
        dict(
            model="",
            mode="",
            cache="",
            batch="d",
            tok_s="",
            ms="",
            speedup="",
            kv_gb="",
            peak_gb="",
        ),
    )
    write_results(args.out, payload, plot, "python benchmarks/hf_generate.py --plot JSON")


if __name__ == "__main__":
    main()
