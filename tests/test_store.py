"""tq.store: the Triton kernel against the reference, strides, canary, reconstruction error."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_kernels
from helpers import assert_same_cache, clone_cache, poisoned_cache, random_kv, slot_rows

from custom_ops import api, reference
from custom_ops.formats import FORMATS, SUPPORTED_HEAD_DIMS, PagedKVCache, get_format

NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE = 6, 2, 4


def _store_both(fmt_name, key, value, slots, kernel_device, gen):
    """Store with the reference on CPU and with the Triton kernel; return both caches."""
    fmt = get_format(fmt_name)
    head_dim = key.shape[-1]
    consts = api.make_constants(fmt, head_dim, seed=11)
    expected = poisoned_cache(fmt, NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE, head_dim, gen)
    actual = clone_cache(expected, kernel_device)
    reference.store(fmt, key, value, expected, slots, *consts)
    dev = api.KVConstants(*(c.to(kernel_device) for c in consts))
    with triton_kernels(kernel_device):
        api.store(
            fmt,
            actual,
            key.to(kernel_device),
            value.to(kernel_device),
            slots.to(kernel_device),
            dev,
        )
    return fmt, expected, PagedKVCache(*(p.cpu() for p in actual))


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference(fmt_name, head_dim, dtype, kernel_device, seeded):
    """The Triton store writes the reference's bytes (codes, norms, scales) into the right
    slots, skipping padding slots, for every format x head dim x input dtype."""
    n_tokens = 11
    key, value = random_kv(n_tokens, NUM_KV_HEADS, head_dim, dtype, seeded)
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, generator=seeded)[:n_tokens].to(torch.int32)
    slots[[2, 7]] = -1
    fmt, expected, actual = _store_both(fmt_name, key, value, slots, kernel_device, seeded)
    assert_same_cache(fmt, expected, actual)


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k8v4", "int8"])
def test_kernel_takes_permuted_strides(fmt_name, kernel_device, seeded):
    """Non-contiguous key/value views (token and head dims swapped in memory) store the same
    bytes as contiguous inputs."""
    key, value = random_kv(9, NUM_KV_HEADS, 64, torch.bfloat16, seeded)
    key_t = key.transpose(0, 1).contiguous().transpose(0, 1)
    value_t = value.transpose(0, 1).contiguous().transpose(0, 1)
    assert not key_t.is_contiguous()
    slots = torch.arange(9, dtype=torch.int32) + 3
    fmt, expected, actual = _store_both(fmt_name, key_t, value_t, slots, kernel_device, seeded)
    assert_same_cache(fmt, expected, actual)


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_store_writes_only_target_slots(fmt_name, kernel_device, seeded):
    """Canary: every byte of every slot not named in slot_mapping is unchanged."""
    key, value = random_kv(5, NUM_KV_HEADS, 128, torch.bfloat16, seeded)
    slots = torch.tensor([9, -1, 0, 23, 14], dtype=torch.int32)
    fmt = get_format(fmt_name)
    consts = api.make_constants(fmt, 128)
    before = poisoned_cache(fmt, NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE, 128, seeded)
    cache = clone_cache(before, kernel_device)
    with triton_kernels(kernel_device):
        api.store(
            fmt,
            cache,
            key.to(kernel_device),
            value.to(kernel_device),
            slots.to(kernel_device),
            api.KVConstants(*(c.to(kernel_device) for c in consts)),
        )
    written = torch.zeros(NUM_PAGES * PAGE_SIZE, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    for raw_b, raw_a in zip(slot_rows(before), slot_rows(cache), strict=True):
        assert torch.equal(raw_a[~written], raw_b[~written])
        assert not torch.equal(raw_a[written], raw_b[written])


# Relative reconstruction error ||x - x_hat|| / ||x|| of keys and values on random_kv inputs,
# from each quantizer's expected error plus a 25% margin: Lloyd-Max sqrt(distortion) (4 bits:
# 0.098, 3 bits: 0.186); uniform b-bit on Gaussian rows, step = range / (2^b - 1) with range
# ~5.3 sigma, error step / sqrt(12) over an rms of 1.12 sigma (4 bits: 0.09, 3 bits: 0.2);
# e4m3: ~0.025; int8 absmax: keys carry an 8x outlier channel, so absmax / 127 is coarse (0.016).
ERROR_BOUNDS = {
    "k8v4": (0.035, 0.125),
    "4bit_nc": (0.125, 0.125),
    "k3v4_nc": (0.23, 0.125),
    "3bit_nc": (0.23, 0.26),
    "int8": (0.02, 0.01),
    "fp8": (0.032, 0.033),
    "tq4_nc": (0.125, 0.125),
    "k2v2_nc": (0.42, 0.62),
    "k2v4_nc": (0.42, 0.125),
}


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_reconstruction_error(fmt_name, seeded):
    """Store then dequantize (reference) recovers K and V within the format's error bound."""
    fmt = get_format(fmt_name)
    key, value = random_kv(64, NUM_KV_HEADS, 128, torch.bfloat16, seeded)
    consts = api.make_constants(fmt, 128)
    cache = fmt.allocate(16, NUM_KV_HEADS, PAGE_SIZE, 128)
    api.store(fmt, cache, key, value, torch.arange(64, dtype=torch.int32), consts)
    table = torch.arange(16, dtype=torch.int32)[None]
    k, v = api.dequantize(
        fmt, cache, table, torch.tensor([64], dtype=torch.int32), consts, 64, torch.float64
    )

    def rel(approx, exact):
        exact = exact.double().transpose(0, 1)[None]
        return ((approx - exact).norm() / exact.norm()).item()

    k_bound, v_bound = ERROR_BOUNDS[fmt_name]
    assert rel(k, key) < k_bound
    assert rel(v, value) < v_bound
