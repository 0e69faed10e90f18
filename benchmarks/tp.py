"""End-to-end decode under tensor parallelism: TurboQuant caches vs bf16, TP=N vs one GPU.

Launched with ``torchrun --nproc-per-node N``: each rank (NCCL on CUDA, gloo on the CPU) holds
its shard of the example model (``examples/tp.py``'s ``apply_tp``: column-parallel
wqkv/w1/w3, row-parallel wo/w2, functional all-reduces that CUDA graphs capture) and caches of
its ``Hk / N`` kv-heads. The cells are ``benchmarks/e2e.py``'s (``run_cells``: caches filled
with random K/V up to ``context - steps - 4`` tokens, the decode step of each mode, ms per step
after warm-up): the bf16 cache with SDPA ``enable_gqa=True`` (the baseline of every speed-up)
and each TurboQuant format, at one batch x context, in each mode (``eager``,
``reduce-overhead``: CUDA graphs). Rank 0's times are reported; the all-reduces of every layer
keep the ranks in step. ``kv_gb`` is one GPU's cache. The ranks time every cell in their own
processes, so a ``reduce-overhead`` cell after the first one runs its CUDA graph as a second
graph of the process (``benchmarks/e2e.py``'s ``--one-process``: bf16, timed first, gains ~90 us
per step on an H200).

The comparison: after the TP cells, rank 0 alone (the other ranks have exited) runs the
unsharded model on one GPU at each ``--single-batches`` batch, default ``batch / N``: **the
same per-GPU cache work**. A TP rank holds and reads ``B x Hk / N`` sequence-heads of cache
per layer and step, exactly what one GPU holds and reads at batch ``B / N`` with all ``Hk``
heads: the same KV bytes (the part TurboQuant shrinks), the same attention work, the same
decode kernel grid per GPU. What differs is the weights: a TP rank reads ``1 / N`` of the
linear layers' (plus the replicated output layer), the single GPU all of them, so at ``B / N``
the single GPU spends a larger share of its step on bytes TurboQuant does not touch, and adds
no all-reduce. TP's speed-up should therefore be at least the single GPU's at ``B / N``. Batch
``B`` on one GPU (``--single-batches 8 16``) is the other reading: the same total work, with a
weights-to-cache mix per GPU close to a TP rank's but twice the bytes.

    torchrun --nproc-per-node 2 benchmarks/tp.py --preset 8b-shape --batch 16 \\
        --context 32768 --modes reduce-overhead --steps 20          # 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/tp.py --modes eager        # CPU: tiny model, gloo

On the CPU the times measure the reference kernels and gloo, not anything a GPU does; the run
checks that every piece works.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import gpu_name, print_table, write_results  # noqa: E402
from e2e import BASELINE, MODES, _printable, plot, run_cells  # noqa: E402

from examples.model import ModelArgs, Transformer, init_weights  # noqa: E402
from examples.tp import apply_tp, init_distributed, leave_process_group  # noqa: E402

# preset, batch, context when not given: the GPU cell, and a CPU-sized one
DEFAULTS = {"cuda": ("8b-shape", 16, 32768), "cpu": ("tiny", 4, 128)}


def build_model(preset: str, device: torch.device) -> Transformer:
    """The example model with random weights (seed 0: the same on every rank), bf16."""
    with torch.device(device):
        return init_weights(Transformer(ModelArgs.from_name(preset)), seed=0).to(torch.bfloat16)


def cells(model: Transformer, args, batch: int, world_size: int) -> list[dict]:
    """``benchmarks/e2e.py``'s cells at ``batch x args.context``, tagged with ``world_size``."""
    cell_args = argparse.Namespace(
        modes=args.modes,
        batches=[batch],
        contexts=[args.context],
        dense=[],
        formats=args.formats,
        steps=args.steps,
        kv_budget_gb=args.kv_budget_gb,
        capacity_gb=None,
        splits=None,
        sinks=None,
        center=False,
        kernels=0,
    )
    return [dict(world_size=world_size, **row) for row in run_cells(model.eval(), cell_args)]


def comparison(rows: list[dict], world_size: int) -> list[dict]:
    """Per mode and format: the TP speed-up over bf16 next to each one-GPU speed-up."""
    tp_rows = [r for r in rows if r["world_size"] == world_size and r["cache"] != BASELINE]
    singles = [r for r in rows if r["world_size"] == 1]
    out = []
    for tp in tp_rows:
        for single in (r for r in singles if (r["mode"], r["cache"]) == (tp["mode"], tp["cache"])):
            both = tp["speedup"] and single["speedup"]  # None where a cache did not fit
            ratio = tp["speedup"] / single["speedup"] if both else None
            out.append(
                dict(
                    mode=tp["mode"],
                    cache=tp["cache"],
                    tp_batch=tp["batch"],
                    tp_speedup=tp["speedup"],
                    single_batch=single["batch"],
                    single_speedup=single["speedup"],
                    tp_over_single=ratio,
                )
            )
    return out


