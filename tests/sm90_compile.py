"""Compile every kernel for sm_90 without a GPU (run without TRITON_INTERPRET, in a subprocess
of tests/custom_ops/triton/test_sm90_compile.py): the interpreter that runs the kernels in the
CPU tests accepts programs that the compiler rejects. Prints one line per kernel; exits 1 if any
fails to compile."""

from __future__ import annotations

import functools
import math
import re
import sys

import torch
import triton

from custom_ops import api
from custom_ops.formats import RecentWindow, get_format
from custom_ops.triton import center, decode, dequant, prefill, store, store_window
from custom_ops.triton.decode import verify
from custom_ops.triton.decode.codes import int8_keys, part_params
from custom_ops.triton.decode.merge import MergeConfig, merge_arguments
from custom_ops.triton.decode.merge_fill import merge_fill_arguments
from custom_ops.triton.decode.plan import SplitConfig, StepMode, step_supported
from custom_ops.triton.decode.softmax import LOG2E
from custom_ops.triton.decode.split import DecodeStep, split_arguments
from custom_ops.triton.offline import compile_offline
from custom_ops.triton.paged import plane_arguments, ring_arguments, table_arguments
from custom_ops.triton.store import side_params

HEAD_DIM, HEADS, GROUP, PAGE, PAGES, WINDOW, SINKS = 128, 2, 4, 16, 8, 16, 4


