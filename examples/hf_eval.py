"""Quality of a Hugging Face model's KV cache, measured through the decode path.

``teacher_forced(model, cache, ids)`` feeds a text one token at a time (or ``chunk`` at a
time) through ``cache``, so every prediction attends to keys and values read back from the
cache (compressed ones for a ``TurboQuantCache``), and keeps each position's negative
log-likelihood of the next token and its argmax; with ``prompt=N`` it prefills the first N
tokens first (in one forward, or ``prompt_chunk`` at a time), as a prompt before its answer.
``perplexity`` and ``agreement`` summarize two such runs (from a position on: the answer's);
``StepTimer`` times the decode steps of ``generate``. ``reference_text`` is the evaluation
text: the "Execution model" chapter of the Python language reference, as CPython ships it
(``pydoc_data.topics``), English technical prose that any Python has offline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["DecodeRun", "StepTimer", "agreement", "perplexity", "reference_text", "teacher_forced"]


class DecodeRun(NamedTuple):
    """One teacher-forced pass: ``nll [T - 1]`` float32 negative log-likelihood of tokens
    ``1 .. T - 1``, ``argmax [T - 1]`` the predicted token at each step (``[B, T - 1]`` each for
    a batch of texts), ``seconds``."""

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

    def tokens_per_second(
        self, batch: int, skip: int = 0, stop: int | None = None
    ) -> float | None:
        """``batch`` x steps / seconds between step ``skip`` and the last before ``stop`` (None:
        < 2 steps)."""
        times = self.times[skip:stop]
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
    prompt: int = 0,
    prompt_chunk: int = 0,
) -> DecodeRun:
    """Feed ``ids [T]`` (or a batch of texts ``[B, T]``, int64) through ``cache``, ``chunk``
    tokens per forward after a prompt of ``prompt`` tokens.

    With ``chunk=1`` every prediction after the prompt is a decode step. With ``chunk=C > 1``
    (at most 16 for a ``TurboQuantCache``'s multi-token decode) each forward appends C tokens
    and their C queries attend causally over the cache, as a speculative verify step does: C
    times fewer forwards, and the same attention except that a query ``c`` places before the
    chunk's last sees the ``c`` oldest positions of the recent window already quantized (they
    leave the window when the whole chunk is written). The prompt's tokens go in one forward
    (``prompt_chunk`` 0) or ``prompt_chunk`` per forward: a prefill, each chunk attending over
    its own tokens exactly and over the cached ones before it.

    Args:
        model: a causal LM (``model(input_ids, past_key_values=cache)``).
        cache: an empty transformers ``Cache`` with room for ``T`` tokens of each text.
        ids: the token ids.
        progress: called as ``progress(done, total)`` about every 64 positions and at the end.
        chunk: tokens per forward after the prompt (>= 1).
        prompt: tokens prefilled first (0: none).
        prompt_chunk: tokens per forward of the prompt (0: all of it in one).
    """
    if chunk < 1 or prompt < 0 or prompt_chunk < 0:
        raise ValueError(
            f"chunk must be >= 1 and prompt, prompt_chunk >= 0, got {chunk!r}, "
            f"{prompt!r}, {prompt_chunk!r}"
        )
    texts = ids if ids.dim() == 2 else ids[None]
    steps = texts.shape[1] - 1
    if prompt > steps:
        raise ValueError(f"prompt of {prompt} tokens leaves nothing to predict in {steps + 1}")
    nll = torch.empty(texts.shape[0], steps)
    argmax = torch.empty(texts.shape[0], steps, dtype=torch.long)
    # forwards over [t, end): the prompt's, then the rest's (the last predicts nothing)
    forwards = [*_spans(0, prompt, prompt_chunk or prompt), *_spans(prompt, steps, chunk)]
    start = time.perf_counter()
    for t, end in forwards:
        out = model(texts[:, t:end], past_key_values=cache, use_cache=True)
        logits = out.logits.float()  # [B, end - t, V]: position i predicts token i + 1
        targets = texts[:, t + 1 : end + 1, None]
        nll[:, t:end] = (torch.logsumexp(logits, -1) - logits.gather(-1, targets)[..., 0]).cpu()
        argmax[:, t:end] = logits.argmax(-1).cpu()
        if progress and (end // 64 > t // 64 or end == steps):
            progress(end, steps)
    seconds = time.perf_counter() - start
    if ids.dim() == 1:
        return DecodeRun(nll[0], argmax[0], seconds)
    return DecodeRun(nll, argmax, seconds)


def _spans(begin: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[begin, end)`` cut into spans of ``step`` (the last shorter; none if empty)."""
    return [(t, min(t + step, end)) for t in range(begin, end, max(step, 1))]


def perplexity(run: DecodeRun, start: int = 0) -> float:
    """exp of the mean negative log-likelihood of the predictions from step ``start`` on (of
    every text of a batch together)."""
    return math.exp(run.nll[..., start:].double().mean().item())


def agreement(run: DecodeRun, reference: DecodeRun, start: int = 0) -> float:
    """Fraction of steps from ``start`` on whose argmax equals the reference run's (top-1
    agreement)."""
    return (run.argmax[..., start:] == reference.argmax[..., start:]).double().mean().item()
