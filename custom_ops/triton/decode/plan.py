"""The decode launch plan: every host-side decision of ``tq.decode``, made once per key.

:func:`plan_decode` turns (format, shapes, dtypes, window, mask kind, split count, device,
overrides) into a frozen :class:`DecodePlan`: which kernels run, their grids, compile-time
parameters and launch options. It is cached, so a decode step does no policy work after the
first call with the same key; the launcher (:func:`custom_ops.triton.decode.decode`) only binds
tensors to the plan's kernels. Tools and tests read plans instead of the kernels' internals.

Per-format speed choices come from :mod:`custom_ops.tuning`; the reasons for the defaults are in
``docs/design/decode.md#the-launch-plan``.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from custom_ops.formats import KVFormat
from custom_ops.splits import many_long_splits, resident_programs, splits_in_one_wave
from custom_ops.triton.decode import merge, merge_fill, prep, ring, verify
from custom_ops.triton.decode.codes import PartParams, part_params, subnormal_values
from custom_ops.triton.decode.softmax import LOG2E
from custom_ops.triton.decode.split import split_kernel
from custom_ops.triton.launch import KernelLaunch, Launcher
from custom_ops.tuning import decode_tuning

__all__ = [
    "QueryMode",
    "StepMode",
    "SplitConfig",
    "DecodePlan",
    "plan_decode",
    "evicts_in_last_split",
    "step_pays",
    "step_supported",
    "STEP_MAX_SEQUENCE_HEADS",
    "TOKENS_PER_STEP",
]

# Tokens the split kernel reads per softmax step (one 32-token tile, or two of 16), its warps
# per program and pipeline stages (H100 sweep, docs/design/decode.md, tiles).
TOKENS_PER_STEP = 32
DEFAULT_WARPS = 1
DEFAULT_STAGES = 2
# Ring tokens per tile when the split kernel reads the window itself: 16 keeps the ring loop's
# two pipeline stages within the compressed loop's shared memory class.
RING_BLOCK = 16
# Query rows per program (padded) from which the split kernel takes one tile per softmax step
# and the launch of MANY_ROWS_LAUNCH: a verify step of 4 or more tokens at GQA 4, and equally a
# one-token decode of a model with GQA 9 or more (the same kernel shape; measured with verify
# steps only).
MANY_ROWS = 16
# (num_warps, register cap or None for the usual one) per padded row count. H100 sweep (4bit_nc
# verify steps, 1x32768 and 16x8192, one warp / two / four x caps 128 / 192 / 255;
# docs/design/decode.md#multi-token-decode): one warp with registers for the [D, rows]
# accumulators beats more warps, which split the tile's tokens and so reduce the softmax across
# warps (32 rows: 66 / 173 us at 255, 82 / 232 on two warps, 108 / 317 on four at 128, the
# earlier launch); 16 rows are fastest at 192 (no spills; 255 costs occupancy). 64 rows keep the
# earlier launch, eight warps at the usual cap: a GQA group of 48 or 64 decodes at 4.5x the
# 32-row time (H200, benchmarks/wide_gqa.py), not tuned yet.
MANY_ROWS_LAUNCH = {16: (1, 192), 32: (1, 255), 64: (8, None)}
# Register cap of the long-split kernel: 16 one-warp programs fit per SM, twice what the split
# count aims at for few sequence-heads (custom_ops.splits.PROGRAMS_PER_SM).
SPLIT_MAX_REGISTERS = 128
# Rotated keys get their queries rotated inside the split kernel (one launch fewer) when a split
# holds at most this many tokens of the capacity: there the preparation launch is on the
# critical path; at longer splits it is cheaper than one rotation per program.
ROTATE_HERE_MAX_TOKENS = 128
# A decode step's (tq.decode_step) bound: there the preparation would be the chain's third
# launch per layer. H200, the 1b shape at B16 4k (256-token splits), two calls: 1.83 / 1.88 ms
# per step on two kernels against 1.82 / 1.86 on three, 1.24x / 1.20x bf16 against 1.25x /
# 1.23x (docs/notes/2026-11-30-scalar-pages.md): one launch fewer (host time without graphs)
# for about 1% under graphs; a plain decode keeps 128 (its kernel alone lost 1-3% at
# 256-token splits, tq4_nc up to 9% with a window).
STEP_ROTATE_HERE_MAX_TOKENS = 256
ROTATE_HERE_MAX_ROWS = 8  # query rows per program (padded): one token's GQA group


class QueryMode(enum.IntEnum):
    """Where the split kernel gets its queries (the values of its ``QUERY`` constexpr)."""

    SCALED = 0  # unrotated keys: the split kernel scales the query itself
    PREPARED = 1  # rotated keys, long splits: the preparation kernel rotates it first
    ROTATED_HERE = 2  # rotated keys, short splits: the split kernel rotates it (Walsh-Hadamard)


class StepMode(enum.IntEnum):
    """What the split kernel does with a decode step's own token (its ``STEP`` constexpr;
    ``tq.decode_step``)."""

    NONE = 0  # tq.decode: no step's token
    APPEND = 1  # attends it and appends it: an eviction (own programs or the last split's),
    # the merge fills the ring


class SplitConfig(NamedTuple):
    """Overrides of the split kernel's defaults (None: the plan's choice); for sweeps and tests.

    Attributes:
        block_n: tokens per tile.
        subtiles: tiles per softmax step (1 or 2).
        num_warps: warps per program.
        num_stages: software pipeline stages.
        max_registers: register cap per thread passed to ptxas (``maxnreg``).
        evict_in_split: a decode step's eviction (the token leaving the ring, into its page)
            in the last split's program rather than in a program of its own per sequence-head
            (decode steps only; see :func:`evicts_in_last_split`).
    """

    block_n: int | None = None
    subtiles: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_registers: int | None = None
    evict_in_split: bool | None = None


@dataclass(frozen=True)
class DecodePlan:
    """Everything ``tq.decode`` decides on the host for one key (see :func:`plan_decode`).

    Attributes:
        num_splits: splits per (sequence, kv-head): the cache's, or fewer for many query
            rows per program (:func:`~custom_ops.splits.splits_in_one_wave`).
        num_partials: partials per query row: the splits', then the ring kernel's.
        query: how the split kernel gets its queries.
        one_tile: every split holds at most one softmax step of tokens at a fixed place, so it
            reads its block-table entries before the length (short contexts).
        verify: the split launch is the verify kernel (:mod:`~custom_ops.triton.decode.verify`,
            Gluon: 32 query rows per kv-head of ``4bit_nc`` on a Hopper GPU, launched eagerly;
            it reads the rings too), not the split kernel.
        ring_in_split: the split launch (the split or the verify kernel) reads the recent
            window's ring itself.
        keys, values: the sides' :class:`~custom_ops.triton.decode.codes.PartParams`.
        q_code_columns: columns of the prepared query (0 without preparation).
        pdl: later kernels use programmatic dependent launch (Hopper and newer).
        prep: the query preparation's launch, or None.
        split: the split kernel's launch.
        ring: the ring kernel's launch (rotated values with a window), or None.
        merge: the merge's launch.
        merge_config: the merge's :class:`~custom_ops.triton.decode.merge.MergeConfig`.
    """

    num_splits: int
    num_partials: int
    query: QueryMode
    one_tile: bool
    verify: bool
    ring_in_split: bool
    keys: PartParams
    values: PartParams
    q_code_columns: int
    pdl: bool
    prep: KernelLaunch | None
    split: KernelLaunch
    ring: KernelLaunch | None
    merge: KernelLaunch
    merge_config: merge.MergeConfig


def _token_run(page_size: int, block_n: int) -> int:
    """How many adjacent bytes of a value-code column belong to consecutive tokens of a tile,
    aligned: tiles start at multiples of ``block_n``, so a power-of-two page gives runs of
    ``min(page_size, block_n)``; other page sizes get no vectorization hint."""
    if page_size & (page_size - 1):
        return 1
    return min(page_size, block_n)


def _query_mode(
    fmt: KVFormat,
    keys: PartParams,
    head_dim: int,
    capacity: int,
    num_splits: int,
    g_pad: int,
    step: StepMode,
) -> QueryMode:
    """Rotating in the split kernel needs the Walsh-Hadamard structure of R (a power-of-two head
    dim) and parts of at least 16 elements; every split program rotates its rows, so a verify
    step's many rows are rotated once, by the preparation kernel. A decode step rotates here
    in longer splits than a plain decode (:data:`STEP_ROTATE_HERE_MAX_TOKENS`)."""
    if not fmt.key.rotated:
        return QueryMode.SCALED
    power_of_two = head_dim & (head_dim - 1) == 0
    max_tokens = ROTATE_HERE_MAX_TOKENS if step == StepMode.NONE else STEP_ROTATE_HERE_MAX_TOKENS
    short = capacity <= max_tokens * num_splits
    if power_of_two and keys.PC >= 16 and short and g_pad <= ROTATE_HERE_MAX_ROWS:
        return QueryMode.ROTATED_HERE
    return QueryMode.PREPARED


def step_supported(fmt: KVFormat, window: int, q_tokens: int) -> bool:
    """Whether the split kernel can attend a decode step's own token (``tq.decode_step``): one
    query token, a ring of ``window > 0`` slots (the step's token goes there) read by the split
    kernel itself (values in the original space; rotated ones take the ring kernel)."""
    return q_tokens == 1 and window > 0 and not fmt.value.rotated


# The most sequence-heads (B * Hk) of a decode step whose append the split kernel and the merge
# take over (tq.decode_step) in the caches. H200, benchmarks/decode_step.py (16 layers of the 1b
# shape's cache work at 4096 tokens, Hk 8), store + decode over the step, 4bit_nc / k8v4: B1
# 1.52x / 1.40x, B8 1.17x / 1.19x, B16 (on: eviction in the last split) 1.13x / 1.08x, B32
# 1.05x / 1.05x, B64 1.01x / 1.01x, B128 0.98x / 0.98x. The model at B16 4k, each cell in its
# own process: 1.18x / 1.13x bf16 with the step, 1.17x / 1.12x with the store.
STEP_MAX_SEQUENCE_HEADS = 512


def evicts_in_last_split(
    num_splits: int, sequence_heads: int, num_warps: int, max_registers: int, sm_count: int
) -> bool:
    """Whether a decode step's split kernel evicts in its last split's program (before that
    split's tokens, usually the fewest) rather than in one more program per sequence-head:
    where those programs would take the grid past one wave of resident programs. H200,
    ``benchmarks/decode_step.py`` (16 layers of the 1b shape's cache work, us per layer): at 16
    x 4096 (16 splits: 2,048 programs of the 2,112 resident, 2,176 with the eviction's) the
    step took 38.2 / 50.6 us (4bit_nc / k8v4) with programs of its own and 35.9 / 40.6 in the
    last split; at 1-4 x 4096 (one wave either way) the last split's eviction lengthened the
    chain (4bit_nc 9.7 -> 12.2 us at B1).

    Args:
        num_splits: the split count.
        sequence_heads: ``B * Hk``.
        num_warps, max_registers: each split program's warps and register cap per thread.
        sm_count: the GPU's streaming multiprocessors.
    """
    grid = (num_splits + 1) * sequence_heads
    return grid > resident_programs(num_warps, max_registers, sm_count)


def step_pays(batch: int, num_kv_heads: int) -> bool:
    """Whether a cache's decode step of ``batch`` sequences appends its token inside the decode
    (``tq.decode_step``) rather than with the window store before it: up to
    :data:`STEP_MAX_SEQUENCE_HEADS` sequence-heads, past which the step no longer pays (the
    store's launch is then a small part of the step, and the step was 0.98x at 1,024)."""
    return batch * num_kv_heads <= STEP_MAX_SEQUENCE_HEADS


@functools.lru_cache(maxsize=1024)
def plan_decode(
    fmt: KVFormat,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_pages: int,
    window: int,
    q_dtype: torch.dtype,
    ring_dtype: torch.dtype | None,
    mask_kind: int,
    num_splits: int,
    device: torch.device,
    fast: bool,
    split_config: SplitConfig | None = None,
    merge_config: merge.MergeConfig | None = None,
    q_tokens: int = 1,
    sinks: int = 0,
    traced: bool = False,
    softcap: float = 0.0,
    step: StepMode = StepMode.NONE,
    store_params: tuple | None = None,
) -> DecodePlan:
    """The plan of a decode over a paged cache (cached per argument tuple).

    Args:
        fmt: the cache's format.
        batch, num_q_heads, num_kv_heads, head_dim: B, query rows (Hq times the query
            tokens), Hk, D.
        page_size, max_pages: the cache's page size and the block table's width.
        window: W, the rings' window slots (0: none).
        q_dtype, ring_dtype: dtypes of the query and of the rings (None without rings).
        mask_kind: 0 no mask, 1 boolean, 2 additive.
        num_splits: splits per (sequence, kv-head), a power of two (the cache's); on a GPU
            a launch of many query rows per program under a register cap (16 or 32 rows, or
            an overridden cap) takes at most what is resident at once.
        device: where the kernels run (a CPU device: compiled offline or interpreted).
        fast: inline-PTX decoding and programmatic dependent launch where available.
        split_config: overrides of the split kernel's defaults.
        merge_config: override of the merge's configuration.
        q_tokens: T, query tokens per sequence (row ``h * T + t`` of the rows is token ``t``
            of query head ``h``).
        sinks: the rings' sink slots (the first positions of each sequence, read with the
            ring run). Rings exist where ``window + sinks > 0``.
        traced: the launches are traced for inductor, which launches Triton kernels only (not
            the Gluon verify kernel).
        softcap: the logit softcap of the scores (natural-log units; 0: none), compiled into
            the split and ring kernels in log2 units; the verify kernel has none.
        step: what the split kernel does with a decode step's own token (:class:`StepMode`).
            Other than ``NONE`` it needs one query token, a window (``window > 0``) and values
            in the original space.
        store_params: with ``StepMode.APPEND``, the key and value
            :class:`~custom_ops.triton.planes.CodecParams` of the cache's rows
            (:func:`custom_ops.triton.store.side_params`), for the append.

    Raises:
        ValueError: a ``step`` this decode cannot take, or ``split_config.evict_in_split`` set
            for a decode without a step.
    """
    cuda = device.type == "cuda"
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if cuda else None
    hopper = cuda and torch.cuda.get_device_capability(device)[0] >= 9
    pdl = fast and hopper
    group = num_q_heads // num_kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    common = dict(D=head_dim, D_PAD=d_pad, INV_SQRT_D=1.0 / math.sqrt(head_dim), PDL=pdl)
    keys = part_params(fmt, "k", head_dim, fast)
    values = part_params(fmt, "v", head_dim, fast)
    capacity = max_pages * page_size  # compressed positions a sequence can hold

    # Split kernel: TOKENS_PER_STEP tokens per softmax step unless a sweep's split config asks
    # for other tiles.
    split_config = split_config or SplitConfig()
    tuning = decode_tuning(fmt)
    g_pad = triton.next_power_of_2(group)
    many_rows = g_pad >= MANY_ROWS  # a verify step's tokens, or a large GQA group
    num_warps = split_config.num_warps
    max_registers = split_config.max_registers
    if many_rows:
        # [D, rows] accumulators: one warp with more registers up to 32 rows, eight warps from
        # 64 (docs/design/decode.md#multi-token-decode); as many splits as are resident at once
        rows_warps, rows_registers = MANY_ROWS_LAUNCH[min(g_pad, max(MANY_ROWS_LAUNCH))]
        num_warps = num_warps or rows_warps
        max_registers = max_registers or rows_registers
        if cuda and max_registers is not None:
            num_splits = splits_in_one_wave(
                num_splits, batch * num_kv_heads, num_warps, max_registers, sm_count
            )
    # one 32-token tile per softmax step for every format; two 16-token tiles only where a
    # sweep asks (docs/design/decode.md#ring-tiles-and-16-token-tiles)
    subtiles = split_config.subtiles or 1
    block_n = split_config.block_n or TOKENS_PER_STEP // subtiles
    one_tile = capacity <= num_splits * subtiles * block_n
    # where a format's tuning of the streaming loop applies (custom_ops.tuning.DecodeTuning):
    # splits of several tiles and few query rows
    streaming_few_rows = not one_tile and not many_rows
    token_run = _token_run(page_size, block_n)
    # each page's value codes a tile of their own where the format's tuning allows it, a tile
    # is two pages of at least 16 tokens (the products' K) and a token's value part is 32
    # bytes (loaded in two halves) or padded to at least 64 (parts of 16 bytes lost up to 3%
    # at D 64, parts padded to 32 went through shared memory); the scalars a tile ahead where
    # the format's tuning says it pays, in streaming splits of one query token
    # (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program)
    value_pages = (
        tuning.value_pages
        and page_size >= 16
        and block_n == 2 * page_size == 2 * token_run
        and (values.PC == 32 or values.PC_PAD >= 64)
    )
    scalars_ahead = tuning.scalars_ahead and subtiles == 1 and streaming_few_rows
    # 3- and 4-bit uniform values as fp16 subnormals where measured: Hopper's tensor cores (and
    # the interpreter, which checks the same arithmetic on the CPU)
    # (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program)
    subnormals = subnormal_values(fmt.value) and (hopper or not cuda)
    # streaming tiles within one page or of two whole pages read their page ids as scalars
    # (custom_ops.triton.decode.tiles.tile_pages); splits start at multiples of the tile
    scalar_pages = not one_tile and (page_size % block_n == 0 or block_n == 2 * page_size)
    query = _query_mode(fmt, keys, head_dim, capacity, num_splits, g_pad, step)
    # the verify kernel where it serves (docs/design/decode.md#the-verify-kernel-in-gluon);
    # sweeps and tests
    # that configure the split kernel get the split kernel
    if step != StepMode.NONE and not step_supported(fmt, window, q_tokens):
        raise ValueError(
            f"a decode step with its own token needs one query token, a recent window and "
            f"values in the original space: got format {fmt.name}, window {window}, "
            f"{q_tokens} query tokens"
        )
    use_verify = (
        not step
        and not traced
        and softcap == 0
        and split_config == SplitConfig()
        and query == QueryMode.PREPARED  # the verify kernel reads the prepared q_code
        and verify.serves(fmt, head_dim, page_size, group, q_dtype, ring_dtype, device, fast)
    )
    ring_in_split = window + sinks > 0 and not fmt.value.rotated
    # rotated values: the ring kernel's parts (the split kernel reads none)
    window_parts, slots_per_part = (
        (0, 0)
        if ring_in_split
        else ring.window_parts(window, sinks, batch * num_kv_heads, sm_count)
    )
    num_partials = num_splits + window_parts
    if max_registers is None and not one_tile:
        # The rarely taken second pass (values beyond fp16's range) would otherwise raise the
        # loop's registers past 128. Splits of one tile keep theirs (unless many rows set a
        # cap): occupancy does not matter there, and capped, tq4_nc's query rotation spills.
        max_registers = SPLIT_MAX_REGISTERS
    # a step that appends in the split kernel evicts the token leaving the ring
    # (custom_ops.triton.decode.split) in one more program per sequence-head, or in the last
    # split where those would take the grid past one wave
    evict_in_split = split_config.evict_in_split
    if evict_in_split is not None and step == StepMode.NONE:
        raise ValueError(
            f"split_config.evict_in_split is for decode steps (tq.decode_step) only, got "
            f"{evict_in_split} for a decode without a step"
        )
    if step == StepMode.APPEND and evict_in_split is None:
        # (an uncapped launch, splits of one tile, counted at the cap: they hold about as many,
        # and their grids are small)
        evict_in_split = cuda and evicts_in_last_split(
            num_splits,
            batch * num_kv_heads,
            num_warps or DEFAULT_WARPS,
            max_registers or SPLIT_MAX_REGISTERS,
            sm_count,
        )
    own_evictions = step == StepMode.APPEND and not evict_in_split
    split_grid = (num_splits + own_evictions, num_kv_heads, batch)
    if num_warps is None:
        # two warps where the grid leaves SMs idle (at most two programs per SM): each decodes
        # half of its tile, shortening the chain short contexts wait for
        # (docs/design/decode.md#two-warp-splits-and-the-one-warp-merge)
        num_warps = 2 if cuda and math.prod(split_grid) <= 2 * sm_count else DEFAULT_WARPS
    streaming_stages = tuning.stages if streaming_few_rows else DEFAULT_STAGES
    # the large batches' long splits: the code tiles double-buffered where that pays, on
    # Hopper, where it was measured (custom_ops.tuning.DecodeTuning.long_split_stages)
    if (
        streaming_few_rows
        and hopper
        and tuning.long_split_stages
        and many_long_splits(num_splits, batch * num_kv_heads, capacity, sm_count)
    ):
        streaming_stages = tuning.long_split_stages
    num_stages = split_config.num_stages or streaming_stages
    launch_options = dict(num_warps=num_warps, num_stages=num_stages)
    if max_registers is not None:
        launch_options["maxnreg"] = max_registers
    if pdl and query == QueryMode.PREPARED:
        # without the preparation, what runs before the split kernel is not ours: launch it
        # normally
        launch_options["launch_pdl"] = True
    if use_verify:
        # one warp at 255 registers: MANY_ROWS_LAUNCH[32], which the splits were counted for
        # above; after the query preparation, with programmatic dependent launch where the
        # split kernel would have it
        split = KernelLaunch(
            split_grid,
            Launcher(
                verify.verify_kernel,
                verify.verify_constexprs(
                    fmt,
                    keys.META,
                    values.META,
                    q_tokens,
                    page_size,
                    window,
                    sinks,
                    mask_kind,
                    num_splits,
                    num_partials,
                    pdl,
                ),
            ),
        )
    else:
        split = KernelLaunch(
            split_grid,
            Launcher(
                split_kernel,
                dict(
                    MASK=mask_kind,
                    Q_TOKENS=q_tokens,
                    PAGE_SIZE=page_size,
                    TOKEN_RUN=token_run,
                    D=head_dim,
                    D_PAD=d_pad,
                    LOG2_D=d_pad.bit_length() - 1,
                    GROUP=group,
                    G_PAD=g_pad,
                    BLOCK_N=block_n,
                    SUBTILES=subtiles,
                    SCALARS_AHEAD=scalars_ahead,
                    VALUE_PAGES=value_pages,
                    SUBNORMAL_VALUES=subnormals,
                    SCALAR_PAGES=scalar_pages,
                    NUM_SPLITS=num_splits,
                    NUM_PARTIALS=num_partials,
                    ONE_TILE=one_tile,
                    K=keys,
                    V=values,
                    QUERY=int(query),
                    INV_SQRT_D=common["INV_SQRT_D"],
                    RING=ring_in_split,
                    RING_BLOCK=RING_BLOCK,
                    RING_QK_F32=ring_in_split and (not fast or ring_dtype != q_dtype),
                    RING_F32=not fast,
                    SINKS=sinks,
                    SOFTCAP=softcap * LOG2E,
                    PDL=pdl,
                    STEP=int(step),
                    EVICT_SPLIT=num_splits - 1 + own_evictions,
                    STORE_K=store_params[0] if step == StepMode.APPEND else None,
                    STORE_V=store_params[1] if step == StepMode.APPEND else None,
                    **launch_options,
                ),
            ),
        )

    num_rows = batch * num_q_heads
    prep_launch = None
    q_code_columns = 0
    if query == QueryMode.PREPARED:
        q_code_columns = keys.PARTS * keys.PC_PAD
        block_q, block_c = prep.prep_blocks(num_rows)
        prep_launch = KernelLaunch(
            (triton.cdiv(num_rows, block_q), q_code_columns // block_c),
            Launcher(
                prep.prep_query_kernel,
                dict(
                    common,
                    PARTS=keys.PARTS,
                    PC=keys.PC,
                    PC_PAD=keys.PC_PAD,
                    BLOCK_Q=block_q,
                    BLOCK_C=block_c,
                ),
            ),
        )
    later = {"launch_pdl": True} if pdl else {}  # kernels after the first one
    ring_launch = None
    if window_parts:
        ring_launch = KernelLaunch(
            (window_parts, num_kv_heads, batch),
            Launcher(
                ring.ring_partials_kernel,
                dict(
                    MASK=mask_kind,
                    Q_TOKENS=q_tokens,
                    D=head_dim,
                    D_PAD=d_pad,
                    GROUP=group,
                    G_PAD=triton.next_power_of_2(group),
                    BLOCK_W=ring.BLOCK_W,
                    SLOTS_PER_PART=slots_per_part,
                    SINK_BLOCK=ring.SINK_BLOCK,
                    NUM_SPLITS=num_splits,
                    NUM_PARTIALS=num_partials,
                    WINDOW_QK_F32=not fast or ring_dtype != q_dtype,
                    WINDOW_F32=not fast,
                    SINKS=sinks,
                    SOFTCAP=softcap * LOG2E,
                    PDL=pdl,
                    num_warps=ring.NUM_WARPS,
                    **later,
                ),
            ),
        )
    if merge_config is None:
        merge_config = merge.merge_config(
            num_rows, num_splits, head_dim, fmt.value.rotated, sm_count
        )
    elif num_splits % merge_config.split_chunk:
        # the merge reads whole chunks of partials: a chunk past the splits would read the
        # ring's partials or the next row's
        raise ValueError(
            f"merge_config.split_chunk must divide the plan's split count {num_splits}, got "
            f"{merge_config.split_chunk}"
        )
    block_d = merge_config.block_d
    if block_d is not None and (fmt.value.rotated or block_d <= 0 or d_pad % block_d):
        raise ValueError(
            f"merge_config.block_d must be None or a positive divisor of the padded head dim "
            f"{d_pad}, and None for rotated values ({fmt.name}: {fmt.value.rotated}), got "
            f"{block_d}"
        )
    block_d = block_d or d_pad
    # (blocks past the head dim of a padded one would merge nothing)
    merge_grid = (triton.cdiv(num_rows, merge_config.block_m), triton.cdiv(head_dim, block_d))
    merge_kernel, fill_options = merge.merge_kernel, {}
    if step == StepMode.APPEND:
        # the step's token goes into the ring in the merge (custom_ops.triton.decode.merge_fill)
        merge_kernel = merge_fill.merge_fill_kernel
        fill_rows = merge_fill.fill_rows_per_program(batch * num_kv_heads, merge_grid[0])
        fill_options = dict(FILL_ROWS=fill_rows, SINKS=sinks)
    merge_launch = KernelLaunch(
        merge_grid,
        Launcher(
            merge_kernel,
            dict(
                common,
                **fill_options,
                NUM_SPLITS=num_splits,
                WINDOW_PARTS=window_parts,
                WINDOW_PARTS_PAD=triton.next_power_of_2(max(1, window_parts)),
                SPLIT_CHUNK=merge_config.split_chunk,
                BLOCK_M=merge_config.block_m,
                BLOCK_D=block_d,
                ROTATE_BACK=fmt.value.rotated,
                LOG2_D=d_pad.bit_length() - 1,
                num_warps=merge_config.num_warps,
                **later,
            ),
        ),
    )
    return DecodePlan(
        num_splits,
        num_partials,
        query,
        one_tile,
        use_verify,
        ring_in_split,
        keys,
        values,
        q_code_columns,
        pdl,
        prep_launch,
        split,
        ring_launch,
        merge_launch,
        merge_config,
    )
