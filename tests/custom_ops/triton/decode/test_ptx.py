"""The decode kernel's inline PTX, run bit-exactly on an emulator (it cannot run on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from ptx_emulator import run

from custom_ops.codebook import int8_key_grid, signed_levels
from custom_ops.formats import Codec, Kind
from custom_ops.triton.decode.codes import subnormal_part_scale
from custom_ops.triton.decode.ptx import (
    INT8_ASM,
    UINT3_ASM,
    UINT3_SUBNORMAL_ASM,
    UINT4_ASM,
    UINT4_SUBNORMAL_ASM,
    decode_asm,
    lut3_asm,
    lut3_int8_asm,
    lut3_integer_values_asm,
    lut4_asm,
    lut4_int8_asm,
    lut5_asm,
    lut5_int8_asm,
    words_asm,
)


def _fp16_pair(word: int) -> list[float]:
    return torch.tensor([word], dtype=torch.int64).to(torch.int32).view(torch.float16).tolist()


def _outputs(asm: str, inputs: dict[int, int], parts: int) -> list[list[float]]:
    """Run an asm: the 4 fp16 values (bytes j..j+3) of each of its ``parts`` outputs."""
    regs = run(asm, inputs)
    return [_fp16_pair(regs[2 * p]) + _fp16_pair(regs[2 * p + 1]) for p in range(parts)]


def _random_words(gen, extra=()):
    words = torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64).tolist()
    return words + list(extra)


def _bytes(word: int) -> list[int]:
    return [(word >> (8 * i)) & 0xFF for i in range(4)]


@pytest.mark.parametrize("side", ["k", "v"])
def test_words_asm(side, seeded):
    """The verify kernel's strings: a word's 4 bytes' low nibbles, then their high nibbles, one
    fp16 value per 16-bit output, as the 4-bit strings decode them."""
    levels = signed_levels(4, 128)
    asm = words_asm(lut4_asm(levels) if side == "k" else UINT4_ASM)
    value = (lambda c: levels[c].item()) if side == "k" else float
    for word in _random_words(seeded, [0x76543210, 0xFEDCBA98, 0xFFFFFFFF]):
        regs = run(asm, {8: word})
        halves = torch.tensor([regs[i] for i in range(8)], dtype=torch.int32).to(torch.int16)
        expected = [value(b & 15) for b in _bytes(word)] + [value(b >> 4) for b in _bytes(word)]
        assert halves.view(torch.float16).tolist() == expected


def test_words_asm_needs_a_four_bit_string():
    with pytest.raises(ValueError, match="4-bit string"):
        words_asm(INT8_ASM)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lut4_asm(head_dim, seeded):
    """Each byte's low / high nibble (sign-magnitude) becomes its fp16 Lloyd-Max level."""
    levels = signed_levels(4, head_dim)
    asm = lut4_asm(levels)
    for word in _random_words(seeded, [0x76543210, 0xFEDCBA98, 0x01234567, 0x89ABCDEF]):
        low, high = _outputs(asm, {4: word}, 2)
        assert low == [levels[b & 15].item() for b in _bytes(word)]
        assert high == [levels[b >> 4].item() for b in _bytes(word)]


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_lut4_int8_asm(head_dim, seeded):
    """Each nibble (sign-magnitude) becomes the int8 whose half-integer, times the grid's unit,
    is its Lloyd-Max level; the outputs interleave each byte's low and high nibbles."""
    grid, unit = int8_key_grid(4, head_dim)
    levels = signed_levels(4, head_dim)
    asm = lut4_int8_asm(grid)
    for word in _random_words(seeded, [0x76543210, 0xFEDCBA98, 0x01234567, 0x89ABCDEF]):
        regs = run(asm, {2: word})
        nibbles = [n for b in _bytes(word) for n in (b & 15, b >> 4)]
        out = _bytes(regs[0]) + _bytes(regs[1])
        decoded = torch.tensor(out, dtype=torch.uint8).view(torch.int8).double()
        assert ((decoded + 0.5) * unit).tolist() == [levels[n].item() for n in nibbles]


