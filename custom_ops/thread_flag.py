"""``ThreadFlag``: a switch of the calling thread, on within a ``with`` block (the ops' Triton
kernels on CPU tensors, traced launches, the fused prefix)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["ThreadFlag"]


class ThreadFlag(threading.local):
    """``flag.on``: whether this thread is inside ``with flag.set():`` (off elsewhere; a block
    inside another restores the outer state when it ends)."""

    on = False  # each thread's own attribute once set; the class default before

    @contextlib.contextmanager
    def set(self) -> Iterator[None]:
        """Turn the flag on for this thread within the block."""
        previous = self.on
        self.on = True
        try:
            yield
        finally:
            self.on = previous
