"""Every finite bf16 key and value is representable (issue 21, defect 1): stored, read back and
attended to with the same relative error at any magnitude from 1e-6 to 1e6 per element, and
norms up to bf16's maximum, on the reference and the kernels. Before the bf16 meta record, an
fp16 norm / scale / zero overflowed to ``inf`` past 65504 (the head's output came back zero or
NaN) and flushed to zero below 6e-8; k8v4's plain fp8 keys saturated at 448."""

from __future__ import annotations

import pytest
import torch
from helpers import IMPLS, impl_context, impl_device, random_kv, window_on

from custom_ops import api, reference
from custom_ops.formats import FORMATS, PagedKVCache, RecentWindow, get_format

MAGNITUDES = (1e-6, 1e-3, 1.0, 1e3, 1e6)
T, HK, GROUP, D, W, PAGE = 12, 2, 2, 64, 4, 4  # 8 compressed tokens, 4 in the ring


def _store(fmt, key, value, device):
    """A fresh cache (and rings) holding ``key``/``value [1, Hk, T, D]`` at positions 0..T-1."""
    consts = api.KVConstants(*(c.to(device) for c in api.make_constants(fmt, D, seed=5)))
    cache = PagedKVCache(*(p.to(device) for p in fmt.allocate(2, HK, PAGE, D)))
    rings = [torch.zeros(1, HK, W, D, dtype=key.dtype, device=device) for _ in range(2)]
    window = RecentWindow(*rings, torch.full((1, HK, W), -1, dtype=torch.int32, device=device))
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    api.store_window(fmt, cache, key.to(device), value.to(device), window, table, start, consts)
    return consts, cache, window, table


def _oracle(fmt, cache, window, table, lens, q, consts):
    """float64 attention over what the cache holds (its dequantized K and V)."""
    cpu = PagedKVCache(*(p.cpu() for p in cache))
    k, v = reference.dequantize(
        fmt,
        cpu,
        table.cpu(),
        lens,
        consts.rotation.cpu(),
        T,
        torch.float64,
        window_on(window, "cpu"),
    )
    return k, v, reference.attention(q.double(), k, v, lens, D**-0.5)


