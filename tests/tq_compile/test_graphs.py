"""tq_compile.DecodeGraph (``tq_compile/graphs.py``): one decode step captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from examples.model import ModelArgs, Transformer, init_weights, prefill
from tq_compile import TurboQuantKVConfig, quantize_


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_graph_decode_loop_200_steps():
    """tq_compile.DecodeGraph: 200 replays of one captured step equal the eager step on a twin
    model, step by step (same token fed to both)."""
    from examples.model import decode_one_token as step_fn
    from tq_compile import DecodeGraph

    def build():
        args = ModelArgs.from_name("tiny")
        with torch.device("cuda"):
            model = init_weights(Transformer(args), seed=0).to(torch.float16)
        model.setup_caches(2, 16 + 200)
        return quantize_(model, TurboQuantKVConfig("4bit_nc"))

    eager, graphed = build(), build()
    prompt = torch.randint(0, 256, (2, 16), device="cuda")
    token, _ = prefill(eager, prompt, torch.arange(16, device="cuda"))
    prefill(graphed, prompt, torch.arange(16, device="cuda"))
    pos = torch.tensor([16], device="cuda")
    graph = DecodeGraph(step_fn, graphed, token, pos)
    assert graph.graph is not None
    for _ in range(200):
        expected_token, expected_logits = step_fn(eager, token, pos)
        graph_token, graph_logits = graph(token, pos)
        torch.testing.assert_close(graph_logits, expected_logits, rtol=0, atol=0)
        assert torch.equal(graph_token, expected_token)
        token = expected_token.clone()
        pos += 1
