"""examples/cuda_graph_loop.py: the hand-written decode loop (eager steps without CUDA)."""

from __future__ import annotations

import ast
import re

from helpers import run_example

from examples.model import ModelArgs


def test_cuda_graph_loop_runs_on_cpu():
    """``examples/cuda_graph_loop.py`` falls back to eager steps without CUDA: it names the
    model, cache and batch, runs every step at a positive tokens/s and prints the first
    sequence's tokens (the prefill's and one per step, all in the vocabulary). Its prompt is
    not seeded, so the tokens themselves are not checked here; DecodeGraph's steps are checked
    against eager steps on CUDA (tests/tq_compile/test_graphs.py)."""
    steps = 4
    out = run_example("examples/cuda_graph_loop.py", "--device", "cpu", "--steps", str(steps))
    assert "tiny model, 4bit_nc cache, batch 4 on cpu: eager steps (no CUDA)" in out
    done = re.search(
        r"(\d+) steps: ([\d,]+) tokens/s; first sequence's tokens: (\[[\d, ]*\])", out
    )
    assert done, out
    assert int(done[1]) == steps
    assert float(done[2].replace(",", "")) > 0
    tokens = ast.literal_eval(done[3])
    assert len(tokens) == steps + 1
    assert all(0 <= t < ModelArgs.from_name("tiny").vocab_size for t in tokens), tokens
