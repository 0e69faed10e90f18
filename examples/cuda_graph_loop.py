"""A hand-written decode loop around one captured CUDA graph (no torch.compile).

The model is the example gpt-fast model with its caches swapped by ``tq_compile.quantize_``.
``tq_compile.DecodeGraph`` captures one eager decode step (store + decode ops per layer) in a
``torch.cuda.CUDAGraph``; the loop then only copies the next token and position into the
graph's static inputs and replays. Because every length lives in device tensors and the decode
grid depends only on the cache's capacity, the one capture is valid for every step.

On the CPU (no CUDA graphs) the same loop runs the step eagerly.

    python examples/cuda_graph_loop.py --steps 200
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
    model_sizes,
    resolve_device,
)


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked arguments (torch is not imported: a bad one fails at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--preset", default="tiny", choices=model_sizes(), help="model size")
    add_format_argument(parser)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args(argv)
    check_arguments(parser, args, "batch", "prompt_len", "steps")
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
from tq_compile import DecodeGraph, TurboQuantKVConfig, quantize_  # noqa: E402


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    device = resolve_device(parser, args)
    cfg = ModelArgs.from_name(args.preset)
    with torch.device(device):
        model = init_weights(Transformer(cfg), seed=0).to(torch.bfloat16).eval()
    model.setup_caches(args.batch, args.prompt_len + args.steps)
    quantize_(model, TurboQuantKVConfig(args.format))

    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), device=device)
    with torch.no_grad():
        token, _ = prefill(model, prompt, torch.arange(args.prompt_len, device=device))
    pos = torch.tensor([args.prompt_len], device=device)
    graph = DecodeGraph(decode_one_token, model, token, pos)
    how = "one captured CUDA graph" if graph.graph is not None else "eager steps (no CUDA)"
    print(f"{args.preset} model, {args.format} cache, batch {args.batch} on {device}: {how}")
    tokens = [token]
    start = time.perf_counter()
    for _ in range(args.steps):
        token, _ = graph(token, pos)
        token = token.clone()  # graph outputs are overwritten by the next replay
        tokens.append(token)
        pos += 1
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = torch.cat(tokens, dim=1)
    print(
        f"{args.steps} steps: {args.batch * args.steps / elapsed:,.0f} tokens/s; first "
        f"sequence's tokens: {generated[0, :12].tolist()}"
    )


if __name__ == "__main__":
    main(PARSER, ARGS)
