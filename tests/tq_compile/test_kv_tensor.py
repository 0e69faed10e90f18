"""TurboQuantKVTensor (``tq_compile/kv_tensor.py``): the subclass contract, SDPA semantics, GQA
views."""

from __future__ import annotations

import contextlib
import math

import expecttest
import pytest
import torch
import torch.nn.functional as F
from conftest import triton_kernels
from helpers import rel_error
from kv_views import GROUP, HK, S_MAX, WINDOW, B, D, dense_attention, filled_tq_cache

from tq_compile import TurboQuantKVCache, TurboQuantKVTensor
from tq_compile.kv_tensor import MAX_FOLDED_ROWS, attention


def _query(length=1, heads=HK * GROUP, seed=1, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, heads, length, D, generator=gen) * 2).to(dtype)


@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("fmt", ["4bit_nc", "k8v4", "3bit_nc"])
def test_decode_sdpa_matches_dense_attention(fmt, window):
    """One query token: SDPA over the views (after gpt-fast's repeat_interleave) equals float64
    attention over the dequantized cache, without and with a recent window."""
    _, keys, values = filled_tq_cache(fmt, window=window)
    keys_rep = keys.repeat_interleave(GROUP, dim=1)
    values_rep = values.repeat_interleave(GROUP, dim=1)
    assert isinstance(keys_rep, TurboQuantKVTensor) and keys_rep.group == GROUP
    q = _query()
    out = F.scaled_dot_product_attention(q, keys_rep, values_rep)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = dense_attention(q, keys, values)
    assert rel_error(out, expected) < 4e-3  # bf16 output rounding


def test_hf_repeat_kv_and_enable_gqa_stay_lazy():
    """Hugging Face's repeat_kv (x[:, :, None].expand(...).reshape(...)) and enable_gqa=True
    both reach the grouped kernel: same result as repeat_interleave, no dense copy."""
    _, keys, values = filled_tq_cache()
    q = _query()

    def repeat_kv(x):
        return x[:, :, None, :, :].expand(B, HK, GROUP, S_MAX, D).reshape(B, HK * GROUP, S_MAX, D)

    k_hf, v_hf = repeat_kv(keys), repeat_kv(values)
    assert isinstance(k_hf, TurboQuantKVTensor) and k_hf.shape == (B, HK * GROUP, S_MAX, D)
    a = F.scaled_dot_product_attention(q, k_hf, v_hf)
    b = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    c = F.scaled_dot_product_attention(
        q, keys.repeat_interleave(GROUP, 1), values.repeat_interleave(GROUP, 1)
    )
    assert torch.equal(a, b) and torch.equal(a, c)


def test_decode_masks():
    """gpt-fast's boolean causal-mask slice [1, 1, 1, S_max] and an additive mask are honoured
    at decode, as dense SDPA would."""
    _, keys, values = filled_tq_cache(length=37)
    q = _query()
    causal_row = (torch.arange(S_MAX) <= 30)[None, None, None, :]  # see only positions 0..30
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_row, enable_gqa=True)
    expected = dense_attention(q, keys, values, attn_mask=causal_row)
    assert rel_error(out, expected) < 4e-3
    bias = torch.randn(1, HK * GROUP, 1, S_MAX, generator=torch.Generator().manual_seed(3))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)
    expected = dense_attention(q, keys, values, attn_mask=bias)
    assert rel_error(out, expected) < 4e-3