def test_uint4_asm(seeded):
    """Each nibble becomes the fp16 of its integer value."""
    for word in _random_words(seeded, [0xFFFFFFFF, 0x0F0F0F0F]):
        low, high = _outputs(UINT4_ASM, {4: word}, 2)
        assert low == [float(b & 15) for b in _bytes(word)]
        assert high == [float(b >> 4) for b in _bytes(word)]


def test_uint4_subnormal_asm(seeded):
    """Each low nibble becomes the fp16 subnormal ``c * 2**-24``, each high nibble ``c *
    2**-20``: exact, and in the units the split kernel scales its part accumulators back from
    (``subnormal_part_scale``)."""
    for word in _random_words(seeded, [0xFFFFFFFF, 0x0F0F0F0F, 0xF0F0F0F0, 0]):
        low, high = _outputs(UINT4_SUBNORMAL_ASM, {4: word}, 2)
        assert low == [math.ldexp(b & 15, -24) for b in _bytes(word)]
        assert high == [math.ldexp(b >> 4, -20) for b in _bytes(word)]
        assert [v * subnormal_part_scale(4, 0) for v in low] == [b & 15 for b in _bytes(word)]
        assert [v * subnormal_part_scale(4, 1) for v in high] == [b >> 4 for b in _bytes(word)]


def _codes5(plane_word: int, low_word: int, high_word: int, block: int, half: int) -> list[int]:
    """5-bit codes of block ``c``'s low (``half`` 0) or high (1) quarter, bytes in order: each
    plane byte's nibble is the magnitude, bit ``2c + 4 half`` of the sign halves' ``low | high
    >> 1`` the sign."""
    signs = [lo | hi >> 1 for lo, hi in zip(_bytes(low_word), _bytes(high_word), strict=True)]
    return [
        ((b >> (4 * half)) & 15) | (((s >> (2 * block + 4 * half)) & 1) << 4)
        for b, s in zip(_bytes(plane_word), signs, strict=True)
    ]


def _interleaved_codes5(plane_word: int, low_word: int, high_word: int, block: int) -> list[int]:
    """:func:`_codes5` of both quarters, each byte's low-quarter code then its high-quarter one
    (the int8 strings' output order)."""
    low = _codes5(plane_word, low_word, high_word, block, 0)
    high = _codes5(plane_word, low_word, high_word, block, 1)
    return [c for pair in zip(low, high, strict=True) for c in pair]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block", [0, 1])
def test_lut5_asm(head_dim, block, seeded):
    """Each byte's low / high nibble is the magnitude of a 5-bit sign-magnitude code of the
    block's low / high quarter, whose sign is bit 2c / 2c + 4 of the sign halves' ``low |
    high >> 1`` (c the block, given as the constant 2c): it becomes its fp16 Lloyd-Max
    level."""
    levels = signed_levels(5, head_dim)
    asm = lut5_asm(levels)
    for plane_word, low_word, high_word in _sign_cases(seeded):
        inputs = {4: plane_word, 5: low_word, 6: high_word, 7: 2 * block * 0x01010101}
        low, high = _outputs(asm, inputs, 2)
        for half, values in ((0, low), (1, high)):
            codes = _codes5(plane_word, low_word, high_word, block, half)
            assert values == [levels[c].item() for c in codes]


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
@pytest.mark.parametrize("block", [0, 1])
def test_lut5_int8_asm(head_dim, block, seeded):
    """A block's 5-bit codes (as in test_lut5_asm, the block's string instead of the constant
    2c) become the int8 whose half-integer, times the grid's unit, is their Lloyd-Max level; the
    outputs interleave each byte's low-quarter and high-quarter codes."""
    grid, unit = int8_key_grid(5, head_dim)
    levels = signed_levels(5, head_dim)
    asm = lut5_int8_asm(grid, block)
    for plane_word, low_word, high_word in _sign_cases(seeded):
        regs = run(asm, {2: plane_word, 3: low_word, 4: high_word})
        codes = _interleaved_codes5(plane_word, low_word, high_word, block)
        out = _bytes(regs[0]) + _bytes(regs[1])
        decoded = torch.tensor(out, dtype=torch.uint8).view(torch.int8).double()
        assert ((decoded + 0.5) * unit).tolist() == [levels[c].item() for c in codes]


