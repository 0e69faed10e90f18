"""custom_ops.compat: the private torch / Triton interfaces the project uses are all present in
the versions it runs on, and a missing one is named clearly (not an AttributeError mid-step)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import triton
from conftest import ROOT

from custom_ops import compat


def test_every_private_interface_resolves():
    """Every interface compat fences exists in this torch / Triton (the compiling ones and, on a
    CUDA build, the CUDA ones included): a release that moves one fails here, by name."""
    assert compat.missing() == [], (
        f"torch {torch.__version__} / triton {triton.__version__} lack {compat.missing()}"
    )


def test_a_missing_interface_is_named_with_the_versions(monkeypatch):
    monkeypatch.setattr(compat, "_PRIVATE", (*compat._PRIVATE, ("torch._C", "_no_such_probe")))
    with pytest.raises(RuntimeError) as error:
        compat.require()
    message = str(error.value)
    assert "torch._C._no_such_probe" in message
    assert torch.__version__ in message and triton.__version__ in message


def _plain() -> bool:
    return (
        compat.len_dispatch_stack() == 0
        and compat.len_pre_dispatch_stack() == 0
        and not compat.jit_tracing_state()
        and not compat.functorch_transforms_active()
    )


def test_the_eager_probes_see_modes_and_transforms():
    """The probes behind the ops' eager fast path: a dispatch mode or a functorch transform
    shows, nothing does outside them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert _plain()
    with Recorder():
        assert not _plain()
    seen = []
    torch.vmap(lambda x: seen.append(_plain()) or x)(torch.ones(2, 3))
    assert seen == [False]


def test_importing_custom_ops_loads_neither_dynamo_nor_inductor():
    """An eager user pays for neither: require() checks only what every process uses."""
    code = (
        "import sys, custom_ops; print(sorted(m for m in sys.modules "
        "if m.startswith(('torch._dynamo', 'torch._inductor'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_the_driver_comes_back_after_an_error():
    from triton.runtime.driver import driver

    before = driver._active
    with pytest.raises(RuntimeError, match="inside"), compat.active_triton_driver(object()):
        raise RuntimeError("inside")
    assert driver._active is before


def test_a_missing_module_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(compat, "_PRIVATE", (("no_such_module_x", "attr"),))
    assert compat.missing(compiling=False)[0] == "no_such_module_x.attr"
