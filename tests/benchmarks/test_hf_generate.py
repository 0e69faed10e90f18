"""benchmarks/hf_generate.py on the CPU: the batch a capacity run gives a cache fits the budget
by the cache's own bytes after a forward (one more sequence does not), and the profiled steps
come after the timed ones."""

from __future__ import annotations

import sys
from argparse import Namespace

import pytest
import torch
from conftest import ROOT
from helpers import TINY_DECODER

transformers = pytest.importorskip("transformers")

from tq_compile.hf import TurboQuantCache  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import hf_generate  # noqa: E402

CONTEXT, WINDOW = 96, 16


@pytest.fixture(scope="module")
def tiny():
    config = transformers.LlamaConfig(**TINY_DECODER)
    torch.manual_seed(0)
    return config, transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _held_bytes(tiny, cache_name: str, batch: int) -> int:
    """What the cache ``cache_name`` holds after a forward of ``batch`` prompts (as
    ``hf_generate.time_cell`` counts it)."""
    config, model = tiny
    if cache_name == "static":
        cache = transformers.StaticCache(config, max_cache_len=CONTEXT)
    else:
        cache = TurboQuantCache(config, CONTEXT, preset=cache_name, window=WINDOW)
    with torch.no_grad():
        model(torch.randint(3, config.vocab_size, (batch, 8)), past_key_values=cache)
    if cache_name == "static":
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return cache.nbytes()


@pytest.mark.parametrize("cache_name", ["static", "4bit_nc", "tqk5v3_nc"])
def test_capacity_batch_fits_the_caches_own_bytes(tiny, cache_name):
    one = _held_bytes(tiny, cache_name, 1)
    args = Namespace(context=CONTEXT, window=WINDOW, capacity_gb=3.5 * one / 1e9)
    batch = hf_generate.capacity_batch(tiny[0], cache_name, args)
    assert batch >= 3, batch
    assert _held_bytes(tiny, cache_name, batch) <= args.capacity_gb * 1e9
    assert _held_bytes(tiny, cache_name, batch + 1) > args.capacity_gb * 1e9


class _Recorder:
    """Stands in for a ``torch.profiler.profile``: records when it is started and stopped."""

    def __init__(self, calls):
        self.events, self.calls = [], calls

    def start(self):
        self.events.append(("start", self.calls()))

    def stop(self):
        self.events.append(("stop", self.calls()))


def test_profiled_steps_follow_the_timed_ones():
    """``--kernels 3`` after 5 timed tokens: profiling starts at the 5th logits call (after the
    5th forward) and stops at the 8th, so it covers forwards 6 to 8; the timer's rate stops at
    the 5th call."""
    profiler = hf_generate.StepProfiler(5, 3)
    recorder = _Recorder(lambda: profiler.calls)
    profiler.prof = recorder
    scores = torch.zeros(1, 4)
    for _ in range(8):
        assert profiler(None, scores) is scores
    assert recorder.events == [("start", 5), ("stop", 8)]
    timer = hf_generate.StepTimer()
    timer.times = [0.0, 1.0, 2.0, 3.0, 4.0, 100.0, 200.0, 300.0]
    assert timer.tokens_per_second(2, skip=1, stop=5) == 2.0
