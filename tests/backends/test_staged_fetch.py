"""A staged store's kernel jobs reach the device through the flat copy kernel, whose
descriptors `_fetch` writes after the job words in the same pinned buffer; here the kernel
is replayed in Python over host arrays (what kvasync_copy_flat reads: src[n], dst[n],
size[n] at the descriptor address, one copy per descriptor)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from kvasync._backends._cuda_staged import FETCH_BYTES, StagedPath


class _FlatKernel:
    def __init__(self) -> None:
        self.launches: list[tuple[int, int, int]] = []

    def launch_flat(self, stream: object, desc_addr: int, n: int, grid: int) -> None:
        self.launches.append((desc_addr, n, grid))
        desc = np.ctypeslib.as_array((ctypes.c_uint64 * (3 * n)).from_address(desc_addr))
        for src, dst, size in zip(desc[:n], desc[n : 2 * n], desc[2 * n :]):
            ctypes.memmove(int(dst), int(src), int(size))


@pytest.mark.parametrize("total", [1, 255, 256, 257, 1000, 4096])
def test_fetch_copies_exactly_the_job_words(total: int) -> None:
    nfetch = -(-total * 8 // FETCH_BYTES)
    words = np.full(total + 3 * nfetch + 5, 0xEE, dtype=np.uint64)  # 5 words of slack
    words[:total] = np.arange(1, total + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    device = np.zeros(total + 5, dtype=np.uint64)
    st = SimpleNamespace(words=words, host_ptr=words.ctypes.data, dev_ptr=device.ctypes.data)
    kernel = _FlatKernel()
    path = StagedPath(0, kernel, None, None)  # type: ignore[arg-type]
    path._fetch(SimpleNamespace(owner=None), st, total, nfetch)  # type: ignore[arg-type]
    assert kernel.launches == [(st.host_ptr + total * 8, nfetch, nfetch)]
    np.testing.assert_array_equal(device[:total], words[:total])
    assert not device[total:].any()  # nothing past the job
    assert (words[total + 3 * nfetch :] == 0xEE).all()  # descriptors stay in their words
    sizes = words[total + 2 * nfetch : total + 3 * nfetch]
    assert int(sizes.sum()) == total * 8 and (sizes > 0).all() and (sizes <= FETCH_BYTES).all()
