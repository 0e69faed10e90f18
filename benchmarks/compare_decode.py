"""``tq.decode`` of two source trees timed side by side: is a change speed-neutral?

Two worker processes, one per tree (each imports its own ``custom_ops`` and its own
``benchmarks/decode.py``), build the same inputs from the same seed (``decode.py``'s shapes,
random caches, shuffled pages and CUDA-graph timing); the controller then replays their graphs
in alternating order for ``--rounds`` rounds and keeps each side's fastest round, so a slow
spell of the GPU lands on both sides. Prints one row per (shape, format, window) with both times
and ``head / base`` speed (> 1: the head tree is faster), and writes ``compare_decode.json``.
``--head-dim`` sets ``decode.py``'s head dim on both sides (default 128).

    git worktree add /tmp/base <commit>
    python benchmarks/compare_decode.py --base /tmp/base          # the head is this tree
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(tree: Path) -> None:
    """Serve ``prepare`` / ``time`` / ``drop`` requests (JSON lines on stdin) for ``tree``."""
    sys.path[:0] = [str(tree / "benchmarks"), str(tree)]
    import decode as bench  # the tree's own benchmark module
    import torch

    from custom_ops import api
    from custom_ops.formats import get_format

    def splits_for(batch: int, seq: int) -> int:
        if hasattr(bench, "default_splits"):
            return bench.default_splits(batch, seq)
        return api.num_splits_for(batch, bench.NUM_KV_HEADS, seq, "cuda")  # older trees

    graphs, inputs = {}, None
    held = {}  # each graph's calls, with the rings they read: a graph holds no tensors
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "prepare":
            fmt = get_format(request["format"])
            batch, seq = request["batch"], request["seq"]
            bench.HEAD_DIM = request["head_dim"]  # read by decode.py's helpers when called
            # the same random caches, queries and page order on both sides
            torch.manual_seed(request["seed"])
            inputs = bench.tq_inputs(fmt, batch, seq)
            for window in request["windows"]:
                calls = bench.tq_calls(
                    fmt, inputs, bench.window_rings(inputs, window), splits_for(batch, seq)
                )
                graphs[window] = bench.capture(calls)
                held[window] = calls
            reply = {"ok": True}
        elif request["op"] == "time":
            reply = {"us": bench.replay_us(graphs[request["window"]], len(inputs))}
        else:  # drop
            graphs, inputs, held = {}, None, {}
            torch.cuda.empty_cache()
            reply = {"ok": True}
        print(json.dumps(reply), flush=True)


class Worker:
    def __init__(self, tree: Path):
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(tree)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker for {request} died (see its stderr above)")
        return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the tree to compare against")
    parser.add_argument("--head", type=Path, default=HERE.parent, help="default: this tree")
    parser.add_argument("--formats", nargs="*")
    parser.add_argument("--shapes", nargs="*", help="BxS, e.g. 1x131072 (default: decode.py's)")
    parser.add_argument("--windows", nargs="*", type=int, default=[0, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    sys.path.insert(0, str(HERE))
    import decode as bench
    from common import gpu_name, print_table, require_cuda, write_json

    from custom_ops.formats import FORMATS

    require_cuda("benchmarks/compare_decode.py")
    shapes = bench.SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    sides = {"base": Worker(args.base.resolve()), "head": Worker(args.head.resolve())}
    rows = []
    for batch, seq in shapes:
        for name in args.formats or list(FORMATS):
            for side in sides.values():
                side.ask(
                    op="prepare",
                    format=name,
                    batch=batch,
                    seq=seq,
                    windows=args.windows,
                    head_dim=args.head_dim,
                    seed=len(rows),
                )
            best = {}
            for r in range(args.rounds):
                order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
                for window in args.windows:
                    for label, side in order:
                        us = side.ask(op="time", window=window)["us"]
                        best[label, window] = min(us, best.get((label, window), us))
            for side in sides.values():
                side.ask(op="drop")
            for window in args.windows:
                base_us, head_us = best["base", window], best["head", window]
                rows.append(
                    dict(
                        shape=f"{batch}x{seq}",
                        format=name,
                        window=window,
                        base_us=base_us,
                        head_us=head_us,
                        speed=base_us / head_us,
                    )
                )
            print(
                f"{batch}x{seq} {name}: "
                + ", ".join(
                    f"w{r['window']} {r['speed']:.3f}" for r in rows[-len(args.windows) :]
                ),
                flush=True,
            )
    print_table(
        rows, dict(shape="", format="", window="d", base_us=".1f", head_us=".1f", speed=".3f")
    )
    speeds = [r["speed"] for r in rows]
    print(f"head / base speed: min {min(speeds):.3f}, max {max(speeds):.3f} over {len(rows)}")
    path = write_json(
        "compare_decode.json",
        dict(
            gpu=gpu_name(),
            base=str(args.base),
            head=str(args.head),
            head_dim=args.head_dim,
            rows=rows,
        ),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
