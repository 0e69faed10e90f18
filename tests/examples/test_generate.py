"""examples/generate.py: generates with bf16 and TurboQuant caches and reports speed, bytes and
next-token agreement."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT
from helpers import run_example

from custom_ops.formats import get_format
from examples.model import ModelArgs

BATCH, PROMPT_LEN, NEW_TOKENS = 2, 16, 8
# generate.py's --window default, TurboQuantKVConfig's page size and its sinks with a window
WINDOW, PAGE_SIZE, SINKS = 16, 16, 4
# Next-token agreement (2 x 8 predictions) of 4bit_nc with the bf16 cache: 0.875-1.0 over
# generate.py's seeds 0-7 (this test runs seed 0: 0.938); an all-zero attention output gives
# 0.125, a random one 0.062.
AGREEMENT_FLOOR = 0.75


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _kv_ratio(fmt_name: str, max_seq: int, head_dim: int, kv_heads: int) -> float:
    """TurboQuant cache bytes over bf16 cache bytes per layer: for each sequence and kv-head,
    whole pages of the format's bytes per token-head for the positions that leave the window,
    and bf16 K and V rings of the window and the sinks; for the cache, its rotation and block
    table; against bf16 K and V of every position."""
    pages = -(-(max_seq - WINDOW) // PAGE_SIZE)
    slots = WINDOW + SINKS
    ring = 2 * slots * head_dim * 2 + slots * 4  # bf16 K and V, int32 slot positions
    per_head = pages * PAGE_SIZE * get_format(fmt_name).bytes_per_token_head(head_dim) + ring
    constants = head_dim * head_dim * 4 + BATCH * pages * 4  # [D, D] float32, [B, pages] int32
    dense = BATCH * kv_heads * 2 * max_seq * head_dim * 2
    return (BATCH * kv_heads * per_head + constants) / dense


def test_generate_runs_and_reports():
    """``examples/generate.py`` (the random-weight example) runs the tiny model on the CPU with
    a compiled decode step: it reports every decode step of both caches, positive tokens/s (and
    their ratio), the KV-cache bytes and ratio to bf16 that 4bit_nc and the window imply, and
    a next-token agreement with the bf16 cache above the floor."""
    sizes = {"--batch": BATCH, "--prompt-len": PROMPT_LEN, "--new-tokens": NEW_TOKENS}
    args = [str(a) for item in sizes.items() for a in item]
    out = run_example("examples/generate.py", "--device", "cpu", *args)
    tiny = ModelArgs.from_name("tiny")
    assert (
        f"tiny model ({tiny.n_layer} layers, Hq={tiny.n_head}, Hk={tiny.n_local_heads}, "
        f"D={tiny.head_dim}) on cpu; batch {BATCH}, prompt {PROMPT_LEN}, "
        f"{NEW_TOKENS} new tokens"
    ) in out
    rates = {}
    for label in ("bf16", "4bit_nc"):
        steps = re.findall(rf"{label} decode: (\d+)/{NEW_TOKENS} tokens", out)
        assert sorted(map(int, steps)) == list(range(1, NEW_TOKENS + 1)), out
        (rate,) = re.findall(rf"{label} decode: {NEW_TOKENS} tokens, ([\d,]+) tokens/s", out)
        rates[label] = _number(rate)
        assert rates[label] > 0

    speed = re.search(r"decode tokens/s: bf16 ([\d,]+), 4bit_nc ([\d,]+) \(([\d.]+)x\)", out)
    assert speed, out
    assert (_number(speed[1]), _number(speed[2])) == (rates["bf16"], rates["4bit_nc"])
    # the rates are printed rounded to whole tokens/s, the ratio from the unrounded ones (to
    # 0.01): on a slow machine (a few tokens/s) the rounding alone moves the ratio by > 0.01
    tq, bf16 = rates["4bit_nc"], rates["bf16"]
    low, high = (tq - 0.5) / (bf16 + 0.5), (tq + 0.5) / max(bf16 - 0.5, 0.5)
    assert low - 0.005 <= float(speed[3]) <= high + 0.005, (speed[0], low, high)

    kv = re.search(
        r"KV cache: ([\d.]+) MB vs bf16 ([\d.]+) MB \(([\d.]+)x; the last (\d+) tokens "
        r"and the first (\d+)",
        out,
    )
    assert kv, out
    max_seq = PROMPT_LEN + NEW_TOKENS + 1
    ratio = _kv_ratio("4bit_nc", max_seq, tiny.head_dim, tiny.n_local_heads)
    dense = tiny.n_layer * BATCH * tiny.n_local_heads * 2 * max_seq * tiny.head_dim * 2
    assert (int(kv[4]), int(kv[5])) == (WINDOW, SINKS)
    assert abs(float(kv[3]) - ratio) <= 5e-4, (kv[3], ratio)
    assert float(kv[2]) == round(dense / 1e6, 2)
    assert float(kv[1]) == round(ratio * dense / 1e6, 2)

    agreement = re.search(r"next-token agreement with the bf16 cache: ([\d.]+)%", out)
    assert agreement, out
    agreement = float(agreement[1]) / 100
    predictions = BATCH * NEW_TOKENS
    assert abs(agreement * predictions - round(agreement * predictions)) < 0.01  # k / 16
    assert AGREEMENT_FLOOR <= agreement <= 1, agreement


def test_bad_arguments_exit_with_a_message():
    """Sizes below 1, a window that would quantize nothing and a missing CUDA device stop the
    script with argparse's status 2 and a message naming the argument."""
    messages = []
    for args in (["--batch", "0"], ["--new-tokens", "0"], ["--window", "200"]):
        result = subprocess.run(
            [sys.executable, "examples/generate.py", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr[-2000:]
        messages.append(result.stderr.strip().splitlines()[-1])
    assert messages == [
        "generate.py: error: --batch must be >= 1, got 0",
        "generate.py: error: --new-tokens must be >= 1, got 0",
        "generate.py: error: --window must be in [0, 96) (prompt + new tokens; longer quantizes "
        "nothing), got 200",
    ]


def test_one_new_token_runs():
    """``--new-tokens 1`` finishes and says the single step is too few to time."""
    out = run_example(
        "examples/generate.py",
        "--device",
        "cpu",
        "--batch",
        "1",
        "--prompt-len",
        "8",
        "--new-tokens",
        "1",
        "--window",
        "4",
    )
    assert "too few steps to time" in out and "next-token agreement" in out
