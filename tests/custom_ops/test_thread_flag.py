"""ThreadFlag (``custom_ops/thread_flag.py``): on within its block, for the calling thread only,
the outer state back after a nested block and after an error."""

from __future__ import annotations

import threading

import pytest

from custom_ops.thread_flag import ThreadFlag


def test_on_within_the_block_for_this_thread_only():
    flag = ThreadFlag()
    seen = []
    assert not flag.on
    with flag.set():
        thread = threading.Thread(target=lambda: seen.append(flag.on))
        thread.start()
        thread.join()
        with flag.set():
            assert flag.on
        assert flag.on  # the nested block restored the outer state
    assert not flag.on and seen == [False]


def test_off_again_after_an_error():
    flag = ThreadFlag()
    with pytest.raises(RuntimeError), flag.set():
        raise RuntimeError("inside")
    assert not flag.on
