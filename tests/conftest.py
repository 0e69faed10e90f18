"""Test set-up: Triton's interpreter on machines without CUDA, shared fixtures and helpers.

Kernel tests run on the ``kernel_device`` fixture: CUDA when present, otherwise the CPU through
``TRITON_INTERPRET=1`` (set here before any kernel is defined) with the interpreter's float
conversions fixed (see ``interpreter_fix``).

The tests mirror the package (``tests/custom_ops/triton/test_store.py`` tests
``custom_ops/triton/store.py``); the modules they share live here beside this file, whose
directory pytest puts on ``sys.path``: ``helpers``, ``window_sequences``, ``kv_views``,
``ptx_emulator``. The repository root goes on ``sys.path`` too (``examples/`` is not installed).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import interpreter_fix  # noqa: E402

from custom_ops import ops  # noqa: E402

if not CUDA:
    interpreter_fix.install()

# Under pytest-xdist (scripts/test.sh runs a worker per core) each worker's torch takes its
# share of the cores: two workers of two threads each on CI's 2 cores would oversubscribe them.
# The examples they start as processes inherit the share through OMP_NUM_THREADS.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # the cores this process may use (sched_getaffinity is Linux only)
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _THREADS = max(1, (_CORES or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


# The tests left out of the quick tier (`scripts/test.sh --quick`, `-m "not slow"`): modules and
# test functions that take most of the suite's time on two cores (pytest --durations, 2026-11-29:
# 1,003 test-seconds in all, these ~590) where faster tests of the same code stay in the tier:
# the real model, the example programs run as processes, tensor parallel's spawned ranks, and
# the decode, store and range tests' largest parametrizations. CI runs every test.
SLOW = {
    "modules": (
        "test_smollm2.py",
        "test_tp.py",
        "test_chat.py",
        "test_readme.py",
        "test_generate.py",
        "test_attention_error.py",
    ),
    "tests": (
        "test_decode_window_contribution_is_exact",
        "test_multi_token_decode",
        "test_decode_reads_sinks_exactly",
        "test_decode_of_centred_keys_is_attention_over_the_keys",
        "test_every_magnitude_is_represented",
        "test_a_cell_in_a_process_of_its_own",
        "test_a_cell_process_reports_its_result_or_its_failure",
        "test_append_launch_matches_reference",
    ),
}


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)
        if item.path.name in SLOW["modules"] or item.originalname in SLOW["tests"]:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def kernel_device() -> str:
    """Where the Triton kernels run in this session: ``cuda`` or ``cpu`` (interpreter)."""
    return "cuda" if CUDA else "cpu"


@contextlib.contextmanager
def triton_kernels(device: str):
    """Route ``torch.ops.tq`` to the Triton kernels for tensors on ``device``."""
    if device == "cpu":
        with ops.triton_on_cpu():
            yield
    else:
        yield


def require_smollm2() -> None:
    """Skip the calling test where SmolLM2's GGUF cannot be had (offline, and no copy under
    ``$TQ_CACHE_DIR``); otherwise it is on disk, downloaded once."""
    from tq_compile.smollm2 import smollm2_gguf

    try:
        smollm2_gguf(quiet=True)
    except RuntimeError as error:
        pytest.skip(f"SmolLM2 not available: {error}")


@pytest.fixture
def seeded() -> torch.Generator:
    """A fresh, seeded generator per test (inputs are random, never zeros)."""
    torch.manual_seed(1234)
    return torch.Generator().manual_seed(1234)
