"""tq.store (``custom_ops/triton/store.py`` on CUDA): the Triton kernel against the reference,
strides, canary; opcheck; bad input."""

from __future__ import annotations

import expecttest
import pytest
import torch
from conftest import triton_kernels
from helpers import (
    IMPLS,
    assert_same_cache,
    clone_cache,
    impl_context,
    impl_device,
    poisoned_cache,
    random_kv,
    slot_rows,
)

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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_nan_in_nan_out(fmt_name, impl, kernel_device, seeded):
    """A NaN in one element of a stored key (kv-head 0) or value (kv-head 1) makes the
    attention of that kv-head's query heads NaN, on the reference and the kernels alike (the
    GPU's min / max skip NaN: scales from them hid it and the row came back finite); kv-head 2
    stays finite, and so does the rest of the NaN rows' page."""
    fmt = get_format(fmt_name)
    device = impl_device(impl, kernel_device)
    consts = api.KVConstants(*(c.to(device) for c in api.make_constants(fmt, 64)))
    key, value = random_kv(12, 3, 64, torch.bfloat16, seeded)
    key[5, 0, 17] = float("nan")
    value[9, 1, 40] = float("nan")
    cache = PagedKVCache(*(p.to(device) for p in fmt.allocate(3, 3, 4, 64)))
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=device)
    lens = torch.tensor([12], dtype=torch.int32, device=device)
    q = torch.randn(1, 6, 64, generator=seeded).to(torch.bfloat16).to(device)  # group 2
    with impl_context(impl, device):
        api.store(
            fmt,
            cache,
            key.to(device),
            value.to(device),
            torch.arange(12, dtype=torch.int32, device=device),
            consts,
        )
        out = api.decode(fmt, q, cache, table, lens, consts, num_splits=2).cpu()
        k_deq, v_deq = api.dequantize(fmt, cache, table, lens, consts, 12, torch.float32)
    assert out[0, :4].isnan().all(), "kv-heads 0 and 1: NaN"
    assert out[0, 4:].isfinite().all(), "kv-head 2: finite"
    assert k_deq[0, 0, 5].isnan().any() and v_deq[0, 1, 9].isnan().any()  # fp8: the element
    others = torch.ones(12, dtype=torch.bool)
    others[[5, 9]] = False
    assert k_deq[0, :, others].isfinite().all() and v_deq[0, :, others].isfinite().all()


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


def _store_args(fmt_name, device, gen, permuted=False):
    fmt = get_format(fmt_name)
    key, value = random_kv(7, 2, 64, torch.bfloat16, gen)
    if permuted:
        key = key.transpose(0, 1).contiguous().transpose(0, 1)
        value = value.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    cache = poisoned_cache(fmt, 5, 2, 4, 64, gen)
    slots = torch.tensor([3, -1, 0, 19, 8, 9, 12], dtype=torch.int32)
    consts = api.make_constants(fmt, 64)
    args = (key, value, *cache, slots, *consts)
    return tuple(a.to(device) for a in args) + (fmt_name,)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_opcheck_store(fmt_name, impl, kernel_device, seeded):
    """opcheck (schema, fake tensor, aot dispatch) for tq.store, with permuted-stride inputs."""
    device = impl_device(impl, kernel_device)
    with impl_context(impl, device):
        for permuted in (False, True):
            args = _store_args(fmt_name, device, seeded, permuted)
            torch.library.opcheck(torch.ops.tq.store.default, args)


def _bad_store_cases(gen):
    fmt = get_format("4bit_nc")
    key, value = random_kv(3, 2, 128, torch.bfloat16, gen)
    slots = torch.tensor([1, 5, 9], dtype=torch.int32)
    consts = api.make_constants(fmt, 128)
    k48, v48 = random_kv(3, 2, 48, torch.bfloat16, gen)
    k64, v64 = random_kv(3, 2, 64, torch.bfloat16, gen)
    return {
        "float32 keys": (key.float(), value.float(), slots, consts),
        "head dim mismatch": (k64, v64, slots, consts),
        "unsupported head dim": (k48, v48, slots, consts),
        "slot beyond capacity": (key, value, torch.tensor([1, 24, 2], dtype=torch.int32), consts),
        "different devices": (key, value, slots.to("meta"), consts),
        "int64 slots": (key, value, slots.long(), consts),
        "kv-heads mismatch": (key[:, :1], value[:, :1], slots, consts),
    }


class TestStoreBadInput(expecttest.TestCase):
    def test_store_rejects_bad_input_before_writing(self):
        """Each bad input raises an error naming what was expected; the cache is unchanged."""
        gen = torch.Generator().manual_seed(0)
        fmt = get_format("4bit_nc")
        cache = poisoned_cache(fmt, 6, 2, 4, 128, gen)
        before = [p.clone() for p in cache]
        messages = []
        for case, (key, value, slots, consts) in _bad_store_cases(gen).items():
            with self.assertRaises((ValueError, TypeError)) as ctx:
                api.store(fmt, cache, key, value, slots, consts)
            messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
            for b, a in zip(before, cache, strict=True):
                self.assertTrue(torch.equal(b, a), case)
        self.assertExpectedInline(
            "\n".join(messages),
            """\
float32 keys: TypeError: tq.store: key must be bfloat16 or float16, got torch.float32
head dim mismatch: ValueError: tq.store: key has head dim 64 but the 4bit_nc cache holds head dim 128 (k_codes rows of 64 bytes)
unsupported head dim: ValueError: tq.store: unsupported head dim 48: expected one of (64, 80, 96, 128, 256)
slot beyond capacity: ValueError: tq.store: slot 24 is beyond the cache's capacity of 24 slots (num_pages * page_size); expected slots in [0, capacity) or < 0 for padding
different devices: ValueError: tq.store: slot_mapping is on meta but the cache is on cpu: expected every tensor on the cache's device
int64 slots: TypeError: tq.store: slot_mapping must be int32, got torch.int64
kv-heads mismatch: ValueError: tq.store: key has 1 kv-heads but the cache has 2""",  # noqa: E501
        )

    def test_store_rejects_token_major_value_codes(self):
        """A ``v_codes`` plane in token-major order is rejected with the shape it must have."""
        gen = torch.Generator().manual_seed(0)
        fmt = get_format("4bit_nc")
        cache = fmt.allocate(6, 2, 4, 128)
        key, value = random_kv(3, 2, 128, torch.bfloat16, gen)
        slots = torch.tensor([1, 5, 9], dtype=torch.int32)
        token_major = cache.value_rows.contiguous()
        cases = {"token-major": token_major, "token-major, transposed": token_major.mT}
        messages = []
        for case, v_codes in cases.items():
            with self.assertRaises(ValueError) as ctx:
                api.store(
                    fmt,
                    cache._replace(v_codes=v_codes),
                    key,
                    value,
                    slots,
                    api.make_constants(fmt, 128),
                )
            messages.append(f"{case}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
token-major: tq.store: v_codes of a 4bit_nc cache with head dim 128 must have shape (6, 2, 64, 4), got (6, 2, 4, 64)
token-major, transposed: tq.store: v_codes must be contiguous""",  # noqa: E501
        )