def kernels(name: str) -> dict:
    """``{kernel: zero-argument compile}`` for one format (launch options as the launchers'
    defaults; the decode kernels through their plan, long splits and short, with and without
    the inline PTX, with a ring and sinks: the kernels without sinks are the same code less
    the sinks' branches)."""
    fmt = get_format(name)
    d = HEAD_DIM
    cache = fmt.allocate(PAGES, HEADS, PAGE, d)
    rot = api.make_constants(fmt, d).rotation
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    ring = torch.empty(2, HEADS, WINDOW + SINKS, d, dtype=torch.bfloat16)
    ring_pos = torch.empty(2, HEADS, WINDOW + SINKS, dtype=torch.int32)
    window = RecentWindow(ring, ring, ring_pos, SINKS)
    rows = torch.empty(4, HEADS, d, dtype=torch.bfloat16)
    new = torch.empty(2, HEADS, 1, d, dtype=torch.bfloat16)
    centres = torch.empty(2, HEADS, d)
    dense = torch.empty(2, HEADS, 64, d)
    kp, vp = side_params(fmt, cache, d)
    inv = 1 / math.sqrt(d)
    jobs = {
        "store": lambda: compile_offline(
            store.store_kernel,
            (1,),
            rows,
            rows,
            *rows.stride(),
            *rows.stride(),
            plane_arguments(cache),
            lens,
            rot,
            8,
            HEADS,
            PAGE,
            PAGES * PAGE,
            D=d,
            INV_SQRT_D=inv,
            BLOCK_R=32,
            K=kp,
            V=vp,
            num_warps=4,
        ),
        # a cache's start: input_pos[:1].expand(B), int64; centring set inline (one token);
        # the launch shapes of appends and of prefill chunks; a padded head dim (its rotation
        # by products, one row per program in appends)
        **{
            _store_window_name(dim, start, center, launch): functools.partial(
                _store_window_job, fmt, dim, start, center, launch
            )
            for dim, start, center, launch in (
                (d, lens, False, store_window.PREFILL_LAUNCH),
                (
                    d,
                    torch.zeros(1, dtype=torch.int64).expand(2),
                    False,
                    store_window.APPEND_LAUNCH,
                ),
                (d, lens, True, store_window.APPEND_LAUNCH),
                (96, lens, False, store_window.APPEND_LAUNCH),
            )
        },
        "center_keys": lambda: compile_offline(
            center.center_keys_kernel,
            (4,),
            new,
            *new.stride(),
            ring,
            ring_pos,
            *ring.stride()[:3],
            centres,
            lens,
            lens.stride(0),
            HEADS,
            1,
            WINDOW,
            D=d,
            D_PAD=d,
            SINKS=SINKS,
            BLOCK=32,
            num_warps=4,
        ),
        "dequant": lambda: compile_offline(
            dequant.dequant_kernel,
            (4, 2),
            plane_arguments(cache),
            table_arguments(table),
            lens,
            rot,
            dense,
            dense,
            ring_arguments(window),
            WINDOW,
            HEADS,
            PAGE,
            4,
            64,
            HAS_WINDOW=True,
            D=d,
            D_PAD=d,
            INV_SQRT_D=inv,
            BLOCK_S=32,
            K=kp,
            V=vp,
            SINKS=SINKS,
            num_warps=4,
        ),
    }
    q = torch.zeros(2, HEADS * GROUP, d, dtype=torch.bfloat16)
    long_table = torch.zeros(2, 64, dtype=torch.int32)
    for fast in (True, False):
        for label, block_table in (("short", table), ("long", long_table)):
            plan = decode.plan_for(fmt, q, cache, block_table, 2, None, window, fast)
            q_code = torch.empty(
                2, HEADS * GROUP, max(1, plan.q_code_columns), dtype=torch.float16
            )
            part_out = torch.empty(2, HEADS * GROUP, plan.num_partials, d)
            part_lse = torch.empty(2, HEADS * GROUP, plan.num_partials)
            mask_args = (lens, 0, 0, 0, 0)
            # split_arguments' arguments but the step's
            split_inputs = (
                q,
                q_code,
                LOG2E,
                rot,
                cache,
                block_table,
                lens,
                mask_args,
                window,
                part_out,
                part_lse,
            )
            launches = {
                "split": (plan.split, split_arguments(*split_inputs)),
                "merge": (plan.merge, merge_arguments(part_out, part_lse, rot, q)),
            }
            if step_supported(fmt, WINDOW, 1) and fast and label == "long":
                # tq.decode_step: the split kernel's eviction programs (or the eviction first
                # in the last split, for grids past one wave), the merge's fill (one
                # configuration: the step's code is the same in the others; its merge in
                # column blocks, as one sequence's merge on a GPU: the CPU plan's takes whole
                # rows)
                step = DecodeStep(new, new, lens, lens)
                step_plans = {}
                for suffix, evict_in_split in (("", False), (", eviction in a split", True)):
                    step_plans[suffix] = step_plan = decode.plan_for(
                        fmt,
                        q,
                        cache,
                        block_table,
                        2,
                        None,
                        window,
                        fast,
                        split_config=SplitConfig(evict_in_split=evict_in_split),
                        merge_config=MergeConfig(1, 2, 1, 32),
                        step=StepMode.APPEND,
                    )
                    launches[f"step split{suffix}"] = (
                        step_plan.split,
                        split_arguments(*split_inputs, step),
                    )
                launches["step merge"] = (  # (the same merge whoever evicts)
                    step_plans[""].merge,
                    merge_fill_arguments(part_out, part_lse, rot, q, step, window, block_table),
                )
            if plan.prep is not None:
                launches["prep"] = (
                    plan.prep,
                    (q, *q.stride()[:2], rot, q_code, 2 * HEADS * GROUP, HEADS * GROUP, LOG2E),
                )
            if plan.ring is not None:
                launches["ring"] = (
                    plan.ring,
                    (
                        q,
                        *q.stride()[:2],
                        LOG2E,
                        ring_arguments(window),
                        WINDOW,
                        lens,
                        64,
                        mask_args,
                        part_out,
                        part_lse,
                        HEADS,
                    ),
                )
            keys = plan.keys
            ptx_int8_keys = keys.ASM_INT8 and int8_keys(keys.INT8_UNIT, keys.PC_PAD, plan.one_tile)
            for kernel, (launch, args) in launches.items():
                job = _compile_job(launch, args)
                if kernel == "split" and ptx_int8_keys:
                    job = _int8_layout_checked(job, keys.LANE_SIGNS)
                jobs[f"{kernel} ({label} splits, fast={fast})"] = job
            if ptx_int8_keys and keys.LANE_SIGNS and label == "long":
                # the launches whose layouts could differ (warps over the tile's tokens, the
                # Hopper-only five stages): the lane-signed keys' strings still in the operand
                split_args = split_arguments(*split_inputs)
                for name, config in (
                    ("two warps", SplitConfig(num_warps=2)),
                    ("five stages", SplitConfig(num_stages=5)),
                ):
                    variant = decode.plan_for(
                        fmt, q, cache, block_table, 2, None, window, fast, split_config=config
                    )
                    jobs[f"split (long splits, {name}, fast={fast})"] = _int8_layout_checked(
                        _compile_job(variant.split, split_args), True
                    )
    return jobs


