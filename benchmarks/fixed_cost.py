"""What a decode call pays whatever its length: the intercept of time against tiles per program,
and the launch floors it could be made of.

At ``benchmarks/decode.py``'s long shapes every call runs 2,048 one-warp split programs of 16
tiles, and about 11-14 us of each call do not scale with the tiles
(``docs/notes/2026-12-01-table-words-merged-and-the-fixed-cost.md``): a fifth to a quarter of the
time, the difference between the formats' streaming rate and their share in the decode table.
This script measures that part and what it could be made of, in one run:

* **decode**: ``tq.decode`` at B = 16, 16 splits, Hk 8 (2,048 programs) with 1 to 64 tiles of 32
  tokens per program (window 0), each timed as ``decode.py`` times its cells (a CUDA graph over
  enough cache copies to defeat L2); a least-squares line ``a + b * tiles`` through the points
  from ``--fit-from`` tiles on gives the fixed part ``a`` and the streaming rate (the bytes of
  one tile per program over ``b``, as a share of the copy bandwidth measured in the same run).
  The plan changes below 8 tiles (one tile: the one-tile split path; up to 4, rotated keys'
  queries rotated in the split kernel instead of a preparation launch), so the default fit
  starts at 8;
* **launch floor**: 1, 2 or 3 dependent kernels of 2,048 one-warp programs that each store one
  word, per call, with and without programmatic dependent launch as the decode chains its
  query preparation, split and merge: the first kernel of a call launched plainly, the later
  ones with the attribute, each releasing its dependents at its start and waiting for the
  kernel before it after that;
* **load chain**: one kernel of 2,048 one-warp programs that each read a length, then a
  block-table entry at an index the length gives, then a 4 KB row of the page that entry names
  (the chain a split program waits on before its first tile; every program's page a
  different one), from copies that defeat L2;
* **merge floor**: what one kernel fewer per call would be worth if the merge moved into the
  split kernel: each of 2,048 programs writes a 2 KB partial (four query rows of 128 fp32),
  and the partials of each group of ``SPLITS`` programs (a sequence-head's splits) are summed
  either by a kernel of their own (plain or under programmatic dependent launch) or by the
  group's last program, found by an acquire-release count per group.

Every timed graph replays at least ``MIN_CALLS`` calls (the decode's cache copies cycled), so
that one replay's launch latency weighs alike in each; and a throw-away graph is captured first,
because a CUDA graph captured after another one in the same process waits longer before each
kernel (``docs/notes/2026-11-29-first-graph.md``): every graph here is such a later one.

    python benchmarks/fixed_cost.py          # 4bit_nc k8v4 k3v4_nc 3bit_nc tqk5v3_nc
    python benchmarks/fixed_cost.py --formats 4bit_nc --tiles 1 4 16 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402
from common import (  # noqa: E402
    copy_bandwidth,
    gpu_name,
    print_table,
    pyplot,
    require_cuda,
    save_figure,
    write_results,
)

from custom_ops.formats import get_format  # noqa: E402

BATCH, SPLITS, BLOCK_N = 16, 16, 32
PROGRAMS = BATCH * SPLITS * bench.NUM_KV_HEADS  # 2,048: one wave of one-warp programs on an H200
CALLS = 64  # calls per graph replay in the floors
MIN_CALLS = 16  # calls per graph replay at least, in the decode's cells
ROW_BYTES = 4096  # the load chain's row: about one tile of a 4-bit format's codes
PARTIAL = 512  # a split's partial in the merge floor: GQA group 4 x D 128 fp32 (2 KB)


@triton.jit
def _store_one(out_ptr, PDL: tl.constexpr):
    """One word per program; under programmatic dependent launch (``PDL``) the next kernel is
    released at once and this one's store waits for the kernel before it, as the decode's
    kernels do."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, pid)