@pytest.mark.parametrize("tokens", [8, 16, 17])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bidirectional_prefix_mask_is_not_made_causal(tokens, impl, kernel_device):
    """A mask that lets every query of a prompt see the whole prompt (a prefix-LM's bidirectional
    prefix, as multimodal models use) is honoured as it is: at most 16 rows go through the
    multi-token tq.decode, which must not add causality on top (main at e30c341: relative
    error 1.07 at 8 tokens, 1.20 at 16, 0.002 at 17 through the dequantized cache)."""
    device = kernel_device if impl == "triton" else "cpu"
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(1, 2, tokens, 64, generator=gen).bfloat16()
    v = torch.randn(1, 2, tokens, 64, generator=gen).bfloat16()
    q = torch.randn(1, 4, tokens, 64, generator=gen).bfloat16()
    every = (torch.arange(64) < tokens).expand(tokens, 64)[None, None]  # [1, 1, T, S]
    with triton_kernels(device) if impl == "triton" else contextlib.nullcontext():
        cache = TurboQuantKVCache(
            1, 2, 64, 64, torch.bfloat16, preset="int8", window=128, device=device
        )
        keys, values = cache.update(
            torch.arange(tokens, device=device), k.to(device), v.to(device)
        )
        out = F.scaled_dot_product_attention(
            q.to(device), keys, values, attn_mask=every.to(device), enable_gqa=True
        )
    # the window holds every token: exact up to bf16 rounding
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert rel_error(out.cpu(), exact) < 4e-3


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_pack_gqa_layout_under_a_per_head_mask(impl, kernel_device):
    """transformers' pack_gqa decode layout q [B, Hk, group, D] under a per-head mask [B, Hq, 1,
    S] packed to [B, Hk, group, S]: each row is one query head of one token (main at e30c341
    read the rows as group tokens, causal among them: error 0.585)."""
    device = kernel_device if impl == "triton" else "cpu"
    with triton_kernels(device) if impl == "triton" else contextlib.nullcontext():
        _, keys, values = filled_tq_cache(length=37, device=device)
        q = _query()
        per_head = torch.rand(B, HK * GROUP, 1, S_MAX, generator=torch.Generator().manual_seed(5))
        per_head = per_head < 0.5
        per_head[..., 36] = True
        packed = F.scaled_dot_product_attention(
            q.reshape(B, HK, GROUP, D).to(device),
            keys,
            values,
            attn_mask=per_head.reshape(B, HK, GROUP, S_MAX).to(device),
        )
        expected = dense_attention(q, keys, values, attn_mask=per_head)
    assert rel_error(packed.reshape(B, HK * GROUP, 1, D).cpu(), expected) < 4e-3


def test_prefill_sdpa_with_causal_mask_and_is_causal():
    """Several query tokens: attention over the dequantized cache with gpt-fast's mask slice,
    and with is_causal=True (top-left aligned, as dense SDPA), scale honoured."""
    cache = TurboQuantKVCache(B, HK, S_MAX, D, preset="4bit_nc")
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(B, HK, 20, D, generator=gen).bfloat16()
    v = torch.randn(B, HK, 20, D, generator=gen).bfloat16()
    keys, values = cache.update(torch.arange(20), k, v)
    q = _query(length=20)
    mask = torch.ones(S_MAX, S_MAX, dtype=torch.bool).tril()[None, None, :20]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=True, scale=0.1
    )
    expected = dense_attention(q, keys, values, attn_mask=mask, scale=0.1)
    assert rel_error(out, expected) < 4e-3
    out_causal = F.scaled_dot_product_attention(
        q, keys, values, is_causal=True, enable_gqa=True, scale=0.1
    )
    assert rel_error(out_causal, expected) < 4e-3


def test_hf_pack_gqa_layout_decodes_in_one_pass():
    """Hugging Face's eager decode packs a head group as query rows ([B, Hk, group, D] under one
    mask row): the same result as one query token per query head, through tq.decode."""
    _, keys, values = filled_tq_cache(length=37)
    q = _query()
    mask = (torch.arange(S_MAX) < 30)[None, None, None, :].expand(B, 1, 1, S_MAX)
    packed = q.reshape(B, HK, GROUP, D)  # HF's pack_gqa
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask)
    reference = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    assert torch.equal(out.reshape(B, HK * GROUP, 1, D), reference)
    expected = dense_attention(q, keys, values, attn_mask=mask)
    assert rel_error(reference, expected) < 4e-3