def _setting(row: dict) -> tuple[int, int, int]:
    """The plot's cell of a row: (GPUs, batch, context)."""
    return row["world_size"], row["batch"], row["context"]


def _setting_label(setting: tuple[int, int, int]) -> str:
    world_size, batch, context = setting
    gpus = f"TP={world_size}" if world_size > 1 else "1 GPU"
    return f"{gpus}, B={batch}\n{context} tokens"


def report(payload: dict, out: str) -> None:
    """Rank 0: the table, the comparison lines, the JSON and the PNG."""
    world_size = payload["world_size"]
    print(
        f"\n{payload['preset']} on {payload['gpu']}, context {payload['context']}; "
        f"speed-up over bf16 SDPA enable_gqa in the same setting; kv_gb per GPU"
    )
    print_table(
        [_printable(r) for r in payload["rows"]],
        dict(
            world_size="d",
            mode="",
            batch="d",
            context="d",
            cache="",
            ms="",
            tok_s="",
            speedup="",
            kv_gb=".2f",
        ),
    )
    for c in payload["comparison"]:
        text = {
            k: "n/a" if c[k] is None else f"{c[k]:.2f}x"
            for k in ("tp_speedup", "single_speedup", "tp_over_single")
        }
        print(
            f"{c['mode']} {c['cache']}: TP={world_size} at B={c['tp_batch']} "
            f"{text['tp_speedup']} vs one GPU at B={c['single_batch']} "
            f"{text['single_speedup']} (ratio {text['tp_over_single']})"
        )
    write_results(out, payload, functools.partial(plot, cell=_setting, label=_setting_label))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=sorted(DEFAULTS),
    )
    parser.add_argument("--preset", help="model preset (default: 8b-shape on CUDA, tiny on CPU)")
    parser.add_argument("--batch", type=int, help="TP batch (default: 16 on CUDA, 4 on CPU)")
    parser.add_argument("--context", type=int, help="tokens (default: 32768 on CUDA, 128 on CPU)")
    parser.add_argument("--modes", nargs="+", default=["eager", "reduce-overhead"], choices=MODES)
    parser.add_argument("--formats", nargs="+", default=["4bit_nc"])
    parser.add_argument(
        "--single-batches",
        type=int,
        nargs="*",
        help="one-GPU batches run by rank 0 afterwards (default: batch / N; none: no one-GPU run)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--kv-budget-gb",
        type=float,
        default=40.0,
        help="e2e.py's max_context column (in the JSON)",
    )
    parser.add_argument(
        "--out", default="tp.json", help="JSON (relative: under benchmarks/results), PNG beside"
    )
    args = parser.parse_args()
    preset, batch, context = DEFAULTS[args.device]
    args.preset, args.batch = args.preset or preset, args.batch or batch
    args.context = args.context or context
    if args.steps < 1 or args.context <= args.steps + 4:
        parser.error(
            f"need --steps >= 1 and --context > steps + 4, got {args.steps} and {args.context}"
        )

    rank, world_size, device = init_distributed(args.device)
    if world_size < 2:
        dist.destroy_process_group()
        parser.error(f"launch with torchrun --nproc-per-node N, N >= 2 (got {world_size})")
    if args.single_batches is None:
        args.single_batches = [max(1, args.batch // world_size)]
    # One printer: the other ranks run the same cells silently.
    quiet = contextlib.redirect_stdout(open(os.devnull, "w")) if rank else contextlib.nullcontext()
    with quiet:
        print(
            f"TP={world_size} over {device.type} ranks: {args.preset}, B={args.batch}, "
            f"context {args.context}",
            flush=True,
        )
        model = apply_tp(build_model(args.preset, device))
        rows = cells(model, args, args.batch, world_size)
        del model
    leave_process_group()
    if rank:
        return
    for batch in args.single_batches:
        gc.collect()
        torch.cuda.empty_cache()
        print(f"one {device.type} device: {args.preset}, B={batch}", flush=True)
        rows += cells(build_model(args.preset, device), args, batch, 1)
    payload = dict(
        gpu=gpu_name(device) if device.type == "cuda" else "cpu",
        preset=args.preset,
        world_size=world_size,
        context=args.context,
        steps=args.steps,
        rows=rows,
    )
    payload["comparison"] = comparison(rows, world_size)
    report(payload, args.out)


if __name__ == "__main__":
    main()