# the operand types of a TTGIR dot with an int32 result: the int8 products of Q K^T
_INT8_DOT = re.compile(r"tt\.dot .*-> tensor<[0-9x]+xi32")
_KWIDTH = re.compile(r"xi8, #ttg\.dot_op<\{opIdx = \d, parent = #\w+, kWidth = (\d+)\}>")
# the inline asm of the keys' strings that take their sign half from the lane id
# (ptx._lane_half_lines), and the layout they are written for: the A operand of a version 2
# MMA (mma.sync), 8 consecutive bytes per lane
_LANE_ASM = "shr.b32 h, h, 1"
_LANE_OPERAND = re.compile(r"xi8, #ttg\.dot_op<\{opIdx = 0, parent = #(\w+), kWidth = 8\}>")


def _int8_layout_checked(compile_it, lane_signs: bool):
    """``compile_it`` (a split kernel with the inline PTX's int8 keys), then a check of its
    int8 products' operand layout: 8 consecutive k per lane (``kWidth = 8``), the layout the 3-
    and 5-bit key strings are written for. Triton picks it by a heuristic (its width from the
    operands' loads, halved after a ``tl.join`` in their chain: the query's int8 rounding has
    one in its interleave, the rotation in its butterfly); from plain int8 loads it chose 4,
    and on the H200 the inline PTX's 3- and 5-bit keys no longer matched the plain decoding
    (docs/design/decode.md, "Integer keys")."""

    def run():
        compiled = compile_it()
        text = compiled.asm["ttgir"]
        ttgir = text.splitlines()
        dots = [line for line in ttgir if _INT8_DOT.search(line)]
        widths = {width for line in dots for width in _KWIDTH.findall(line)}
        if not dots or widths != {"8"}:
            raise RuntimeError(
                f"int8 products: {len(dots)} dots, operand kWidth {sorted(widths)}; want 8"
            )
        # the one-sign-tile strings (3- and 5-bit keys at D 128) must also run in that layout,
        # not in one Triton converts from afterwards: they read each lane's half of its row
        # from the lane id
        lane_asm = [
            line for line in ttgir if "elementwise_inline_asm" in line and _LANE_ASM in line
        ]
        if bool(lane_asm) != lane_signs:
            raise RuntimeError(f"{len(lane_asm)} lane-signed key strings; want some: {lane_signs}")
        for line in lane_asm:
            results = line.rsplit("->", 1)[1]
            parents = set(_LANE_OPERAND.findall(results))
            mma = {
                alias
                for alias in parents
                if f"#{alias} = #ttg.nvidia_mma<{{versionMajor = 2" in text
            }
            if (
                results.count("tensor<") != results.count("kWidth = 8")
                or not parents
                or mma != parents
            ):
                raise RuntimeError(f"lane-signed keys decoded outside the int8 operand: {results}")
        return compiled

    return run


def prefill_kernels() -> dict:
    """``{label: zero-argument compile}`` of the prefill kernel: a mask of each kind (the rows
    check, the chunk taken from SDPA or recomputed), rings with and without sinks and centred
    keys, inline PTX and not, uniform, rotated and fp8-key formats (about 12 s a compile: a
    few variants cover its branches)."""
    variants = (
        ("4bit_nc", WINDOW, SINKS, 1, 2, True),
        ("tqk5v3_nc", 0, 0, 0, 1, True),
        ("k8v4", WINDOW, 0, 2, 2, False),
        ("tq3_nc", 0, 0, 0, 0, False),
    )
    return {
        f"{name} prefill (window {window}, sinks {sinks}, mask {mask_kind}, chunk mode "
        f"{chunk_mode}, fast={fast})": functools.partial(
            _prefill_job, get_format(name), window, sinks, mask_kind, chunk_mode, fast
        )
        for name, window, sinks, mask_kind, chunk_mode, fast in variants
    }


