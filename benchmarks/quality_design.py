"""Quality design space on the real LLM: formats x window x sinks x key centering, fast.

``benchmarks/quality.py --model smollm2`` measures a format through the real cache, one token
per forward (about 10 minutes per configuration for 2048 tokens on two CPU cores), which is too
slow to explore options the cache does not have yet or to average over many texts. This tool
computes the *same attention* in one parallel forward per configuration: every query ``t``
attends to position ``p <= t`` with the model's own key and value where the cache would hold
them in full precision (the recent window, ``p > t - W``, and the first ``S`` positions, the
attention sinks) and with the format's reference round trip (``attention_error.quantized``: the
reference encoder and decoder, scalars rounded to the format's meta dtype) everywhere else; that
is what teacher-forced decoding through a ``TurboQuantCache`` reads, since a token is quantized
when it leaves the window and never changes after. Key centering subtracts one vector ``mu`` per
(layer, kv-head) before quantizing and adds it back after (``mu``: the mean of the keys of
positions ``[S, S + max(W, 1))``, the window's contents when its first token is evicted, so a
cache can set it causally, as ``TurboQuantKVCache(center_keys=True)`` does; softmax is
invariant to a shift that all of a query's keys share, so the cache stores every key centred and
decode reads them as they are).

Texts: the first ``--eval-len`` tokens (default 2048) of the ``--texts`` longest chapters of the
Python language reference as CPython ships it (``pydoc_data.topics``); reports per configuration
the perplexity increase over the uncompressed cache averaged over the texts (mean of per-text
increases), its smallest and largest, and bytes per token-head, and writes
``results/quality_design.json``. The model runs in float32 by default (``--dtype``): in bf16 a
parallel forward and one-token decoding differ by rounding that moves a 256-token perplexity by
0.3%, as much as the 4-bit formats' whole cost, while in float32 they agree to 1e-5 per token,
so what remains is the format's own error. ``tests/benchmarks/test_quality_design.py`` checks
the attention against a ``TurboQuantKVCache`` decoded one token at a time.

    python benchmarks/quality_design.py --formats 4bit_nc tq3_nc --sinks 0 4 --center off on
    python benchmarks/quality_design.py --texts 4 --formats lm4+lm2 --sinks 4   # a codec pair
    python benchmarks/quality_design.py --texts 4 --formats lm2+bf16 bf16+lm2 --sinks 4  # one side
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from attention_error import attention, quantized  # noqa: E402
from common import print_table, pyplot, save_figure, write_json  # noqa: E402

from custom_ops import api, reference  # noqa: E402
from custom_ops.formats import Codec, Kind, KVFormat, get_format  # noqa: E402

ATTENTION = "tq_quality_design"


class WideLloydMax(NamedTuple):
    """A rotated, norm-corrected Lloyd-Max side wider than the cache's codecs store (6 to 8
    bits), in reference math only (:func:`custom_ops.reference.lloyd_max_codes`, the norm in
    the meta dtype): how a format with such a side would measure."""

    bits: int
    meta_fields: tuple[str, ...] = ("norm",)

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8


class Exact(NamedTuple):
    """A side left unquantized (``bf16``: 16 bits, no meta record; centred keys still round
    ``key - mu`` to the model's dtype, as a centring cache's ring does): pairs such as
    ``lm2+bf16`` measure one side's quantization alone."""

    meta_fields: tuple[str, ...] = ()

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * 2


class DesignFormat(NamedTuple):
    """A ``<keys>+<values>`` pair with a :class:`WideLloydMax` or :class:`Exact` side (what
    :func:`format_of` gives instead of a :class:`KVFormat`, which holds storable codecs
    only)."""

    name: str
    key: Codec | WideLloydMax | Exact
    value: Codec | WideLloydMax | Exact
    meta_dtype: torch.dtype

    def bytes_per_token_head(self, head_dim: int) -> int:
        fields = len(self.key.meta_fields) + len(self.value.meta_fields)
        code_bytes = self.key.code_bytes(head_dim) + self.value.code_bytes(head_dim)
        return code_bytes + fields * self.meta_dtype.itemsize


# the sides a "<keys>+<values>" format spec names: Lloyd-Max (rotated, norm-corrected) or
# uniform, and the width
_SPEC_CODECS = (
    {f"lm{bits}": Codec(Kind.LLOYD_MAX, bits, True) for bits in (1, 2, 3, 4, 5)}
    | {f"lm{bits}": WideLloydMax(bits) for bits in (6, 7, 8)}
    | {f"u{bits}": Codec(Kind.UNIFORM, bits) for bits in (2, 3, 4)}
    | {"bf16": Exact()}
)


