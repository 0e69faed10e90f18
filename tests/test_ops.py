"""torch.ops.tq.store / dequantize as operators: opcheck, bad input, torch.compile."""

from __future__ import annotations

import expecttest
import pytest
import torch
from conftest import triton_kernels
from helpers import filled_cache, poisoned_cache, random_kv

from custom_ops import api
from custom_ops.formats import FORMATS, get_format

IMPLS = ["reference", "triton"]


def _device(impl: str, kernel_device: str) -> str:
    return "cpu" if impl == "reference" else kernel_device


def _impl_context(impl: str, device: str):
    return triton_kernels(device) if impl == "triton" else torch.no_grad()


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
    device = _device(impl, kernel_device)
    with _impl_context(impl, device):
        for permuted in (False, True):
            args = _store_args(fmt_name, device, seeded, permuted)
            torch.library.opcheck(torch.ops.tq.store.default, args)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_opcheck_dequantize(fmt_name, impl, kernel_device, seeded):
    """opcheck for tq.dequantize, including a non-contiguous block table."""
    device = _device(impl, kernel_device)
    fmt = get_format(fmt_name)
    consts = api.make_constants(fmt, 64)
    cache = filled_cache(fmt, 6, 2, 4, 64, consts, seeded)
    block_table = torch.tensor([[5, 1, 4], [0, 2, 3]], dtype=torch.int32).T.contiguous().T
    block_table = block_table[:, :3]
    seq_lens = torch.tensor([9, 12], dtype=torch.int32)
    tensors = (*cache, block_table, seq_lens, *consts)
    args = tuple(t.to(device) for t in tensors) + (fmt_name, 12, torch.bfloat16)
    with _impl_context(impl, device):
        torch.library.opcheck(torch.ops.tq.dequantize.default, args)


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


class TestBadInput(expecttest.TestCase):
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
                api.store(fmt, cache._replace(v_codes=v_codes), key, value, slots,
                          api.make_constants(fmt, 128))  # fmt: skip
            messages.append(f"{case}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
token-major: tq.store: v_codes of a 4bit_nc cache with head dim 128 must have shape (6, 2, 64, 4), got (6, 2, 4, 64)
token-major, transposed: tq.store: v_codes must be contiguous""",  # noqa: E501
        )

    def test_dequantize_rejects_bad_input(self):
        gen = torch.Generator().manual_seed(0)
        fmt = get_format("k8v4")
        cache = poisoned_cache(fmt, 6, 2, 4, 128, gen)
        consts = api.make_constants(fmt, 128)
        table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
        cases = {
            "length beyond capacity": (table, torch.tensor([13], dtype=torch.int32), 12),
            "length beyond max_seq_len": (table, torch.tensor([9], dtype=torch.int32), 8),
            "max_seq_len beyond table": (table, torch.tensor([9], dtype=torch.int32), 16),
            "page id out of range": (table + 4, torch.tensor([9], dtype=torch.int32), 12),
            "int64 block table": (table.long(), torch.tensor([9], dtype=torch.int32), 12),
        }
        messages = []
        for case, (bt, lens, max_len) in cases.items():
            with self.assertRaises((ValueError, TypeError)) as ctx:
                api.dequantize(fmt, cache, bt, lens, consts, max_len)
            messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
length beyond capacity: ValueError: tq.dequantize: seq_lens must be in [0, 12], got a length of 13
length beyond max_seq_len: ValueError: tq.dequantize: seq_lens must be in [0, 8], got a length of 9
max_seq_len beyond table: ValueError: tq.dequantize: max_seq_len 16 must be in [0, 12] (block_table pages * page_size)
page id out of range: ValueError: tq.dequantize: block_table holds page ids outside [0, 6) for positions below seq_lens
int64 block table: TypeError: tq.dequantize: block_table must be int32, got torch.int64""",  # noqa: E501
        )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_store_then_dequantize(backend, seeded):
    """A compiled function that stores new tokens and dequantizes the cache (fullgraph) gives
    the eager result and mutates the cache like eager."""
    fmt = get_format("3bit_nc")
    consts = api.make_constants(fmt, 64)
    key, value = random_kv(6, 2, 64, torch.bfloat16, seeded)
    slots = torch.tensor([0, 1, 2, 5, 6, 7], dtype=torch.int32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([8], dtype=torch.int32)

    def step(cache, k, v):
        api.store(fmt, cache, k, v, slots, consts)
        return api.dequantize(fmt, cache, table, lens, consts, 8, torch.float32)

    eager_cache = fmt.allocate(2, 2, 4, 64)
    compiled_cache = fmt.allocate(2, 2, 4, 64)
    expected = step(eager_cache, key, value)
    actual = torch.compile(step, backend=backend, fullgraph=True)(compiled_cache, key, value)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    for e, a in zip(eager_cache, compiled_cache, strict=True):
        assert torch.equal(e, a)