@pytest.mark.parametrize("length", [2, 20, 40])
def test_queries_sharing_all_positions(length, monkeypatch):
    """Several non-causal queries without a mask all see every cached position: up to
    MAX_FOLDED_ROWS rows per kv-head (a decode step's worth) go through tq.decode, more through
    the dequantized cache; both equal dense attention."""
    _, keys, values = filled_tq_cache(length=37)
    q = _query(length=length)
    calls = []
    decode = torch.ops.tq.decode
    monkeypatch.setattr(torch.ops.tq, "decode", lambda *a: (calls.append(1), decode(*a))[1])
    out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    assert bool(calls) == (GROUP * length <= MAX_FOLDED_ROWS)
    expected = dense_attention(q, keys, values)
    assert rel_error(out, expected) < 4e-3


def test_unmasked_chunk_attends_over_its_exact_keys(monkeypatch):
    """A chunk attending without a mask and not causal (a bidirectional prompt, one head per
    kv-head) right after the update that wrote it reads its own exact keys through tq.prefill,
    as a longer one does, not their codes through a folded decode (4bit_nc, window 0: 0.13 of
    the output's norm)."""
    cache = TurboQuantKVCache(1, 2, 128, D, preset="4bit_nc", window=0)
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(1, 2, 64, D, generator=gen).bfloat16()
    v = torch.randn(1, 2, 64, D, generator=gen).bfloat16()
    keys, values = cache.update(torch.arange(64), k, v)
    q = torch.randn(1, 2, 64, D, generator=gen).bfloat16()
    calls = []
    decode = torch.ops.tq.decode
    monkeypatch.setattr(torch.ops.tq, "decode", lambda *a: (calls.append(1), decode(*a))[1])
    out = F.scaled_dot_product_attention(q, keys, values)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert not calls and rel_error(out, exact) < 4e-3


@pytest.mark.parametrize("group", [32, 64])
def test_wide_pack_gqa_group_through_the_kernels(group, kernel_device):
    """A decode step of a multi-query model in transformers' pack_gqa layout (q [B, 1, group,
    D]) through the Triton kernels (32 and 64 rows per kv-head, the widest folded) equals
    float64 attention over the dequantized cache."""
    with triton_kernels(kernel_device):
        cache = TurboQuantKVCache(
            1, 1, S_MAX, D, preset="4bit_nc", window=WINDOW, device=kernel_device
        )
        gen = torch.Generator().manual_seed(9)
        k = (torch.randn(1, 1, 37, D, generator=gen) * 2).bfloat16()
        v = torch.randn(1, 1, 37, D, generator=gen).bfloat16()
        keys, values = cache.update(
            torch.arange(37, device=kernel_device), k.to(kernel_device), v.to(kernel_device)
        )
        q = torch.randn(1, 1, group, D, generator=gen).bfloat16()
        out = F.scaled_dot_product_attention(q.to(kernel_device), keys, values)
        expected = dense_attention(q, keys, values)
    assert rel_error(out.cpu(), expected) < 4e-3


@pytest.mark.parametrize("window", [0, WINDOW])
def test_prefix_slice_before_causal_prefill(window):
    """k[:, :, :n] (Hugging Face's trim before a causal prefill on an empty static cache) keeps
    the first n positions: is_causal attention over it equals dense causal attention over the
    prompt's own keys and values, exact whatever the window (the prompt attends over itself, not
    over its codes); one query over a trimmed view reads the cache's prefix."""
    length = 20
    cache = TurboQuantKVCache(B, HK, S_MAX, D, preset="4bit_nc", window=window)
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(B, HK, length, D, generator=gen).bfloat16()
    v = torch.randn(B, HK, length, D, generator=gen).bfloat16()
    keys, values = cache.update(torch.arange(length), k, v)
    k_prompt, v_prompt = keys[:, :, :length], values[:, :, :length, :]
    assert isinstance(k_prompt, TurboQuantKVTensor) and k_prompt.shape == (B, HK, length, D)
    q = _query(length=length)
    out = F.scaled_dot_product_attention(q, k_prompt, v_prompt, is_causal=True, enable_gqa=True)
    exact = F.scaled_dot_product_attention(
        q.double(),
        k.double().repeat_interleave(GROUP, 1),
        v.double().repeat_interleave(GROUP, 1),
        is_causal=True,
    )
    assert rel_error(out, exact) < 4e-3  # one bf16 rounding of the output: 2^-9
    dense_k = keys.dequantize(torch.float64)[:, :, :length].repeat_interleave(GROUP, 1)
    dense_v = values.dequantize(torch.float64)[:, :, :length].repeat_interleave(GROUP, 1)
    short = 7  # one query over the first 7 positions only
    out = F.scaled_dot_product_attention(
        q[:, :, -1:], keys[:, :, :short], values[:, :, :short], enable_gqa=True
    )
    expected = F.scaled_dot_product_attention(
        q[:, :, -1:].double(), dense_k[:, :, :short], dense_v[:, :, :short]
    )
    assert rel_error(out, expected) < 4e-3


