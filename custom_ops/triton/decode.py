"""Split-KV decode attention over a compressed paged cache: ``torch.ops.tq.decode`` on CUDA.

Three launches with shapes fixed by the inputs (CUDA-graph safe, no host sync):

1. ``_prep_query_kernel`` (grid ``B * Hq``): rotates the query into the keys' code space
   (``q @ R / sqrt(D)`` for Lloyd-Max keys), multiplies by ``scale * log2(e)`` so the softmax can
   use ``exp2``, and writes it in the key tile's padded element order as fp16.
2. ``_split_kernel`` (grid ``(num_splits, Hk, B)``): one program per (sequence, kv-head, split)
   serves every q-head of the GQA group, so each cache byte is read once. Each split finds its
   token range from ``seq_lens`` on the device (an empty split writes a neutral partial), then
   streams ``BLOCK_N``-token tiles: ``S = Q @ K^T`` and ``P @ V`` on the tensor cores with the
   group padded to 16 rows, an online softmax in the log2 domain, and the codecs' scalars folded
   in: the key norm/scale multiplies the scores, the value scale multiplies the probabilities
   before ``P @ V`` and the value zero enters through a running ``sum(p * zero)``.
3. ``_merge_kernel`` (grid ``B * Hq``): log-sum-exp merge of the splits; rotates Lloyd-Max values
   back to the original space and casts to the query's dtype.

Decode is bound by the instructions that turn codes into fp16, not by bytes. 4-bit codes are
stored split-half (byte ``j`` holds elements ``j`` and ``j + D/2``), so one byte row gives two
contiguous halves of the head dim, each multiplied by its half of the query in its own
``tl.dot``: no shuffles. On the GPU the halves are decoded by inline PTX working on 4 bytes at a
time: ``prmt`` looks Lloyd-Max magnitudes up in registers and a ``lop3`` sets the sign
(:func:`lut4_asm`); uniform codes become fp16 by or-ing them into the mantissa of 1024.0
(:data:`UINT4_ASM`). Under the interpreter the same kernel decodes with plain Triton instead.
Other widths are decoded as one tile in the codec's strided order
(:mod:`custom_ops.triton.planes`); the query is prepared in that order and the output is
scattered back to the natural order when a split stores its partial.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from custom_ops.codebook import signed_levels
from custom_ops.formats import Codec, Kind, KVFormat, PagedKVCache
from custom_ops.triton.planes import PlaneParams, load_codes
from custom_ops.triton.store import codec_constexprs, first_meta_column

_LLOYD_MAX = tl.constexpr(int(Kind.LLOYD_MAX))
_UNIFORM = tl.constexpr(int(Kind.UNIFORM))
_FP8 = tl.constexpr(int(Kind.FP8))
_INT8_ABSMAX = tl.constexpr(int(Kind.INT8_ABSMAX))
LOG2E = 1.4426950408889634
_MIN_ROWS = 16  # tl.dot needs at least 16 rows: the GQA group is padded to this


def lut4_asm(levels: torch.Tensor) -> str:
    """PTX decoding 4 bytes of 4-bit sign-magnitude Lloyd-Max codes into 8 fp16 levels.

    For ``tl.inline_asm_elementwise(..., pack=4)`` on a ``uint8`` tile: ``$4`` holds 4 code
    bytes; ``$0, $1`` receive the fp16 levels of their low nibbles (the first half of the head
    dim) and ``$2, $3`` those of their high nibbles (the second half). ``prmt`` looks the
    magnitudes up in registers (the low and the high bytes of the 8 fp16 magnitudes, indexed by
    each nibble's 3-bit magnitude), then ``lop3`` ors each nibble's sign bit into bit 15.

    Args:
        levels: ``[16] float32`` signed levels (:func:`custom_ops.codebook.signed_levels`).
    """
    mags = [int(m) & 0xFFFF for m in levels[:8].to(torch.float16).view(torch.int16)]

    def word(values):
        return values[0] | values[1] << 8 | values[2] << 16 | values[3] << 24

    low, high = [m & 0xFF for m in mags], [m >> 8 for m in mags]
    tables = (word(low[:4]), word(low[4:]), word(high[:4]), word(high[4:]))
    return f"""{{
.reg .b32 tl0, tl1, th0, th1, m, x, y, s, t;
mov.b32 tl0, {tables[0]:#010x};
mov.b32 tl1, {tables[1]:#010x};
mov.b32 th0, {tables[2]:#010x};
mov.b32 th1, {tables[3]:#010x};
and.b32 m, $4, 0x77777777;
prmt.b32 x, tl0, tl1, m;
prmt.b32 y, th0, th1, m;
prmt.b32 $0, x, y, 0x6240;
prmt.b32 $2, x, y, 0x7351;
shr.b32 m, m, 16;
prmt.b32 x, tl0, tl1, m;
prmt.b32 y, th0, th1, m;
prmt.b32 $1, x, y, 0x6240;
prmt.b32 $3, x, y, 0x7351;
shl.b32 s, $4, 4;
prmt.b32 t, s, 0, 0x1404;
lop3.b32 $0, $0, t, 0x80008000, 0xF8;
prmt.b32 t, $4, 0, 0x1404;
lop3.b32 $2, $2, t, 0x80008000, 0xF8;
prmt.b32 t, s, 0, 0x3424;
lop3.b32 $1, $1, t, 0x80008000, 0xF8;
prmt.b32 t, $4, 0, 0x3424;
lop3.b32 $3, $3, t, 0x80008000, 0xF8;
}}"""


# lut4_asm's contract for uniform 4-bit codes: the fp16 of each integer code, exact: the code is
# or-ed into the mantissa of 1024.0 (0x6400) and 1024 subtracted.
UINT4_ASM = """{
.reg .b32 t, magic;
mov.b32 magic, 0x64006400;
prmt.b32 t, $4, 0, 0x4140;
lop3.b32 $0, t, 0x000F000F, magic, 0xEA;
shr.b32 t, t, 4;
lop3.b32 $2, t, 0x000F000F, magic, 0xEA;
prmt.b32 t, $4, 0, 0x4342;
lop3.b32 $1, t, 0x000F000F, magic, 0xEA;
shr.b32 t, t, 4;
lop3.b32 $3, t, 0x000F000F, magic, 0xEA;
sub.rn.f16x2 $0, $0, magic;
sub.rn.f16x2 $1, $1, magic;
sub.rn.f16x2 $2, $2, magic;
sub.rn.f16x2 $3, $3, magic;
}"""


def decode_asm(codec: Codec, head_dim: int) -> str:
    """The inline PTX that decodes a 4-bit side on the GPU ("" for other codecs)."""
    if codec.bits != 4:
        return ""
    if codec.kind == Kind.UNIFORM:
        return UINT4_ASM
    return lut4_asm(signed_levels(codec.bits, head_dim))


@triton.jit
def _tile_elements(G: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr):
    """Natural element index and validity of each position of a flattened ``G * C_PAD`` tile."""
    i = tl.arange(0, G * C_PAD)
    return (i // C_PAD) * C + i % C_PAD, (i % C_PAD) < C


@triton.jit
def _prep_query_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    rot_ptr,
    out_ptr,
    num_q_heads,
    q_scale,
    ROTATE: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
):
    """``out[b, h, i] = (q[b, h] @ R / sqrt(D))[elem(i)] * q_scale``, fp16 ``[B, Hq, G*C_PAD]``."""
    row = tl.program_id(0)
    b = row // num_q_heads
    h = row % num_q_heads
    q_row = q_ptr + b * stride_qb + h * stride_qh
    elem, ok = _tile_elements(G, C, C_PAD)
    if ROTATE:
        d = tl.arange(0, D_PAD)
        q = tl.load(q_row + d, mask=d < D, other=0.0).to(tl.float32)
        rot_mask = (d[:, None] < D) & ok[None, :]
        rot = tl.load(rot_ptr + d[:, None] * D + elem[None, :], mask=rot_mask, other=0.0)
        q_code = tl.sum(q[:, None] * rot, axis=0) * INV_SQRT_D
    else:
        q_code = tl.load(q_row + elem, mask=ok, other=0.0).to(tl.float32)
    q_code = tl.where(ok, q_code * q_scale, 0.0)
    tl.store(out_ptr + row * (G * C_PAD) + tl.arange(0, G * C_PAD), q_code.to(tl.float16))


@triton.jit
def _load_values(
    code_row,
    valid,
    levels_ptr,
    KIND: tl.constexpr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    OFF1: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
):
    """Decode one side's codes of ``BLOCK_N`` tokens into fp16, *before* the per-token scalars
    (Lloyd-Max levels, uniform integer codes, fp8 or int8 values).

    4-bit codes (``G == 2``) come back as two halves ``[BLOCK_N, C_PAD]`` (low and high
    nibbles: elements ``[0, C)`` and ``[C, 2C)``), decoded by the inline PTX ``ASM`` when one is
    given; other codes as one tile ``[BLOCK_N, G * C_PAD]`` in tile order (returned twice).
    """
    if G == 2:
        c = tl.arange(0, C_PAD)[None, :]
        packed = tl.load(code_row[:, None] + c, mask=valid[:, None] & (c < C), other=0)
        if ASM != "":
            first, second = tl.inline_asm_elementwise(
                ASM,
                "=r,=r,=r,=r,r",
                [packed],
                dtype=(tl.float16, tl.float16),
                is_pure=True,
                pack=4,
            )
        else:
            low_codes = (packed & 15).to(tl.int32)
            high_codes = (packed >> 4).to(tl.int32)
            if KIND == _LLOYD_MAX:
                first = tl.load(levels_ptr + low_codes).to(tl.float16)
                second = tl.load(levels_ptr + high_codes).to(tl.float16)
            else:
                first = low_codes.to(tl.float16)
                second = high_codes.to(tl.float16)
    else:
        if KIND == _LLOYD_MAX or KIND == _UNIFORM:
            codes = load_codes(code_row, valid, W0, W1, OFF1, BLOCK_N, G, C, C_PAD)
            if KIND == _LLOYD_MAX:
                values = tl.load(levels_ptr + codes).to(tl.float16)
            else:
                values = codes.to(tl.float16)
        else:
            i = tl.arange(0, C_PAD)[None, None, :]
            mask = valid[:, None, None] & (i < C)
            byte = tl.load(code_row[:, None, None] + i, mask=mask, other=0)
            if KIND == _INT8_ABSMAX:
                values = byte.to(tl.int8, bitcast=True).to(tl.float16)
            else:
                values = byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        first = tl.reshape(values, (BLOCK_N, G * C_PAD))
        second = first
    return first, second


@triton.jit
def _split_kernel(
    q_ptr,
    k_codes_ptr,
    v_codes_ptr,
    meta_ptr,
    stride_kc_page,
    stride_kc_head,
    stride_kc_slot,
    stride_vc_page,
    stride_vc_head,
    stride_vc_slot,
    stride_m_page,
    stride_m_head,
    stride_m_slot,
    block_table_ptr,
    stride_bt_b,
    stride_bt_p,
    seq_lens_ptr,
    codebooks_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_kv_heads,
    max_pages,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BITS: tl.constexpr,
    K_NC: tl.constexpr,
    K_META: tl.constexpr,
    K_W0: tl.constexpr,
    K_W1: tl.constexpr,
    K_OFF1: tl.constexpr,
    K_G: tl.constexpr,
    K_C: tl.constexpr,
    K_C_PAD: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BITS: tl.constexpr,
    V_NC: tl.constexpr,
    V_META: tl.constexpr,
    V_W0: tl.constexpr,
    V_W1: tl.constexpr,
    V_OFF1: tl.constexpr,
    V_G: tl.constexpr,
    V_C: tl.constexpr,
    V_C_PAD: tl.constexpr,
    CODEBOOK_STRIDE: tl.constexpr,
    K_ASM: tl.constexpr,
    V_ASM: tl.constexpr,
):
    split = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    # 4-bit sides are two halves (two dots); other widths one tile. KA / VA: columns per dot.
    KA: tl.constexpr = K_C_PAD if K_G == 2 else K_G * K_C_PAD
    VA: tl.constexpr = V_C_PAD if V_G == 2 else V_G * V_C_PAD

    # This split's token range, from the device-side length: [start, end).
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_pages * PAGE_SIZE)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    # The GQA group's prepared queries, fp16 [G_PAD, KA] per half (rows >= GROUP are padding).
    g = tl.arange(0, G_PAD)
    row_ok = g < GROUP
    q_rows = (b * num_kv_heads * GROUP + head * GROUP + g).to(tl.int64)
    q_half = q_ptr + q_rows[:, None] * (K_G * K_C_PAD) + tl.arange(0, KA)[None, :]
    q_a = tl.load(q_half, mask=row_ok[:, None], other=0.0)
    q_b = tl.load(q_half + KA, mask=row_ok[:, None] & (K_G == 2), other=0.0)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc_a = tl.zeros([G_PAD, VA], tl.float32)
    acc_b = tl.zeros([G_PAD, VA], tl.float32)
    zero_acc = tl.zeros([G_PAD], tl.float32)
    k_head = head.to(tl.int64) * stride_kc_head
    v_head = head.to(tl.int64) * stride_vc_head
    m_head = head.to(tl.int64) * stride_m_head
    for tile_start in range(start, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        valid = n < end
        page = tl.load(
            block_table_ptr + b * stride_bt_b + (n // PAGE_SIZE) * stride_bt_p, mask=valid, other=0
        )
        page = page.to(tl.int64)
        slot = (n % PAGE_SIZE).to(tl.int64)
        k_row = k_codes_ptr + page * stride_kc_page + k_head + slot * stride_kc_slot
        v_row = v_codes_ptr + page * stride_vc_page + v_head + slot * stride_vc_slot
        m_row = meta_ptr + page * stride_m_page + m_head + slot * stride_m_slot

        k_a, k_b = _load_values(
            k_row,
            valid,
            codebooks_ptr,
            K_KIND,
            K_W0,
            K_W1,
            K_OFF1,
            K_G,
            K_C,
            K_C_PAD,
            BLOCK_N,
            K_ASM,
        )
        scores = tl.dot(q_a, tl.trans(k_a))  # [G_PAD, BLOCK_N] fp32, log2 domain
        if K_G == 2:
            scores = tl.dot(q_b, tl.trans(k_b), scores)
        if K_KIND != _FP8:
            k_mul = tl.load(m_row + K_META, mask=valid, other=0.0).to(tl.float32)
            scores = scores * k_mul[None, :]
        scores = tl.where(valid[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        v_a, v_b = _load_values(
            v_row,
            valid,
            codebooks_ptr + CODEBOOK_STRIDE,
            V_KIND,
            V_W0,
            V_W1,
            V_OFF1,
            V_G,
            V_C,
            V_C_PAD,
            BLOCK_N,
            V_ASM,
        )
        v_mul = tl.load(m_row + V_META, mask=valid, other=0.0).to(tl.float32)
        if V_KIND == _UNIFORM:
            v_zero = tl.load(m_row + V_META + 1, mask=valid, other=0.0).to(tl.float32)
            zero_acc = zero_acc * alpha + tl.sum(p * v_zero[None, :], axis=1)
        pv = (p * v_mul[None, :]).to(tl.float16)
        acc_a = tl.dot(pv, v_a, acc_a * alpha[:, None])
        if V_G == 2:
            acc_b = tl.dot(pv, v_b, acc_b * alpha[:, None])

    # This split's partial, normalized, in natural element order; lse in the log2 domain.
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.math.log2(safe_l), float("-inf"))
    part_rows = q_rows * NUM_SPLITS + split
    out_rows = part_out_ptr + part_rows[:, None] * D
    if V_G == 2:
        c = tl.arange(0, V_C_PAD)[None, :]
        ok = row_ok[:, None] & (c < V_C)
        tl.store(out_rows + c, (acc_a + zero_acc[:, None]) / safe_l[:, None], mask=ok)
        tl.store(out_rows + V_C + c, (acc_b + zero_acc[:, None]) / safe_l[:, None], mask=ok)
    else:
        elem, ok = _tile_elements(V_G, V_C, V_C_PAD)
        tl.store(
            out_rows + elem[None, :],
            (acc_a + zero_acc[:, None]) / safe_l[:, None],
            mask=row_ok[:, None] & ok[None, :],
        )
    tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    rot_ptr,
    out_ptr,
    NUM_SPLITS: tl.constexpr,
    ROTATE_BACK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """``out[row] = sum_s w_s * o_s / sum_s w_s`` with ``w_s = exp2(lse_s - max lse)``."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s)
    m = tl.max(lse, axis=0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)
    total = tl.sum(w, axis=0)
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + s)[:, None] * D + d[None, :],
        mask=(d < D)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    if ROTATE_BACK:
        # x = y @ R.T / sqrt(D): out[j] = sum_i y[i] * R[j, i].
        rot_mask = (d[:, None] < D) & (d < D)[None, :]
        rot = tl.load(rot_ptr + d[None, :] * D + d[:, None], mask=rot_mask, other=0.0)
        out = tl.sum(out[:, None] * rot, axis=0) * INV_SQRT_D
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """A fixed split count for a cache: enough programs to fill the GPU, splits of >= 256 tokens.

    Chosen once from the cache's capacity (``batch`` x ``max_seq_len``) and the GPU's SM count,
    never from the current lengths, so a captured graph stays valid as sequences grow.
    """
    wanted = triton.cdiv(4 * sm_count, max(1, batch * num_kv_heads))
    by_length = max(1, max_seq_len // 256)
    return triton.next_power_of_2(max(1, min(wanted, by_length)))


def _split_launch(
    fmt,
    q_code,
    cache,
    block_table,
    seq_lens,
    codebooks,
    part_out,
    part_lse,
    num_splits,
    block_n,
    fast,
    num_warps=2,
    num_stages=3,
):
    """Grid, positional and keyword arguments of ``_split_kernel``."""
    batch, num_q_heads, _ = q_code.shape
    _, num_kv_heads, page_size, _ = cache.k_codes.shape
    head_dim = part_out.shape[-1]
    group = num_q_heads // num_kv_heads
    grid = (num_splits, num_kv_heads, batch)
    args = (
        q_code,
        cache.k_codes,
        cache.v_codes,
        cache.meta,
        *cache.k_codes.stride()[:3],
        *cache.v_codes.stride()[:3],
        *cache.meta.stride()[:3],
        block_table,
        *block_table.stride(),
        seq_lens,
        codebooks,
        part_out,
        part_lse,
        num_kv_heads,
        block_table.shape[1],
    )
    kwargs = dict(
        PAGE_SIZE=page_size,
        D=head_dim,
        GROUP=group,
        G_PAD=max(_MIN_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        **codec_constexprs("K", fmt.key, first_meta_column(fmt, "k"), head_dim),
        **codec_constexprs("V", fmt.value, first_meta_column(fmt, "v"), head_dim),
        CODEBOOK_STRIDE=codebooks.stride(0),
        K_ASM=decode_asm(fmt.key, head_dim) if fast else "",
        V_ASM=decode_asm(fmt.value, head_dim) if fast else "",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return grid, args, kwargs


def _buffers(fmt, q, num_splits):
    batch, num_q_heads, head_dim = q.shape
    key_planes = PlaneParams.of(fmt.key, head_dim)
    kdim = key_planes.groups * key_planes.chunk_pad
    q_code = torch.empty(batch, num_q_heads, kdim, dtype=torch.float16, device=q.device)
    part_out = torch.empty(
        batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    return key_planes, q_code, part_out, part_lse


def decode(
    fmt: KVFormat,
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    num_splits: int,
    scale: float,
    block_n: int = 64,
    fast: bool | None = None,
    num_warps: int = 2,
    num_stages: int = 3,
) -> torch.Tensor:
    """Launch the decode kernels (inputs validated; see ``torch.ops.tq.decode``).

    ``fast`` selects the inline-PTX decoding of 4-bit codes (default: on CUDA); it does not run
    under the interpreter, where the kernel decodes in plain Triton. ``block_n``, ``num_warps``
    and ``num_stages`` tune the split kernel (defaults measured best on H100/H200, NOTES.md).
    """
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    key_planes, q_code, part_out, part_lse = _buffers(fmt, q, num_splits)
    inv_sqrt_d = 1.0 / math.sqrt(head_dim)
    d_pad = triton.next_power_of_2(head_dim)
    _prep_query_kernel[(batch * num_q_heads,)](
        q,
        q.stride(0),
        q.stride(1),
        rotation,
        q_code,
        num_q_heads,
        scale * LOG2E,
        ROTATE=fmt.key.rotated,
        D=head_dim,
        D_PAD=d_pad,
        INV_SQRT_D=inv_sqrt_d,
        G=key_planes.groups,
        C=key_planes.chunk,
        C_PAD=key_planes.chunk_pad,
    )
    fast = q.device.type == "cuda" if fast is None else fast
    grid, args, kwargs = _split_launch(
        fmt,
        q_code,
        cache,
        block_table,
        seq_lens,
        codebooks,
        part_out,
        part_lse,
        num_splits,
        block_n,
        fast,
        num_warps,
        num_stages,
    )
    _split_kernel[grid](*args, **kwargs)
    _merge_kernel[(batch * num_q_heads,)](
        part_out,
        part_lse,
        rotation,
        out,
        NUM_SPLITS=num_splits,
        ROTATE_BACK=fmt.value.rotated,
        D=head_dim,
        D_PAD=d_pad,
        INV_SQRT_D=inv_sqrt_d,
    )
    return out


def compile_split_kernel(
    fmt,
    q,
    cache,
    block_table,
    seq_lens,
    rotation,
    codebooks,
    num_splits,
    block_n,
    compile_fn,
    fast=True,
):
    """Compile (not launch) the split kernel for these inputs through ``compile_fn(kernel, grid,
    *args, **kwargs)``; used by ``benchmarks/sass_report.py`` to inspect its SASS."""
    del rotation
    _, q_code, part_out, part_lse = _buffers(fmt, q, num_splits)
    grid, args, kwargs = _split_launch(
        fmt,
        q_code,
        cache,
        block_table,
        seq_lens,
        codebooks,
        part_out,
        part_lse,
        num_splits,
        block_n,
        fast,
    )
    return compile_fn(_split_kernel, grid, *args, **kwargs)
