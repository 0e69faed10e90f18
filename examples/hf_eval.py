"""Quality of a Hugging Face model's KV cache, measured through the decode path.

``teacher_forced(model, cache, ids)`` feeds a text one token at a time (or ``chunk`` at a
time) through ``cache``, so every prediction attends to keys and values read back from the
cache (compressed ones for a ``TurboQuantCache``), and keeps each position's negative
log-likelihood of the next token and its argmax. ``perplexity`` and ``agreement`` summarize
two such runs; ``StepTimer`` times the decode steps of ``generate``. ``reference_text`` is the
evaluation text: the "Execution model" chapter of the Python language reference, as CPython
ships it (``pydoc_data.topics``), English technical prose that any Python has offline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["DecodeRun", "StepTimer", "agreement", "perplexity", "reference_text",
           "teacher_forced"]  # fmt: skip


class DecodeRun(NamedTuple):
    """One teacher-forced pass: ``nll [T - 1]`` float32 negative log-likelihood of tokens
    ``1 .. T - 1``, ``argmax [T - 1]`` the predicted token at each step, ``seconds``."""

    nll: torch.Tensor
    argmax: torch.Tensor
    seconds: float


class StepTimer:
    """A ``generate`` logits processor that records the time of every decode step (after a
    CUDA synchronization) and optionally reports progress as ``progress(step)``."""

    def __init__(self, progress: Callable[[int], None] | None = None):
        self.times: list[float] = []
        self.progress = progress

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        if self.progress:
            self.progress(len(self.times))
        return scores

    def tokens_per_second(self, batch: int, skip: int = 0) -> float | None:
        """``batch`` x steps / seconds between step ``skip`` and the last (None: < 2 steps)."""
        times = self.times[skip:]
        if len(times) < 2:
            return None
        return batch * (len(times) - 1) / (times[-1] - times[0])


def reference_text() -> str:
    """The evaluation text: CPython's "Execution model" reference chapter (about 9.5k
    characters, ~2k tokens of SmolLM2's tokenizer)."""
    from pydoc_data.topics import topics

    return topics["execmodel"]


@torch.no_grad()
def teacher_forced(
    model,
    cache,
    ids: torch.Tensor,
    progress: Callable[[int, int], None] | None = None,
    chunk: int = 1,
) -> DecodeRun:
    """Feed ``ids [T]`` (int64) through ``cache``, ``chunk`` tokens per forward.

    With ``chunk=1`` every prediction is a decode step. With ``chunk=C > 1`` (at most 16 for
    a ``TurboQuantCache``: its multi-token decode) each forward appends C tokens and their C
    queries attend causally over the cache, as a speculative verify step does: C times fewer
    forwards, and the same attention except that a query ``c`` places before the chunk's last
    sees the ``c`` oldest positions of the recent window already quantized (they leave the
    window when the whole chunk is written).

    Args:
        model: a causal LM (``model(input_ids, past_key_values=cache)``).
        cache: an empty transformers ``Cache`` with room for ``T`` tokens at batch 1.
        ids: the token ids.
        progress: called as ``progress(done, total)`` about every 64 positions and at the end.
        chunk: tokens per forward (>= 1).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk!r}")
    steps = ids.shape[0] - 1
    nll, argmax = torch.empty(steps), torch.empty(steps, dtype=torch.long)
    start = time.perf_counter()
    for t in range(0, steps, chunk):
        end = min(t + chunk, steps)
        out = model(ids[None, t:end], past_key_values=cache, use_cache=True)
        logits = out.logits[0].float()  # [end - t, V]: position i predicts token i + 1
        targets = ids[t + 1 : end + 1, None]
        nll[t:end] = (torch.logsumexp(logits, -1) - logits.gather(-1, targets)[:, 0]).cpu()
        argmax[t:end] = logits.argmax(-1).cpu()
        if progress and (end // 64 > t // 64 or end == steps):
            progress(end, steps)
    return DecodeRun(nll, argmax, time.perf_counter() - start)


def perplexity(run: DecodeRun) -> float:
    """exp of the mean negative log-likelihood."""
    return math.exp(run.nll.double().mean().item())


def agreement(run: DecodeRun, reference: DecodeRun) -> float:
    """Fraction of steps whose argmax equals the reference run's (top-1 agreement)."""
    return (run.argmax == reference.argmax).double().mean().item()