def test_flatten_unflatten_roundtrip():
    _, keys, _ = filled_tq_cache()
    names, attrs = keys.__tensor_flatten__()
    inner = {n: getattr(keys, n) for n in names}
    rebuilt = TurboQuantKVTensor.__tensor_unflatten__(inner, attrs, keys.shape, keys.stride())
    assert rebuilt.shape == keys.shape and rebuilt.fmt == keys.fmt and rebuilt.side == "key"
    assert all(getattr(rebuilt, n) is inner[n] for n in names)
    assert keys._stable_hash_for_caching() == rebuilt._stable_hash_for_caching()


def test_to_detach_clone():
    """.to(device) moves the planes, .to(fp16) changes only the logical dtype, detach shares
    data, clone copies it."""
    _, keys, _ = filled_tq_cache()
    moved = keys.to("cpu")
    assert isinstance(moved, TurboQuantKVTensor) and moved.device == keys.device
    half = keys.to(torch.float16)
    assert half.dtype == torch.float16 and half.k_codes.dtype == torch.uint8
    detached = keys.detach()
    assert detached.k_codes.data_ptr() == keys.k_codes.data_ptr()
    cloned = keys.clone()
    assert cloned.k_codes.data_ptr() != keys.k_codes.data_ptr()
    assert torch.equal(cloned.k_codes, keys.k_codes)
    assert torch.equal(cloned.dequantize(), keys.dequantize())


class TestKVTensorMessages(expecttest.TestCase):
    def test_repr(self):
        _, keys, _ = filled_tq_cache()
        self.assertExpectedInline(
            repr(keys.repeat_interleave(GROUP, dim=1)),
            """TurboQuantKVTensor(fmt=4bit_nc, side=key, shape=(2, 8, 48, 64), dtype=torch.bfloat16, group=4, pages=4x16, device=cpu)""",  # noqa: E501
        )

    def test_unsupported_operations_raise(self):
        """Arithmetic, reductions, slicing and float casts raise instead of dequantizing."""
        _, keys, values = filled_tq_cache()
        q = _query()
        cases = {
            "add": lambda: keys + 1,
            "matmul": lambda: q @ keys.transpose(-1, -2),
            "slice positions": lambda: keys[:, :, 5:10],
            "float cast": lambda: keys.float(),
            "dropout": lambda: F.scaled_dot_product_attention(
                q, keys, values, dropout_p=0.1, enable_gqa=True
            ),
            "heads mismatch": lambda: F.scaled_dot_product_attention(q, keys, values),
            "value as key": lambda: F.scaled_dot_product_attention(
                q, values, keys, enable_gqa=True
            ),
        }
        messages = []
        for case, fn in cases.items():
            with self.assertRaises((TypeError, ValueError, NotImplementedError)) as ctx:
                fn()
            messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
