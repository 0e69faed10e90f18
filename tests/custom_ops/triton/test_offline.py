"""custom_ops/triton/offline.py: every kernel compiles for sm_90, without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[3] / "tests"
ROOT = TESTS.parent
# LM keys of 2, 3 and 4 bits; uniform values of 3 and 4 bits; rotated LM values of 2, 3 and 4
# bits (prep, ring kernels); int8 and fp8 absmax (the int8 PTX, the fp8 finite decode)
FORMATS = ["3bit_nc", "tq4_nc", "tq3_nc", "tq2_nc", "k2v4_nc", "int8", "fp8"]


def test_every_kernel_compiles_for_sm90():
    """store, store_window, dequant and the decode kernels (split with its ring, short and long
    splits, with and without the inline PTX; prep; ring; merge) compile for sm_90 with Triton's
    ptxas: the CPU tests run them under the interpreter, which accepts programs that the
    compiler rejects (seen: a tuple of floats passed to a jit helper; an early return in a
    constexpr branch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(TESTS / "sm90_compile.py"), *FORMATS],
                            cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    lines = result.stdout.splitlines()
    failed = [line for line in lines if "FAILED" in line]
    assert result.returncode == 0 and not failed, "\n".join(failed) or result.stderr[-3000:]
    # 3 store/dequant kernels per format, split and merge in 4 decode configurations, prep and
    # ring where the format has them
    assert len(lines) >= len(FORMATS) * 11, result.stdout