@pytest.mark.parametrize("lane", range(32))
def test_int8_asm_lane_signs(lane, seeded):
    """At D 128 the 3- and 5-bit int8 strings read one tile of the sign plane and take the
    lane's half of the row from its lane id (lanes 2 and 3 of each quad: bytes ``j >= D/8``):
    the same int8 as from the sign halves that half's bytes would load (the tile as ``low``,
    or as ``high``), whatever the unread third operand holds."""
    half = lane >> 1 & 1
    lut3 = lut3_int8_asm(int8_key_grid(3, 128)[0], lane_signs=True)
    halves3 = lut3_int8_asm(int8_key_grid(3, 128)[0])
    lut5 = [lut5_int8_asm(int8_key_grid(5, 128)[0], block, lane_signs=True) for block in (0, 1)]
    halves5 = [lut5_int8_asm(int8_key_grid(5, 128)[0], block) for block in (0, 1)]
    for plane_word, sign_word, other in _sign_cases(seeded):
        low, high = (0, sign_word) if half else (sign_word, 0)
        got = run(lut3, {4: plane_word, 5: sign_word, 6: other}, lane)
        want = run(halves3, {4: plane_word, 5: low, 6: high}, lane)
        assert [got[i] for i in range(4)] == [want[i] for i in range(4)]
        for lanes, halves in zip(lut5, halves5, strict=True):
            got = run(lanes, {2: plane_word, 3: sign_word, 4: other}, lane)
            want = run(halves, {2: plane_word, 3: low, 4: high}, lane)
            assert [got[0], got[1]] == [want[0], want[1]]


def test_lut5_int8_asm_needs_magnitudes_below_128():
    """A flagged lookup must give 0: a magnitude of 128 (bit 7 set), a negative one or a grid
    of other than 16 is refused."""
    for grid in ([*range(15), 128], [-1, *range(15)], list(range(15))):
        with pytest.raises(ValueError, match="16 magnitudes in 0..127"):
            lut5_int8_asm(grid, 0)


@pytest.mark.parametrize("block", [0, 1])
def test_lut5_int8_asm_top_magnitudes(block, seeded):
    """Magnitudes up to 127, above the real grids' (113-119 at D 64-256): each code still gets
    ``r`` or ``~r`` of its magnitude."""
    grid = list(range(112, 128))
    asm = lut5_int8_asm(grid, block)
    for plane_word, low_word, high_word in _sign_cases(seeded):
        regs = run(asm, {2: plane_word, 3: low_word, 4: high_word})
        codes = _interleaved_codes5(plane_word, low_word, high_word, block)
        expected = [grid[c & 15] ^ (0xFF if c & 16 else 0) for c in codes]
        assert _bytes(regs[0]) + _bytes(regs[1]) == expected


def _codes3(plane_word: int, low_word: int, high_word: int, quarter: int) -> list[int]:
    """3-bit codes of quarter ``q``: bits 2q of the 2-bit plane bytes, bit 2q of the sign
    halves' bytes ``low | high >> 1``."""
    return [
        ((b >> (2 * quarter)) & 3) | ((((lo | hi >> 1) >> (2 * quarter)) & 1) << 2)
        for b, lo, hi in zip(_bytes(plane_word), _bytes(low_word), _bytes(high_word), strict=True)
    ]


