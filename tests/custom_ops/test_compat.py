"""custom_ops.compat: the private torch / Triton interfaces the project uses are all present in
the versions it runs on, and a missing one is named clearly (not an AttributeError mid-step)."""

from __future__ import annotations

import pytest
import torch
import triton

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


def test_dispatch_is_plain_sees_modes_and_transforms():
    """The probe behind the ops' eager fast path: false under a dispatch mode or a functorch
    transform, true outside them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert compat.dispatch_is_plain()
    with Recorder():
        assert not compat.dispatch_is_plain()
    seen = []
    torch.vmap(lambda x: seen.append(compat.dispatch_is_plain()) or x)(torch.ones(2, 3))
    assert seen == [False]
