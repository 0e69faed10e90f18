"""Generate with a TurboQuant KV cache: the example model, quantize_, a compiled decode step.

1. Builds the example gpt-fast model (``examples/model.py``, random weights: the point is speed
   and fidelity to the bf16 cache, not text) and sets up bf16 caches.
2. Generates greedily with the bf16 caches: the reference tokens.
3. Swaps the caches with ``tq_compile.quantize_(model, TurboQuantKVConfig(format, window=))``
   (``--window``, 16 here: the demo's sequences are short), prefills
   again, and decodes with ``torch.compile(decode_one_token, fullgraph=True)`` (``mode=
   "reduce-overhead"``, i.e. CUDA graphs, on CUDA), fed the reference tokens (teacher forcing).
4. Prints decode tokens/s for both caches, KV-cache bytes vs bf16, and how often the TurboQuant
   model's next token equals the bf16 model's.

Runs on the CPU (tiny model, reference kernels) and on CUDA when present (Triton kernels, the
~1B ``1b-shape`` model).

    python examples/generate.py                        # CPU or CUDA, whichever is here
    python examples/generate.py --format 3bit_nc --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.arguments import add_model_arguments, check_arguments, resolve_device  # noqa: E402


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked arguments (torch is not imported: a bad one fails at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--window",
        type=int,
        default=16,
        help="recent tokens kept in bf16 (the library's default is 128; this demo's sequences "
        "are only ~100 tokens, so 128 would leave nothing to quantize)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="eager decode steps")
    args = parser.parse_args(argv)
    check_arguments(parser, args, "batch", "prompt_len", "new_tokens")
    if not 0 <= args.window < args.prompt_len + args.new_tokens:
        parser.error(
            f"--window must be in [0, {args.prompt_len + args.new_tokens}) (prompt "
            f"+ new tokens; longer quantizes nothing), got {args.window}"
        )
    return parser, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # before the imports below, which take seconds

import torch  # noqa: E402

from examples.model import (  # noqa: E402
    ModelArgs,
    Transformer,
    decode_one_token,
    init_weights,
    prefill,
)
from tq_compile import TurboQuantKVConfig, kv_cache_nbytes, quantize_  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def decode(model, step_fn, prompt, n, device, label, inputs=None):
    """Prefill ``prompt``, then ``n`` decode steps: greedy, or fed ``inputs [B, n]``.

    Returns the tokens fed ``[B, n]`` (the prefill's prediction first), the predictions
    ``[B, n]`` and decode tokens/s after the first 2 steps (None when ``n <= 2``).
    """
    batch, prompt_len = prompt.shape
    token, _ = prefill(model, prompt, torch.arange(prompt_len, device=device))
    fed, predicted, start = [], [], None
    for i in range(n):
        if i == 2:
            sync(device)
            start = time.perf_counter()
        feed = token if inputs is None else inputs[:, i : i + 1]
        pos = torch.tensor([prompt_len + i], device=device)
        token, _ = step_fn(model, feed, pos)
        token = token.clone()
        fed.append(feed)
        predicted.append(token)
        if (i + 1) % max(1, n // 8) == 0 or i + 1 == n:
            print(f"\r  {label}: {i + 1}/{n} tokens", end="", flush=True)
    sync(device)
    rate = batch * (n - 2) / (time.perf_counter() - start) if start is not None else None
    shown = f"{rate:,.0f} tokens/s" if rate else "too few steps to time"
    print(f"\r  {label}: {n} tokens, {shown}" + " " * 20)
    return torch.cat(fed, dim=1), torch.cat(predicted, dim=1), rate


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    device = resolve_device(parser, args)
    preset = args.preset or ("1b-shape" if device == "cuda" else "tiny")
    cfg = ModelArgs.from_name(preset)
    max_seq = args.prompt_len + args.new_tokens + 1
    print(
        f"{preset} model ({cfg.n_layer} layers, Hq={cfg.n_head}, Hk={cfg.n_local_heads}, "
        f"D={cfg.head_dim}) on {device}; batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens"
    )
    with torch.device(device):
        model = init_weights(Transformer(cfg), args.seed).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen)
    prompt = prompt.to(device)

    mode = "reduce-overhead" if device == "cuda" else "default"

    steps = args.new_tokens

    def run(label: str, quantized: bool, inputs=None):
        """Decode with fresh caches twice through one compiled step: an untimed warm-up (the
        compilation and first-call costs), then the timed pass. Returns ``decode``'s result
        and the caches' bytes."""
        step = decode_one_token
        if not args.no_compile:
            torch._dynamo.reset()
            step = torch.compile(decode_one_token, mode=mode, fullgraph=True)
        for timed in (False, True):
            model.setup_caches(args.batch, max_seq)
            if quantized:
                quantize_(model, TurboQuantKVConfig(args.format, window=args.window))
            n = steps if timed else min(4, steps)
            feed = inputs if inputs is None or timed else inputs[:, :n]
            result = decode(model, step, prompt, n, device, label if timed else "warm-up", feed)
        return result, kv_cache_nbytes(model)

    print("bf16 cache (reference):")
    (fed, reference, bf16_rate), dense_bytes = run("bf16 decode", quantized=False)
    print(f"TurboQuant {args.format} cache:")
    (_, predicted, tq_rate), tq_bytes = run(f"{args.format} decode", True, inputs=fed)
    agreement = (predicted == reference).float().mean().item()

    if bf16_rate and tq_rate:
        print(
            f"\ndecode tokens/s: bf16 {bf16_rate:,.0f}, {args.format} {tq_rate:,.0f} "
            f"({tq_rate / bf16_rate:.2f}x)"
        )
        if device == "cpu":
            print(
                "  (CPU: the reference kernels and a tiny model; these rates vary with the "
                "machine's load and say nothing about GPU speed)"
            )
    sinks = model.layers[0].attention.kv_cache.sinks  # the quantized caches' (the last run's)
    print(
        f"KV cache: {tq_bytes / 1e6:,.2f} MB vs bf16 {dense_bytes / 1e6:,.2f} MB "
        f"({tq_bytes / dense_bytes:.3f}x; the last {args.window} tokens and the first "
        f"{sinks} of each sequence in bf16)"
    )
    print(f"next-token agreement with the bf16 cache: {agreement:.1%}")


if __name__ == "__main__":
    main(PARSER, ARGS)
