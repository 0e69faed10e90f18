"""Compile the decode kernels for Hopper (sm_90) on a machine without a GPU and count SASS.

Decode is bound by the instructions that turn codes into numbers, not by bytes, so the number
that predicts its speed is *warp-instructions per token-head* in the streaming loop. This tool
compiles a kernel with Triton's bundled ptxas (no GPU needed), disassembles the cubin with the
bundled nvdisasm, finds the innermost loop and reports its instruction mix divided by the
tokens one iteration handles. Registers and spills come from the cubin's resource usage.

It also sums the loop's *static stall cycles*: the cycles ptxas has a warp wait after each
instruction for fixed-latency results (4 bits of each instruction's control code), which is
one warp's issue schedule less its waits on variable latencies (memory, shared memory, MMA,
shuffles). The decode loop is bound by latency with about one eligible warp per scheduler, so
this predicted the 5-bit keys' whole-nibble lookups (1,757 -> 1,660 cycles, 1.035x-1.050x on
an H200) better than the instruction count; it did not predict that right shifts as
``IMAD.HI`` lose (docs/notes/2026-12-03-whole-nibble-lookups.md).

    python benchmarks/sass_report.py --format 4bit_nc --block-n 64
    python benchmarks/sass_report.py --format tqk5v3_nc --source-lines 12
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton

from custom_ops.triton.offline import compile_offline


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def disassemble(cubin: bytes) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [_tool("nvdisasm"), "-c", "-g", "-hex", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return sass.splitlines()


def resource_usage(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG" in line)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_(\d+)\)|0x([0-9a-f]+))")
_LABEL = re.compile(r"^\.L_x_(\d+):")


_SOURCE = re.compile(r'//## File "([^"]+)", line (\d+)')
# ``nvdisasm -hex``: an instruction's high 64 bits on the line after it; bits 41-44 of that
# word (105-108 of the instruction) are its stall count
_HIGH_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


def _stall(line: str) -> int:
    """The stall cycles in the control code of the instruction whose high word is ``line``."""
    m = _HIGH_WORD.match(line)
    return (int(m.group(1), 16) >> 41) & 0xF if m else 0


def loops(lines: list[str]) -> list[list[tuple[str, str, int]]]:
    """``(opcode, source line, stall cycles)`` of each instruction of each loop closed by a
    predicated backward branch, largest first (the streaming loop; with a ring read by the
    split kernel, the ring's loop is the second). Triton's loops end in their exit test; an
    unpredicated jump back comes from the out-of-line code of a divergent branch (``BRA.DIV``)
    and would span unrelated code. The source line (``file:line``, from ``nvdisasm -g``) is the
    innermost one Triton records: inlined helpers keep their own lines. The stall cycles: the
    fixed-latency wait ptxas puts after the instruction (:func:`_stall`)."""
    instrs, labels, source = [], {}, "?"
    for i, line in enumerate(lines):
        if m := _SOURCE.search(line):
            source = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            continue
        if m := _LABEL.match(line.strip()):
            labels[m.group(1)] = len(instrs)
        if m := _INSTR.search(line):
            stall = _stall(lines[i + 1]) if i + 1 < len(lines) else 0
            instrs.append((m.group(3), bool(m.group(2)), line, source, stall))
    found = []
    for end, (op, predicated, line, _, _) in enumerate(instrs):
        if (
            op.startswith("BRA")
            and predicated
            and (m := _BRANCH.search(line))
            and m.group(1) in labels
        ):
            start = labels[m.group(1)]
            if start < end:
                found.append(
                    [(op, where, stall) for op, _, _, where, stall in instrs[start : end + 1]]
                )
    return sorted(found, key=len, reverse=True) or [[]]


def report(compiled, tokens_per_iteration: int, title: str, source_lines: int = 0) -> dict:
    lines = disassemble(compiled.asm["cubin"])
    body, *others = loops(lines)
    mix = collections.Counter(op.split(".")[0] for op, _, _ in body)
    stalls = sum(stall for _, _, stall in body)
    per_token = len(body) / tokens_per_iteration
    print(f"{title}: {resource_usage(compiled.asm['cubin'])}")
    print(f"  shared memory: {compiled.metadata.shared} bytes")
    print(
        f"  loop: {len(body)} instructions / {tokens_per_iteration} tokens = "
        f"{per_token:.1f} warp-instructions per token-head (per warp; x num_warps in total)"
    )
    top = ", ".join(f"{op} {n}" for op, n in mix.most_common(14))
    print(f"  mix: {top}")
    print(f"  static stall cycles: {stalls} per iteration (one warp, fixed latencies only)")
    if others:
        print(f"  other loops (instructions): {[len(loop) for loop in others]}")
    if source_lines:
        # where the loop's instructions come from: the decode strings, the products, the softmax
        by_source = collections.defaultdict(collections.Counter)
        stalls_by_source = collections.Counter()
        for op, where, stall in body:
            by_source[where][op.split(".")[0]] += 1
            stalls_by_source[where] += stall
        ranked = sorted(by_source.items(), key=lambda item: -item[1].total())
        print(f"  by source line (top {source_lines}; instructions, static stall cycles):")
        for where, ops in ranked[:source_lines]:
            top_ops = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
            print(f"    {ops.total():5d} {stalls_by_source[where]:5d}  {where}: {top_ops}")
    return {
        "loop_instructions": len(body),
        "per_token": per_token,
        "mix": dict(mix),
        "static_stall_cycles": stalls,
    }


def main() -> None:
    from custom_ops import api
    from custom_ops.formats import RecentWindow, get_format
    from custom_ops.triton import decode

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="4bit_nc")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument(
        "--tokens", type=int, default=1, help="query tokens per sequence (a verify step's T)"
    )
    parser.add_argument("--block-n", type=int, help="default: the launch plan's")
    parser.add_argument("--warps", type=int, help="default: the launch plan's")
    parser.add_argument("--stages", type=int, help="default: the launch plan's")
    parser.add_argument("--subtiles", type=int, help="default: the launch plan's")
    parser.add_argument(
        "--splits",
        type=int,
        default=2,
        help="split count for a 1024-token cache: 2 (512 tokens per split, the long-context "
        "configuration) or 32 (one tile per split, queries rotated in the kernel: 1 x 1024)",
    )
    parser.add_argument("--maxnreg", type=int, help="register cap (default: the launch plan's)")
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        help="recent-window ring size (bf16 rings; formats whose split kernel reads the ring "
        "get a second loop, reported after the streaming loop)",
    )
    parser.add_argument("--sinks", type=int, default=0, help="sink slots of the rings")
    parser.add_argument("--dump", help="write the SASS here")
    parser.add_argument(
        "--source-lines",
        type=int,
        default=0,
        help="also list the streaming loop's instructions per source line, this many lines",
    )
    args = parser.parse_args()

    fmt = get_format(args.format)
    batch, hk, page, pages = 1, 8, 16, 64
    cache = fmt.allocate(pages, hk, page, args.head_dim)
    consts = api.make_constants(fmt, args.head_dim)
    q = torch.zeros(batch, hk * args.group, args.tokens, args.head_dim, dtype=torch.bfloat16)
    table = torch.zeros(batch, pages, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.int32)
    ring = torch.zeros(batch, hk, args.window + args.sinks, args.head_dim, dtype=torch.bfloat16)
    ring_pos = torch.full(ring.shape[:3], -1, dtype=torch.int32)
    window = RecentWindow(ring, ring, ring_pos, args.sinks) if args.window + args.sinks else None
    config = decode.SplitConfig(args.block_n, args.subtiles, args.warps, args.stages, args.maxnreg)
    plan = decode.plan_for(fmt, q, cache, table, args.splits, None, window, True, config)
    compiled = decode.compile_split_kernel(
        fmt,
        q,
        cache,
        table,
        lens,
        consts.rotation,
        args.splits,
        compile_offline,
        split_config=config,
        window=window,
    )
    if args.dump:
        with open(args.dump, "w") as f:
            f.write("\n".join(disassemble(compiled.asm["cubin"])))
    kwargs = plan.split.kwargs
    block_n, subtiles = kwargs["BLOCK_N"], kwargs["SUBTILES"]
    report(
        compiled,
        block_n * subtiles,
        f"{args.format} D={args.head_dim} group={args.group} T={args.tokens} "
        f"BLOCK_N={block_n} x {subtiles}, "
        f"{kwargs['num_warps']} warps, maxnreg {kwargs.get('maxnreg')}",
        args.source_lines,
    )


if __name__ == "__main__":
    main()