def _row_errors(actual, expected):
    """Largest ``||actual - expected|| / ||expected||`` over the rows ``[..., D]``."""
    diff = (actual.double() - expected.double()).norm(dim=-1)
    return (diff / expected.double().norm(dim=-1)).max().item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_every_magnitude_is_represented(fmt_name, impl, kernel_device, seeded):
    """Keys and values scaled by 1e-6 .. 1e6 read back (dequantize) with the relative error
    they have at magnitude 1, and decode matches float64 attention over the stored values at
    every value magnitude and at key magnitudes up to 1 (beyond, bf16 queries make the scores
    too sharp to compare; the output is still finite and non-zero)."""
    fmt = get_format(fmt_name)
    device = impl_device(impl, kernel_device)
    base_k, base_v = random_kv(T, HK, D, torch.float32, seeded)
    base_k, base_v = base_k.transpose(0, 1)[None], base_v.transpose(0, 1)[None]  # [1, Hk, T, D]
    q = torch.randn(1, HK * GROUP, D, generator=seeded).to(torch.bfloat16)
    lens = torch.tensor([T], dtype=torch.int32)
    errors = {}
    for magnitude in MAGNITUDES:
        for side in ("key", "value"):
            key = (base_k * (magnitude if side == "key" else 1.0)).to(torch.bfloat16)
            value = (base_v * (magnitude if side == "value" else 1.0)).to(torch.bfloat16)
            with impl_context(impl, device):
                consts, cache, window, table = _store(fmt, key, value, device)
                k_deq, v_deq = api.dequantize(
                    fmt, cache, table, lens.to(device), consts, T, torch.float32, window
                )
                out = api.decode(
                    fmt,
                    q.to(device),
                    cache,
                    table,
                    lens.to(device),
                    consts,
                    num_splits=2,
                    window=window,
                ).cpu()
            stored = k_deq if side == "key" else v_deq
            errors[side, magnitude] = _row_errors(stored.cpu(), key if side == "key" else value)
            where = f"{fmt_name} {side}s x {magnitude:g}"
            assert out.isfinite().all(), f"{where}: non-finite decode output"
            assert (out.abs().amax(dim=-1) > 0).all(), f"{where}: a head's output is zero"
            if side == "value" or magnitude <= 1.0:
                _, v64, expected = _oracle(fmt, cache, window, table, lens, q, consts)
                # fp16 products on the tensor cores, bf16 output: relative to the values' size
                scale = v64.abs().amax()
                error = ((out.double() - expected).abs().amax() / scale).item()
                assert error < 8e-3, f"{where}: decode error {error:.2e} of max |v|"
    for (side, magnitude), error in errors.items():
        usual = errors[side, 1.0]
        # bf16 inputs at another magnitude round differently: a few percent of the usual error
        assert error <= 1.1 * usual + 1e-3, (
            f"{fmt_name} {side}s x {magnitude:g}: relative error {error:.3g}, {usual:.3g} at 1"
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k8v4", "tq4_nc"])
def test_values_near_bf16_max_decode(fmt_name, impl, kernel_device, seeded):
    """Values of ~1e35 per element (their scales past 2**104, the split kernel's second pass in
    units of the largest) decode to float64 attention over the stored values: scaling the
    accumulators back must not overflow float32 on the way (3- and 4-bit uniform values enter
    the products as subnormals, 2**-24 and less, and are scaled back by the inverse)."""
    fmt = get_format(fmt_name)
    device = impl_device(impl, kernel_device)
    key, value = random_kv(T, HK, D, torch.float32, seeded)
    key = key.transpose(0, 1)[None].to(torch.bfloat16)
    value = (value * 1e35).transpose(0, 1)[None].to(torch.bfloat16)
    q = torch.randn(1, HK * GROUP, D, generator=seeded).to(torch.bfloat16)
    lens = torch.tensor([T], dtype=torch.int32)
    with impl_context(impl, device):
        consts, cache, window, table = _store(fmt, key, value, device)
        out = api.decode(
            fmt, q.to(device), cache, table, lens.to(device), consts, num_splits=2, window=window
        ).cpu()
    assert out.isfinite().all(), f"{fmt_name}: non-finite decode output at values of 1e35"
    _, v64, expected = _oracle(fmt, cache, window, table, lens, q, consts)
    error = ((out.double() - expected).abs().amax() / v64.abs().amax()).item()
    assert error < 8e-3, f"{fmt_name}: decode error {error:.2e} of max |v| at values of 1e35"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq4_nc", "k8v4"])
def test_norms_up_to_bf16_max(fmt_name, impl, kernel_device, seeded):
    """Rows whose norm approaches bf16's maximum (elements ~1e37 at D = 64) store finite
    records: float32 squares of such elements overflow unless the row is scaled first."""
    fmt = get_format(fmt_name)
    device = impl_device(impl, kernel_device)
    key, value = random_kv(T, HK, D, torch.float32, seeded)
    big = torch.finfo(torch.bfloat16).max / 4 / D**0.5
    key = (key / key.abs().amax() * big).transpose(0, 1)[None].to(torch.bfloat16)
    value = value.transpose(0, 1)[None].to(torch.bfloat16)
    lens = torch.tensor([T], dtype=torch.int32)
    with impl_context(impl, device):
        consts, cache, window, table = _store(fmt, key, value, device)
        k_deq, _ = api.dequantize(
            fmt, cache, table, lens.to(device), consts, T, torch.float32, window
        )
    assert cache.meta.isfinite().all()
    error = _row_errors(k_deq.cpu()[:, :, : T - W], key[:, :, : T - W])
    assert error < 0.25, f"relative error {error:.3g} of rows with norms near bf16's maximum"
