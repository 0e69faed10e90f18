"""Pure-torch encode / decode / attention for every format: the CPU implementation and the oracle.

This module is the executable specification of each format. The Triton kernels reproduce its
arithmetic step by step (same float32 operations in the same order where it matters), so their
bytes match up to the summation order of a norm or a rotation: a code can differ by one step
only where a value sits on a decision boundary.

Shapes: ``R`` token-head rows of ``D`` elements; a paged cache as in :mod:`custom_ops.formats`.
"""

from __future__ import annotations

import math

import torch

from custom_ops.codebook import signed_levels
from custom_ops.formats import (
    FP8_MAX,
    INT8_MAX,
    Codec,
    Kind,
    KVFormat,
    PagedKVCache,
    RecentWindow,
    ring_window,
    sequence_capacity,
    window_size,
)

__all__ = [
    "encode_rows",
    "decode_rows",
    "lloyd_max_codes",
    "lloyd_max_rows",
    "pack_codes",
    "unpack_codes",
    "store",
    "store_window",
    "center_keys",
    "uncenter_keys",
    "written_lengths",
    "ring_start",
    "ring_slots",
    "overlay_window",
    "overlay_chunk",
    "gather_rows",
    "dequantize",
    "softcap_scores",
    "attention",
    "decode",
    "prefill",
    "chunk_is_everything",
    "HIDDEN_BIAS",
]

# An additive attention mask's value at or below this hides its position as -inf does (for
# Hugging Face's finfo.min masks): beside a visible position's score its weight is 0 in float32.
HIDDEN_BIAS = -1e30


