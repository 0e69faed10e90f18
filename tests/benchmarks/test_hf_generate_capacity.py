"""benchmarks/hf_generate.py's capacity batches on the CPU: the batch a capacity run gives a
cache fits the budget by the cache's own bytes after a forward, and one more sequence does not."""

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
