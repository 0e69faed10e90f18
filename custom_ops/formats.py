"""Every KV-cache format and its byte layout: the one module that knows where each byte lives.

A paged cache is three tensors (planes), all indexed ``[page, kv_head, ...]``:

* ``k_codes [num_pages, Hk, page_size, key_code_bytes] uint8``: the key codes of one token-head
  in one row.
* ``v_codes [num_pages, Hk, value_code_bytes, page_size] uint8``: the value codes, token-minor:
  byte ``j`` of the value-code row of the token in slot ``s`` is ``v_codes[page, head, j, s]``
  (:attr:`PagedKVCache.value_rows` is the token-major ``[..., page_size, value_code_bytes]``
  view of those rows).
* ``meta [num_pages, Hk, page_size, num_meta] bfloat16 | float32``: the per-token-head scalars
  (key norm or scale, value scale / zero / norm) in one record, keys' fields first. bfloat16
  has float32's exponent range, so every finite bf16 / fp16 input has a finite, non-zero
  record (fp16 overflowed at 65504 and flushed scales below 6e-8 to zero).

Head-major inside a page keeps one kv-head's ``page_size`` rows contiguous, which is what the
decode kernel (one program per (sequence, kv-head, split)) streams. Value codes are token-minor
because the decode kernel feeds them to the tensor cores as the A operand of ``V^T @ P^T``,
which wants the same byte of 4 consecutive tokens in one 32-bit register: with the token as the
fastest dimension, that is one aligned 32-bit load.

Codes of ``b`` bits are split into *bit planes* stored one after the other in the row: 8 and 4
bits are one plane, 3 bits are a 2-bit plane (the low bits) followed by a 1-bit plane (the top
bit, which is the sign of a sign-magnitude code), 5 bits likewise a 4-bit plane and a 1-bit
plane, 2 and 1 bits one plane (a 2-bit Lloyd-Max code is the sign in bit 1 and the magnitude in
bit 0). Inside a plane of
``w`` bits (``n = D * w / 8`` bytes) the elements are **strided**: element ``e`` sits in byte
``e % n`` at bit ``w * (e // n)``. So byte ``j`` of a 4-bit plane holds element ``j`` in its low
nibble and element ``j + D/2`` in its high nibble: one shift (or mask) of a whole row of bytes
yields a contiguous half of the head dim, which the decode kernel multiplies with the matching
half of the query without any shuffle.

Lloyd-Max codes are sign-magnitude (see :mod:`custom_ops.codebook`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "FP8_MAX",
    "INT8_MAX",
    "Kind",
    "Codec",
    "BitPlane",
    "KVFormat",
    "PagedKVCache",
    "RecentWindow",
    "FORMATS",
    "get_format",
    "check_head_dim",
    "sequence_capacity",
    "ring_window",
    "window_size",
]

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)

# Numbers every encoder (the reference and the kernels) must agree on.
FP8_MAX = 448.0  # largest finite e4m3 value: fp8 absmax scale = absmax / FP8_MAX
INT8_MAX = 127.0  # int8 absmax scale = absmax / INT8_MAX


class Kind(enum.IntEnum):
    """How a codec turns a vector into codes (the integer is what kernels see as constexpr)."""

    LLOYD_MAX = 0  # rotate, store Lloyd-Max sign-magnitude codes + one (norm-corrected) norm
    UNIFORM = 1  # asymmetric uniform codes + a scale and zero (min)
    FP8_ABSMAX = 3  # e4m3 of x / scale with scale = absmax / 448, per token-head
    INT8_ABSMAX = 4  # int8 of x / scale with scale = absmax / 127, per token-head


_META_FIELDS = {
    Kind.LLOYD_MAX: ("norm",),
    Kind.UNIFORM: ("scale", "zero"),
    Kind.FP8_ABSMAX: ("scale",),
    Kind.INT8_ABSMAX: ("scale",),
}

# 5-bit codes are Lloyd-Max only: keys, which decide the attention weights
# (docs/design/formats.md#wider-keys-at-the-4-bit-budget).
_BITS = {Kind.FP8_ABSMAX: (8,), Kind.INT8_ABSMAX: (8,), Kind.LLOYD_MAX: (1, 2, 3, 4, 5)}


@dataclass(frozen=True)
class BitPlane:
    """One bit plane of a code row.

    Attributes:
        width: bits per element in this plane (1, 2, 4 or 8).
        shift: the plane holds bits ``[shift, shift + width)`` of each code.
        offset: byte offset of the plane inside the code row.
        nbytes: ``D * width // 8``; element ``e`` is in byte ``offset + e % nbytes`` at bit
            ``width * (e // nbytes)``.
    """

    width: int
    shift: int
    offset: int
    nbytes: int

    @property
    def groups(self) -> int:
        """How many elements share one byte (``8 // width``)."""
        return 8 // self.width


@dataclass(frozen=True)
class Codec:
    """How one side (keys or values) of a token-head is encoded.

    Attributes:
        kind: the :class:`Kind` of quantizer.
        bits: code width per element.
        norm_correction: Lloyd-Max only: the stored norm is ``||x|| / ||c[codes]||`` so the
            reconstruction has the original norm (vLLM's "nc"), folded in at write time.
    """

    kind: Kind
    bits: int
    norm_correction: bool = False

    def __post_init__(self) -> None:
        allowed = _BITS.get(self.kind, (1, 2, 3, 4))
        if self.bits not in allowed:
            raise ValueError(f"{self.kind.name} codes take bits in {allowed}, got {self.bits}")
        if self.norm_correction and self.kind != Kind.LLOYD_MAX:
            raise ValueError("norm_correction applies to LLOYD_MAX codecs only")

    @property
    def rotated(self) -> bool:
        """Whether codes live in the rotated space (the reader must rotate q / un-rotate out)."""
        return self.kind == Kind.LLOYD_MAX

    @property
    def meta_fields(self) -> tuple[str, ...]:
        return _META_FIELDS[self.kind]

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8

    def planes(self, head_dim: int) -> tuple[BitPlane, ...]:
        """The bit planes of a code row, low bits first (3 bits: a 2-bit then a 1-bit plane; 5
        bits: a 4-bit then a 1-bit plane, the sign)."""
        widths = {3: (2, 1), 5: (4, 1)}.get(self.bits, (self.bits,))
        planes, offset, shift = [], 0, 0
        for width in widths:
            nbytes = head_dim * width // 8
            planes.append(BitPlane(width, shift, offset, nbytes))
            offset += nbytes
            shift += width
        return tuple(planes)


@dataclass(frozen=True)
class KVFormat:
    """A KV-cache format: a key codec, a value codec and the dtype of the meta record.

    Attributes:
        name: preset name (vLLM's where one exists).
        key: codec of the keys.
        value: codec of the values.
        meta_dtype: dtype of the per-token-head meta record.
    """

    name: str
    key: Codec
    value: Codec
    meta_dtype: torch.dtype

    @property
    def meta_columns(self) -> tuple[str, ...]:
        """Names of the meta record's columns: ``k_<field>`` then ``v_<field>``."""
        return tuple(f"k_{f}" for f in self.key.meta_fields) + tuple(
            f"v_{f}" for f in self.value.meta_fields
        )

    def meta_index(self, column: str) -> int:
        """Column index of ``column`` in the meta record, or -1 when the format has none."""
        return self.meta_columns.index(column) if column in self.meta_columns else -1

    @property
    def rotated(self) -> bool:
        return self.key.rotated or self.value.rotated

    def bytes_per_token_head(self, head_dim: int) -> int:
        meta_bytes = len(self.meta_columns) * self.meta_dtype.itemsize
        return self.key.code_bytes(head_dim) + self.value.code_bytes(head_dim) + meta_bytes

    def plane_shapes(
        self, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each plane of a paged cache (``v_codes`` token-minor)."""
        lead = (num_pages, num_kv_heads, page_size)
        value_bytes = self.value.code_bytes(head_dim)
        return {
            "k_codes": ((*lead, self.key.code_bytes(head_dim)), torch.uint8),
            "v_codes": ((num_pages, num_kv_heads, value_bytes, page_size), torch.uint8),
            "meta": ((*lead, len(self.meta_columns)), self.meta_dtype),
        }

    def allocate(
        self,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """Allocate a zero-filled paged cache of this format."""
        check_head_dim(head_dim)
        planes = {
            name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in self.plane_shapes(
                num_pages, num_kv_heads, page_size, head_dim
            ).items()
        }
        return PagedKVCache(**planes)


class PagedKVCache(NamedTuple):
    """The three planes of a paged cache (see the module docstring for the layout)."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    meta: torch.Tensor

    @property
    def value_rows(self) -> torch.Tensor:
        """The value-code rows, token-major like the other planes: a view of ``v_codes``.

        Returns:
            ``[num_pages, Hk, page_size, value_code_bytes] uint8``, row ``[page, head, slot]``
            the value codes of that token-head; writes go through to ``v_codes``. Its byte
            stride (``stride(3)``) is ``page_size``.
        """
        return self.v_codes.transpose(2, 3)


class RecentWindow(NamedTuple):
    """A cache's full-precision recent window: the rings that hold each sequence-head's latest
    positions and its first ``sinks`` (attention sinks), and the keys' centre that goes with them.

    Slots ``[0, W)`` of a ring hold a sequence-head's latest positions, position ``p`` at slot
    ``p % W``; slots ``[W, W + sinks)`` its first ``sinks`` positions, position ``p`` at slot
    ``W + p``, which never leave for a page (:func:`ring_window`; the ops' contract is in
    :mod:`custom_ops.ops`). The ops and launchers take the window as this one argument; only a
    ``torch.library`` schema lists its fields flat (:func:`custom_ops.schema.window_fields`,
    :func:`custom_ops.schema.window_of`), under the same names.

    ``key_center`` is here and not beside the planes: it exists only with rings (the ops reject
    it otherwise), has their batch and kv-heads, is set from the keys the ring holds before any
    is quantized and re-centres the ring's keys when it changes; so every op that takes the
    rings takes it too. ``tq.decode`` alone has no use for it (softmax ignores the shift that
    all of a query's scores share) and drops it when the window is flattened.

    Attributes:
        k_window: ``[>= B, Hk, W + sinks, D]`` bf16/fp16 (the model's dtype), contiguous: the
            keys of the positions each slot holds (minus ``key_center`` where there is one).
        v_window: the values, like ``k_window``.
        window_pos: ``[>= B, Hk, W + sinks] int32``, contiguous: the position each slot holds,
            -1 for none (a new cache fills it with -1).
        sinks: the rings' sink slots, ``>= 0``.
        key_center: optional ``[>= B, Hk, D] float32`` (the rings' batch; zeros in a new
            cache): the vector each sequence-head's keys are stored minus; None: keys stored as
            they are.
    """

    k_window: torch.Tensor
    v_window: torch.Tensor
    window_pos: torch.Tensor
    sinks: int = 0
    key_center: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """W, the rings' window slots (the sinks' slots aside)."""
        return ring_window(self.k_window, self.sinks)


def window_size(window: RecentWindow | None) -> int:
    """W of an optional window: :attr:`RecentWindow.size`, 0 without one."""
    return 0 if window is None else window.size


def sequence_capacity(max_pages: int, page_size: int, window: int = 0) -> int:
    """Positions one sequence of a paged cache can hold: its block table's pages, plus the
    ``window`` most recent positions, which live in a full-precision ring and need no page."""
    return max_pages * page_size + window


def ring_window(k_window: torch.Tensor | None, sinks: int = 0) -> int:
    """W, the recent-window slots of rings ``[B, Hk, W + sinks, D]`` (0 without rings).

    Slots ``[0, W)`` hold a sequence's latest positions, position ``p`` at slot ``p % W``;
    slots ``[W, W + sinks)`` hold its first ``sinks`` positions (attention sinks), position
    ``p`` at slot ``W + p``, which never leave for a page."""
    return 0 if k_window is None else k_window.shape[2] - sinks


def check_head_dim(head_dim: int) -> None:
    """Raise ``ValueError`` unless ``head_dim`` is one of :data:`SUPPORTED_HEAD_DIMS`."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"unsupported head dim {head_dim}: expected one of {SUPPORTED_HEAD_DIMS}")


_BF16 = torch.bfloat16
_LM = Kind.LLOYD_MAX

FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        # vLLM's presets, same names and semantics; k8v4's fp8 keys carry a per-token-head
        # scale (vLLM casts them plainly, which saturates at +-448 and flushes |k| < 2^-9).
        KVFormat("k8v4", Codec(Kind.FP8_ABSMAX, 8), Codec(Kind.UNIFORM, 4), _BF16),
        KVFormat("4bit_nc", Codec(_LM, 4, True), Codec(Kind.UNIFORM, 4), _BF16),
        KVFormat("k3v4_nc", Codec(_LM, 3, True), Codec(Kind.UNIFORM, 4), _BF16),
        KVFormat("3bit_nc", Codec(_LM, 3, True), Codec(Kind.UNIFORM, 3), _BF16),
        # Per-token-head absmax formats (vLLM's per_token_head INT8 / FP8), float32 scales.
        KVFormat("int8", Codec(Kind.INT8_ABSMAX, 8), Codec(Kind.INT8_ABSMAX, 8), torch.float32),
        KVFormat("fp8", Codec(Kind.FP8_ABSMAX, 8), Codec(Kind.FP8_ABSMAX, 8), torch.float32),
        # turboquant-vllm's TQ4: Lloyd-Max keys and rotated Lloyd-Max values, 4 bits each.
        KVFormat("tq4_nc", Codec(_LM, 4, True), Codec(_LM, 4, True), _BF16),
        # The same at 3 and 2 bits: rotated Lloyd-Max values have less error than uniform ones
        # of the same width, which pays on SmolLM2 at 2 bits
        # (docs/design/formats.md#lloyd-max-values-at-3-and-2-bits).
        KVFormat("tq3_nc", Codec(_LM, 3, True), Codec(_LM, 3, True), _BF16),
        KVFormat("tq2_nc", Codec(_LM, 2, True), Codec(_LM, 2, True), _BF16),
        # The 3-bit budget spent unevenly: 4-bit keys decide the attention weights, rotated
        # 2-bit values only average (SmolLM2: +0.76% vs tq3_nc's +1.21% with 4 sinks, the same
        # 100 bytes at D=128; docs/design/formats.md#bits-moved-from-values-to-keys).
        KVFormat("tqk4v2_nc", Codec(_LM, 4, True), Codec(_LM, 2, True), _BF16),
        # The 4-bit budget spent the same way: 5-bit Lloyd-Max keys, tq3_nc's values (132 B at
        # D=128, tq4_nc's; SmolLM2 with 4 sinks and centred keys: +0.25% vs tq4_nc's +0.41%;
        # docs/design/formats.md#wider-keys-at-the-4-bit-budget).
        KVFormat("tqk5v3_nc", Codec(_LM, 5, True), Codec(_LM, 3, True), _BF16),
        # 2-bit Lloyd-Max keys (sign + one magnitude bit) with 2- or 4-bit uniform values: too
        # lossy alone, usable with a full-precision recent window (see TurboQuantKVCache).
        KVFormat("k2v2_nc", Codec(_LM, 2, True), Codec(Kind.UNIFORM, 2), _BF16),
        KVFormat("k2v4_nc", Codec(_LM, 2, True), Codec(Kind.UNIFORM, 4), _BF16),
    )
}


def get_format(name: str | KVFormat) -> KVFormat:
    """Look a format up by preset name (a :class:`KVFormat` passes through)."""
    if isinstance(name, KVFormat):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV format {name!r}: expected one of {sorted(FORMATS)}"
        ) from None