def pack_codes(codec: Codec, codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes into the codec's bit planes.

    Args:
        codec: the codec (defines the planes).
        codes: ``[R, D]`` integer codes in ``[0, 2^bits)``.

    Returns:
        ``[R, code_bytes] uint8``.
    """
    rows, head_dim = codes.shape
    codes = codes.to(torch.int32)
    out = []
    for plane in codec.planes(head_dim):
        bits = (codes >> plane.shift) & ((1 << plane.width) - 1)
        grouped = bits.reshape(rows, plane.groups, plane.nbytes)
        shifts = torch.arange(plane.groups, dtype=torch.int32, device=codes.device) * plane.width
        out.append((grouped << shifts[None, :, None]).sum(dim=1))
    return torch.cat(out, dim=1).to(torch.uint8)


def unpack_codes(codec: Codec, packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[R, code_bytes] uint8 -> [R, D] int32``."""
    rows = packed.shape[0]
    head_dim = packed.shape[1] * 8 // codec.bits
    packed = packed.to(torch.int32)
    codes = torch.zeros(rows, head_dim, dtype=torch.int32, device=packed.device)
    for plane in codec.planes(head_dim):
        data = packed[:, plane.offset : plane.offset + plane.nbytes]
        shifts = torch.arange(plane.groups, dtype=torch.int32, device=packed.device)
        bits = (data[:, None, :] >> (shifts * plane.width)[None, :, None]) & (
            (1 << plane.width) - 1
        )
        codes |= bits.reshape(rows, head_dim) << plane.shift
    return codes


def _magnitude_midpoints(levels: torch.Tensor, bits: int) -> torch.Tensor:
    mags = levels[: 1 << (bits - 1)]
    return (mags[1:] + mags[:-1]) * 0.5


def _reciprocal_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` where ``x > 0``, else 0 (one division per row, multiplies per element)."""
    return torch.where(x > 0, 1.0 / x, torch.zeros_like(x))


def _power_of_two_floor(x: torch.Tensor) -> torch.Tensor:
    """The power of two at or below ``x >= 0`` (float32, from its exponent bits), capped at
    2^126 so that its reciprocal is a normal number; 0 for zero and subnormal ``x``."""
    exponent = x.to(torch.float32).view(torch.int32) & 0x7F800000
    return exponent.clamp_max(0x7E800000).view(torch.float32)


def _stored(x: torch.Tensor, meta_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to the meta record's dtype, back in float32: codes are computed against
    the scalars that are stored, not the float32 ones."""
    return x.to(meta_dtype).to(torch.float32)


def lloyd_max_codes(
    bits: int, norm_correction: bool, x: torch.Tensor, rotation: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd-Max codes of rows ``x [R, D]`` float32: ``(codes [R, D] int32, norm [R]
    float32)``, sign-magnitude codes of ``bits`` bits (any width the codebook has, 1..8; the
    cache's codecs store 1..4) and the norm to store (norm-corrected with
    ``norm_correction``)."""
    head_dim = x.shape[1]
    levels = signed_levels(bits, head_dim).to(x.device)
    # Divided by a power of two near its absmax (exact), the row's squares and rotated sums
    # stay in float32's range for any finite bf16 row; the codes are those of the unscaled row.
    pow2 = _power_of_two_floor(x.abs().amax(dim=1))
    x = x * _reciprocal_or_zero(pow2)[:, None]
    norm = torch.sqrt((x * x).sum(dim=1))  # of the scaled row: 0 for zero rows, else >= 1
    inv_sqrt_d = torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32)
    inv = torch.where(norm > 0, inv_sqrt_d / torch.where(norm > 0, norm, 1.0), 0.0)
    y = (x @ rotation) * inv[:, None]
    magnitude = torch.bucketize(y.abs(), _magnitude_midpoints(levels, bits))
    sign = (y < 0).to(torch.int32)
    codes = (sign << (bits - 1)) | magnitude.to(torch.int32)
    if norm_correction:
        recon = levels[codes]
        norm = norm / torch.sqrt((recon * recon).sum(dim=1))
    return codes, norm * pow2


def lloyd_max_rows(
    bits: int,
    codes: torch.Tensor,
    norm: torch.Tensor,
    rotation: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows ``[R, D]`` in ``dtype`` of Lloyd-Max ``codes [R, D]`` (``bits`` wide) and their
    stored ``norm [R]``: the levels rotated back, times ``norm / sqrt(D)``."""
    head_dim = codes.shape[1]
    rotated = signed_levels(bits, head_dim).to(device=codes.device, dtype=dtype)[codes]
    unrotated = rotated @ rotation.to(device=codes.device, dtype=dtype).T
    return unrotated * (norm.to(dtype) * (1.0 / math.sqrt(head_dim)))[:, None]


def _encode_uniform(
    codec: Codec, x: torch.Tensor, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    qmax = (1 << codec.bits) - 1
    lo = x.amin(dim=1)
    hi = x.amax(dim=1)
    # Differences of halves: hi - lo and x - lo would overflow float32 for rows spanning
    # +-bf16 max; halving is exact, so the codes are those of the plain differences.
    scale = _stored((hi * 0.5 - lo * 0.5) / (qmax * 0.5), meta_dtype)
    zero = _stored(lo, meta_dtype)
    inv = _reciprocal_or_zero(scale)
    q = torch.floor((x * 0.5 - zero[:, None] * 0.5) * inv[:, None] * 2.0 + 0.5)
    q = q.clamp(0, qmax)
    return q.to(torch.int32), [scale, zero]


def _encode_absmax(
    codec: Codec, x: torch.Tensor, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    qmax = FP8_MAX if codec.kind == Kind.FP8_ABSMAX else INT8_MAX
    scale = _stored(x.abs().amax(dim=1) / qmax, meta_dtype)
    scaled = x * _reciprocal_or_zero(scale)[:, None]
    if codec.kind == Kind.FP8_ABSMAX:
        # the stored scale may round below absmax / 448: saturate (torch's cast does too)
        codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch.floor(scaled + 0.5).clamp(-128, 127).to(torch.int8).view(torch.uint8)
    return codes.to(torch.int32), [scale]


def encode_rows(
    codec: Codec, x: torch.Tensor, rotation: torch.Tensor, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Encode token-head rows with one codec.

    Args:
        codec: the codec.
        x: ``[R, D]`` rows (any float dtype; computed in float32).
        rotation: ``[D, D]`` +-1 rotation matrix (used by Lloyd-Max codecs, whose levels are
            :func:`custom_ops.codebook.signed_levels` of the codec's bits and ``D``).
        meta_dtype: the format's meta dtype: scales and zeros are rounded to it before the
            codes are computed against them.

    Returns:
        ``(packed [R, code_bytes] uint8, meta)`` with one ``[R] float32`` per meta field.
    """
    x = x.to(torch.float32)
    if codec.kind == Kind.LLOYD_MAX:
        codes, norm = lloyd_max_codes(codec.bits, codec.norm_correction, x, rotation.to(x.device))
        meta = [norm]
    elif codec.kind == Kind.UNIFORM:
        codes, meta = _encode_uniform(codec, x, meta_dtype)
    else:
        codes, meta = _encode_absmax(codec, x, meta_dtype)
    return pack_codes(codec, codes), meta


def decode_rows(
    codec: Codec,
    packed: torch.Tensor,
    meta: list[torch.Tensor],
    rotation: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode rows back to vectors in the original (un-rotated) space.

    Args:
        codec: the codec.
        packed: ``[R, code_bytes] uint8``.
        meta: one ``[R]`` tensor per meta field of the codec.
        rotation: ``[D, D]`` +-1 rotation matrix.
        dtype: float32 for the CPU implementation, float64 for oracles.

    Returns:
        ``[R, D]`` in ``dtype``.
    """
    meta = [m.to(dtype) for m in meta]
    if codec.kind in (Kind.FP8_ABSMAX, Kind.INT8_ABSMAX):
        raw = packed.view(torch.float8_e4m3fn if codec.kind == Kind.FP8_ABSMAX else torch.int8)
        return raw.to(dtype) * meta[0][:, None]
    codes = unpack_codes(codec, packed)
    if codec.kind == Kind.UNIFORM:
        return codes.to(dtype) * meta[0][:, None] + meta[1][:, None]
    return lloyd_max_rows(codec.bits, codes, meta[0], rotation, dtype)


def _split_meta(fmt: KVFormat, meta: torch.Tensor) -> tuple[list, list]:
    n_key = len(fmt.key.meta_fields)
    columns = [meta[..., i] for i in range(meta.shape[-1])]
    return columns[:n_key], columns[n_key:]


def store(
    fmt: KVFormat,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    rotation: torch.Tensor,
) -> None:
    """Quantize ``key``/``value`` ``[N, Hk, D]`` and write them into the slots of a paged cache.

    ``slot_mapping [N] int32`` gives each token's slot (``page * page_size + offset``), or ``[N,
    Hk]`` each token-head's; a negative slot is padding and skipped. The cache planes are
    modified in place.
    """
    n_tokens, num_kv_heads, head_dim = key.shape
    page_size = cache.k_codes.shape[2]
    k_packed, k_meta = encode_rows(fmt.key, key.reshape(-1, head_dim), rotation, fmt.meta_dtype)
    v_packed, v_meta = encode_rows(
        fmt.value, value.reshape(-1, head_dim), rotation, fmt.meta_dtype
    )
    meta = torch.stack(k_meta + v_meta, dim=1).to(fmt.meta_dtype)

    slots = slot_mapping.to(torch.int64)
    if slots.dim() == 1:
        slots = slots[:, None].expand(n_tokens, num_kv_heads)
    tokens, heads = torch.nonzero(slots >= 0, as_tuple=True)
    pages = slots[tokens, heads] // page_size
    offsets = slots[tokens, heads] % page_size

    def rows_of(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n_tokens, num_kv_heads, *t.shape[1:])[tokens, heads]

    cache.k_codes[pages, heads, offsets] = rows_of(k_packed)
    cache.value_rows[pages, heads, offsets] = rows_of(v_packed)
    cache.meta[pages, heads, offsets] = rows_of(meta)


def _slots_of(positions: torch.Tensor, block_table_row: torch.Tensor, page_size: int):
    """Slots ``[n] int32`` of a sequence's ``positions [n]`` through its block table row."""
    pages = block_table_row.to(torch.int64)[positions // page_size]
    return (pages * page_size + positions % page_size).to(torch.int32)


def store_window(
    fmt: KVFormat,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    window: RecentWindow,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    rotation: torch.Tensor,
) -> torch.Tensor:
    """Write ``key``/``value`` ``[B, Hk, T, D]`` at positions ``start_pos[b] ..`` of sequences
    that keep their most recent tokens, and their first ``sinks``, in full precision; the
    sequences' new lengths (:func:`written_lengths`).

    Each sequence-head keeps a run of its latest positions ``[w, len)`` (at most ``W``) in the
    rings ``window.k_window / v_window [B, Hk, W + sinks, D]``, position ``p`` at slot ``p %
    W``, its first ``sinks`` positions at slots ``W + p`` (never evicted), and the positions in
    ``[sinks, w)`` quantized in its pages; ``window.window_pos [B, Hk, W + sinks] int32``
    records the position each slot holds (-1: none; :func:`ring_start` finds ``w``). The new
    tokens take positions ``start .. start + T - 1`` (a negative start skips the sequence), for
    any start up to the current length: everything from ``start`` on is new (a rollback, a
    re-run step, rejected drafts, a new sequence from 0). A ring slot's old position leaves for
    its page only if it is below ``start`` (still part of the sequence); new tokens that do not
    fit the ring go straight to their pages. Afterwards the ring holds the last ``min(W, start +
    T - w)`` positions of at least ``sinks``, and every position in ``[sinks, w)`` is in its
    page: written once if it left the ring in this call or an earlier one.

    With ``window.key_center [>= B, Hk, D] float32`` every key is stored minus its
    sequence-head's centre, which :func:`center_keys` sets first. The rings, ``window_pos`` and
    the centres are written in place.
    """
    if window.key_center is not None:
        key = center_keys(key, window, start_pos)
    k_window, v_window, window_pos, sinks, _ = window
    n_new = key.shape[2]
    size = window.size
    page_size = cache.k_codes.shape[2]
    for b in range(key.shape[0]):
        start = int(start_pos[b])
        if start < 0:
            continue
        new_pos = start + torch.arange(n_new)
        sink = new_pos < sinks
        # new positions >= start + T - W end up in the ring, the others (sinks aside) in pages
        stay = (new_pos >= start + n_new - size) & ~sink
        direct = ~stay & ~sink
        written = ring_slots(new_pos[stay], size, sinks)  # the window slots written
        held = window_pos[b][:, written].to(torch.int64)  # [Hk, C] their old positions
        leaves = (held >= 0) & (held < start)
        leaving = torch.where(leaves, held, 0)  # (a stale position may lie past the pages)
        old_slots = torch.where(leaves, _slots_of(leaving, block_table[b], page_size), -1)
        new_slots = _slots_of(new_pos[direct], block_table[b], page_size)
        # [n, Hk, D] rows: old tokens from the ring (slots per head), then new ones that skip it
        k_rows = torch.cat([k_window[b][:, written], key[b][:, direct]], dim=1)
        v_rows = torch.cat([v_window[b][:, written], value[b][:, direct]], dim=1)
        slots = torch.cat([old_slots.T, new_slots[:, None].expand(-1, old_slots.shape[0])])
        if slots.shape[0]:
            store(
                fmt,
                k_rows.transpose(0, 1).float(),
                v_rows.transpose(0, 1).float(),
                cache,
                slots,
                rotation,
            )
        kept = stay | sink
        kept_slots = ring_slots(new_pos, size, sinks)[kept]
        k_window[b][:, kept_slots] = key[b][:, kept].to(k_window.dtype)
        v_window[b][:, kept_slots] = value[b][:, kept].to(v_window.dtype)
        window_pos[b][:, kept_slots] = new_pos[kept].to(window_pos.dtype)
    return written_lengths(start_pos, n_new)


def center_keys(key: torch.Tensor, window: RecentWindow, start_pos: torch.Tensor) -> torch.Tensor:
    """Key centering before :func:`store_window` writes ``key [B, Hk, T, D]`` from
    ``start_pos[b]`` on: the keys minus their sequence-head's centre, rounded to the ring's
    dtype (what a key that passes through the ring is quantized from, so a chunk written
    straight to the pages gives the same codes).

    Every key a sequence-head holds (ring, sinks and pages) is stored minus one vector ``mu =
    window.key_center[b, h]`` (``[>= B, Hk, D] float32``, 0 in a new cache; written in place,
    and so are the ring's keys where they are re-centred). Attention is unchanged:
    softmax is invariant to the shift ``-q . mu`` that every score of a query then shares, so
    decode reads the stored keys as they are; the quantized ones lose less to a common component
    they no longer carry. ``mu`` may change only while no page holds a live position of the
    sequence-head: at the write that first sends positions to pages (its length passes ``sinks +
    W``) it becomes the mean of the keys of positions ``[sinks, sinks + max(W, 1))`` (from the
    ring, un-centred, and from ``key``), and the ring's live slots are re-centred on it (one
    rounding to the ring's dtype). A write from position 0 (a new sequence) first resets it to
    0; a rollback to a start at or below ``sinks`` (no page live any more) lets the next such
    write set it anew.
    """
    k_window, _, window_pos, sinks, key_center = window
    size = window.size
    n_new = key.shape[2]
    samples = max(size, 1)
    centered = key.float()
    for b in range(key.shape[0]):
        start = int(start_pos[b])
        if start < 0:
            continue
        if start == 0:
            key_center[b] = 0.0  # a new sequence: nothing it holds is centred yet
        held = window_pos[b].to(torch.int64)  # [Hk, W + sinks]
        live = (held >= 0) & (held < start)
        # pages hold [sinks, paged_to): the ring run's start for the length `start`
        paged_to = ring_start(window_pos[b : b + 1], torch.tensor([start]), sinks)[0]  # [Hk]
        freeze = (paged_to <= sinks) & (start + n_new - size > sinks)  # [Hk]
        if freeze.any():
            old = key_center[b].clone()  # [Hk, D]
            ring = k_window[b].float() + old[:, None]  # un-centred
            in_sample = live & (held >= sinks) & (held < sinks + samples)
            in_sample[:, size:] = False
            new_pos = start + torch.arange(n_new)
            chunk_sample = (new_pos >= sinks) & (new_pos < sinks + samples)
            zero = torch.zeros((), dtype=torch.float32)
            total = torch.where(in_sample[..., None], ring, zero).sum(dim=1)
            total += centered[b][:, chunk_sample].sum(dim=1)
            count = in_sample.sum(dim=1, keepdim=True) + chunk_sample.sum()
            mean = total / count.clamp_min(1)
            new = torch.where(freeze[:, None], mean, old)  # [Hk, D]
            recentered = (ring - new[:, None]).to(k_window.dtype)
            moved = live & freeze[:, None]  # [Hk, W + sinks]
            k_window[b] = torch.where(moved[..., None], recentered, k_window[b])
            key_center[b] = new
        centered[b] -= key_center[b][:, None]
    return centered.to(k_window.dtype)


def uncenter_keys(
    k: torch.Tensor, key_center: torch.Tensor | None, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Dense keys ``k [B, Hk, S, D]`` as they were before :func:`center_keys`: plus each
    sequence-head's centre ``key_center [>= B, Hk, D]`` at positions below ``seq_lens[b]`` (the
    others stay zero); ``k`` unchanged without a centre. Computes in float32 (float64 for a
    float64 ``k``) and returns ``k``'s dtype."""
    if key_center is None:
        return k
    compute = torch.float64 if k.dtype == torch.float64 else torch.float32
    batch, _, seq, _ = k.shape
    valid = torch.arange(seq, device=k.device)[None, :] < seq_lens.to(k.device)[:, None]
    shift = torch.where(
        valid[:, None, :, None],
        key_center[:batch, :, None].to(compute),
        torch.zeros((), dtype=compute, device=k.device),
    )
    return (k.to(compute) + shift).to(k.dtype)


def ring_slots(positions: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """The ring slots of ``positions`` in rings of ``window`` slots and ``sinks`` sinks: ``p %
    window``, a sink's (``p < sinks``) ``window + p`` (the kernels' copy:
    :func:`custom_ops.triton.paged.ring_slots`)."""
    return torch.where(positions < sinks, window + positions, positions % max(window, 1))


def written_lengths(start_pos: torch.Tensor, n_new: int) -> torch.Tensor:
    """``[B] int32``: the length of each sequence after ``n_new`` tokens written from
    ``start_pos [B]`` on (everything from the start is new), 0 for a skipped sequence (negative
    start), whose length the write does not know."""
    return torch.where(start_pos >= 0, start_pos + n_new, 0).to(torch.int32)


def ring_start(window_pos: torch.Tensor, seq_lens: torch.Tensor, sinks: int = 0) -> torch.Tensor:
    """``[B, Hk] int64``: where each sequence-head's ring run starts, the least position below
    ``seq_lens [B]`` that the window slots of its ring ``window_pos [>= B, Hk, W + sinks]`` hold
    (its length if none): positions from ``sinks`` up to it are read from the pages, the others
    from the ring (see :func:`store_window`)."""
    lens = seq_lens.to(torch.int64)[:, None, None]
    window = ring_window(window_pos, sinks)
    held = window_pos[: seq_lens.shape[0], :, :window].to(device=lens.device, dtype=torch.int64)
    in_run = (held >= 0) & (held < lens)
    run_or_len = torch.where(in_run, held, lens)
    return torch.cat([run_or_len, lens.expand(*held.shape[:2], 1)], dim=2).amin(dim=2)


def overlay_window(
    dense: torch.Tensor,
    ring: torch.Tensor,
    window_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: int = 0,
) -> torch.Tensor:
    """``dense [B, Hk, S, D]`` with each sequence-head's ring run (positions ``ring_start ..
    len - 1``) and its sinks (positions below ``min(sinks, len)``) taken from the ring ``[>= B,
    Hk, W + sinks, D]`` (see :func:`store_window`)."""
    batch, _, seq, _ = dense.shape
    window = ring_window(ring, sinks)
    positions = torch.arange(seq, device=dense.device)
    first = ring_start(window_pos, seq_lens, sinks).to(dense.device)[:, :, None]  # [B, Hk, 1]
    lens = seq_lens.to(device=dense.device, dtype=torch.int64)[:, None, None]
    in_ring = ((positions >= first) | (positions < sinks)) & (positions < lens)  # [B, Hk, S]
    ring_rows = ring[:batch][:, :, ring_slots(positions, window, sinks)]
    return torch.where(in_ring[..., None], ring_rows.to(dense.device, dense.dtype), dense)


def gather_rows(
    cache: PagedKVCache, block_table: torch.Tensor, max_seq_len: int, paged_lens: torch.Tensor
) -> PagedKVCache:
    """Gather each sequence's rows from the pages into a cache of one page per sequence.

    Page ``b`` of the result holds positions ``0 .. max_seq_len - 1`` of sequence ``b``, in the
    layout of every cache: ``k_codes`` and ``meta`` ``[B, Hk, max_seq_len, ...]``, ``v_codes
    [B, Hk, value_code_bytes, max_seq_len]`` (rows through ``value_rows``). Only the block-table
    entries of positions below ``paged_lens [B]`` are followed (the kernels' contract: entries
    past a sequence's pages may hold anything); the other positions read page 0, and callers
    mask them by length.
    """
    page_size = cache.k_codes.shape[2]
    positions = torch.arange(max_seq_len, device=block_table.device)
    page_index = (positions // page_size).clamp_max(block_table.shape[1] - 1)
    followed = positions[None, :] < paged_lens.to(block_table.device, torch.int64)[:, None]
    pages = torch.where(followed, block_table.to(torch.int64)[:, page_index], 0)  # [B, S]
    offsets = (positions % page_size)[None, :]

    def gather(rows: torch.Tensor) -> torch.Tensor:  # [num_pages, Hk, page_size, W]
        return rows.permute(0, 2, 1, 3)[pages, offsets].permute(0, 2, 1, 3)  # [B, Hk, S, W]

    value_rows = gather(cache.value_rows)
    return PagedKVCache(gather(cache.k_codes), value_rows.transpose(2, 3), gather(cache.meta))


def dequantize(
    fmt: KVFormat,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    max_seq_len: int,
    dtype: torch.dtype,
    window: RecentWindow | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize every sequence's cache to ``[B, Hk, max_seq_len, D]`` K and V in ``dtype``.

    Positions at or beyond ``seq_lens[b]`` are zero. With a recent window (see
    :func:`store_window`) each sequence-head's ring run and sinks come from its rings; with its
    ``key_center`` the keys get their centre back (:func:`uncenter_keys`). float64 ``dtype``
    computes in float64 (the oracle); anything else computes in float32 and casts at the end.
    """
    paged_lens = seq_lens
    if window is not None:
        paged_lens = ring_start(window.window_pos, seq_lens, window.sinks).amax(dim=1)
    rows = gather_rows(cache, block_table, max_seq_len, paged_lens)
    batch, num_kv_heads, seq, _ = rows.k_codes.shape
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    k_meta, v_meta = _split_meta(fmt, rows.meta.reshape(-1, rows.meta.shape[-1]))

    def side(codec, packed, meta):
        flat = decode_rows(codec, packed.reshape(-1, packed.shape[-1]), meta, rotation, compute)
        return flat.reshape(batch, num_kv_heads, seq, rotation.shape[0])  # D: N may be 0

    k = side(fmt.key, rows.k_codes, k_meta)
    v = side(fmt.value, rows.value_rows, v_meta)
    valid = torch.arange(seq, device=k.device)[None, :] < seq_lens.to(k.device)[:, None]
    valid = valid[:, None, :, None]
    k = torch.where(valid, k, torch.zeros((), dtype=compute))
    v = torch.where(valid, v, torch.zeros((), dtype=compute))
    if window is None:
        return k.to(dtype), v.to(dtype)
    k = overlay_window(k, window.k_window, window.window_pos, seq_lens, window.sinks)
    v = overlay_window(v, window.v_window, window.window_pos, seq_lens, window.sinks)
    return uncenter_keys(k, window.key_center, seq_lens).to(dtype), v.to(dtype)


def softcap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)``, Gemma 2's attention logit softcapping, applied to
    scores before the mask; ``softcap`` 0: ``scores`` as they are."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Single-query attention of ``q [B, Hq, D]`` over ``k, v [B, Hk, S, D]`` (GQA by groups).

    Scores are ``scale * q . k``, capped at ``softcap * tanh(score / softcap)`` where
    ``softcap > 0`` (:func:`softcap_scores`). Keys at positions ``>= seq_lens[b]`` are masked,
    and so are those a boolean ``mask`` ``[B or 1, Hq or 1, M]`` sets False (an additive mask is
    added to the capped scores; positions ``>= M`` are masked). A row with no key left gives
    zeros; NaN in a score gives NaN. Computed in the dtype of ``k``; returns ``[B, Hq, D]`` in
    that dtype.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, seq = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.to(k.dtype).reshape(batch, num_kv_heads, group, head_dim)
    scores = softcap_scores(torch.einsum("bhgd,bhsd->bhgs", qg, k) * scale, softcap)
    valid = torch.arange(seq, device=k.device)[None, :] < seq_lens.to(k.device)[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if mask is not None:
        # [B or 1, Hq or 1, M] -> additive [B, Hq, S]; positions >= M are masked out
        pad = max(0, seq - mask.shape[-1])
        if mask.dtype == torch.bool:
            allowed = torch.nn.functional.pad(mask, (0, pad))[..., :seq]
            bias = torch.zeros_like(allowed, dtype=scores.dtype)
            bias = bias.masked_fill(~allowed, float("-inf"))
        else:
            bias = torch.nn.functional.pad(mask.to(scores.dtype), (0, pad), value=float("-inf"))
            bias = bias[..., :seq]
        bias = bias.to(k.device).expand(batch, num_q_heads, seq)
        scores = scores + bias.reshape(batch, num_kv_heads, group, seq)
    # a row with no key left gives zeros; NaN in a score (a NaN key, query or mask) stays NaN,
    # as in dense SDPA and the kernels
    no_key = (scores == float("-inf")).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1).masked_fill(no_key, 0.0)
    out = torch.einsum("bhgs,bhsd->bhgd", probs, v)
    return out.reshape(batch, num_q_heads, head_dim)


def decode(
    fmt: KVFormat,
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float32,
    mask: torch.Tensor | None = None,
    window: RecentWindow | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` (one token per sequence), or ``[B, Hq, T, D]`` (the
    sequence's last ``T`` tokens: without a mask causal among themselves, token ``t`` seeing the
    positions below ``len - T + t + 1``; with a mask ``[B or 1, Hq or 1, T, M]``, per token,
    the mask alone decides below ``len``, as for dense SDPA), over a paged cache (and its
    recent window, if any): dequantize, then attend (``mask`` and ``softcap`` as in
    :func:`attention`). The keys are read as stored: a window's ``key_center`` is not added
    back (softmax ignores the shift that all of a query's scores share; a cap does not, so
    capped scores need keys stored without a centre).

    Computed in ``dtype`` (float32 for the CPU op, float64 for oracles); returns ``q``'s shape
    in the query's dtype.
    """
    # the ring's window slots hold the last W positions
    max_seq_len = sequence_capacity(
        block_table.shape[1], cache.k_codes.shape[2], window_size(window)
    )
    stored = None if window is None else window._replace(key_center=None)
    k, v = dequantize(fmt, cache, block_table, seq_lens, rotation, max_seq_len, dtype, stored)
    if q.dim() == 3:
        return attention(q, k, v, seq_lens, scale, mask, softcap).to(q.dtype)
    tokens = q.shape[2]
    outputs = []
    for t in range(tokens):
        lag = tokens - 1 - t if mask is None else 0
        visible = (seq_lens.to(torch.int64) - lag).clamp_min(0)
        token_mask = mask if mask is None or mask.dim() == 3 else mask[:, :, t]
        outputs.append(attention(q[:, :, t], k, v, visible, scale, token_mask, softcap))
    return torch.stack(outputs, dim=2).to(q.dtype)


def overlay_chunk(
    dense: torch.Tensor, chunk: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """``dense [B, H, S, D]`` with each sequence's last ``T`` positions below its length
    (``seq_lens [B]``) holding ``chunk [B, Hk, T, D]`` (its heads repeated to ``H``) as given, in
    ``dense``'s dtype: a chunk just stored, read exactly instead of through its codes.
    Differentiable in ``chunk``."""
    batch, heads, seq, head_dim = dense.shape
    tokens = chunk.shape[2]
    chunk = chunk.to(dense.dtype)
    if chunk.shape[1] != heads:
        chunk = chunk.repeat_interleave(heads // chunk.shape[1], dim=1)
    starts = seq_lens.to(device=dense.device, dtype=torch.int64)[:, None] - tokens
    offset = torch.arange(seq, device=dense.device)[None, :] - starts  # [B, S]: chunk index
    in_chunk = ((offset >= 0) & (offset < tokens))[:, None, :, None]
    index = offset.clamp(0, tokens - 1)[:, None, :, None].expand(batch, heads, seq, head_dim)
    return torch.where(in_chunk, chunk.gather(2, index), dense)


def prefill(
    fmt: KVFormat,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    scale: float,
    is_causal: bool,
    max_seq_len: int,
    dtype: torch.dtype = torch.float32,
    mask: torch.Tensor | None = None,
    window: RecentWindow | None = None,
    softcap: float = 0.0,
    query_block: int = 256,
) -> torch.Tensor:
    """Attention of a chunk of ``T`` tokens just stored, queries ``q [B, Hq, T, D]``, over their
    own exact keys and values and their sequence's cached prefix.

    The chunk holds positions ``start .. start + T - 1`` with ``start = seq_lens[b] - T``: its
    keys and values are ``key``/``value [B, Hk, T, D]`` as the model computed them, not their
    stored codes. Positions below ``start`` (the prefix) are read from the cache as
    :func:`dequantize` gives them (their ring run and sinks in full precision, the keys with
    their centre back). Position ``p`` is visible to token ``t`` where ``p < min(seq_lens[b],
    max_seq_len)``, where ``mask`` (``[B or 1, Hq or 1, T, M]``, positions ``>= M`` masked)
    allows it (``mask[b, h, t, p]`` True; a float mask is added to the score instead), and with
    ``is_causal`` where ``p <= t`` (SDPA's top-left alignment: the whole chunk is causal when
    ``start`` is 0). A row with no visible position gives zeros.

    Args:
        fmt: the format.
        q: ``[B, Hq, T, D]`` the chunk's queries (``Hq`` a multiple of ``Hk``).
        key, value: ``[B, Hk, T, D]`` the chunk's keys and values.
        cache, block_table, seq_lens, rotation, window: the cache after the chunk was stored,
            as :func:`dequantize` takes it.
        scale: the softmax scale.
        is_causal: SDPA's top-left causal order (with a mask too: both apply).
        max_seq_len: positions at or past it are hidden (a view's length).
        dtype: the arithmetic's dtype (float32 for the CPU op, float64 for oracles).
        mask: optional ``[B or 1, Hq or 1, T, M]`` bool or additive mask.
        softcap: logit softcap of the scores, before the mask (0: none; see
            :func:`softcap_scores`).
        query_block: query tokens per block of scores (``[B, Hq, query_block, S]``).

    Returns:
        ``[B, Hq, T, D]`` in q's dtype.
    """
    batch, num_q_heads, tokens, head_dim = q.shape
    num_kv_heads = key.shape[1]
    group = num_q_heads // num_kv_heads
    capacity = sequence_capacity(block_table.shape[1], cache.k_codes.shape[2], window_size(window))
    seq = min(capacity, max_seq_len)
    k, v = dequantize(fmt, cache, block_table, seq_lens, rotation, capacity, dtype, window)
    # the chunk's own keys and values at its positions, as they are
    positions = torch.arange(capacity, device=q.device)
    lens = seq_lens.to(device=q.device, dtype=torch.int64)
    k = overlay_chunk(k, key, lens)[:, :, :seq]
    v = overlay_chunk(v, value, lens)[:, :, :seq]
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    v = v.repeat_interleave(group, dim=1)
    present = (positions[None, :seq] < lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    outputs = []
    for t0 in range(0, tokens, query_block):
        rows = torch.arange(t0, min(t0 + query_block, tokens), device=q.device)
        scores = torch.einsum("bhtd,bhsd->bhts", q[:, :, rows].to(dtype), k) * scale
        scores = softcap_scores(scores, softcap)
        if mask is not None:
            block = mask[:, :, t0 : t0 + rows.shape[0]].to(q.device)
            pad = max(0, seq - block.shape[-1])  # positions >= M are masked out
            if block.dtype == torch.bool:
                allowed = torch.nn.functional.pad(block, (0, pad))[..., :seq]
                scores = scores.masked_fill(~allowed, float("-inf"))
            else:
                bias = torch.nn.functional.pad(block.to(dtype), (0, pad), value=float("-inf"))
                scores = scores + bias[..., :seq]
        if is_causal:
            causal = positions[None, :seq] <= rows[:, None]  # [rows, S]
            scores = scores.masked_fill(~causal, float("-inf"))
        scores = scores.masked_fill(~present, float("-inf"))
        no_key = (scores == float("-inf")).all(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1).masked_fill(no_key, 0.0)
        outputs.append(torch.einsum("bhts,bhsd->bhtd", probs, v))
    return torch.cat(outputs, dim=2).to(q.dtype)


def decode_step(
    fmt: KVFormat,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    rotation: torch.Tensor,
    scale: float,
    window: RecentWindow,
    dtype: torch.dtype = torch.float32,
    mask: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step with its own token: ``q [B, Hq, D]`` attends each sequence's cache as it
    is, the positions below ``start_pos[b]`` (compressed pages, ring run and sinks), and the
    step's ``key``/``value [B, Hk, 1, D]`` at ``start_pos[b]``, exactly: :func:`prefill` of a
    one-token chunk over the cache before the token is stored. Then the token is appended
    (:func:`store_window`). A skipped sequence (``start_pos < 0``) attends nothing (zeros) and
    keeps its cache. ``mask``: ``[B or 1, Hq or 1, M]`` over positions, as ``tq.decode``'s.

    Returns:
        ``(out, new_lens)``: ``[B, Hq, D]`` in q's dtype and the new lengths ``[B] int32``.
    """
    live = start_pos >= 0
    lens = torch.where(live, start_pos + 1, 1).to(torch.int32)  # skipped rows: zeroed below
    capacity = sequence_capacity(block_table.shape[1], cache.k_codes.shape[2], window.size)
    out = prefill(
        fmt,
        q[:, :, None],
        key,
        value,
        cache,
        block_table,
        lens,
        rotation,
        scale,
        False,
        capacity,
        dtype,
        None if mask is None else mask[:, :, None],
        window,
        softcap,
    )[:, :, 0]
    out = torch.where(live[:, None, None], out, 0).to(q.dtype)
    return out, store_window(fmt, key, value, cache, window, block_table, start_pos, rotation)


def chunk_is_everything(
    seq_lens: torch.Tensor,
    tokens: int,
    is_causal: bool,
    max_seq_len: int,
    mask: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`prefill` of a chunk over sequences of lengths ``seq_lens`` is dense
    attention over the chunk alone: no prefix (every length is ``tokens``), nothing of the chunk
    hidden by ``max_seq_len``, and either no mask (causal with ``is_causal``, full without) or
    a mask whose rows show exactly chunk positions ``0 .. t`` (an additive one 0 there and at
    most :data:`HIDDEN_BIAS` elsewhere). Reads ``seq_lens`` and ``mask`` (the CPU op's host
    check).

    Args:
        seq_lens: ``[B] int32``.
        tokens: T.
        is_causal: the call's ``is_causal`` (at start 0 the chunk's causal order).
        max_seq_len: the view's length.
        mask: optional ``[B or 1, Hq or 1, T, M]``.

    Returns:
        True where the dense kernel over the chunk gives the answer.
    """
    if tokens > max_seq_len or not bool((seq_lens == tokens).all()):
        return False
    if mask is None:
        return True
    if mask.shape[-1] < tokens:
        return False
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=mask.device).tril()
    block = mask[..., :tokens]
    if mask.dtype == torch.bool:
        return bool((block == causal).all())
    return bool(torch.where(causal, block == 0, block <= HIDDEN_BIAS).all())
