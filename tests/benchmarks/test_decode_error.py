"""benchmarks/decode_error.py: its error measure and its argument checks (the measurement itself
needs a GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_error  # noqa: E402


def test_errors_are_relative_to_the_reference():
    """``relative_errors``: the error's rms over the reference's rms and its largest magnitude
    over the reference's largest, in float64 whatever the inputs' dtype."""
    ref = torch.tensor([[3.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
    out = (ref + torch.tensor([[0.0, 0.0], [0.0, 0.5]], dtype=torch.float64)).to(torch.float32)
    rms, largest = decode_error.relative_errors(out, ref)
    assert rms == pytest.approx(((0.25 / 4) / (25 / 4)) ** 0.5, rel=1e-12)
    assert largest == pytest.approx(0.5 / 4.0, rel=1e-12)
    assert decode_error.relative_errors(ref, ref) == (0.0, 0.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--splits", "3"], "--splits takes 0 or powers of two, got [3]"),
        (["--shapes", "4by8192"], "--shapes: takes BxS, e.g. 1x131072, got '4by8192'"),
        (["--shapes", "4x100"], "--shapes: 4x100: B >= 1 and S a multiple of 16"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(argv, message):
    """Split counts the kernel does not take and malformed shapes: an argument error naming
    the value, before the script asks for a GPU."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_error.py"), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert message in result.stderr