add: NotImplementedError: TurboQuantKVTensor (a compressed KV cache) does not support aten.add.Tensor: it supports F.scaled_dot_product_attention, repeat_interleave / unsqueeze / expand / reshape of the head dim (GQA), .to(device), detach, clone and .dequantize() (a dense copy).
matmul: NotImplementedError: TurboQuantKVTensor (a compressed KV cache) does not support aten.transpose.int: it supports F.scaled_dot_product_attention, repeat_interleave / unsqueeze / expand / reshape of the head dim (GQA), .to(device), detach, clone and .dequantize() (a dense copy).
slice positions: TypeError: TurboQuantKVTensor.__getitem__: only head repetition for GQA and a prefix of the positions (k[:, :, :n]) are supported lazily (got index (slice(None, None, None), slice(None, None, None), slice(5, 10, None)) on shape (2, 2, 48, 64)); call .dequantize() for a dense tensor
float cast: TypeError: TurboQuantKVTensor's dtype is the model's (bf16 or fp16), got torch.float32; call .dequantize(dtype) for a dense copy
dropout: ValueError: dropout_p must be 0 with a TurboQuantKVTensor (inference only)
heads mismatch: ValueError: query has 8 heads and key 2: repeat the key/value heads or pass enable_gqa=True (as for dense SDPA)
value as key: ValueError: key and value must be the key and value views of one cache, got TurboQuantKVTensor(fmt=4bit_nc, side=value, shape=(2, 2, 48, 64), dtype=torch.bfloat16, group=1, pages=4x16, device=cpu) and TurboQuantKVTensor(fmt=4bit_nc, side=key, shape=(2, 2, 48, 64), dtype=torch.bfloat16, group=1, pages=4x16, device=cpu)""",  # noqa: E501
        )


@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("fmt", ["4bit_nc", "tq4_nc", "int8"])
def test_softcapped_attention_matches_capped_dense_attention(fmt, window):
    """``attention(..., softcap=...)`` (Gemma 2's logit softcapping): one decode token, a
    pack_gqa head group under one mask row, a few tokens with a mask row each, and a prefill
    chunk over its exact keys, each equal to float64 attention with the same cap; the cap
    binds (the uncapped answer is far off)."""
    cache, keys, values = filled_tq_cache(fmt, window=window)
    softcap = 1.5
    q = _query() * 4
    out = attention(q, keys, values, enable_gqa=True, softcap=softcap)
    expected = dense_attention(q, keys, values, softcap=softcap)
    assert rel_error(out, expected) < 4e-3
    assert rel_error(dense_attention(q, keys, values), expected) > 0.1
    packed = _query(length=GROUP, heads=HK) * 4  # [B, Hk, group, D]: one mask row for all
    row = torch.rand(B, 1, 1, S_MAX, generator=torch.Generator().manual_seed(2)) > 0.3
    out = attention(packed, keys, values, attn_mask=row, softcap=softcap)
    assert rel_error(out, dense_attention(packed, keys, values, row, softcap=softcap)) < 4e-3
    tokens = _query(length=3) * 4
    causal = torch.ones(3, S_MAX, dtype=torch.bool).tril(S_MAX - 3)[None, None]
    out = attention(tokens, keys, values, attn_mask=causal, enable_gqa=True, softcap=softcap)
    expected = dense_attention(tokens, keys, values, causal, softcap=softcap)
    assert rel_error(out, expected) < 4e-3
    # a prefill chunk of 20 tokens (more than a multi-token decode takes) after 20 others
    cache, _, _ = filled_tq_cache(fmt, length=20, window=window)
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(B, HK, 20, D, generator=gen) * 2).to(torch.bfloat16)
    v = torch.randn(B, HK, 20, D, generator=gen).to(torch.bfloat16)
    keys, values = cache.update(torch.arange(20, 40), k, v)
    chunk = _query(length=20) * 4
    causal = torch.ones(20, S_MAX, dtype=torch.bool).tril(20)  # [T, S]: row t to 20 + t
    out = attention(
        chunk, keys, values, attn_mask=causal[None, None], enable_gqa=True, softcap=softcap
    )
    # float64 over the dequantized prefix and the chunk as it was given
    exact_k, exact_v = keys.dequantize(torch.float64), values.dequantize(torch.float64)
    exact_k[:, :, 20:40], exact_v[:, :, 20:40] = k.double(), v.double()
    exact_k, exact_v = exact_k.repeat_interleave(GROUP, 1), exact_v.repeat_interleave(GROUP, 1)
    scores = torch.tanh(chunk.double() @ exact_k.transpose(-1, -2) * D**-0.5 / softcap) * softcap
    expected = torch.softmax(scores.masked_fill(~causal, -math.inf), -1) @ exact_v
    assert rel_error(out, expected) < 4e-3


def test_softcap_refused_where_it_cannot_apply():
    """A softcap over centred keys (the kernels leave out the centre's score, which a cap does
    not ignore), and a negative or infinite one, are refused naming the argument."""
    _, keys, values = filled_tq_cache()
    q = _query()
    for softcap in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="softcap must be 0"):
            attention(q, keys, values, enable_gqa=True, softcap=softcap)
    cache = TurboQuantKVCache(B, HK, S_MAX, D, torch.bfloat16, window=WINDOW, center_keys=True)
    k = torch.randn(B, HK, 5, D).to(torch.bfloat16)
    keys, values = cache.update(torch.arange(5), k, k)
    with pytest.raises(ValueError, match="center_keys=False"):
        attention(q, keys, values, enable_gqa=True, softcap=2.0)


@pytest.mark.parametrize("fmt", ["4bit_nc", "k8v4"])
def test_attention_with_autograd_is_differentiable(fmt):
    """With grad enabled SDPA over the views works as over a dense cache: a decode query and a
    prefill chunk give the no_grad answer (to bf16 rounding), and the gradient reaching the
    query (and the chunk's keys and values, which the views carry) is dense autograd's over
    the same dequantized cache."""
    cache, keys, values = filled_tq_cache(fmt)
    q = _query().float().requires_grad_()
    out = F.scaled_dot_product_attention(q.to(torch.bfloat16), keys, values, enable_gqa=True)
    with torch.no_grad():
        plain = F.scaled_dot_product_attention(q.to(torch.bfloat16), keys, values, enable_gqa=True)
    assert out.requires_grad and rel_error(out, plain) < 4e-3
    out.float().square().sum().backward()
    q64 = q.detach().double().requires_grad_()
    dense_attention(q64, keys, values).square().sum().backward()
    assert rel_error(q.grad, q64.grad) < 2e-2  # bf16 query, output and backward
    gen = torch.Generator().manual_seed(4)
    k = (torch.randn(B, HK, 6, D, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    v = torch.randn(B, HK, 6, D, generator=gen).to(torch.bfloat16).requires_grad_()
    keys, values = cache.update(torch.arange(37, 43), k, v)
    chunk = _query(length=6)
    mask = torch.ones(6, S_MAX, dtype=torch.bool).tril(37)[None, None]  # row t to 37 + t
    out = F.scaled_dot_product_attention(chunk, keys, values, attn_mask=mask, enable_gqa=True)
    with torch.no_grad():
        plain = F.scaled_dot_product_attention(
            chunk, keys, values, attn_mask=mask, enable_gqa=True
        )
    assert rel_error(out, plain) < 4e-3
    out.float().sum().backward()
    assert k.grad is not None and v.grad is not None and bool(v.grad.any())
    # a decode token carries its keys and values too: StaticCache's index_copy_ passes the
    # gradient to them, and so do the views (dense float64 autograd over the same positions)
    token_k = (torch.randn(B, HK, 1, D, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    token_v = torch.randn(B, HK, 1, D, generator=gen).to(torch.bfloat16).requires_grad_()
    keys, values = cache.update(torch.arange(43, 44), token_k, token_v)
    q = _query()
    F.scaled_dot_product_attention(q, keys, values, enable_gqa=True).float().sum().backward()
    exact_k, exact_v = keys.dequantize(torch.float64), values.dequantize(torch.float64)
    k64 = token_k.detach().double().requires_grad_()
    v64 = token_v.detach().double().requires_grad_()
    exact_k = torch.cat([exact_k[:, :, :43], k64, exact_k[:, :, 44:]], dim=2)
    exact_v = torch.cat([exact_v[:, :, :43], v64, exact_v[:, :, 44:]], dim=2)
    visible = (torch.arange(S_MAX) < 44)[None, None, None, :]
    F.scaled_dot_product_attention(
        q.double(), exact_k, exact_v, attn_mask=visible, enable_gqa=True
    ).sum().backward()
    assert rel_error(token_k.grad, k64.grad) < 2e-2 and rel_error(token_v.grad, v64.grad) < 2e-2