def _sign_cases(gen):
    """(plane word, low sign half, high sign half) triples: as the kernel loads them (one half
    zero, or each byte's half zero in the other) and arbitrary."""
    planes = _random_words(gen, [0, 0xFFFFFFFF, 0x12345678, 0x87654321])
    signs = _random_words(gen, [0xFFFFFFFF, 0, 0xFFFF0000, 0x0000FFFF])
    for i, (plane_word, sign_word) in enumerate(zip(planes, signs, strict=True)):
        byte_mask = (0x0000FFFF, 0xFFFF0000, 0x00FF00FF)[i % 3]
        yield plane_word, sign_word, 0
        yield plane_word, 0, sign_word
        yield plane_word, sign_word & byte_mask, sign_word & ~byte_mask & 0xFFFFFFFF
        yield plane_word, sign_word, planes[-1 - i]


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_lut3_int8_asm(head_dim, seeded):
    """Each quarter's 3-bit code (as in test_lut3_asm) becomes the int8 whose half-integer,
    times the grid's unit, is its Lloyd-Max level; outputs 0 and 1 interleave quarters 0 and 2
    of each byte, outputs 2 and 3 quarters 1 and 3."""
    grid, unit = int8_key_grid(3, head_dim)
    levels = signed_levels(3, head_dim)
    asm = lut3_int8_asm(grid)
    for plane_word, low_word, high_word in _sign_cases(seeded):
        regs = run(asm, {4: plane_word, 5: low_word, 6: high_word})
        quarters = [_codes3(plane_word, low_word, high_word, q) for q in range(4)]
        for first, (a, b) in ((0, (0, 2)), (2, (1, 3))):
            codes = [c for pair in zip(quarters[a], quarters[b], strict=True) for c in pair]
            out = _bytes(regs[first]) + _bytes(regs[first + 1])
            decoded = torch.tensor(out, dtype=torch.uint8).view(torch.int8).double()
            assert ((decoded + 0.5) * unit).tolist() == [levels[c].item() for c in codes]


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_lut3_integer_values_asm(head_dim, seeded):
    """Every quarter's 3-bit code (as in test_lut3_asm, bytes in order) becomes the fp16 ``k /
    scale`` whose ``(k + 1/2) * unit`` is its Lloyd-Max level: exact, at each head dim's unit
    and scale."""
    grid, unit = int8_key_grid(3, head_dim)
    levels = signed_levels(3, head_dim)
    scale = 2.0 ** -math.floor(math.log2(unit))
    asm = lut3_integer_values_asm(grid, scale)
    for plane_word, low_word, high_word in _sign_cases(seeded):
        outputs = _outputs(asm, {8: plane_word, 9: low_word, 10: high_word}, 4)
        for quarter, values in enumerate(outputs):
            codes = _codes3(plane_word, low_word, high_word, quarter)
            integers = [v * scale for v in values]
            assert all(k == round(k) for k in integers), integers
            assert [(k + 0.5) * unit for k in integers] == [levels[c].item() for c in codes]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_lut3_asm(head_dim, seeded):
    """Every quarter's 3-bit sign-magnitude code becomes its fp16 Lloyd-Max level, its sign from
    the sign halves."""
    levels = signed_levels(3, head_dim)
    asm = lut3_asm(levels)
    for plane_word, low_word, high_word in _sign_cases(seeded):
        outputs = _outputs(asm, {8: plane_word, 9: low_word, 10: high_word}, 4)
        for quarter, values in enumerate(outputs):
            codes = _codes3(plane_word, low_word, high_word, quarter)
            assert values == [levels[c].item() for c in codes]


def test_uint3_asm(seeded):
    """Every quarter's 3-bit uniform code becomes the fp16 of its integer value."""
    for plane_word, low_word, high_word in _sign_cases(seeded):
        outputs = _outputs(UINT3_ASM, {8: plane_word, 9: low_word, 10: high_word}, 4)
        for quarter, values in enumerate(outputs):
            codes = _codes3(plane_word, low_word, high_word, quarter)
            assert values == [float(c) for c in codes]


