"""Formats and their byte layout."""

from __future__ import annotations

import expecttest
import pytest
import torch

from custom_ops import reference
from custom_ops.formats import FORMATS, SUPPORTED_HEAD_DIMS, Codec, Kind, get_format


def _bytes_table() -> str:
    header = "format   " + "".join(f"{d:>6}" for d in SUPPORTED_HEAD_DIMS)
    rows = [header]
    for name, fmt in FORMATS.items():
        sizes = "".join(f"{fmt.bytes_per_token_head(d):>6}" for d in SUPPORTED_HEAD_DIMS)
        rows.append(f"{name:<9}{sizes}")
    return "\n".join(rows)


class TestLayout(expecttest.TestCase):
    def test_bytes_per_token_head(self):
        """Bytes per token-head for every format x head dim (vLLM's 196/134/118/102 at D=128)."""
        self.assertExpectedInline(
            _bytes_table(),
            """\
format       64    80    96   128   256
k8v4        102   126   150   198   390
4bit_nc      70    86   102   134   262
k3v4_nc      62    76    90   118   230
3bit_nc      54    66    78   102   198
int8        136   168   200   264   520
fp8         136   168   200   264   520
tq4_nc       68    84   100   132   260
tq3_nc       52    64    76   100   196
tq2_nc       36    44    52    68   132
tqk4v2_nc    52    64    76   100   196
tqk5v3_nc    68    84   100   132   260
k2v2_nc      38    46    54    70   134
k2v4_nc      54    66    78   102   198""",
        )

    def test_meta_columns_and_planes(self):
        """The meta record's columns and the code planes (offset, width, bytes) at D=128."""
        lines = []
        for name, fmt in FORMATS.items():
            planes = "; ".join(
                f"{side}:" + ",".join(f"{p.offset}+{p.nbytes}@{p.width}b" for p in c.planes(128))
                for side, c in (("k", fmt.key), ("v", fmt.value))
            )
            lines.append(f"{name}: {list(fmt.meta_columns)} {fmt.meta_dtype} {planes}")
        self.assertExpectedInline(
            "\n".join(lines),
            """\
k8v4: ['k_scale', 'v_scale', 'v_zero'] torch.bfloat16 k:0+128@8b; v:0+64@4b
4bit_nc: ['k_norm', 'v_scale', 'v_zero'] torch.bfloat16 k:0+64@4b; v:0+64@4b
k3v4_nc: ['k_norm', 'v_scale', 'v_zero'] torch.bfloat16 k:0+32@2b,32+16@1b; v:0+64@4b
3bit_nc: ['k_norm', 'v_scale', 'v_zero'] torch.bfloat16 k:0+32@2b,32+16@1b; v:0+32@2b,32+16@1b
int8: ['k_scale', 'v_scale'] torch.float32 k:0+128@8b; v:0+128@8b
fp8: ['k_scale', 'v_scale'] torch.float32 k:0+128@8b; v:0+128@8b
tq4_nc: ['k_norm', 'v_norm'] torch.bfloat16 k:0+64@4b; v:0+64@4b
tq3_nc: ['k_norm', 'v_norm'] torch.bfloat16 k:0+32@2b,32+16@1b; v:0+32@2b,32+16@1b
tq2_nc: ['k_norm', 'v_norm'] torch.bfloat16 k:0+32@2b; v:0+32@2b
tqk4v2_nc: ['k_norm', 'v_norm'] torch.bfloat16 k:0+64@4b; v:0+32@2b
tqk5v3_nc: ['k_norm', 'v_norm'] torch.bfloat16 k:0+64@4b,64+16@1b; v:0+32@2b,32+16@1b
k2v2_nc: ['k_norm', 'v_scale', 'v_zero'] torch.bfloat16 k:0+32@2b; v:0+32@2b
k2v4_nc: ['k_norm', 'v_scale', 'v_zero'] torch.bfloat16 k:0+32@2b; v:0+64@4b""",
        )

    def test_plane_shapes(self):
        """Planes of a 3-page, 2-kv-head, 16-slot cache at D=128: value codes token-minor."""
        shapes = get_format("k3v4_nc").plane_shapes(3, 2, 16, 128)
        self.assertExpectedInline(
            "\n".join(f"{name}: {shape} {dtype}" for name, (shape, dtype) in shapes.items()),
            """\
k_codes: (3, 2, 16, 48) torch.uint8
v_codes: (3, 2, 64, 16) torch.uint8
meta: (3, 2, 16, 3) torch.bfloat16""",
        )

    def test_unknown_format_error(self):
        with self.assertRaises(ValueError) as ctx:
            get_format("5bit")
        self.assertExpectedInline(
            str(ctx.exception),
            """unknown KV format '5bit': expected one of ['3bit_nc', '4bit_nc', 'fp8', 'int8', 'k2v2_nc', 'k2v4_nc', 'k3v4_nc', 'k8v4', 'tq2_nc', 'tq3_nc', 'tq4_nc', 'tqk4v2_nc', 'tqk5v3_nc']""",  # noqa: E501
        )


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_strided_planes(bits, head_dim, seeded):
    """Element e of a w-bit plane of n bytes sits in byte e % n at bit w * (e // n); 3-bit codes
    are a 2-bit plane of the low bits then a 1-bit plane of the top bit."""
    codec = Codec(Kind.UNIFORM, bits)
    codes = torch.randint(0, 1 << bits, (5, head_dim), generator=seeded, dtype=torch.int32)
    packed = reference.pack_codes(codec, codes)
    assert packed.shape == (5, head_dim * bits // 8)
    for plane in codec.planes(head_dim):
        for e in range(head_dim):
            byte = packed[:, plane.offset + e % plane.nbytes].to(torch.int32)
            field = (byte >> (plane.width * (e // plane.nbytes))) & ((1 << plane.width) - 1)
            assert torch.equal(field, (codes[:, e] >> plane.shift) & ((1 << plane.width) - 1))
    assert torch.equal(reference.unpack_codes(codec, packed), codes)


def test_codec_rejects_unsupported_bits():
    with pytest.raises(ValueError, match="UNIFORM codes take bits in"):
        Codec(Kind.UNIFORM, 5)


def test_value_rows_are_a_token_major_view():
    """``value_rows`` views the token-minor ``v_codes`` as rows ``[page, head, slot]``: byte
    ``j`` of slot ``s``'s row is ``v_codes[page, head, j, s]`` and writes go through."""
    cache = get_format("k8v4").allocate(3, 2, 16, 128)
    rows = cache.value_rows
    assert cache.v_codes.is_contiguous() and rows.shape == (3, 2, 16, 64)
    row = torch.arange(1, 65, dtype=torch.uint8)
    rows[1, 0, 5] = row
    assert torch.equal(cache.v_codes[1, 0, :, 5], row)
    assert int(cache.v_codes.sum()) == int(row.sum())  # nothing else was written
