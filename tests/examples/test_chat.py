"""examples/chat.py (the main job): SmolLM2-135M-Instruct answers with a bf16 and a TurboQuant
cache and reports texts, speed, bytes, agreement and perplexity. Skipped when the model file
cannot be fetched."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT, require_smollm2
from helpers import run_example

pytest.importorskip("transformers")


def test_chat_answers_with_both_caches():
    """A short run prints both answers (real English), tokens/s of both caches, the KV bytes
    ratio, where the answers agree and both perplexities on the fixed text (16 tokens: with
    window 4 and 4 sinks, 8 of them are read back quantized)."""
    require_smollm2()
    out = run_example(
        "examples/chat.py",
        "--device",
        "cpu",
        "--prompt",
        "What is the capital of France?",
        "--new-tokens",
        "12",
        "--window",
        "4",
        "--ppl-tokens",
        "16",
        timeout=600,
    )
    answers = re.findall(r"--- (.+) ---\n(.+)\n", out)
    assert [title for title, _ in answers] == [
        "bf16 StaticCache",
        "TurboQuant 4bit_nc, window 4, sinks 4",
    ]
    assert "Paris" in answers[0][1], out
    assert re.search(r"answers: .*\((\d+)/(\d+) positions equal\)", out), out
    rates = re.findall(r"decode (bf16|4bit_nc): ([\d,.]+) tokens/s; KV cache ([\d.]+) MB", out)
    assert [r[0] for r in rates] == ["bf16", "4bit_nc"] and all(float(r[1]) > 0 for r in rates)
    ratio = re.search(r"KV bytes: ([\d.]+)x bf16's", out)
    assert ratio and 0.2 < float(ratio[1]) < 1, out
    ppl = dict(re.findall(r"(bf16|4bit_nc): perplexity ([\d.]+)", out))
    assert set(ppl) == {"bf16", "4bit_nc"} and 1 < float(ppl["bf16"]) < 100, out
    assert re.search(r"4bit_nc vs bf16: [+-][\d.]+% perplexity, top-1 agreement [\d.]+%", out)


def test_bad_arguments_exit_with_a_message():
    """Out-of-range arguments stop the script before the model loads."""
    messages = []
    for args in (
        ["--new-tokens", "0"],
        ["--window", "-1"],
        ["--sinks", "-2"],
        ["--ppl-tokens", "1"],
    ):
        result = subprocess.run(
            [sys.executable, "examples/chat.py", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr[-2000:]
        messages.append(result.stderr.strip().splitlines()[-1])
    assert messages == [
        "chat.py: error: --new-tokens must be >= 1, got 0",
        "chat.py: error: --window must be >= 0, got -1",
        "chat.py: error: --sinks must be >= 0, got -2",
        "chat.py: error: --ppl-tokens must be 0 (skip) or >= 2, got 1",
    ]
