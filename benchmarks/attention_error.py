"""Each format's error in SmolLM2's attention outputs, layer by layer, without the feedback of
a perplexity run.

Teacher-forced perplexity through a quantized cache (``quality.py --model smollm2``) feeds every
layer's error into the next token's keys and values; without the window that loop is chaotic:
changes far below a format's own error (the meta record's rounding) move perplexity by points.
This measures the error where it is made: one forward of ``--tokens`` tokens of the "Execution
model" chapter through the bf16 SmolLM2-135M-Instruct captures every layer's post-RoPE queries,
keys and values; each format's reference encoder and decoder (``custom_ops.reference``)
quantize the keys and values, with the meta record rounded to the format's dtype or to each of
``--records``; causal attention (float64, GQA) over the quantized keys and values, the last
``--window`` positions before each query exact as the cache's ring keeps them, is compared
with attention over the exact ones. Reported per format x record: the mean over layers of
``||O_q - O|| / ||O||``, and the 99th / 99.9th percentile and maximum of the same ratio per
(token, head) row over every layer. CPU: about 10-30 s per row on two cores after the forward.

    python benchmarks/attention_error.py                              # every format
    python benchmarks/attention_error.py --formats 4bit_nc k8v4 --records float16 float32
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import print_table, pyplot, save_figure, write_json  # noqa: E402

from custom_ops import api, reference  # noqa: E402
from custom_ops.formats import FORMATS, get_format  # noqa: E402
from examples.hf_eval import reference_text  # noqa: E402

RECORDS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@torch.no_grad()
def capture_qkv(num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(q [1, Hq, T, D], k, v [1, Hk, T, D])`` float32 of SmolLM2's forward over the
    first ``num_tokens`` tokens of the evaluation text (what its SDPA calls receive)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tq_compile.smollm2 import load_smollm2

    captured = []

    def capturing_sdpa(module, query, key, value, attention_mask, **kwargs):
        captured.append((query.float(), key.float(), value.float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("tq_capture", capturing_sdpa)
    model, tokenizer = load_smollm2(quiet=True)
    model.set_attn_implementation("tq_capture")
    ids = tokenizer(reference_text(), return_tensors="pt").input_ids[:, :num_tokens]
    model(ids)
    return captured


def quantized(codec, x: torch.Tensor, rotation: torch.Tensor, record: torch.dtype) -> torch.Tensor:
    """``x [B, H, T, D]`` through ``codec``'s reference encoder and decoder (float32), the meta
    record in ``record`` (codes computed against the rounded scalars, as the store does)."""
    head_dim = x.shape[-1]
    packed, meta = reference.encode_rows(codec, x.reshape(-1, head_dim), rotation, record)
    rows = reference.decode_rows(codec, packed, [m.to(record).float() for m in meta], rotation)
    return rows.reshape(x.shape)


def attention(
    q, k, v, k_exact, v_exact, window: int, sinks: int = 0, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Causal GQA attention ``[B, Hq, T, D]`` in ``dtype`` over ``k, v``, except that the
    ``window`` positions up to each query (the ring) and the first ``sinks`` positions read
    ``k_exact, v_exact``."""
    group = q.shape[1] // k.shape[1]
    q = q.to(dtype)
    k, v, k_exact, v_exact = (
        t.to(dtype).repeat_interleave(group, 1) for t in (k, v, k_exact, v_exact)
    )
    positions = torch.arange(q.shape[2])
    distance = positions[:, None] - positions[None, :]  # query - key
    exact = (distance >= 0) & ((distance < window) | (positions[None, :] < sinks))
    scores = torch.where(exact, q @ k_exact.transpose(-1, -2), q @ k.transpose(-1, -2))
    scores = scores * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(distance < 0, float("-inf")), dim=-1)
    return (probs * exact) @ v_exact + (probs * ~exact) @ v


def measure(captured, fmt_name: str, record: torch.dtype, window: int) -> dict:
    fmt = get_format(fmt_name)
    head_dim = captured[0][1].shape[-1]
    rotation = api.make_constants(fmt, head_dim, seed=0).rotation
    layer_errors, row_errors = [], []
    for q, k, v in captured:
        k_q = quantized(fmt.key, k, rotation, record)
        v_q = quantized(fmt.value, v, rotation, record)
        exact = attention(q, k, v, k, v, 0)
        approx = attention(q, k_q, v_q, k, v, window)
        layer_errors.append(float((approx - exact).norm() / exact.norm()))
        row_errors.append(((approx - exact).norm(dim=-1) / exact.norm(dim=-1)).flatten())
    rows = torch.cat(row_errors)
    return dict(
        format=fmt_name,
        record=str(record).removeprefix("torch."),
        window=window,
        mean_error=sum(layer_errors) / len(layer_errors),
        p99=float(rows.quantile(0.99)),
        p999=float(rows.quantile(0.999)),
        max=float(rows.max()),
        worst_layer=max(range(len(layer_errors)), key=layer_errors.__getitem__),
    )


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    labels = [f"{r['format']}\n{r['record']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["mean_error"] for r in rows], label="mean over layers")
    ax.plot(range(len(rows)), [r["p99"] for r in rows], "k_", markersize=14, label="p99 row")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("||O_q - O|| / ||O||")
    ax.set_title(f"SmolLM2 attention-output error, window {rows[0]['window']}")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=sorted(FORMATS), choices=sorted(FORMATS))
    parser.add_argument(
        "--records",
        nargs="*",
        default=[],
        choices=sorted(RECORDS),
        help="meta-record dtypes to try besides each format's own",
    )
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text (>= 2)")
    parser.add_argument("--window", type=int, default=0, help="exact positions before a query")
    parser.add_argument("--out", default="attention_error.json")
    args = parser.parse_args()
    if args.tokens < 2 or args.window < 0:
        parser.error(f"--tokens must be >= 2 and --window >= 0, got {args.tokens}, {args.window}")
    captured = capture_qkv(args.tokens)
    rows = []
    for fmt_name in args.formats:
        own = get_format(fmt_name).meta_dtype
        for record in dict.fromkeys([own, *(RECORDS[r] for r in args.records)]):
            rows.append(measure(captured, fmt_name, record, args.window))
            print(f"  {fmt_name} {rows[-1]['record']}: {rows[-1]['mean_error']:.5f}", flush=True)
    print_table(
        rows,
        {
            "format": "",
            "record": "",
            "mean_error": ".5f",
            "p99": ".4f",
            "p999": ".4f",
            "max": ".3f",
            "worst_layer": "d",
        },
    )
    path = write_json(
        args.out,
        dict(model="SmolLM2-135M-Instruct", tokens=args.tokens, window=args.window, rows=rows),
    )
    print(f"wrote {path}")
    if importlib.util.find_spec("matplotlib") is not None:
        plot(rows, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