def format_of(name: str) -> KVFormat | DesignFormat:
    """A format of ``custom_ops.FORMATS`` by name, or one that pairs two sides, written
    ``<keys>+<values>`` with each side ``lm1`` .. ``lm8`` (Lloyd-Max; from 6 bits a
    :class:`WideLloydMax`), ``u2`` .. ``u4`` (uniform) or ``bf16`` (:class:`Exact`) and a bf16
    meta record: ``lm4+lm2`` spends a 3-bit budget on 4-bit keys, ``lm2+bf16`` measures 2-bit
    keys alone."""
    if "+" not in name:
        return get_format(name)
    sides = name.split("+")
    if len(sides) != 2 or not set(sides) <= set(_SPEC_CODECS):
        raise ValueError(
            f"format {name!r}: expected a format name or <keys>+<values> with each "
            f"side one of {sorted(_SPEC_CODECS)}"
        )
    key, value = (_SPEC_CODECS[side] for side in sides)
    if isinstance(key, Codec) and isinstance(value, Codec):
        return KVFormat(name, key, value, torch.bfloat16)
    return DesignFormat(name, key, value, torch.bfloat16)


def round_trip(
    side: Codec | WideLloydMax | Exact,
    x: torch.Tensor,
    rotation: torch.Tensor,
    meta_dtype: torch.dtype,
) -> torch.Tensor:
    """``x [B, H, T, D]`` as one side of a format reads it back (float32)."""
    if isinstance(side, Exact):
        return x
    if isinstance(side, Codec):
        return quantized(side, x, rotation, meta_dtype)
    rows = x.reshape(-1, x.shape[-1]).float()
    codes, norm = reference.lloyd_max_codes(side.bits, True, rows, rotation)
    stored = norm.to(meta_dtype).float()
    return reference.lloyd_max_rows(side.bits, codes, stored, rotation).reshape(x.shape)


class Setting:
    """One cache configuration: format ``fmt_name`` (None: uncompressed; see
    :func:`format_of`), ``window`` W, ``sinks`` S, key ``center``ing."""

    def __init__(self, fmt_name, window=0, sinks=0, center=False):
        self.fmt_name, self.window, self.sinks, self.center = fmt_name, window, sinks, center
        self.fmt = None if fmt_name is None else format_of(fmt_name)

    @property
    def label(self) -> str:
        if self.fmt is None:
            return "uncompressed"
        return f"{self.fmt_name} W{self.window} S{self.sinks}{' centered' if self.center else ''}"


def quantized_attention(setting: Setting, rotation: torch.Tensor):
    """An attention function for transformers' ``AttentionInterface`` that computes causal
    attention as a cache of ``setting`` serves it (see the module docstring; float32): ``query
    [B, Hq, T, D]``, ``key``/``value [B, Hk, T, D]`` -> ``(out [B, T, Hq, D] in the query's
    dtype, None)``. The mask is the causal one whatever ``attention_mask`` says (one unpadded
    sequence) and the scale ``D ** -0.5``."""

    def serve(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
        head_dim = query.shape[-1]
        if scaling is not None and abs(scaling * head_dim**0.5 - 1) > 1e-6:
            raise ValueError(
                f"quality_design: attention scaling must be D ** -0.5 = "
                f"{head_dim**-0.5:g}, got {scaling!r}"
            )
        k, v = key.float(), value.float()
        if setting.fmt is None:
            out = attention(query, k, v, k, v, window=0, dtype=torch.float32)
        else:
            fmt = setting.fmt
            mu = torch.zeros_like(k[:, :, :1])
            if setting.center:
                first = slice(setting.sinks, setting.sinks + max(setting.window, 1))
                mu = k[:, :, first].mean(dim=2, keepdim=True)
            # centred keys in the model's dtype, as a centring cache's ring holds them
            centred = (k - mu).to(key.dtype).float()
            k_hat = round_trip(fmt.key, centred, rotation, fmt.meta_dtype) + mu
            v_hat = round_trip(fmt.value, v, rotation, fmt.meta_dtype)
            out = attention(
                query, k_hat, v_hat, k, v, setting.window, setting.sinks, dtype=torch.float32
            )
        return out.transpose(1, 2).to(query.dtype), None

    return serve


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, setting: Setting, rotation: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood ``[T - 1]`` float32 of tokens ``1 .. T - 1`` of ``ids [T]`` with
    attention served as ``setting`` says (one parallel forward, no cache)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, quantized_attention(setting, rotation))
    model.set_attn_implementation(ATTENTION)
    logits = model(ids[None], use_cache=False).logits[0, :-1].float()
    return torch.logsumexp(logits, -1) - logits.gather(-1, ids[1:, None])[:, 0]