def _prefill_job(fmt, window, sinks, mask_kind, chunk_mode, fast):
    """Compile the prefill kernel with or without rings (and sinks, centred keys), a mask of
    ``mask_kind`` and the chunk taken as ``chunk_mode``, inline PTX or not."""
    d, tokens = HEAD_DIM, 24
    cache = fmt.allocate(PAGES, HEADS, PAGE, d)
    q = torch.empty(2, HEADS * GROUP, tokens, d, dtype=torch.bfloat16)
    chunk = torch.empty(2, HEADS, tokens, d, dtype=torch.bfloat16)
    lse = torch.empty(2, HEADS * GROUP, tokens)
    lens = torch.zeros(2, dtype=torch.int32)
    ring = torch.empty(2, HEADS, WINDOW + SINKS, d, dtype=torch.bfloat16)
    ring_pos = torch.empty(2, HEADS, WINDOW + SINKS, dtype=torch.int32)
    rings = (
        ring_arguments(RecentWindow(ring, ring, ring_pos, SINKS))
        if window + sinks
        else (q, q, lens, 0, 0, 0)
    )
    mask = torch.empty(1, 1, tokens, 64, dtype=torch.bool if mask_kind == 1 else torch.bfloat16)
    mask_args = (mask, 0, 0, 64, 64) if mask_kind else (lens, 0, 0, 0, 0)
    config = prefill.PrefillConfig()
    kwargs = prefill._launcher(
        part_params(fmt, "k", d, fast),
        part_params(fmt, "v", d, fast),
        GROUP,
        d,
        PAGE,
        sinks,
        window + sinks > 0,
        window > 0,
        mask_kind,
        chunk_mode == 1,
        chunk_mode,
        config,
    ).kwargs
    return compile_offline(
        prefill.prefill_kernel,
        (2 * HEADS, 2),
        q,
        *q.stride()[:3],
        chunk,
        chunk,
        *chunk.stride()[:3],
        *chunk.stride()[:3],
        q,
        *q.stride()[:3],
        lse,
        *lse.stride(),
        plane_arguments(cache),
        table_arguments(torch.zeros(2, 4, dtype=torch.int32)),
        lens,
        api.make_constants(fmt, d).rotation,
        rings,
        torch.empty(2, HEADS, d),
        mask_args,
        torch.empty(2, 1, tokens, dtype=torch.int8),
        tokens,
        0,
        HEADS,
        tokens,
        window,
        4,
        1000,
        0.1,
        **kwargs,
    )


def _store_window_name(dim, start, center, launch) -> str:
    return f"store_window D={dim} {start.dtype}{' centred' if center else ''} {launch}"


def _store_window_job(fmt, d, start, center, launch):
    """Compile the window store for head dim ``d`` with ``start`` (int32 or int64 starts),
    centring set inline or not, and ``launch`` ``(rows per program, warps)``."""
    cache = fmt.allocate(PAGES, HEADS, PAGE, d)
    kp, vp = side_params(fmt, cache, d)
    d_pad = triton.next_power_of_2(d)
    ring = torch.empty(2, HEADS, WINDOW + SINKS, d, dtype=torch.bfloat16)
    ring_pos = torch.empty(2, HEADS, WINDOW + SINKS, dtype=torch.int32)
    new = torch.empty(2, HEADS, 1, d, dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32)
    return compile_offline(
        store_window.store_window_kernel,
        (1,),
        store_window.token_arguments(new, new),
        ring_arguments(RecentWindow(ring, ring, ring_pos, SINKS)),
        plane_arguments(cache),
        table_arguments(torch.zeros(2, 4, dtype=torch.int32)),
        start,
        start.stride(0),
        lens,
        api.make_constants(fmt, d).rotation,
        torch.empty(2, HEADS, d),
        4,
        HEADS,
        1,
        1,
        WINDOW,
        PAGE,
        4,
        D=d,
        D_PAD=d_pad,
        INV_SQRT_D=1 / math.sqrt(d),
        BLOCK_R=launch[0],
        K=kp,
        V=vp,
        SINKS=SINKS,
        CENTER=center,
        CENTER_INLINE=center,
        num_warps=launch[1],
    )


