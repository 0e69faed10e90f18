"""The decode kernel's own arithmetic error at long contexts: ``tq.decode`` against the float64
reference attention over the same codes, by the tokens each split holds.

A format's quality is its codes' (``quality.py``, ``attention_error.py``); this is what the
kernel adds on top of them, which the tests bound only at short contexts. It grows with what a
split accumulates: the tensor cores truncate while they align an MMA's products to the largest,
so a term every product carries (a uniform value's zero point, an operand's bias) loses a
fraction of the accumulators' whole size per MMA, in one direction, and longer splits hold
longer sums (``docs/notes/2026-12-02-integer-subnormals-and-the-bound.md``). Run it before and
after a change of the kernel's numbers, at the capacity shapes' split lengths too.

For each format and ``B x S`` shape (Hq 32, Hk 8, D 128, page 16, random bf16 tokens stored in
the format, a random bf16 query, window 0): the decode with the cache's default split count
(``--splits``: another one), the reference's float64 attention over the same codes
(``reference.decode``), and the error's rms and maximum relative to the reference's rms and
maximum magnitude, with the tokens per split.

    python benchmarks/decode_error.py                                   # the default set
    python benchmarks/decode_error.py --formats tq3_nc --shapes 165x8192 --splits 1 4 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402
from common import gpu_name, print_table, pyplot, require_cuda, save_figure, write_results  # noqa: E402

from custom_ops import api, reference  # noqa: E402
from custom_ops.formats import FORMATS, get_format  # noqa: E402

FORMATS_DEFAULT = ["4bit_nc", "3bit_nc", "tq3_nc", "tqk5v3_nc", "k8v4"]
SHAPES_DEFAULT = [(4, 8192), (1, 32768), (1, 131072), (165, 8192)]


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(rms, max)`` of ``out - ref`` over the rms and the largest magnitude of ``ref``."""
    err = out.double() - ref.double()
    rms = (err.square().mean() / ref.double().square().mean()).sqrt().item()
    return rms, (err.abs().max() / ref.double().abs().max()).item()


def measure(name: str, batch: int, seq: int, splits: int, seed: int) -> dict:
    """One format at one shape and split count (0: the cache's default): the row of the
    table."""
    torch.manual_seed(seed)
    fmt = get_format(name)
    cache, consts, table, lens = bench.filled_cache(fmt, batch, seq)
    q = torch.randn(batch, bench.NUM_Q_HEADS, bench.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    splits = splits or bench.default_splits(batch, seq)
    out = api.decode(fmt, q, cache, table, lens, consts, splits)
    ref = reference.decode(
        fmt, q, cache, table, lens, consts.rotation, bench.HEAD_DIM**-0.5, torch.float64
    )
    rms, largest = relative_errors(out, ref.reshape(out.shape))
    return dict(
        format=name,
        shape=f"{batch}x{seq}",
        splits=splits,
        tokens_per_split=-(-seq // splits),
        rel_rms=rms,
        rel_max=largest,
    )


def plot(payload: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["format"] for r in payload["rows"]):
        rows = sorted(
            (r for r in payload["rows"] if r["format"] == name),
            key=lambda r: r["tokens_per_split"],
        )
        ax.plot(
            [r["tokens_per_split"] for r in rows], [r["rel_rms"] for r in rows], "o-", label=name
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per split")
    ax.set_ylabel("relative rms error against float64 over the same codes")
    ax.set_title(f"Decode kernel arithmetic error ({payload['gpu']})")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=FORMATS_DEFAULT, choices=sorted(FORMATS))
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=bench.parse_shape,
        default=SHAPES_DEFAULT,
        help="BxS, e.g. 1x131072",
    )
    parser.add_argument(
        "--splits", nargs="+", type=int, default=[0], help="split counts (0: the cache's default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="decode_error.json")
    args = parser.parse_args()
    if any(s < 0 or s & (s - 1) for s in args.splits):
        parser.error(f"--splits takes 0 or powers of two, got {args.splits}")
    require_cuda("benchmarks/decode_error.py")
    rows = []
    for name in args.formats:
        for batch, seq in args.shapes:
            for splits in args.splits:
                row = measure(name, batch, seq, splits, args.seed)
                print(
                    f"{name:10s} {row['shape']:>9s} splits {row['splits']:3d} "
                    f"({row['tokens_per_split']} tokens each): rel rms {row['rel_rms']:.3e}, "
                    f"rel max {row['rel_max']:.3e}",
                    flush=True,
                )
                rows.append(row)
                torch.cuda.empty_cache()
    print(f"\n{gpu_name()}")
    columns = {"format": "", "shape": "", "splits": "d", "tokens_per_split": "d"}
    print_table(rows, {**columns, "rel_rms": ".3e", "rel_max": ".3e"})
    payload = dict(gpu=gpu_name(), seed=args.seed, rows=rows)
    write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