def texts(tokenizer, count: int, length: int) -> list[tuple[str, torch.Tensor]]:
    """The first ``length`` token ids of the ``count`` longest chapters of CPython's language
    reference (``pydoc_data.topics``) that have that many tokens."""
    from pydoc_data.topics import topics

    encoded = {name: tokenizer(text)["input_ids"] for name, text in topics.items()}
    longest = sorted(
        (n for n in encoded if len(encoded[n]) >= length), key=lambda n: -len(encoded[n])
    )
    if len(longest) < count:
        raise ValueError(f"--texts: only {len(longest)} chapters have {length} tokens")
    return [(name, torch.tensor(encoded[name][:length])) for name in longest[:count]]


def plot(payload: dict, path: Path) -> None:
    """Perplexity increase against bytes per token-head, one series per (window, sinks,
    centering): the quality frontier."""
    plt = pyplot()
    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    variants = dict.fromkeys((r["window"], r["sinks"], r["center"]) for r in rows)
    for i, variant in enumerate(variants):
        window, sinks, center = variant
        points = [r for r in rows if (r["window"], r["sinks"], r["center"]) == variant]
        points.sort(key=lambda r: r["bytes_per_token_head"])
        label = f"window {window}, sinks {sinks}{', centered' if center else ''}"
        ax.plot(
            [r["bytes_per_token_head"] for r in points],
            [r["ppl_delta_pct"] for r in points],
            marker="osD^v<>"[i % 7],
            linewidth=0.8,
            label=label,
        )
        for r in points:
            ax.annotate(
                r["format"],
                (r["bytes_per_token_head"], r["ppl_delta_pct"]),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=6,
            )
    ax.set_yscale("symlog", linthresh=0.1)  # linear within +-0.1 %, logarithmic beyond
    ax.set_xlabel("KV-cache bytes per token-head (D=64)")
    ax.set_ylabel("perplexity increase over the uncompressed cache (%)")
    ax.set_title(
        f"SmolLM2-135M-Instruct ({payload['dtype']}), {len(payload['texts'])} texts x "
        f"{payload['eval_len']} tokens, mean over texts"
    )
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    from tq_compile.smollm2 import load_smollm2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--formats",
        nargs="+",
        default=["4bit_nc", "tq4_nc", "3bit_nc", "tq3_nc", "k2v2_nc", "tq2_nc"],
        help="format names, or codec pairs <keys>+<values> such as lm4+lm2 (see format_of)",
    )
    parser.add_argument("--windows", nargs="+", type=int, default=[128])
    parser.add_argument("--sinks", nargs="+", type=int, default=[0, 4])
    parser.add_argument("--center", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--texts", type=int, default=8, help="chapters averaged over")
    parser.add_argument("--eval-len", type=int, default=2048, help="tokens per text")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", default="quality_design.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), device="cpu", quiet=True)
    head_dim = model.config.head_dim
    rotation = api.make_constants("4bit_nc", head_dim).rotation  # the caches' default seed
    grid = itertools.product(args.formats, args.windows, args.sinks, args.center)
    settings = [Setting(f, w, s, c == "on") for f, w, s, c in grid]
    chapters = texts(tokenizer, args.texts, args.eval_len)
    payload = dict(
        model="SmolLM2-135M-Instruct",
        dtype=args.dtype,
        eval_len=args.eval_len,
        texts=[name for name, _ in chapters],
    )
    start = time.perf_counter()
    plain = [
        token_nll(model, ids, Setting(None), rotation).double().mean().exp().item()
        for _, ids in chapters
    ]
    rows = []
    for s in settings:
        ppl = [
            token_nll(model, ids, s, rotation).double().mean().exp().item() for _, ids in chapters
        ]
        deltas = [100 * (p / b - 1) for p, b in zip(ppl, plain, strict=True)]
        rows.append(
            dict(
                format=s.fmt_name,
                window=s.window,
                sinks=s.sinks,
                center=s.center,
                bytes_per_token_head=s.fmt.bytes_per_token_head(head_dim),
                ppl_delta_pct=sum(deltas) / len(deltas),
                min_pct=min(deltas),
                max_pct=max(deltas),
                per_text=deltas,
            )
        )
        print(
            f"  {s.label}: {rows[-1]['ppl_delta_pct']:+.3f}% "
            f"({min(deltas):+.3f} .. {max(deltas):+.3f}), {time.perf_counter() - start:.0f} s",
            flush=True,
        )
    payload |= dict(uncompressed_ppl=plain, rows=rows)
    print(
        f"\nSmolLM2-135M-Instruct ({args.dtype}), {len(chapters)} texts x {args.eval_len} "
        f"tokens; perplexity increase over the uncompressed cache, mean over texts (smallest, "
        f"largest); bytes at D={head_dim}"
    )
    print_table(
        rows,
        dict(
            format="",
            window="d",
            sinks="d",
            center="",
            bytes_per_token_head="d",
            ppl_delta_pct="+.3f",
            min_pct="+.3f",
            max_pct="+.3f",
        ),
    )
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib not installed: no PNG")
        return
    plot(payload, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