def test_uint3_subnormal_asm(seeded):
    """Every quarter ``q``'s 3-bit uniform code becomes the fp16 subnormal ``c * 2**(2q -
    24)``, exactly."""
    for plane_word, low_word, high_word in _sign_cases(seeded):
        outputs = _outputs(UINT3_SUBNORMAL_ASM, {8: plane_word, 9: low_word, 10: high_word}, 4)
        for quarter, values in enumerate(outputs):
            codes = _codes3(plane_word, low_word, high_word, quarter)
            assert values == [math.ldexp(c, 2 * quarter - 24) for c in codes]
            assert [v * subnormal_part_scale(3, quarter) for v in values] == codes


@pytest.mark.parametrize("kind", [Kind.LLOYD_MAX, Kind.UNIFORM])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lut2_asm(kind, head_dim, seeded):
    """Every quarter's 2-bit code (bits 2q of each byte) becomes its fp16 value: the signed
    Lloyd-Max level of a sign-magnitude code, or the integer of a uniform code."""
    table = signed_levels(2, head_dim) if kind == Kind.LLOYD_MAX else torch.arange(4.0)
    asm = decode_asm(Codec(kind, 2), head_dim)
    for word in _random_words(seeded, [0, 0xFFFFFFFF, 0xE4E4E4E4, 0x1B1B1B1B]):
        outputs = _outputs(asm, {8: word}, 4)
        for quarter, values in enumerate(outputs):
            codes = [(b >> (2 * quarter)) & 3 for b in _bytes(word)]
            assert values == [table[c].item() for c in codes]


def test_int8_asm(seeded):
    """Each byte becomes the fp16 of its int8 value."""
    for word in _random_words(seeded, [0x7F80FF00, 0x01FE817F]):
        (values,) = _outputs(INT8_ASM, {2: word}, 1)
        assert values == [float(b - 256 if b > 127 else b) for b in _bytes(word)]


def _strings() -> dict[str, str]:
    """Every inline-PTX string the decode kernels compile, by a name for the test ids."""
    strings = {
        "int8": INT8_ASM,
        "uint3": UINT3_ASM,
        "uint3_subnormal": UINT3_SUBNORMAL_ASM,
        "uint4": UINT4_ASM,
        "uint4_subnormal": UINT4_SUBNORMAL_ASM,
        "lut3": lut3_asm(signed_levels(3, 128)),
        "lut4": lut4_asm(signed_levels(4, 128)),
        "lut5": lut5_asm(signed_levels(5, 128)),
        "lut3_int8": lut3_int8_asm(int8_key_grid(3, 128)[0]),
        "lut4_int8": lut4_int8_asm(int8_key_grid(4, 128)[0]),
        "lut3_integer_values": lut3_integer_values_asm(int8_key_grid(3, 128)[0], 0.25),
    }
    strings["lut3_int8_lanes"] = lut3_int8_asm(int8_key_grid(3, 128)[0], lane_signs=True)
    for block in (0, 1):
        strings[f"lut5_int8_{block}"] = lut5_int8_asm(int8_key_grid(5, 128)[0], block)
        strings[f"lut5_int8_{block}_lanes"] = lut5_int8_asm(
            int8_key_grid(5, 128)[0], block, lane_signs=True
        )
    strings["words_lut4"] = words_asm(strings["lut4"])
    return strings


@pytest.mark.parametrize(("name", "asm"), list(_strings().items()))
def test_registers_declared_once(name, asm):
    """Each string declares every register it writes, once: the emulator skips ``.reg`` lines,
    so a missing or repeated declaration would only show in ptxas, on a GPU."""
    declared = []
    written = set()
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line.startswith(".reg"):
            names = line.split(None, 2)[2]
            declared += [n.strip() for n in names.split(",")]
        elif line and line[0] not in "{}" and not line.startswith("@"):
            op, _, args = line.partition(" ")
            dst = args.split(",")[0].strip().lstrip("{")
            if not dst.startswith("$"):
                written.add(dst)
    assert len(declared) == len(set(declared)), f"{name}: declared twice"
    assert written <= set(declared), f"{name}: {sorted(written - set(declared))} undeclared"
