"""benchmarks/profiling.py: the per-kernel table of profiled decode steps (the GPU's idle time
charged to the launch that waited) and the kernels per layer of a cache's attention work."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import profiling  # noqa: E402


def test_attention_kernels_count_the_caches_work_per_layer():
    """``attn_kernels``: the tq ops' kernels (a traced launch's flat entry under its kernel's
    name) per layer and step for a TurboQuant cache; SDPA's own kernels for bf16, not
    inductor's kernels named after it nor the model's GEMMs."""
    layers = 16
    tq_rows = [
        dict(kernel="store_window_kernel_flat_0123abcd", launches=16.0),
        dict(kernel="split_kernel", launches=16.0),
        dict(kernel="merge_kernel", launches=16.0),
        dict(kernel="nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", launches=32.0),
        dict(kernel="triton_poi_fused__to_copy_add_decode_index_mul", launches=16.0),
    ]
    assert profiling.attention_kernels(tq_rows, False, layers) == 3.0
    dense_rows = [
        dict(kernel="cudnn_generated_fort_native_sdpa_sm80_flash_fprop", launches=16.0),
        dict(kernel="void cudnn::fusion::lean_reduction_kernel<false>", launches=16.0),
        dict(
            kernel="triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy", launches=16.0
        ),
        dict(kernel="split_kernel", launches=16.0),
    ]
    assert profiling.attention_kernels(dense_rows, True, layers) == 2.0
    assert {"split_kernel", "merge_kernel", "store_window_kernel"} <= profiling.tq_kernel_names()


def test_idle_time_is_charged_to_the_launch_that_waited():
    """``idle_us``: the time the GPU ran none of the step's kernels just before a launch
    started, 0 for one that overlapped an earlier launch (programmatic dependent launch: the
    merge starting while the split kernel runs) and 0 after a pause between steps; a step's
    timeline lists its launches in order from its first one's start."""
    launches = [
        ("merge_kernel", 14.0, 20.0),  # started before the split kernel ended
        ("store_window_kernel", 0.0, 4.0),
        ("split_kernel", 6.5, 15.0),
        ("gemm", 21.0, 30.0),
        ("store_window_kernel", 130.0, 134.0),  # the next step, after the host's pause
    ]
    timed = profiling.idle_before(launches)
    assert [(name, idle) for name, _, _, idle in timed] == [
        ("store_window_kernel", 0.0),
        ("split_kernel", 2.5),
        ("merge_kernel", 0.0),
        ("gemm", 1.0),
        ("store_window_kernel", 0.0),
    ]
    assert profiling.step_timeline(timed[:4], 2) == [
        dict(kernel="merge_kernel", start_us=0.0, us=6.0, idle_us=0.0),
        dict(kernel="gemm", start_us=7.0, us=9.0, idle_us=1.0),
    ]
