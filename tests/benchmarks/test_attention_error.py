"""benchmarks/attention_error.py: its windowed attention and an end-to-end run on SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import ROOT, require_smollm2

sys.path.insert(0, str(ROOT / "benchmarks"))
from attention_error import attention  # noqa: E402


def _qkv(tokens=12, gen=None):
    q = torch.randn(1, 6, tokens, 16, generator=gen)
    k, v = (torch.randn(1, 2, tokens, 16, generator=gen) for _ in range(2))
    return q, k, v


def test_attention_reads_the_ring_for_the_window(seeded):
    """Window 0: causal GQA SDPA over the approximate keys and values; a window covering every
    position: SDPA over the exact ones; window 1: only each query's own position exact."""
    q, k, v = _qkv(gen=seeded)
    k_q, v_q = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)

    def sdpa(keys, values):
        return torch.nn.functional.scaled_dot_product_attention(
            q.double(), keys.double(), values.double(), is_causal=True, enable_gqa=True
        )

    torch.testing.assert_close(attention(q, k_q, v_q, k, v, 0), sdpa(k_q, v_q))
    torch.testing.assert_close(attention(q, k_q, v_q, k, v, 12), sdpa(k, v))
    own = torch.eye(12, dtype=torch.bool)[None, None, :, :, None]  # [.., query, key, 1]
    k_diag = torch.where(own, k[:, :, None], k_q[:, :, None])  # [1, 2, query, key, D]
    v_diag = torch.where(own, v[:, :, None], v_q[:, :, None])
    for t in (0, 5, 11):
        expected = sdpa(k_diag[:, :, t], v_diag[:, :, t])[:, :, t]
        torch.testing.assert_close(attention(q, k_q, v_q, k, v, 1)[:, :, t], expected)


def test_runs_on_smollm2(tmp_path):
    """Two formats on 16 tokens: a finite error per row, int8's far below 4bit_nc's, the extra
    record (float32) beside each format's own."""
    require_smollm2()
    out = tmp_path / "ae.json"
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/attention_error.py",
            "--formats",
            "int8",
            "4bit_nc",
            "--records",
            "float32",
            "--tokens",
            "16",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["format"], r["record"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [("4bit_nc", "bfloat16"), ("4bit_nc", "float32"), ("int8", "float32")]
    assert (
        0 < rows["int8", "float32"]["mean_error"] < rows["4bit_nc", "bfloat16"]["mean_error"] / 4
    )
