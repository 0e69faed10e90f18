"""The verify kernel: 32 query rows of a GQA group over one split of the compressed tokens, in
Gluon (Triton's dialect with explicit layouts and shared memory).

A speculative-decoding verify step of T = 8 tokens at GQA 4 (any ``T x group = 32``) asks each
(sequence, kv-head) program for 32 query rows. The split kernel (Triton) holds their ``[D, 32]``
float32 accumulators and the query operand in one warp and spills; a second warp would decode
every tile again (``docs/design/decode.md#the-verify-kernel-in-gluon``). This kernel keeps
one warp per program (grid ``(num_splits, Hk, B)``, the split kernel's) and:

* puts the rows on the tensor cores' M dimension (``S = Q K^T``, ``O += P V``, two m16 tiles of
  ``mma_v2``), so each operand fragment of the keys and values serves both;
* brings each 32-token tile's code bytes to shared memory by ``cp.async`` one tile ahead and
  reads them back as 32-bit words laid out as the B operands' registers, each word decoded into
  8 fp16 values (:func:`~custom_ops.triton.decode.ptx.words_asm`) whose pairs *are* operand
  registers: no decoded tile in shared memory, no byte repacking. That fixes the order in which
  dims and tokens meet the tensor cores: the query's dims are stored permuted once (four blocks
  of 32, :func:`_query_dims`), and the key rows are copied in the tile's token order
  (:func:`_tile_token`), which the values' words give;
* keeps the prepared query in shared memory, read per dim block each tile (its registers would
  not fit beside the accumulators);
* rescales only when a row's scores pass the reference they are taken against by
  ``RESCALE_SLACK`` (the split kernel's slack; here only those rows move, in a branch of the one
  warp), and redoes the split in units of its largest value scale where ``p * scale`` could
  overflow fp16 or lose precision (the split kernel's second pass, the same bounds).

What it serves (:func:`serves`, the plan's choice): 4-bit Lloyd-Max keys and 4-bit uniform
values (``4bit_nc``), D = 128, pages of 16 tokens or more (powers of two), exactly 32 query rows
per kv-head (T = 8 at GQA 4, T = 4 at GQA 8, ...), masks of either kind, and the recent
window's rings (the window and the sinks, read in full precision after the compressed tokens, a
tile per split round robin, as the split kernel does, into the shared memory the codes and the
prepared query had; rings of the query's dtype; the sinks' page slots are never read). Its
partials are the split kernel's, merged by the merge. Gluon
kernels do not run under Triton's interpreter and inductor does not launch them, so the plan
takes this kernel for eager launches on Hopper GPUs only; its tests run on a GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from custom_ops.formats import Kind, KVFormat, PagedKVCache, RecentWindow
from custom_ops.triton.decode.ptx import decode_asm, words_asm
from custom_ops.triton.decode.softmax import LOG2E, RESCALE_SLACK, causal_ends
from custom_ops.triton.decode.split import UNIT_MAX, UNIT_MIN
from custom_ops.triton.paged import ring_run_length, ring_run_positions, ring_slots
from custom_ops.triton.traced import unread

__all__ = ["ROWS", "BLOCK_N", "serves", "verify_constexprs", "verify_arguments", "verify_kernel"]

ROWS = 32  # query rows per program: two m16 tiles in one warp
BLOCK_N = 32  # tokens per tile
_ROWS = gl.constexpr(ROWS)
# ring places per tile: one k16 step of the values' product
_RING_BLOCK = gl.constexpr(16)
_BLOCK_N = gl.constexpr(BLOCK_N)
_D = gl.constexpr(128)
_LOG2E = gl.constexpr(LOG2E)


def serves(
    fmt: KVFormat,
    head_dim: int,
    page_size: int,
    rows: int,
    q_dtype: torch.dtype,
    ring_dtype: torch.dtype | None,
    device: torch.device,
    fast: bool,
) -> bool:
    """Whether this kernel takes a decode's split work: ``rows`` query rows per kv-head (Hq / Hk
    times the query tokens), on a Hopper GPU with the inline-PTX path (``fast``); rings, if
    any, of the query's dtype, fp16 or bf16 (the tensor cores' operands)."""
    key, value = fmt.key, fmt.value
    return (
        fast
        and ring_dtype in (None, q_dtype)
        and q_dtype in (torch.float16, torch.bfloat16)
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and key.kind == Kind.LLOYD_MAX
        and key.bits == 4
        and value.kind == Kind.UNIFORM
        and value.bits == 4
        and head_dim == _D.value
        and rows == ROWS
        and page_size >= 16
        and page_size & (page_size - 1) == 0
    )


def verify_constexprs(
    fmt: KVFormat,
    key_meta: int,
    value_meta: int,
    q_tokens: int,
    page_size: int,
    window: int,
    sinks: int,
    mask_kind: int,
    num_splits: int,
    num_partials: int,
    pdl: bool,
) -> dict:
    """The kernel's compile-time arguments and launch options for a plan (``pdl``: launched
    with programmatic dependent launch after the query preparation, which it waits for)."""
    head_dim = _D.value
    return dict(
        K_ASM=words_asm(decode_asm(fmt.key, head_dim)),
        V_ASM=words_asm(decode_asm(fmt.value, head_dim)),
        K_META=key_meta,
        V_META=value_meta,
        Q_TOKENS=q_tokens,
        PAGE_SIZE=page_size,
        WINDOW=window,
        SINKS=sinks,
        MASK=mask_kind,
        NUM_SPLITS=num_splits,
        NUM_PARTIALS=num_partials,
        PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )


def verify_arguments(
    rows: torch.Tensor,
    q_code: torch.Tensor,
    q_scale: float,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window: RecentWindow | None,
    mask_args: tuple,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
) -> tuple:
    """The kernel's runtime arguments: the query rows ``rows [B, Hq * T, D]`` (the rings' dtype;
    read for the rings), their prepared form ``q_code [B, Hq * T, D] fp16`` and ``q_scale``
    (``scale * log2(e)``), the cache (contiguous planes), ``block_table [B, max_pages]``,
    ``seq_lens [B]``, the recent window (rings ``[>= B, Hk, W + sinks, D]`` and their slots'
    positions ``[>= B, Hk, W + sinks]``; None without rings: placeholders, never read),
    ``mask_args`` (``(mask, stride_b, stride_h, stride_t, mask_len)``) and the partials ``[B,
    Hq * T, num_partials, D]`` and their lse.

    With rings the kernel copies ``rows`` by 16-byte ``cp.async``, which compiles only where
    Triton knows each row's start 16-byte aligned: the pointer, and strides divisible by 16
    elements (its specialization). Other rows (a padded or offset query) are passed as a
    contiguous copy."""
    k_codes, v_codes, meta = cache
    if window is None:
        rings = (unread(rows), unread(rows), 0, 0, 0, unread(seq_lens), 0, 0)
    else:
        k_window, v_window, window_pos = window[:3]
        rings = (k_window, v_window, *k_window.stride()[:3], window_pos, *window_pos.stride()[:2])
        stride_b, stride_h, stride_d = rows.stride()
        if rows.data_ptr() % 16 or stride_b % 16 or stride_h % 16 or stride_d != 1:
            rows = rows.clone(memory_format=torch.contiguous_format)
    return (
        q_code,
        rows,
        rows.stride(0),
        rows.stride(1),
        q_scale,
        k_codes,
        v_codes,
        meta,
        k_codes.stride(0),
        k_codes.stride(1),
        v_codes.stride(0),
        v_codes.stride(1),
        meta.stride(0),
        meta.stride(1),
        meta.stride(2),
        block_table,
        *block_table.stride(),
        block_table.shape[1],
        seq_lens,
        *rings,
        *mask_args,
        part_out,
        part_lse,
        k_codes.shape[1],
    )


@gluon.jit
def _grid_dependency(INSTRUCTION: gl.constexpr):
    """``griddepcontrol.<INSTRUCTION>`` (programmatic dependent launch; Triton's ``gdc_wait`` /
    ``gdc_launch_dependents``, which Gluon lacks): ``wait`` for the kernel before, or let the
    next one launch (``launch_dependents``)."""
    gl.inline_asm_elementwise(
        f"griddepcontrol.{INSTRUCTION}; // dummy $0",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _tile_token(n):
    """The token (within a tile) of operand column / row ``n`` (0..31): the values' words hold 4
    consecutive tokens, whose pairs ``(4w, 4w + 1)`` make rows ``2w, 2w + 1`` of the first 16
    and ``(4w + 2, 4w + 3)`` of the last 16."""
    c = n % 16
    return 4 * (c // 2) + c % 2 + 2 * (n // 16)


@gluon.jit
def _query_dims(k, block: gl.constexpr):
    """The head dim of column ``k`` (0..31) of the query's dim ``block`` (0..3): a key word holds
    dims ``4w .. 4w + 3`` (low nibbles) and ``64 + 4w ..`` (high), paired as ``_tile_token``."""
    return 64 * (block // 2) + 4 * (k // 2) + 2 * (block % 2) + k % 2


@gluon.jit
def _pair(a, b, K: gl.constexpr, N: gl.constexpr, OP: gl.constexpr):
    """fp16 ``a``, ``b [K / 2, N]`` -> ``[K, N]`` with row ``2i`` from ``a``, ``2i + 1`` from
    ``b``, in the operand layout ``OP`` (a relabelling: the pairs are registers already)."""
    x = gl.permute(gl.join(a, b), [0, 2, 1])  # [K / 2, 2, N]
    return gl.convert_layout(gl.reshape(x, [K, N]), OP)


@gluon.jit
def _value_operand(f0, f1, f2, f3, N: gl.constexpr, OP: gl.constexpr):
    """Values of tokens ``4w + i`` (``fi [8, N]``) -> the ``[32, N]`` operand whose row ``k`` is
    token ``_tile_token(k)``."""
    x = gl.join(gl.join(f0, f1), gl.join(f2, f3))  # [8, N, 2 (+1), 2 (+2)]
    x = gl.permute(x, [3, 0, 2, 1])  # [2, 8, 2, N]
    return gl.convert_layout(gl.reshape(x, [32, N]), OP)


@gluon.jit
def _words(word_tile, ASM: gl.constexpr):
    """Decode ``int32`` code words: 8 fp16 tensors of their shape (bytes 0..3's low nibbles,
    then their high nibbles)."""
    return gl.inline_asm_elementwise(
        ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r",
        [word_tile],
        dtype=(gl.float16,) * 8,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _tile_pages(bt, tile, end, t, PAGE_SIZE: gl.constexpr):
    """int64 pages of a tile's tokens ``tile + t``: one or two table entries (tiles are aligned to
    BLOCK_N, pages hold 16 tokens or more), loaded once for all of ``t``; an entry wholly past
    ``end`` is not read (0: tokens there are masked, and may read a page's stale slots).
    ``bt``: the sequence's table row and its entries' stride."""
    row, stride_page = bt  # the sequence's table row and its entries' stride
    first = tile // PAGE_SIZE
    page = gl.load(row + first * stride_page, mask=tile < end, other=0)
    if PAGE_SIZE < 32:
        second = gl.load(row + (first + 1) * stride_page, mask=tile + PAGE_SIZE < end, other=0)
        page = gl.where(t < PAGE_SIZE, page, second)
    return page.to(gl.int64)


@gluon.jit
def _issue_codes(k_raw, v_raw, tile, end, bt, head_planes, PAGE_SIZE: gl.constexpr):
    """Start copying a tile's code bytes to shared memory (one commit group): key rows ``k_raw
    [32, 64]`` in ``_tile_token`` order, value rows ``v_raw [64, 32]`` (a byte of 32 tokens) in
    token order."""
    KL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])  # [tokens, bytes]
    VL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])  # [bytes, tokens]
    k_base, v_base, _, kc_page, vc_page, _, _ = head_planes
    t_k = _tile_token(gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(1, KL)))
    bytes_k = gl.arange(0, _D // 2, layout=gl.SliceLayout(0, KL))
    k_at = k_base + _tile_pages(bt, tile, end, t_k, PAGE_SIZE) * kc_page
    k_at += (t_k % PAGE_SIZE) * (_D // 2)
    async_copy.async_copy_global_to_shared(
        k_raw, gl.max_contiguous(gl.multiple_of(k_at[:, None] + bytes_k[None, :], [1, 8]), [1, 8])
    )
    t_v = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, VL))
    bytes_v = gl.arange(0, _D // 2, layout=gl.SliceLayout(1, VL))
    v_at = v_base + _tile_pages(bt, tile, end, t_v, PAGE_SIZE) * vc_page + t_v % PAGE_SIZE
    async_copy.async_copy_global_to_shared(
        v_raw,
        gl.max_contiguous(
            gl.multiple_of(v_at[None, :] + bytes_v[:, None] * PAGE_SIZE, [1, 8]), [1, 8]
        ),
    )
    async_copy.commit_group()


@gluon.jit
def _head_planes(planes, head):
    """The kv-head's code planes and meta and their strides: ``(k_base, v_base, m_base,
    kc_page, vc_page, m_page, m_slot)``."""
    k_codes, v_codes, meta, kc_page, kc_head, vc_page, vc_head, m_page, m_head, m_slot = planes
    head_at = head.to(gl.int64)
    return (
        k_codes + head_at * kc_head,
        v_codes + head_at * vc_head,
        meta + head_at * m_head,
        kc_page,
        vc_page,
        m_page,
        m_slot,
    )


@gluon.jit
def _tile_scalars(
    tile,
    end,
    bt,
    head_planes,
    K_META: gl.constexpr,
    V_META: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SINKS: gl.constexpr,
):
    """A tile's key scales, value scales and value zeros (``[BLOCK_N]`` float32, a token a lane
    in ``_tile_token`` order): 0 past ``end`` and at the sinks' page slots, which are never
    read."""
    ML: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    _, _, m_base, _, _, m_page, m_slot = head_planes
    t_m = _tile_token(gl.arange(0, _BLOCK_N, layout=ML))
    m_at = m_base + _tile_pages(bt, tile, end, t_m, PAGE_SIZE) * m_page
    m_at += (t_m % PAGE_SIZE) * m_slot
    ok = (tile + t_m < end) & (tile + t_m >= SINKS)
    k_mul = gl.load(m_at + K_META, mask=ok, other=0.0).to(gl.float32)
    v_mul = gl.load(m_at + V_META, mask=ok, other=0.0).to(gl.float32)
    v_zero = gl.load(m_at + V_META + 1, mask=ok, other=0.0).to(gl.float32)
    return k_mul, v_mul, v_zero


@gluon.jit
def _first_tile(
    k_raw,
    v_raw,
    start,
    end,
    bt,
    head_planes,
    K_META: gl.constexpr,
    V_META: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SINKS: gl.constexpr,
):
    """Start a split pass: its first tile's codes on their way to buffer 0, and its scalars
    (:func:`_tile_scalars`)."""
    _issue_codes(k_raw.index(0), v_raw.index(0), start, end, bt, head_planes, PAGE_SIZE)
    return _tile_scalars(start, end, bt, head_planes, K_META, V_META, PAGE_SIZE, SINKS)


@gluon.jit
def _ring_view(buffer, rows: gl.constexpr, dtype: gl.constexpr):
    """``[rows, D]`` of the rings' dtype (an A or B operand's rows) in the place of ``buffer``,
    a buffer of the split passes: the ring pass comes after them."""
    RING_SMEM: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    return buffer._reinterpret(dtype, [rows, _D], RING_SMEM)


@gluon.jit
def _issue_query(q_smem, q_orig, b, head, dtype: gl.constexpr):
    """Start copying the rows' original queries (``q_orig``: the rows' pointer and strides, which
    :func:`verify_arguments` keeps 16-byte aligned) to the place of the prepared ones
    (``q_smem``, viewed as ``dtype``, the rings'; one commit group)."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])  # [rows, dims]
    q_ptr, stride_qb, stride_qh = q_orig
    rows = head * _ROWS + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, LOAD))
    at = q_ptr + b.to(gl.int64) * stride_qb + rows[:, None] * stride_qh
    at += gl.arange(0, _D, layout=gl.SliceLayout(0, LOAD))[None, :]
    async_copy.async_copy_global_to_shared(_ring_view(q_smem, _ROWS, dtype), at)
    async_copy.commit_group()


