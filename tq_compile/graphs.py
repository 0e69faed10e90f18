"""CUDA-graph capture of one decode step, for hand-written decode loops.

A TurboQuant decode step is graph-safe by construction: every length and position it uses lives
in device tensors, and the decode kernel's grid depends only on the cache's capacity. So one
capture serves every later step; only the static inputs are rewritten before each replay::

    graph = DecodeGraph(decode_one_token, model, token, input_pos)
    for _ in range(n):
        token, logits = graph(token, input_pos)  # copy in, replay, static outputs
        input_pos += 1

On the CPU (no CUDA graphs) the same object calls the step eagerly, so loops written against it
run everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DecodeGraph"]


class DecodeGraph:
    """One decode step ``step_fn(model, token, input_pos)`` captured in a ``torch.cuda.CUDAGraph``.

    Args:
        step_fn: the decode step, e.g. gpt-fast's ``decode_one_token``; its tensor inputs other
            than the model must be ``token`` and ``input_pos``.
        model: the model (its caches are written by every replay).
        token: ``[B, 1] int64`` example token (shape and dtype of every later call).
        input_pos: ``[1] int64`` example position.
        warmup: eager runs before capture (kernel compilation, allocator warm-up). They run at
            ``input_pos`` with ``token``, as the first replay will, so the cache holds nothing
            it would not hold anyway.

    Calling it copies ``token`` and ``input_pos`` into the static inputs, replays, and returns
    the step's outputs: *static* tensors, overwritten by the next replay (clone what you keep).
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        model: torch.nn.Module,
        token: torch.Tensor,
        input_pos: torch.Tensor,
        warmup: int = 3,
    ):
        self.step_fn, self.model = step_fn, model
        self.token, self.input_pos = token.clone(), input_pos.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        if token.device.type != "cuda":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                step_fn(model, self.token, self.input_pos)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.outputs = step_fn(model, self.token, self.input_pos)

    def __call__(self, token: torch.Tensor, input_pos: torch.Tensor) -> Any:
        if self.graph is None:  # CPU: plain eager step
            with torch.no_grad():
                return self.step_fn(self.model, token, input_pos)
        self.token.copy_(token)
        self.input_pos.copy_(input_pos)
        self.graph.replay()
        return self.outputs
