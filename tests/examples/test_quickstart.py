"""examples/quickstart.py: runs and reports every format's bytes and errors."""

from __future__ import annotations

import math

from helpers import run_example

from custom_ops.formats import FORMATS

# Relative errors of K, V and q.k scores the quick start prints at 64 tokens, D = 64: the
# largest over its seeds 0-15, times 1.25, rounded up (measured largest: k8v4 0.029, 0.089,
# 0.030; 4bit_nc 0.091, 0.089, 0.096; k3v4_nc 0.174, 0.089, 0.183; 3bit_nc 0.174, 0.191,
# 0.183; int8 0.013, 0.006, 0.014; fp8 0.020, 0.025, 0.021; tq4_nc 0.091, 0.096, 0.096;
# k2v2_nc 0.322, 0.447, 0.342; k2v4_nc 0.322, 0.089, 0.342; tq3_nc 0.174, 0.186, 0.183;
# tq2_nc 0.322, 0.348, 0.342; tqk4v2_nc: tq4_nc's keys, tq2_nc's values; tqk5v3_nc 0.047,
# 0.186, 0.049). Errors vary by < 5% over seeds.
QUICKSTART_ERROR = {
    "k8v4": (0.037, 0.12, 0.038),
    "4bit_nc": (0.12, 0.12, 0.12),
    "k3v4_nc": (0.22, 0.12, 0.23),
    "3bit_nc": (0.22, 0.24, 0.23),
    "int8": (0.017, 0.0075, 0.018),
    "fp8": (0.025, 0.032, 0.026),
    "tq4_nc": (0.12, 0.13, 0.12),
    "k2v2_nc": (0.41, 0.56, 0.43),
    "k2v4_nc": (0.41, 0.12, 0.43),
    "tq3_nc": (0.22, 0.24, 0.23),
    "tq2_nc": (0.41, 0.44, 0.43),
    "tqk4v2_nc": (0.12, 0.44, 0.12),
    "tqk5v3_nc": (0.06, 0.24, 0.062),
}


def test_quickstart_reports_every_format():
    """``examples/quickstart.py`` runs on the CPU and prints one table row per format: its
    bytes per token-head, the compression against bf16 (4 * D bytes) those imply, and K, V and
    q.k errors above zero and within the format's bound."""
    out = run_example(
        "examples/quickstart.py",
        "--tokens",
        "64",
        "--head-dim",
        "64",
        "--device",
        "cpu",
        timeout=120,
    )
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert "bf16 K+V: 256 bytes per token-head" in out
    for name, fmt in FORMATS.items():
        assert name in rows, f"no row for {name} in:\n{out}"
        assert rows[name][1] == str(fmt.bytes_per_token_head(64))
        _, nbytes, ratio, *errors = rows[name]
        assert ratio == f"{256 / int(nbytes):.2f}x", rows[name]
        for error, bound in zip(map(float, errors), QUICKSTART_ERROR[name], strict=True):
            assert math.isfinite(error) and 0 < error < bound, (name, errors)
