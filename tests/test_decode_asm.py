"""The decode kernel's inline PTX, run bit-exactly on an emulator (it cannot run on the CPU)."""

from __future__ import annotations

import pytest
import torch
from ptx_emulator import run

from custom_ops.codebook import signed_levels
from custom_ops.triton.decode import UINT4_ASM, lut4_asm


def _fp16_pair(word: int) -> list[float]:
    return torch.tensor([word], dtype=torch.int64).to(torch.int32).view(torch.float16).tolist()


def _decode(asm: str, word: int) -> tuple[list[float], list[float]]:
    """Run an asm on the 4 bytes of ``word``: (low-nibble values, high-nibble values)."""
    regs = run(asm, {4: word})
    return _fp16_pair(regs[0]) + _fp16_pair(regs[1]), _fp16_pair(regs[2]) + _fp16_pair(regs[3])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lut4_asm_decodes_every_code(head_dim, seeded):
    """Each byte's low / high nibble (sign-magnitude) becomes its fp16 Lloyd-Max level, for
    every nibble value in every byte position."""
    levels = signed_levels(4, head_dim)
    asm = lut4_asm(levels)
    words = torch.randint(0, 2**32, (64,), generator=seeded, dtype=torch.int64).tolist()
    words += [0x76543210, 0xFEDCBA98, 0x01234567, 0x89ABCDEF]
    for word in words:
        raw = [(word >> (8 * i)) & 0xFF for i in range(4)]
        low, high = _decode(asm, word)
        assert low == [levels[b & 15].item() for b in raw]
        assert high == [levels[b >> 4].item() for b in raw]


def test_uint4_asm_decodes_every_code(seeded):
    """Each nibble becomes the fp16 of its integer value."""
    words = torch.randint(0, 2**32, (64,), generator=seeded, dtype=torch.int64).tolist()
    for word in words + [0xFFFFFFFF, 0x0F0F0F0F]:
        raw = [(word >> (8 * i)) & 0xFF for i in range(4)]
        low, high = _decode(UINT4_ASM, word)
        assert low == [float(b & 15) for b in raw]
        assert high == [float(b >> 4) for b in raw]
