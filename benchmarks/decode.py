"""Decode attention speed: ``torch.ops.tq.decode`` vs bf16 SDPA, as ratios measured in one run.

Shapes (Hq=32, Hk=8, D=128, page 16): B x S in {1 x 131072, 4 x 32768, 16 x 8192, 64 x 2048}
(131072 cached tokens each) plus B=1 at S in {1024, 4096}. For each shape and format: median
microseconds, effective bandwidth on the compressed bytes, its ratio to the device's copy
bandwidth measured in the same run, and the speed-up over
``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on bf16 K/V of the same shape.
Each format is also timed with a recent window (``--windows``, default 0 and 128: the last W of
the S tokens read from bf16 rings) and with ``--sinks`` (default 0: the first tokens read from
the rings too), and ``vs_window0`` is window 0's (without sinks) time over this one's.
``--tokens 4 8`` also times a speculative-decoding verify step: each sequence's last T tokens
as queries ``[B, Hq, T, D]``, causal among themselves, against bf16 SDPA with the same queries
and a lower-right causal mask (``torch.nn.attention.bias.causal_lower_right``); ``vs_t1`` is
this time over the one-token decode's.

Timing: each op is captured in a CUDA graph that calls it on R different copies of its inputs
(R chosen so the copies total >= 256 MiB, several times the L2), and one replay's time is divided
by R, so every call reads its cache from memory as a model's layers would, with no launch gaps.
A format's windows are replayed in alternating rounds and each keeps its fastest round, so that
``vs_window0`` compares times taken side by side.

    python benchmarks/decode.py                      # all shapes and formats
    python benchmarks/decode.py --formats 4bit_nc --sweep    # tuning sweep of the split kernel
    python benchmarks/decode.py --formats 4bit_nc --shapes 1x32768 --tokens 4 8 --sweep  # verify
    python benchmarks/decode.py --formats 4bit_nc --shapes 1x32768 16x8192 --tokens 1 4 8
    python benchmarks/decode.py --formats 4bit_nc k8v4 tq4_nc --windows 128 --sinks 0 4
    python benchmarks/decode.py --plot results/decode.json   # PNG from a saved run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    copy_bandwidth,
    gpu_name,
    print_table,
    pyplot,
    require_cuda,
    save_figure,
    write_results,
)

from custom_ops import api  # noqa: E402
from custom_ops.formats import FORMATS, RecentWindow, get_format  # noqa: E402
from custom_ops.triton import decode as triton_decode  # noqa: E402
from custom_ops.triton.decode import SplitConfig  # noqa: E402

SHAPES = [(1, 131072), (4, 32768), (16, 8192), (64, 2048), (1, 1024), (1, 4096)]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
COLD_BYTES = 256 << 20


def capture(calls) -> torch.cuda.CUDAGraph:
    """A CUDA graph that makes all ``calls`` (compiled and warmed up outside the capture).

    The graph holds addresses, not tensors: the caller keeps ``calls`` (and so every tensor
    they read) alive for as long as it replays the graph. A ring freed after the capture is
    reused by the next allocation, and the graph then reads whatever lands there."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, num_calls: int, reps: int = 20) -> float:
    """Median microseconds of one of the graph's ``num_calls`` calls over ``reps`` replays."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_calls)
    return statistics.median(times)


def time_graph(calls, reps: int = 20) -> float:
    """Median microseconds of one call, from replays of a graph that makes all ``calls``."""
    return replay_us(capture(calls), len(calls), reps)


# Rounds of alternating replays when one configuration is timed with several rings: their
# ratio (vs_window0) is read from the fastest round of each, so that a slow spell of the GPU
# (a few percent, seen between runs) does not land on one ring only.
WINDOW_ROUNDS = 3


def time_windows(graphs: dict, num_calls: int) -> dict:
    """``{ring: us}`` for graphs of the same calls with different rings (``(window, sinks)``),
    replayed in ``WINDOW_ROUNDS`` alternating rounds: the fastest round's median for each."""
    best = {}
    for _ in range(WINDOW_ROUNDS):
        for window, graph in graphs.items():
            us = replay_us(graph, num_calls)
            best[window] = min(us, best.get(window, us))
    return best