def _compile_job(launch, args):
    """A zero-argument compile of one of a plan's launches."""
    return lambda: compile_offline(launch.launcher.kernel, launch.grid, *args, **launch.kwargs)


def report(label: str, compile_it) -> bool:
    """Run ``compile_it()`` and print ``<label>: ok``, or ``<label>: FAILED <the error's last
    lines>`` (a compile error is reported, not raised); whether it compiled."""
    try:
        compile_it()
    except Exception as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        print(f"{label}: FAILED {' | '.join(lines[-4:])}", flush=True)
        return False
    print(f"{label}: ok", flush=True)
    return True


def verify_kernels() -> dict:
    """``{label: zero-argument compile}`` of the Gluon verify kernel (4bit_nc, 32 rows: T = 8 at
    GQA 4) without a mask and with either kind, with rings (a window and sinks) and without, with
    padded query rows, and with pages of 32 tokens (its plans are made on a GPU only, so its
    constexprs are given here as the plan gives them)."""
    fmt = get_format("4bit_nc")
    cache = fmt.allocate(PAGES, HEADS, PAGE, HEAD_DIM)
    rows, tokens, splits = HEADS * verify.ROWS, 8, 2
    q = torch.empty(2, rows, HEAD_DIM, dtype=torch.bfloat16)
    q_code = torch.empty(2, rows, HEAD_DIM, dtype=torch.float16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    ring = torch.empty(2, HEADS, WINDOW + SINKS, HEAD_DIM, dtype=torch.bfloat16)
    ring_pos = torch.empty(2, HEADS, WINDOW + SINKS, dtype=torch.int32)
    part_out = torch.empty(2, rows, splits, HEAD_DIM)
    part_lse = torch.empty(2, rows, splits)
    no_mask = (lens, 0, 0, 0, 0)

    def job(query, paged, page, window, sinks, mask_kind=0, mask_args=no_mask):
        rings = RecentWindow(ring, ring, ring_pos, SINKS) if window + sinks else None
        args = verify.verify_arguments(
            query, q_code, LOG2E, paged, table, lens, rings, mask_args, part_out, part_lse
        )
        kwargs = verify.verify_constexprs(
            fmt, 0, 1, tokens, page, window, sinks, mask_kind, splits, splits, True
        )
        return functools.partial(
            compile_offline, verify.verify_kernel, (splits, HEADS, 2), *args, **kwargs
        )

    jobs = {}
    for mask_kind, mask in (
        (0, None),
        (1, torch.empty(2, rows, 64, dtype=torch.bool)),
        (2, torch.empty(1, 1, 64)),
    ):
        mask_args = no_mask if mask is None else (mask, 0, 64, 0, 64)
        for window, sinks in ((0, 0), (WINDOW, SINKS)):
            jobs[f"verify (mask {mask_kind}, window {window}, sinks {sinks})"] = job(
                q, cache, PAGE, window, sinks, mask_kind, mask_args
            )
    # query rows padded to 136 elements: strides Triton cannot tell 16-byte aligned, which the
    # ring pass's cp.async of the query needs (verify_arguments passes a contiguous copy)
    padded = torch.empty(2, rows, HEAD_DIM + 8, dtype=torch.bfloat16)[..., :HEAD_DIM]
    jobs["verify (padded query rows)"] = job(padded, cache, PAGE, WINDOW, SINKS)
    # pages of 32 tokens: a tile's tokens in one page
    cache_32 = fmt.allocate(PAGES, HEADS, 2 * PAGE, HEAD_DIM)
    jobs["verify (pages of 32)"] = job(q, cache_32, 2 * PAGE, 0, 0)
    return jobs


def main(names: list[str]) -> int:
    results = [
        report(f"{name} {kernel}", compile_it)
        for name in names
        for kernel, compile_it in kernels(name).items()
    ]
    results += [
        report(f"4bit_nc {label}", compile_it) for label, compile_it in verify_kernels().items()
    ]
    results += [report(label, compile_it) for label, compile_it in prefill_kernels().items()]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
