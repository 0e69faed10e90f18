"""custom_ops/triton/offline.py: every kernel compiles for sm_90, without a GPU."""

from __future__ import annotations

from helpers import run_compiler_script

from custom_ops.formats import get_format

# LM keys of 2, 3, 4 and 5 bits; uniform values of 3 and 4 bits; rotated LM values of 2, 3
# (tqk5v3_nc's) and 4 bits (prep, ring kernels); int8 and fp8 absmax (the int8 PTX, the fp8
# finite decode)
FORMATS = ["3bit_nc", "tq4_nc", "tqk5v3_nc", "tq2_nc", "k2v4_nc", "int8", "fp8"]


def test_every_kernel_compiles_for_sm90():
    """store, store_window, dequant and the decode kernels (split with its ring, short and long
    splits, with and without the inline PTX; prep; ring; merge; the decode step's split and
    merge with its fill, for the formats it serves; the Gluon verify kernel with
    and without masks, rings and sinks, and with padded query rows, which runs on GPUs only)
    and the prefill kernel (4 variants) compile for sm_90 with Triton's ptxas: the CPU tests
    run them under the interpreter, which accepts programs that the compiler rejects (seen: a
    tuple of floats passed to a jit helper; a NamedTuple's field in a tensor's shape;
    an early return in a constexpr branch; a 16-byte cp.async from rows Triton cannot tell
    aligned). The split kernels with the inline PTX's int8 keys must also give their int8
    products the operand layout the PTX is written for (``kWidth = 8``, which Triton picks by
    a heuristic; sm90_compile.py's ``_int8_layout_checked``)."""
    result = run_compiler_script("sm90_compile.py", *FORMATS)
    lines = result.stdout.splitlines()
    failed = [line for line in lines if "FAILED" in line]
    assert result.returncode == 0 and not failed, "\n".join(failed) or result.stderr[-3000:]
    # 4 store/dequant kernels per format (store_window with an int32 and an int64 start), split
    # and merge in 4 decode configurations, prep and ring where the format has them; 8 verify
    assert len(lines) >= len(FORMATS) * 12 + 8, result.stdout
    stepped = [name for name in FORMATS if not get_format(name).value.rotated]
    assert sum("step merge" in line for line in lines) == len(stepped), result.stdout
    assert sum("verify" in line for line in lines) == 8, result.stdout
    assert sum("prefill" in line for line in lines) == 4, result.stdout
