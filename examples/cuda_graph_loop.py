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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from custom_ops import FORMATS  # noqa: E402
from examples.model import (  # noqa: E402
    ModelArgs,
    Transformer,
    decode_one_token,
    init_weights,
    prefill,
    transformer_configs,
)
from tq_compile import DecodeGraph, TurboQuantKVConfig, quantize_  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument(
        "--preset", default="tiny", choices=sorted(transformer_configs), help="model size"
    )
    parser.add_argument("--format", default="4bit_nc", choices=sorted(FORMATS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    for name in ("batch", "prompt_len", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = args.device
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
    main()