@triton.jit
def _load_chain(lens_ptr, table_ptr, rows_ptr, out_ptr, PAGES: tl.constexpr, ROW: tl.constexpr):
    """A length, the block-table entry it indexes, the row that entry names: three dependent
    loads, then one word stored."""
    pid = tl.program_id(0)
    length = tl.load(lens_ptr + pid)
    page = tl.load(table_ptr + pid * PAGES + length % PAGES)
    words = tl.load(rows_ptr + page.to(tl.int64) * (ROW // 4) + tl.arange(0, ROW // 4))
    tl.store(out_ptr + pid, tl.sum(words, axis=0))


@triton.jit
def _store_partial(partials_ptr, PARTIAL: tl.constexpr):
    """This program's partial: ``PARTIAL`` fp32 ``pid + i`` (the same code in both floors)."""
    pid = tl.program_id(0)
    i = tl.arange(0, PARTIAL)
    tl.store(partials_ptr + pid * PARTIAL + i, (pid + i).to(tl.float32))


@triton.jit
def _write_partial(partials_ptr, PARTIAL: tl.constexpr, PDL: tl.constexpr):
    """Each program's partial; under programmatic dependent launch (``PDL``) the kernel after
    it (the merge) is released at once, as the split kernel does."""
    if PDL:
        gdc_launch_dependents()
    _store_partial(partials_ptr, PARTIAL)


@triton.jit
def _sum_partials(partials_ptr, out_ptr, group, SPLITS: tl.constexpr, PARTIAL: tl.constexpr):
    """``out[group] = the sum of the group's SPLITS partials``, four at a time (64 registers a
    lane for a partial of 512), unrolled so that both floors issue the same loads."""
    CHUNK: tl.constexpr = min(4, SPLITS)
    tl.static_assert(SPLITS % CHUNK == 0, "SPLITS: a multiple of 4, or a power of two below it")
    i = tl.arange(0, PARTIAL)
    total = tl.zeros([PARTIAL], tl.float32)
    for first in tl.static_range(0, SPLITS, CHUNK):
        rows = (group * SPLITS + first + tl.arange(0, CHUNK))[:, None] * PARTIAL + i[None, :]
        total += tl.sum(tl.load(partials_ptr + rows), axis=0)
    tl.store(out_ptr + group * PARTIAL + i, total)


@triton.jit
def _merge_partials(
    partials_ptr, out_ptr, SPLITS: tl.constexpr, PARTIAL: tl.constexpr, PDL: tl.constexpr
):
    """The merge as its own kernel, one program per group; under ``PDL`` it waits for the
    partials' kernel before it reads."""
    if PDL:
        gdc_wait()
    _sum_partials(partials_ptr, out_ptr, tl.program_id(0), SPLITS, PARTIAL)


@triton.jit
def _write_partial_counted(
    partials_ptr, counts_ptr, out_ptr, SPLITS: tl.constexpr, PARTIAL: tl.constexpr
):
    """Each program writes its partial, then counts itself into its group (acquire-release, GPU
    scope: the acquire also drops the SM's L1 lines, so the last program reads every partial
    from L2); the group's last program sums the group's partials and sets the count back to 0.
    The next call sees that 0 because its kernel is launched plainly, after this one ends: a
    call chained to this one by programmatic dependent launch would need the reset ordered
    before its wait."""
    group = tl.program_id(0) // SPLITS
    _store_partial(partials_ptr, PARTIAL)
    tl.debug_barrier()  # every lane's stores before lane 0's release
    arrived = tl.atomic_add(counts_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        _sum_partials(partials_ptr, out_ptr, group, SPLITS, PARTIAL)
        tl.store(counts_ptr + group, 0)


def decode_times(name: str, tiles: list[int]) -> list[dict]:
    """``tq.decode`` at 2,048 programs of each number of ``tiles``: one row per count."""
    fmt = get_format(name)
    rows = []
    for count in tiles:
        seq = SPLITS * count * BLOCK_N
        inputs = bench.tq_inputs(fmt, BATCH, seq)
        calls = bench.tq_calls(fmt, inputs, bench.window_rings(inputs, 0), SPLITS)
        us = bench.time_graph(calls * -(-MIN_CALLS // len(calls)))
        rows.append(dict(format=name, tiles=count, us=us))
        print(f"{name:10s} {count:3d} tiles per program: {us:7.1f} us", flush=True)
        del inputs, calls
        torch.cuda.empty_cache()
    return rows


def fit_line(rows: list[dict], fit_from: int) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``us = a + b * tiles`` over the rows from ``fit_from`` tiles."""
    points = [(r["tiles"], r["us"]) for r in rows if r["tiles"] >= fit_from]
    x = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    a, b = torch.linalg.lstsq(design, y[:, None]).solution.flatten().tolist()
    return a, b


def streaming_share(name: str, b_us: float, copy_bytes_per_s: float) -> float:
    """The share of the copy bandwidth at which format ``name`` streams when one more tile per
    program (``PROGRAMS`` tiles of ``BLOCK_N`` tokens) costs ``b_us``."""
    step_bytes = PROGRAMS * BLOCK_N * get_format(name).bytes_per_token_head(bench.HEAD_DIM)
    return step_bytes / (b_us * 1e-6) / copy_bytes_per_s


def discard_first_graph() -> None:
    """Capture and replay one throw-away graph, so that every graph timed after it is a later
    graph of the process (which waits longer before each kernel) alike."""
    out = torch.zeros(PROGRAMS, dtype=torch.int32, device="cuda")
    bench.capture([lambda: _store_one[(PROGRAMS,)](out, PDL=False, num_warps=1)]).replay()
    torch.cuda.synchronize()


def launch_floors() -> list[dict]:
    """us per call of 1-3 dependent kernels of ``PROGRAMS`` one-warp programs, with and without
    programmatic dependent launch, and of the load chain."""
    out = torch.zeros(PROGRAMS, dtype=torch.int32, device="cuda")
    rows = []
    for pdl, chains in ((False, (1, 2, 3)), (True, (2, 3))):
        for kernels in chains:

            def call(kernels=kernels, pdl=pdl):
                for i in range(kernels):
                    chained = pdl and i > 0
                    _store_one[(PROGRAMS,)](out, PDL=chained, num_warps=1, launch_pdl=chained)

            us = bench.time_graph([call] * CALLS)
            label = f"{kernels} kernel(s){' with PDL' if pdl else ''}"
            rows.append(dict(floor=label, us=us))
            print(f"launch floor, {label}: {us:.2f} us per call", flush=True)
    # copies of the chain's inputs that together defeat L2, one per call
    pages = 64
    copies = []
    for _ in range(CALLS):
        lens = torch.randint(0, 1 << 20, (PROGRAMS,), dtype=torch.int32, device="cuda")
        # each program's entries name one page, a different one for each program
        page = torch.randperm(PROGRAMS, device="cuda").to(torch.int32)
        table = page[:, None].expand(PROGRAMS, pages).contiguous()
        data = torch.randint(
            -(1 << 30), 1 << 30, (PROGRAMS, ROW_BYTES // 4), dtype=torch.int32, device="cuda"
        )
        copies.append((lens, table, data))
    calls = [
        lambda c=c: _load_chain[(PROGRAMS,)](*c, out, PAGES=pages, ROW=ROW_BYTES, num_warps=1)
        for c in copies
    ]
    us = bench.time_graph(calls)
    rows.append(dict(floor=f"load chain: length, table entry, {ROW_BYTES} B row", us=us))
    print(f"load chain: {us:.2f} us per call", flush=True)
    return rows


def merge_floors() -> list[dict]:
    """us per call of 2,048 partials merged in groups of ``SPLITS``: by a merge kernel (plain,
    or under programmatic dependent launch) or by each group's last program (one kernel)."""
    groups = PROGRAMS // SPLITS
    partials = torch.empty(PROGRAMS, PARTIAL, device="cuda")
    out = torch.empty(groups, PARTIAL, device="cuda")
    counts = torch.zeros(groups, dtype=torch.int32, device="cuda")
    rows = []
    for pdl in (False, True):

        def call(pdl=pdl):
            _write_partial[(PROGRAMS,)](partials, PARTIAL=PARTIAL, PDL=pdl, num_warps=1)
            _merge_partials[(groups,)](
                partials, out, SPLITS=SPLITS, PARTIAL=PARTIAL, PDL=pdl, num_warps=1, launch_pdl=pdl
            )

        label = f"partials, then a merge kernel{' under PDL' if pdl else ''}"
        us = bench.time_graph([call] * CALLS)
        rows.append(dict(floor=label, us=us))
        print(f"merge floor, {label}: {us:.2f} us per call", flush=True)

    def counted():
        _write_partial_counted[(PROGRAMS,)](
            partials, counts, out, SPLITS=SPLITS, PARTIAL=PARTIAL, num_warps=1
        )

    label = "partials merged by each group's last program (one kernel)"
    us = bench.time_graph([counted] * CALLS)
    rows.append(dict(floor=label, us=us))
    print(f"merge floor, {label}: {us:.2f} us per call", flush=True)
    return rows


def plot(payload: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, fit in payload["fits"].items():
        rows = [r for r in payload["decode"] if r["format"] == name]
        x = [r["tiles"] for r in rows]
        (line,) = ax.plot(x, [r["us"] for r in rows], "o", label=f"{name}: a {fit['a_us']:.1f} us")
        ax.plot(x, [fit["a_us"] + fit["b_us"] * t for t in x], "-", color=line.get_color())
    for row in payload["floors"]:
        ax.axhline(row["us"], color="grey", linewidth=0.6, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tiles of 32 tokens per program (2,048 programs)")
    ax.set_ylabel("us per decode call")
    ax.set_title(f"Fixed cost per decode call ({payload['gpu']}; dotted: floors)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--formats", nargs="+", default=["4bit_nc", "k8v4", "k3v4_nc", "3bit_nc", "tqk5v3_nc"]
    )
    parser.add_argument("--tiles", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--fit-from", type=int, default=8, help="tiles per program the fit starts at"
    )
    parser.add_argument("--out", default="fixed_cost.json")
    args = parser.parse_args()
    if sum(t >= args.fit_from for t in set(args.tiles)) < 2:
        parser.error(f"--fit-from {args.fit_from} leaves fewer than 2 of --tiles {args.tiles}")
    require_cuda("benchmarks/fixed_cost.py")
    copy_bps = copy_bandwidth()
    discard_first_graph()
    decode_rows, fits = [], {}
    for name in args.formats:
        rows = decode_times(name, args.tiles)
        a, b = fit_line(rows, args.fit_from)
        share = streaming_share(name, b, copy_bps)
        fits[name] = dict(a_us=a, b_us=b, streaming_share_of_copy=share)
        decode_rows += rows
    floors = launch_floors() + merge_floors()
    print(f"\n{gpu_name()}, copy bandwidth {copy_bps / 1e12:.2f} TB/s")
    print_table(
        [dict(format=n, **f) for n, f in fits.items()],
        {"format": "", "a_us": ".1f", "b_us": ".2f", "streaming_share_of_copy": ".1%"},
    )
    print()
    print_table(floors, {"floor": "", "us": ".2f"})
    payload = dict(
        gpu=gpu_name(),
        copy_bandwidth_bytes_per_s=copy_bps,
        programs=PROGRAMS,
        fit_from=args.fit_from,
        decode=decode_rows,
        fits=fits,
        floors=floors,
    )
    write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