def replicas(nbytes: int) -> int:
    return max(1, min(64, -(-COLD_BYTES // nbytes)))


def sdpa_time(batch: int, seq: int, tokens: int = 1) -> float:
    """bf16 SDPA of ``tokens`` queries per sequence (the last ones: a lower-right causal mask
    when several) over ``seq`` cached tokens."""
    kv_bytes = 2 * batch * NUM_KV_HEADS * seq * HEAD_DIM * 2
    mask = causal_lower_right(tokens, seq) if tokens > 1 else None
    calls = []
    for _ in range(replicas(kv_bytes)):
        q = torch.randn(batch, NUM_Q_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, NUM_KV_HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        calls.append(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True
            )
        )
    return time_graph(calls)


def filled_cache(fmt, batch: int, seq: int):
    """A cache holding ``batch`` sequences of ``seq`` random tokens, pages shuffled."""
    num_pages = batch * seq // PAGE_SIZE
    consts = api.make_constants(fmt, HEAD_DIM, device="cuda")
    cache = fmt.allocate(num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM, "cuda")
    chunk = 16384
    for start in range(0, num_pages * PAGE_SIZE, chunk):
        n = min(chunk, num_pages * PAGE_SIZE - start)
        key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        value = torch.randn_like(key)
        slots = torch.arange(start, start + n, device="cuda", dtype=torch.int32)
        api.store(fmt, cache, key, value, slots, consts)
    table = torch.randperm(num_pages, device="cuda").to(torch.int32).reshape(batch, -1)
    lens = torch.full((batch,), seq, device="cuda", dtype=torch.int32)
    return cache, consts, table, lens


def tq_inputs(fmt, batch: int, seq: int, tokens: int = 1) -> list:
    """R replicas (enough to defeat L2) of (q, cache, constants, block table, lengths); ``q [B,
    Hq, D]``, or ``[B, Hq, T, D]`` for several query tokens."""
    cache_bytes = batch * seq * NUM_KV_HEADS * fmt.bytes_per_token_head(HEAD_DIM)
    inputs = []
    for _ in range(replicas(cache_bytes)):
        cache, consts, table, lens = filled_cache(fmt, batch, seq)
        q_shape = (batch, NUM_Q_HEADS, *((tokens,) if tokens > 1 else ()), HEAD_DIM)
        q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16)
        inputs.append((q, cache, consts, table, lens))
    return inputs


def window_rings(inputs, window: int, sinks: int = 0) -> list:
    """Per replica: a :class:`RecentWindow` of bf16 ``[B, Hk, W + sinks, D]`` rings and their
    slots' positions (None without a window or sinks). The cache's last ``W`` positions and
    first ``sinks`` are then read from them instead."""
    rings = []
    for q, *_, lens in inputs:
        shape = (q.shape[0], NUM_KV_HEADS, window + sinks, HEAD_DIM)
        ring = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        positions = api.appended_window_positions(lens, NUM_KV_HEADS, window, sinks)
        rings.append(RecentWindow(*ring, positions, sinks) if window + sinks else None)
    return rings


def parse_shape(text: str) -> tuple[int, int]:
    """``"BxS"`` -> ``(B, S)``: the ``type`` of the decode benchmarks' ``--shapes`` (a cache of B
    sequences of S tokens in whole pages)."""
    try:
        batch, seq = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes BxS, e.g. 1x131072, got {text!r}") from None
    if batch < 1 or seq < PAGE_SIZE or seq % PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"{text}: B >= 1 and S a multiple of {PAGE_SIZE}")
    return batch, seq


def default_splits(batch: int, seq: int) -> int:
    """The split count a cache of ``batch`` x ``seq`` positions gets by default."""
    return api.default_num_splits(batch, NUM_KV_HEADS, seq // PAGE_SIZE, PAGE_SIZE, 0, "cuda")


def tq_calls(fmt, inputs, rings, num_splits: int, **kernel_args) -> list:
    """One ``tq.decode`` call per replica of the inputs and rings."""
    return [
        lambda q=q, c=cache, k=consts, t=table, s=lens, r=ring: triton_decode.decode(
            fmt,
            q,
            c,
            t,
            s,
            *k,
            num_splits=num_splits,
            scale=HEAD_DIM**-0.5,
            window=r,
            **kernel_args,
        )
        for (q, cache, consts, table, lens), ring in zip(inputs, rings, strict=True)
    ]


# Tuning sweep: (BLOCK_N, num_warps, num_stages, subtiles) of the split kernel, then split
# counts x 1/2, x 2 and x 4 around the default at the default configuration.
SWEEP = [
    (32, 1, 2, 1),
    (32, 1, 3, 1),  # the default tile with the block-table entries loaded two tiles ahead
    # five stages: Triton shares num_stages - 1 between the block table and the codes it
    # addresses, so 2-4 stages give the codes one shared-memory buffer, refilled only after the
    # tile has read it; 5 double-buffers them (4bit_nc 778 -> 821 instructions per tile). H200,
    # 1 x 131072: 0.94x for 4bit_nc, 0.79x for tqk5v3_nc, 1.02x for tqk4v2_nc
    (32, 1, 5, 1),
    (32, 1, 2, 2),
    (32, 1, 3, 2),
    (64, 1, 2, 1),
    (16, 1, 2, 2),
    (32, 2, 2, 2),
    (64, 2, 2, 1),
    (32, 4, 2, 1),
    (32, 4, 2, 2),
]
SPLIT_FACTORS = (0.5, 2, 4)
# Sweep of a verify step (several query tokens): (tokens per tile, num_warps, register cap) of
# one tile per softmax step, the plan's choice for many query rows; 16-token tiles hold half
# the scores and decoded codes (32 rows at 32 tokens spill at 255 registers).
VERIFY_SWEEP = [
    (32, 1, 128),
    (32, 1, 192),
    (32, 1, 255),
    (32, 2, 128),
    (32, 2, 192),
    (32, 2, 255),
    (32, 4, 128),
    (32, 4, 255),
    (16, 1, 192),
    (16, 1, 255),
]


def run(formats, shapes, sweep: bool, windows=(0,), token_counts=(1,), sink_counts=(0,)) -> dict:
    copy_bw = copy_bandwidth()
    print(f"{gpu_name()}: copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
    rows = []
    one_token_us = {}  # (shape, format, (window, sinks), config) -> us of the one-token decode
    rings = [(0, 0)] if sweep else [(w, s) for w in windows for s in sink_counts]
    for (batch, seq), tokens in ((shape, t) for shape in shapes for t in token_counts):
        shape = f"{batch}x{seq}"
        base_us = sdpa_time(batch, seq, tokens)
        bf16_bytes = 2 * batch * NUM_KV_HEADS * seq * HEAD_DIM * 2
        one_token_us.setdefault((shape, "bf16 sdpa", (0, 0), ""), base_us)
        rows.append(
            dict(
                shape=shape,
                tokens=tokens,
                format="bf16 sdpa",
                us=base_us,
                tb_s=bf16_bytes / base_us / 1e6,
                copy_pct=100 * bf16_bytes / base_us / 1e-6 / copy_bw,
                speedup=1.0,
                window=0,
                sinks=0,
                vs_window0=1.0,
                vs_t1=base_us / one_token_us[shape, "bf16 sdpa", (0, 0), ""],
                splits=0,
                config="",
            )
        )
        splits_default = default_splits(batch, seq)
        for name in formats:
            fmt = get_format(name)
            nbytes = batch * seq * NUM_KV_HEADS * fmt.bytes_per_token_head(HEAD_DIM)
            inputs = tq_inputs(fmt, batch, seq, tokens)
            configs = [({}, splits_default)]
            if sweep and tokens > 1:
                configs = [
                    ({"split_config": SplitConfig(bn, 1, w, 2, regs)}, splits_default)
                    for bn, w, regs in VERIFY_SWEEP
                ]
            elif sweep:
                configs = [
                    ({"split_config": SplitConfig(bn, sub, w, st)}, splits_default)
                    for bn, w, st, sub in SWEEP
                ]
                configs += [({}, max(1, int(splits_default * f))) for f in SPLIT_FACTORS]
            for config, splits in configs:
                try:
                    # the calls hold the rings their graph reads: kept until every graph is
                    # timed
                    ring_calls = {
                        ring: tq_calls(fmt, inputs, window_rings(inputs, *ring), splits, **config)
                        for ring in rings
                    }
                    graphs = {ring: capture(calls) for ring, calls in ring_calls.items()}
                except Exception as err:  # a sweep point that does not compile or fit
                    print(f"  {name} {config}: {type(err).__name__}: {str(err)[:160]}")
                    continue
                times = time_windows(graphs, len(inputs))
                del graphs, ring_calls
                label = _config_label(config)
                # the split count the plan took: a verify step's may be below the cache's
                q, cache, _, table, _ = inputs[0]
                plan = triton_decode.plan_for(fmt, q, cache, table, splits, **config)
                for (window, sinks), us in times.items():
                    t1 = one_token_us.setdefault((shape, name, (window, sinks), label), us)
                    rows.append(
                        dict(
                            shape=shape,
                            tokens=tokens,
                            format=name,
                            us=us,
                            tb_s=nbytes / us / 1e6,
                            copy_pct=100 * nbytes / us / 1e-6 / copy_bw,
                            speedup=base_us / us,
                            window=window,
                            sinks=sinks,
                            vs_window0=times.get((0, 0), float("nan")) / us,
                            vs_t1=us / t1,
                            splits=plan.num_splits,
                            config=label,
                        )
                    )
            del inputs
            torch.cuda.empty_cache()
    print_table(
        rows,
        dict(
            shape="",
            tokens="d",
            format="",
            us=".1f",
            tb_s=".2f",
            copy_pct=".1f",
            speedup=".2f",
            window="d",
            sinks="d",
            vs_window0=".3f",
            vs_t1=".2f",
            splits="d",
            config="",
        ),
    )
    return dict(gpu=gpu_name(), copy_bandwidth=copy_bw, rows=rows)


def _config_label(config: dict) -> str:
    """``block_n=..,subtiles=..,num_warps=..,num_stages=..,max_registers=..`` of a sweep point
    ("" default)."""
    split_config = config.get("split_config")
    if split_config is None:
        return ""
    return ",".join(f"{k}={v}" for k, v in split_config._asdict().items())


def plot(payload: dict, path: Path) -> None:
    plt = pyplot()

    rows = [
        r
        for r in payload["rows"]
        if r["format"] != "bf16 sdpa"
        and not r["config"]
        and not r.get("window")
        and not r.get("sinks")
        and r.get("tokens", 1) == 1
    ]
    if not rows:
        print("no one-token rows without a window: no PNG")
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(formats)
    for i, name in enumerate(formats):
        speed = {r["shape"]: r["speedup"] for r in rows if r["format"] == name}
        xs = [j + i * width for j in range(len(shapes))]
        ax.bar(xs, [speed.get(s, 0) for s in shapes], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set_xlabel("batch x cached tokens (Hq=32, Hk=8, D=128)")
    ax.set_ylabel("speed-up vs bf16 SDPA")
    ax.set_title(f"tq.decode on {payload['gpu']}")
    ax.legend(ncol=4, fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--shapes", nargs="*", type=parse_shape, help="BxS, e.g. 1x131072")
    parser.add_argument("--sweep", action="store_true", help="tune block/warps/stages/splits")
    parser.add_argument(
        "--windows",
        nargs="*",
        type=int,
        default=[0, 128],
        help="recent-window sizes to time (tokens in bf16 rings; 0: none)",
    )
    parser.add_argument(
        "--sinks",
        nargs="*",
        type=int,
        default=[0],
        help="sink counts to time with each window (first tokens in the bf16 rings)",
    )
    parser.add_argument(
        "--tokens",
        nargs="*",
        type=int,
        default=[1],
        help="query tokens per sequence to time (several: a speculative-decoding verify step)",
    )
    parser.add_argument("--plot", type=Path, help="only draw the PNG of a saved JSON run")
    parser.add_argument("--out", default="decode.json")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    require_cuda("benchmarks/decode.py")
    payload = run(
        args.formats, args.shapes or SHAPES, args.sweep, args.windows, args.tokens, args.sinks
    )
    write_results(args.out, payload, plot, "python benchmarks/decode.py --plot JSON later")


if __name__ == "__main__":
    main()