@gluon.jit
def _store_query(q_smem, q_code, q_row):
    """The prepared query rows ``q_row ..`` (``q_code``, fp16) into ``q_smem [4, 32, 32]``, the
    dims of block ``i`` in ``_query_dims`` order."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])
    rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, QL))
    k = gl.arange(0, 32, layout=gl.SliceLayout(0, QL))
    q_at = q_code + (q_row + rows)[:, None].to(gl.int64) * _D
    for block in gl.static_range(4):
        q_smem.index(block).store(gl.load(q_at + _query_dims(k, block)[None, :]))


@gluon.jit
def _ring_start(pos_ptr, seq_len, WINDOW: gl.constexpr):
    """Where the ring run starts (``paged.ring_start``, whose ``tl.arange`` has no layout for
    Gluon): the least position below ``seq_len`` of the ``WINDOW`` slots' positions,
    ``seq_len`` if none."""
    first = seq_len
    if WINDOW > 0:
        SLOTS: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        for r0 in range(0, WINDOW, 128):
            r = r0 + gl.arange(0, 128, layout=SLOTS)
            held = gl.load(pos_ptr + r, mask=r < WINDOW, other=-1)
            in_run = (held >= 0) & (held < seq_len)
            first = gl.minimum(first, gl.min(gl.where(in_run, held, seq_len), axis=0))
    return first


@gluon.jit
def _masked_scores(
    x, seen, positions, q_rows, b, masking, MASK: gl.constexpr, Q_TOKENS: gl.constexpr
):
    """``x [32, N]`` (log2 units) at ``-inf`` outside ``seen [32, N]``, and the attention mask
    at key ``positions [N]`` of the query rows ``q_rows`` (``softmax.mask_scores``: boolean,
    False masks out; additive, natural-log units)."""
    mask_ptr, stride_b, stride_h, stride_t, mask_len = masking
    x = gl.where(seen, x, float("-inf"))
    if MASK != 0:
        rows = (q_rows // Q_TOKENS) * stride_h + (q_rows % Q_TOKENS) * stride_t
        at = mask_ptr + b.to(gl.int64) * stride_b + rows[:, None] + positions[None, :]
        in_mask = (positions < mask_len)[None, :] & (q_rows >= 0)[:, None]
        if MASK == 1:
            x = gl.where(gl.load(at, mask=in_mask, other=0) != 0, x, float("-inf"))
        else:
            bias = gl.load(at, mask=in_mask, other=float("-inf")).to(gl.float32)
            x = x + bias * _LOG2E
    return x


@gluon.jit
def _seen(positions, end, row_end, SINKS: gl.constexpr):
    """``[32, N]``: which compressed ``positions`` each row sees (below the split's end and the
    row's causal end; the sinks' are read from the ring)."""
    seen = (positions[None, :] < end) & (positions[None, :] < row_end[:, None])
    if SINKS > 0:
        seen = seen & (positions[None, :] >= SINKS)
    return seen


@gluon.jit
def _softmax_step(x, state):
    """One tile's online-softmax step: ``(p, state)`` for scores ``x [32, N]`` relative to the
    rows' references (``state = (m, l, zero_acc, acc_lo, acc_hi)``). A row moves its reference
    to its maximum on its first keys, or when a tile's scores pass it by the slack (the
    accumulators rescaled, a branch of the one warp); a row that saw no key keeps it."""
    m_ref, l_i, zero_acc, acc_lo, acc_hi = state
    x_max = gl.max(x, axis=1)
    moves = (x_max - RESCALE_SLACK > 0) | ((l_i == 0.0) & (x_max > float("-inf")))
    if gl.max(moves.to(gl.int32), axis=0) > 0:
        shift = gl.where(moves, x_max, 0.0)
        alpha = gl.exp2(-shift)
        m_ref += shift
        x = x - shift[:, None]
        l_i *= alpha
        zero_acc *= alpha
        acc_lo *= alpha[:, None]
        acc_hi *= alpha[:, None]
    p = gl.exp2(x)
    return p, (m_ref, l_i + gl.sum(p, axis=1), zero_acc, acc_lo, acc_hi)


@gluon.jit
def _split_pass(
    inv_unit,
    start,
    end,
    seq_len,
    b,
    head,
    q_smem,
    k_raw,
    v_raw,
    k_mul_s,
    v_mul_s,
    v_zero_s,
    head_planes,
    bt,
    masking,
    scalars,
    K_ASM: gl.constexpr,
    V_ASM: gl.constexpr,
    K_META: gl.constexpr,
    V_META: gl.constexpr,
    Q_TOKENS: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    SINKS: gl.constexpr,
    MASK: gl.constexpr,
):
    """The online softmax over the split's compressed tokens ``[start, end)``: ``(state,
    v_top)``, ``state = (m, l, zero_acc, acc_lo, acc_hi)`` (:func:`_softmax_step`) with the
    value products in units of ``1 / inv_unit``, ``v_top`` the largest value scale seen; the
    first tile's codes are on their way, ``scalars`` its scalars (:func:`_first_tile`)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
    )
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # 32-bit code words as B operands of a k8 product: each register is a word whose 4 bytes
    # decode into two fp16 operand registers
    W_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=1)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    ML: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # [_BLOCK_N]: a token a lane
    RAW_W: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    HALF: gl.constexpr = _D // 2

    rows = gl.arange(0, _ROWS, layout=ROW)
    q_rows = head * _ROWS + rows  # the rows' index among the sequence's Hq * T
    row_end = causal_ends(seq_len, q_rows, Q_TOKENS, MASK)
    zeros = gl.zeros([_ROWS], gl.float32, ROW)
    acc = gl.zeros([_ROWS, HALF], gl.float32, MMA)
    state = (zeros, zeros, zeros, acc, acc)  # m, l, zero_acc, acc dims 0..63, dims 64..127
    t_c = _tile_token(gl.arange(0, _BLOCK_N, layout=COL))
    v_top = gl.zeros([_BLOCK_N], gl.float32, ML)
    k_mul, v_mul, v_zero = scalars
    buf = 0
    for tile in range(start, end, _BLOCK_N):
        nxt = tile + _BLOCK_N
        # the next tile's scalars, stored to shared memory next iteration
        next_k_mul, next_v_mul, next_v_zero = _tile_scalars(
            nxt, end, bt, head_planes, K_META, V_META, PAGE_SIZE, SINKS
        )
        v_top = gl.maximum(v_top, v_mul)
        k_mul_s.store(k_mul)
        v_mul_s.store(v_mul * inv_unit)
        v_zero_s.store(v_zero)
        async_copy.wait_group(0)
        gl.thread_barrier()  # this tile's codes and scalars are in shared memory
        _issue_codes(
            k_raw.index(1 - buf), v_raw.index(1 - buf), nxt, end, bt, head_planes, PAGE_SIZE
        )

        # S = Q K^T [32 rows, 32 tokens]: key words [16, 32] (word w of row n: dims 4w..4w+3
        # and 64 + 4w.. of token _tile_token(n)), four k32 products over the query's blocks
        k_words = k_raw.index(buf)._reinterpret(gl.int32, [_BLOCK_N, HALF // 4], RAW_W)
        e0, e1, e2, e3, e4, e5, e6, e7 = _words(k_words.permute([1, 0]).load(W_OP), K_ASM)
        s = gl.zeros([_ROWS, _BLOCK_N], gl.float32, MMA)
        s = mma_v2(q_smem.index(0).load(A_OP), _pair(e0, e1, 32, _BLOCK_N, B_OP), s)
        s = mma_v2(q_smem.index(1).load(A_OP), _pair(e2, e3, 32, _BLOCK_N, B_OP), s)
        s = mma_v2(q_smem.index(2).load(A_OP), _pair(e4, e5, 32, _BLOCK_N, B_OP), s)
        s = mma_v2(q_smem.index(3).load(A_OP), _pair(e6, e7, 32, _BLOCK_N, B_OP), s)
        x = s * k_mul_s.load(COL)[None, :] - state[0][:, None]
        positions = tile + t_c
        if MASK != 0:
            x = _masked_scores(
                x,
                _seen(positions, end, row_end, SINKS),
                positions,
                q_rows,
                b,
                masking,
                MASK,
                Q_TOKENS,
            )
        elif (tile < SINKS) | (tile + _BLOCK_N > end) | (tile + _BLOCK_N > seq_len - Q_TOKENS + 1):
            # only a split's last tile, the causal block's and the sinks' have masked positions
            x = _masked_scores(
                x,
                _seen(positions, end, row_end, SINKS),
                positions,
                q_rows,
                b,
                masking,
                MASK,
                Q_TOKENS,
            )
        p, state = _softmax_step(x, state)
        m_ref, l_i, zero_acc, acc_lo, acc_hi = state
        zero_acc += gl.sum(p * v_zero_s.load(COL)[None, :], axis=1)
        p_op = gl.convert_layout((p * v_mul_s.load(COL)[None, :]).to(gl.float16), A_OP)

        # O += P V: value words [8, 64] (word w of byte j: tokens 4w..4w+3, dims j and 64 + j)
        v_words = v_raw.index(buf)._reinterpret(gl.int32, [HALF, _BLOCK_N // 4], RAW_W)
        f0, f1, f2, f3, f4, f5, f6, f7 = _words(v_words.permute([1, 0]).load(W_OP), V_ASM)
        acc_lo = mma_v2(p_op, _value_operand(f0, f1, f2, f3, HALF, B_OP), acc_lo)
        acc_hi = mma_v2(p_op, _value_operand(f4, f5, f6, f7, HALF, B_OP), acc_hi)
        state = (m_ref, l_i, zero_acc, acc_lo, acc_hi)
        gl.thread_barrier()  # this tile's scalars are read before the next ones are stored
        k_mul = next_k_mul
        v_mul = next_v_mul
        v_zero = next_v_zero
        buf = 1 - buf
    async_copy.wait_group(0)
    gl.thread_barrier()
    return state, gl.max(v_top, axis=0)


@gluon.jit
def _ring_places(
    r0,
    run_len,
    seq_len,
    compressed_len,
    WINDOW: gl.constexpr,
    SINKS: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """``(in_ring, positions, slots)`` of the ring run's places ``r0 .. r0 + RING_BLOCK - 1``:
    the window's positions from ``compressed_len`` (slot ``p % W``), then the sinks (slot
    ``W + p``)."""
    run = r0 + gl.arange(0, _RING_BLOCK, layout=LAYOUT)
    positions = ring_run_positions(run, compressed_len, seq_len, SINKS)
    return run < run_len, positions, ring_slots(positions, WINDOW, SINKS)


@gluon.jit
def _issue_ring(
    k_ring_s, v_ring_s, r0, ring_run, ring_planes, WINDOW: gl.constexpr, SINKS: gl.constexpr
):
    """Start copying the keys and values of ring places ``r0 ..`` to ``k_ring_s``, ``v_ring_s
    [RING_BLOCK, D]`` (one commit group; places past the run are zero-filled)."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])  # [places, dims]
    run_len, seq_len, compressed_len, ring = ring_run
    k_window, v_window, stride_w_slot = ring_planes
    in_ring, _, slots = _ring_places(
        r0, run_len, seq_len, compressed_len, WINDOW, SINKS, gl.SliceLayout(1, LOAD)
    )
    dims = gl.arange(0, _D, layout=gl.SliceLayout(0, LOAD))
    rows = ring + slots[:, None] * stride_w_slot + dims[None, :]
    full = in_ring[:, None] & (dims >= 0)[None, :]
    async_copy.async_copy_global_to_shared(k_ring_s, k_window + rows, mask=full)
    async_copy.async_copy_global_to_shared(v_ring_s, v_window + rows, mask=full)
    async_copy.commit_group()


@gluon.jit
def _ring_pass(
    state,
    split,
    b,
    head,
    seq_len,
    compressed_len,
    q_smem,
    q_orig,
    q_scale,
    rings,
    k_raw,
    v_raw,
    masking,
    WINDOW: gl.constexpr,
    SINKS: gl.constexpr,
    MASK: gl.constexpr,
    Q_TOKENS: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
):
    """This split's share of the ring run (the window's positions from ``compressed_len``, then
    the sinks) into ``state``: its ``RING_BLOCK``-place tiles from the ``NUM_SPLITS - 1 -
    split``-th, every ``NUM_SPLITS``-th (the split kernel's ``RING`` share, which gives the
    split with the fewest compressed tokens the first). Exact values in the original space (as
    the compressed ones, not rotated): ``S = Q K^T`` against the original query in the rings'
    dtype, ``O += P V`` with ``P`` as two terms of it (``tiles.split_probabilities``). The
    query and each tile's keys and values are copied where the split passes kept the prepared
    query and the codes (``q_smem``, ``k_raw``, ``v_raw``): the ring adds no shared memory,
    and nothing of it is live through the compressed tokens."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
    )
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    HALF: gl.constexpr = _D // 2
    k_window, v_window, stride_w_b, stride_w_h, stride_w_slot = rings
    dtype: gl.constexpr = k_window.dtype.element_ty
    run_len = ring_run_length(compressed_len, seq_len, SINKS)
    ring = b.to(gl.int64) * stride_w_b + head.to(gl.int64) * stride_w_h
    # (places, the length, where the window's positions start, the sequence-head's rings)
    ring_run = (run_len, seq_len, compressed_len, ring)
    ring_planes = (k_window, v_window, stride_w_slot)
    k_ring_s = _ring_view(k_raw, _RING_BLOCK, dtype)
    v_ring_s = _ring_view(v_raw, _RING_BLOCK, dtype)
    q_ring = _ring_view(q_smem, _ROWS, dtype)
    rows = gl.arange(0, _ROWS, layout=ROW)
    q_rows = head * _ROWS + rows
    row_end = causal_ends(seq_len, q_rows, Q_TOKENS, MASK)
    first = (NUM_SPLITS - 1 - split) * _RING_BLOCK
    if first < run_len:
        _issue_query(q_smem, q_orig, b, head, dtype)  # waited for with the first tile
    for r0 in range(first, run_len, NUM_SPLITS * _RING_BLOCK):
        _issue_ring(k_ring_s, v_ring_s, r0, ring_run, ring_planes, WINDOW, SINKS)
        async_copy.wait_group(0)
        gl.thread_barrier()
        s = gl.zeros([_ROWS, _RING_BLOCK], gl.float32, MMA)
        for half in gl.static_range(2):
            q_op = q_ring.slice(half * HALF, HALF, dim=1).load(A_OP)
            k_op = k_ring_s.slice(half * HALF, HALF, dim=1).permute([1, 0]).load(B_OP)
            s = mma_v2(q_op, k_op, s)
        in_ring, positions, _ = _ring_places(
            r0, run_len, seq_len, compressed_len, WINDOW, SINKS, COL
        )
        seen = in_ring[None, :] & (positions[None, :] < row_end[:, None])
        x = _masked_scores(
            s * q_scale - state[0][:, None], seen, positions, q_rows, b, masking, MASK, Q_TOKENS
        )
        p, state = _softmax_step(x, state)
        m_ref, l_i, zero_acc, acc_lo, acc_hi = state
        p_hi = p.to(dtype)
        p_lo = gl.convert_layout((p - p_hi.to(gl.float32)).to(dtype), A_OP)
        p_hi = gl.convert_layout(p_hi, A_OP)
        v_lo = v_ring_s.slice(0, HALF, dim=1).load(B_OP)
        acc_lo = mma_v2(p_lo, v_lo, mma_v2(p_hi, v_lo, acc_lo))
        v_hi = v_ring_s.slice(HALF, HALF, dim=1).load(B_OP)
        acc_hi = mma_v2(p_lo, v_hi, mma_v2(p_hi, v_hi, acc_hi))
        state = (m_ref, l_i, zero_acc, acc_lo, acc_hi)
        gl.thread_barrier()  # the tile is read before the next one is copied
    return state


@gluon.jit
def verify_kernel(
    q_code,
    q_ptr,
    stride_qb,
    stride_qh,
    q_scale,
    k_codes,
    v_codes,
    meta,
    kc_page,
    kc_head,
    vc_page,
    vc_head,
    m_page,
    m_head,
    m_slot,
    table,
    stride_bt_b,
    stride_bt_p,
    max_pages,
    seq_lens,
    k_window,
    v_window,
    stride_w_b,
    stride_w_h,
    stride_w_slot,
    pos_ptr,
    stride_pos_b,
    stride_pos_h,
    mask_ptr,
    stride_mask_b,
    stride_mask_h,
    stride_mask_t,
    mask_len,
    part_out,
    part_lse,
    num_kv_heads,
    K_ASM: gl.constexpr,
    V_ASM: gl.constexpr,
    K_META: gl.constexpr,
    V_META: gl.constexpr,
    Q_TOKENS: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    WINDOW: gl.constexpr,
    SINKS: gl.constexpr,
    MASK: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    NUM_PARTIALS: gl.constexpr,
    PDL: gl.constexpr,
):
    """One (split, kv-head, sequence): the partial ``[32 rows, D]`` and lse (log2) of the
    sequence's 32 query rows of this kv-head over the split's compressed tokens and its share
    of the rings (see the module docstring; arguments from :func:`verify_arguments`)."""
    split = gl.program_id(0)
    head = gl.program_id(1)
    b = gl.program_id(2)
    if PDL:
        # the merge may launch now: it waits for this kernel before it reads the partials
        _grid_dependency("launch_dependents")
    HALF: gl.constexpr = _D // 2
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
    )
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    RAW: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_smem = gl.allocate_shared_memory(gl.float16, [4, _ROWS, 32], Q_SMEM)  # dim blocks
    k_raw = gl.allocate_shared_memory(gl.uint8, [2, _BLOCK_N, HALF], RAW)
    v_raw = gl.allocate_shared_memory(gl.uint8, [2, HALF, _BLOCK_N], RAW)
    k_mul_s = gl.allocate_shared_memory(gl.float32, [_BLOCK_N], FLAT)
    v_mul_s = gl.allocate_shared_memory(gl.float32, [_BLOCK_N], FLAT)
    v_zero_s = gl.allocate_shared_memory(gl.float32, [_BLOCK_N], FLAT)

    # This split's share of the compressed positions [0, ring start) (split.py's rule)
    seq_len = gl.minimum(gl.load(seq_lens + b), max_pages * PAGE_SIZE + WINDOW)
    positions = pos_ptr + b.to(gl.int64) * stride_pos_b + head.to(gl.int64) * stride_pos_h
    compressed_len = _ring_start(positions, seq_len, WINDOW)
    per_split = gl.cdiv(gl.cdiv(compressed_len, NUM_SPLITS), _BLOCK_N) * _BLOCK_N
    start = split * per_split
    end = gl.minimum(start + per_split, compressed_len)
    # the first tile's codes, on their way before the wait for the query preparation (which
    # may still be writing q_code: the codes do not depend on it)
    planes = _head_planes(
        (k_codes, v_codes, meta, kc_page, kc_head, vc_page, vc_head, m_page, m_head, m_slot), head
    )
    bt = (table + b.to(gl.int64) * stride_bt_b, stride_bt_p)
    scalars = _first_tile(k_raw, v_raw, start, end, bt, planes, K_META, V_META, PAGE_SIZE, SINKS)
    q_row = (b * num_kv_heads + head) * _ROWS
    if PDL:
        _grid_dependency("wait")  # for the preparation kernel's q_code
    _store_query(q_smem, q_code, q_row)

    masking = (mask_ptr, stride_mask_b, stride_mask_h, stride_mask_t, mask_len)
    state, v_top = _split_pass(
        1.0,
        start,
        end,
        seq_len,
        b,
        head,
        q_smem,
        k_raw,
        v_raw,
        k_mul_s,
        v_mul_s,
        v_zero_s,
        planes,
        bt,
        masking,
        scalars,
        K_ASM,
        V_ASM,
        K_META,
        V_META,
        Q_TOKENS,
        PAGE_SIZE,
        SINKS,
        MASK,
    )
    if ((v_top > UNIT_MAX) | (v_top < UNIT_MIN)) & (v_top > 0):
        # value scales whose products could overflow fp16 (or lose its precision): again in
        # units of the largest
        scalars = _first_tile(
            k_raw, v_raw, start, end, bt, planes, K_META, V_META, PAGE_SIZE, SINKS
        )
        state, _ = _split_pass(
            1.0 / v_top,
            start,
            end,
            seq_len,
            b,
            head,
            q_smem,
            k_raw,
            v_raw,
            k_mul_s,
            v_mul_s,
            v_zero_s,
            planes,
            bt,
            masking,
            scalars,
            K_ASM,
            V_ASM,
            K_META,
            V_META,
            Q_TOKENS,
            PAGE_SIZE,
            SINKS,
            MASK,
        )
        m_ref, l_i, zero_acc, acc_lo, acc_hi = state
        state = (m_ref, l_i, zero_acc, acc_lo * v_top, acc_hi * v_top)
    if WINDOW + SINKS > 0:
        rings = (k_window, v_window, stride_w_b, stride_w_h, stride_w_slot)
        state = _ring_pass(
            state,
            split,
            b,
            head,
            seq_len,
            compressed_len,
            q_smem,
            (q_ptr, stride_qb, stride_qh),
            q_scale,
            rings,
            k_raw,
            v_raw,
            masking,
            WINDOW,
            SINKS,
            MASK,
            Q_TOKENS,
            NUM_SPLITS,
        )

    m_ref, l_i, zero_acc, acc_lo, acc_hi = state
    has_keys = l_i > 0
    safe_l = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, m_ref + gl.log2(safe_l), float("-inf"))
    inv_l = 1.0 / safe_l
    zero_term = zero_acc * inv_l
    rows = gl.arange(0, _ROWS, layout=ROW)
    part_rows = (q_row + rows).to(gl.int64) * NUM_PARTIALS + split
    cols = gl.arange(0, HALF, layout=COL)
    out_at = part_out + part_rows[:, None] * _D + cols[None, :]
    gl.store(out_at, acc_lo * inv_l[:, None] + zero_term[:, None])
    gl.store(out_at + HALF, acc_hi * inv_l[:, None] + zero_term[:, None])
    gl.store(part_lse + part_rows, lse)
