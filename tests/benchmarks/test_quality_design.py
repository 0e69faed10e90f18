"""``benchmarks/quality_design.py`` computes, in one parallel pass, the attention that decoding
through a TurboQuant cache reads: here against a ``TurboQuantKVCache`` fed one token at a time
(reference path on the CPU), the recent window's boundary crossed, GQA 3 as in SmolLM2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_error

from custom_ops import api
from custom_ops.formats import Codec, get_format
from tq_compile import TurboQuantKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quality_design  # noqa: E402
from quality_design import Setting, format_of, quantized_attention  # noqa: E402

BATCH, KV_HEADS, GROUP, HEAD_DIM, TOKENS, WINDOW = 1, 2, 3, 64, 40, 8


@pytest.mark.parametrize(
    "fmt_name, sinks, center",
    [
        ("4bit_nc", 0, False),
        ("tq3_nc", 0, False),
        ("k2v2_nc", 0, False),
        ("4bit_nc", 4, False),
        ("k2v2_nc", 4, False),
        ("tq2_nc", 4, True),
        ("tqk4v2_nc", 0, True),
    ],
)
def test_parallel_attention_equals_decoding_through_the_cache(fmt_name, sinks, center):
    """Query t's output equals one-token decoding at position t (cache written up to t) to the
    rounding of the decode path's bf16 output (2^-9 relative: measured 2.1e-3; a window one
    token off measures 2e-2 or more), far below what quantization changes (the same attention
    with nothing quantized); with the cache's attention sinks and key centering as the design
    measure's."""
    gen = torch.Generator().manual_seed(7)
    shape = (BATCH, KV_HEADS, TOKENS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).bfloat16()
    v = torch.randn(shape, generator=gen).bfloat16()
    q = torch.randn(BATCH, KV_HEADS * GROUP, TOKENS, HEAD_DIM, generator=gen).bfloat16()
    cache = TurboQuantKVCache(
        BATCH,
        KV_HEADS,
        TOKENS,
        HEAD_DIM,
        preset=fmt_name,
        window=WINDOW,
        sinks=sinks,
        center_keys=center,
    )
    k = k + 2 * torch.randn(KV_HEADS, HEAD_DIM, generator=gen)[None, :, None].bfloat16()
    decoded = torch.full((BATCH, TOKENS, KV_HEADS * GROUP, HEAD_DIM), float("nan"))
    for t in range(TOKENS):
        keys, values = cache.update(torch.tensor([t]), k[:, :, t : t + 1], v[:, :, t : t + 1])
        out = F.scaled_dot_product_attention(
            q[:, :, t : t + 1], keys[:, :, : t + 1], values[:, :, : t + 1], enable_gqa=True
        )
        decoded[:, t] = out[:, :, 0].float()
    rotation = api.make_constants(fmt_name, HEAD_DIM).rotation
    setting = Setting(fmt_name, WINDOW, sinks, center)
    parallel, _ = quantized_attention(setting, rotation)(None, q, k, v, None)
    uncompressed, _ = quantized_attention(Setting(None), rotation)(None, q, k, v, None)
    error = rel_error(parallel.float(), decoded)
    assert error < 4e-3, error
    # past the window the quantized tokens make a difference well above that
    assert rel_error(uncompressed[:, WINDOW:].float(), decoded[:, WINDOW:]) > 5 * error
    # within the window nothing is quantized yet
    assert rel_error(uncompressed[:, :WINDOW].float(), decoded[:, :WINDOW]) < 4e-3


def test_codec_pairs_name_formats():
    """``<keys>+<values>`` pairs two codecs in a format of their bytes (4-bit Lloyd-Max keys
    and 2-bit values at D=128: 64 + 32 code bytes and the bf16 meta record's 4), names of
    ``FORMATS`` stay those formats, and anything else names what is allowed."""
    fmt = format_of("lm4+lm2")
    assert (fmt.key.bits, fmt.key.rotated, fmt.value.bits, fmt.value.rotated) == (4, True, 2, True)
    assert fmt.bytes_per_token_head(128) == 100
    assert format_of("tq3_nc") is get_format("tq3_nc")
    with pytest.raises(ValueError, match=r"'lm9\+u2'.*lm1"):
        format_of("lm9+u2")


def test_wide_lloyd_max_sides():
    """A side wider than the cache stores (``lm6`` .. ``lm8``) counts its bytes (6-bit keys
    and 2-bit values at D=128: 96 + 32 code bytes, two bf16 norms) and reads back closer to
    the input than the 5-bit codec, in whose convention it is computed (a 5-bit side through
    the same function equals the storable codec's round trip)."""
    fmt = format_of("lm6+lm2")
    assert fmt.bytes_per_token_head(128) == 132
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 64, 128, generator=gen).bfloat16().float()
    rotation = api.make_constants("4bit_nc", 128).rotation
    five = format_of("lm5+lm3").key
    assert isinstance(five, Codec) and five.bits == 5
    torch.testing.assert_close(
        quality_design.round_trip(quality_design.WideLloydMax(5), x, rotation, torch.bfloat16),
        quality_design.round_trip(five, x, rotation, torch.bfloat16),
        rtol=1e-5,
        atol=1e-5,
    )
    errors = [
        rel_error(x, quality_design.round_trip(side, x, rotation, torch.bfloat16))
        for side in (five, fmt.key)
    ]
    assert errors[1] < 0.6 * errors[0], errors


def test_exact_side_measures_the_other_alone():
    """``bf16`` keeps a side as the model computed it (2 bytes per element, no meta record):
    ``lm2+bf16`` at D=128 is 32 code bytes and one bf16 norm beside 256 value bytes, its values
    read back unchanged and its keys as the 2-bit codec's round trip; the attention of a pair
    with one exact side differs from the uncompressed one by less than the full pair's."""
    fmt = format_of("lm2+bf16")
    assert fmt.bytes_per_token_head(128) == 32 + 256 + 2
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 64, 128, generator=gen).bfloat16().float()
    rotation = api.make_constants("4bit_nc", 128).rotation
    assert quality_design.round_trip(fmt.value, x, rotation, torch.bfloat16) is x
    torch.testing.assert_close(
        quality_design.round_trip(fmt.key, x, rotation, torch.bfloat16),
        quality_design.round_trip(format_of("lm2+lm2").key, x, rotation, torch.bfloat16),
    )
    shape = (BATCH, KV_HEADS, TOKENS, HEAD_DIM)
    k, v = (torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(BATCH, KV_HEADS * GROUP, TOKENS, HEAD_DIM, generator=gen).bfloat16()
    rotation = api.make_constants("4bit_nc", HEAD_DIM).rotation

    def attention(name):
        setting = Setting(name, WINDOW) if name else Setting(None)
        return quantized_attention(setting, rotation)(None, q, k, v, None)[0].float()

    exact = attention(None)
    both, keys_only, values_only = (
        rel_error(attention(n), exact) for n in ("lm2+lm2", "lm2+bf16", "bf16+lm2")
    )
    assert 0 < keys_only < both and 0 < values_only < both, (keys_only, values_only, both)
