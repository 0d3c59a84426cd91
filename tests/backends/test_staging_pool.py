"""The CUDA path's descriptor staging pool, without a GPU: a buffer is given back from its
`__del__`, which the cyclic collector may run on a thread already inside the pool."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kvasync._backends._cuda_kernel import StagingPool, _Staging


@pytest.mark.timeout(60)
def test_a_buffer_collected_inside_the_pool_gives_itself_back_without_deadlock() -> None:
    """A failed enqueue's traceback keeps its staging buffer in a reference cycle; the
    collector frees it at whatever allocation it runs, here inside `give` (which allocates
    under the pool's lock) on the same thread: that thread used to block on its own lock."""
    pool = StagingPool(0, keep_per_class=10**9)

    def pair() -> _Staging:  # the pool never touches CuPy once a pair exists
        return _Staging(pool, 4096, SimpleNamespace(ptr=1), SimpleNamespace(ptr=2),
                        np.zeros(1, np.uint64))

    def failed_enqueue() -> None:
        st = pair()  # noqa: F841  # held by the frame, and so by the traceback
        raise RuntimeError("injected copy failure")

    def worker() -> None:
        old = gc.get_threshold()
        gc.set_threshold(700)  # (the default) a collection lands inside `give` in time
        try:
            for _ in range(20000):
                try:
                    failed_enqueue()
                except RuntimeError as exc:
                    holder: list[object] = [exc]
                    holder.append(holder)  # a cycle, as `error` in a launch frame
                del holder
                pool.give(pair())  # the completion thread returning another buffer
        finally:
            gc.set_threshold(*old)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "a thread blocked on the staging pool's own lock"
