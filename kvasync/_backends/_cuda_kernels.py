"""Copy kernels (CuPy RawModule source) and the host-side packing they read.

Why kernels at all: the copy engines need one descriptor (and ~1-2 us of driver time) per
scattered block, which caps small-page transfers far below the PCIe link (5.9 GB/s for
4 KiB stores through `cuMemcpyBatchAsync` on the H200, ../shared/notes). SM loads and
stores of pinned, mapped host memory need no per-block driver work: a few CTAs with one
warp per block reach the link at every page size.

Two kernels share one warp-wide copy routine:

- `kvasync_copy_flat` reads flat (src, dst, size) descriptors (any plan; host cost is the
  descriptor expansion, O(refs x blocks)).
- `kvasync_copy_table` computes addresses itself from the slot ids of a plan's segments
  and a static per-direction table of per-ref base/stride rows and fragments (uploaded
  once per `RefTable`), so a transfer's host work is O(blocks + refs), independent of the
  number of layers.

The warp copy is byte exact for any size and alignment: with source and destination
congruent modulo 16 (8, 4) it copies a head byte-wise, the body in 16 (8, 4) byte vectors
(four loads in flight per lane) and a byte-wise tail; otherwise it copies bytes. Large
copies are cut into `PIECE`-byte pieces so one huge block spreads over many warps.

Everything here but `CopyKernels` is plain NumPy and runs without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .._program import RefTable, Segment

__all__ = [
    "BLOCK",
    "PIECE",
    "SOURCE",
    "CopyKernels",
    "PackedTable",
    "emulate_table",
    "pack_job",
    "pack_table",
    "split_descriptors",
]

U64 = np.uint64

#: bytes of one work unit: copies larger than this are shared among several warps
PIECE = 64 * 1024
#: threads per CTA (16 warps)
BLOCK = 512
#: columns of one ref row of the packed table
_ROW = 8
#: words of one segment header in a job
_SEG = 5

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned char u8;

// Copy n bytes with one warp; s and d are congruent modulo sizeof(T).
template <typename T>
__device__ __forceinline__ void copy_congruent(const u8* __restrict__ s, u8* __restrict__ d,
                                               u64 n, const unsigned lane) {
    const u64 W = sizeof(T);
    u64 head = (W - (reinterpret_cast<u64>(s) & (W - 1))) & (W - 1);
    if (head > n) head = n;
    if (lane < head) d[lane] = s[lane];  // bytes before the first aligned vector
    s += head;
    d += head;
    n -= head;
    const u64 nv = n / W;
    const T* __restrict__ sv = reinterpret_cast<const T*>(s);
    T* __restrict__ dv = reinterpret_cast<T*>(d);
    u64 i = lane;
    for (; i + 96 < nv; i += 128) {
        const T a = __ldcg(sv + i);
        const T b = __ldcg(sv + i + 32);
        const T c = __ldcg(sv + i + 64);
        const T e = __ldcg(sv + i + 96);
        __stcg(dv + i, a);
        __stcg(dv + i + 32, b);
        __stcg(dv + i + 64, c);
        __stcg(dv + i + 96, e);
    }
    for (; i < nv; i += 32) __stcg(dv + i, __ldcg(sv + i));
    const u64 done = nv * W;
    if (lane < n - done) d[done + lane] = s[done + lane];
}

__device__ __forceinline__ void warp_copy(const u64 src, const u64 dst, const u64 n,
                                          const unsigned lane) {
    const u8* s = reinterpret_cast<const u8*>(src);
    u8* d = reinterpret_cast<u8*>(dst);
    const u64 rel = src ^ dst;
    if ((rel & 15) == 0) copy_congruent<uint4>(s, d, n, lane);
    else if ((rel & 7) == 0) copy_congruent<uint2>(s, d, n, lane);
    else if ((rel & 3) == 0) copy_congruent<unsigned int>(s, d, n, lane);
    else copy_congruent<u8>(s, d, n, lane);
}

// desc: src[n], dst[n], size[n] (uint64), one warp per descriptor.
extern "C" __global__ void kvasync_copy_flat(const u64 desc_addr, const u64 n) {
    const u64* __restrict__ desc = reinterpret_cast<const u64*>(desc_addr);
    const unsigned lane = threadIdx.x & 31u;
    const u64 warps = (static_cast<u64>(gridDim.x) * blockDim.x) >> 5;
    u64 w = (static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    for (; w < n; w += warps) warp_copy(desc[w], desc[n + w], desc[2 * n + w], lane);
}

// table: per ref row r, 8 words: src_base, src_row_stride, src_sub_stride,
//        dst_base, dst_row_stride, dst_sub_stride, frag_start, frag_count
// frags: frag_src[F], frag_dst[F], frag_size[F]
// job:   per segment 5 words: unit_start, n, slot_off, refs_off, pieces;
//        then refs[refs_len], src_slots[total_slots], dst_slots[total_slots]
// A unit is (segment, ref j, slot i, piece p), p fastest; one warp per unit.
extern "C" __global__ void kvasync_copy_table(
        const u64 table_addr, const u64 frags_addr, const u64 num_frags,
        const u64 job_addr, const u64 num_segs, const u64 refs_len, const u64 total_slots,
        const u64 total_units, const u64 src_factor, const u64 dst_factor, const u64 piece) {
    const u64* __restrict__ table = reinterpret_cast<const u64*>(table_addr);
    const u64* __restrict__ frags = reinterpret_cast<const u64*>(frags_addr);
    const u64* __restrict__ segs = reinterpret_cast<const u64*>(job_addr);
    const u64* __restrict__ refs = segs + 5 * num_segs;
    const u64* __restrict__ src_slots = refs + refs_len;
    const u64* __restrict__ dst_slots = src_slots + total_slots;
    const unsigned lane = threadIdx.x & 31u;
    const u64 warps = (static_cast<u64>(gridDim.x) * blockDim.x) >> 5;
    u64 u = (static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    for (; u < total_units; u += warps) {
        u64 lo = 0, hi = num_segs;
        while (hi - lo > 1) {
            const u64 mid = (lo + hi) >> 1;
            if (segs[5 * mid] <= u) lo = mid; else hi = mid;
        }
        const u64* h = segs + 5 * lo;
        // 32-bit index math (the host guarantees units and slots < 2^32): a 64-bit
        // division is a long subroutine, a 32-bit one a few instructions
        const unsigned n = static_cast<unsigned>(h[1]);
        const unsigned pieces = static_cast<unsigned>(h[4]);
        unsigned local = static_cast<unsigned>(u - h[0]);
        unsigned p = 0;
        if (pieces != 1) {
            p = local % pieces;
            local /= pieces;
        }
        const unsigned i = local % n;
        const unsigned j = local / n;
        const u64* row = table + 8 * refs[h[3] + j];
        const unsigned ss = static_cast<unsigned>(src_slots[h[2] + i]);
        const unsigned ds = static_cast<unsigned>(dst_slots[h[2] + i]);
        const unsigned sf = static_cast<unsigned>(src_factor);
        const unsigned df = static_cast<unsigned>(dst_factor);
        const u64 sp = sf == 1 ? row[0] + ss * row[1]
                               : row[0] + (ss / sf) * row[1] + (ss % sf) * row[2];
        const u64 dp = df == 1 ? row[3] + ds * row[4]
                               : row[3] + (ds / df) * row[4] + (ds % df) * row[5];
        const u64 f_end = row[6] + row[7];
        const u64 off = static_cast<u64>(p) * piece;
        for (u64 f = row[6]; f < f_end; ++f) {
            const u64 size = frags[2 * num_frags + f];
            if (off >= size) continue;
            const u64 len = size - off < piece ? size - off : piece;
            warp_copy(sp + frags[f] + off, dp + frags[num_frags + f] + off, len, lane);
        }
    }
}
"""


# -- host-side packing (NumPy only) ------------------------------------------------------------
def split_descriptors(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, piece: int = PIECE
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut descriptors larger than `piece` into `piece`-sized ones (same bytes, more warps)."""
    if len(sizes) == 0 or int(sizes.max()) <= piece:
        return src, dst, sizes
    p = U64(piece)
    counts = ((sizes + p - U64(1)) // p).astype(np.int64)
    idx = np.repeat(np.arange(len(sizes)), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    k = (np.arange(len(idx), dtype=np.int64) - np.repeat(first, counts)).astype(U64)
    off = k * p
    out_z = np.minimum(sizes[idx] - off, p).astype(U64)
    return (src[idx] + off).astype(U64), (dst[idx] + off).astype(U64), out_z


@dataclass
class PackedTable:
    """A RefTable in the kernel's layout, plus what the host needs per transfer."""

    rows: np.ndarray  # uint64 [R * 8]
    frags: np.ndarray  # uint64 [3 * F]
    pieces: np.ndarray  # int64 [R]: units per (ref, slot)
    num_frags: int
    src_factor: int
    dst_factor: int


def pack_table(table: RefTable, piece: int = PIECE) -> PackedTable:
    """Lay out `table` as the 8-word rows and 3-column fragments `kvasync_copy_table` reads."""
    r = len(table.tensor_idx)
    rows = np.zeros((r, _ROW), dtype=U64)
    rows[:, 0] = table.src_base
    rows[:, 1] = table.src_row_stride
    rows[:, 2] = table.src_sub_stride
    rows[:, 3] = table.dst_base
    rows[:, 4] = table.dst_row_stride
    rows[:, 5] = table.dst_sub_stride
    rows[:, 6] = table.frag_start.astype(U64)
    rows[:, 7] = table.frag_count.astype(U64)
    f = len(table.frag_size)
    frags = np.concatenate([table.frag_src, table.frag_dst, table.frag_size]).astype(U64)
    pieces = np.ones(r, dtype=np.int64)
    for i in range(r):
        a, k = int(table.frag_start[i]), int(table.frag_count[i])
        if k:
            biggest = int(table.frag_size[a : a + k].max())
            pieces[i] = max(1, -(-biggest // piece))
    return PackedTable(rows.ravel(), frags, pieces, f, table.src.factor, table.dst.factor)


@dataclass
class Job:
    """One transfer's kernel input: the words to upload and the kernel's scalar arguments."""

    words: np.ndarray  # uint64
    num_segs: int
    refs_len: int
    total_slots: int
    total_units: int
    #: the most units of one segment: the kernel counts them in 32 bits (`fits_32`)
    max_seg_units: int = 0

    @property
    def fits_32(self) -> bool:
        """Whether every segment's units, slots and ref rows index in 32 bits."""
        return self.max_seg_units < 1 << 32


def pack_job(
    segments: Sequence[Segment],
    pieces: np.ndarray,
    alloc: Callable[[int], np.ndarray] | None = None,
    cache: dict[int, tuple[np.ndarray, int]] | None = None,
) -> Job:
    """Segment headers, ref rows and slot ids of a plan, as one uint64 array (O(blocks)).

    `alloc(nwords)` returns the (pinned staging) array to pack into, so the slot ids are
    copied once; default: a fresh NumPy array. `cache` remembers each refs array's piece
    count (the refs of a plan are the table's own partition arrays, reused by every call).
    """
    segs = [s for s in segments if len(s.src_slots)]
    head: list[int] = []
    unit = slot = ref = most = 0
    for seg in segs:
        refs = seg.refs
        hit = cache.get(id(refs)) if cache is not None else None
        if hit is not None and hit[0] is refs:
            pc = hit[1]
        else:
            pc = int(pieces[refs].max())
            if cache is not None:
                cache[id(refs)] = (refs, pc)
        n, r = len(seg.src_slots), len(refs)
        head += (unit, n, slot, ref, pc)
        most = max(most, r * n * pc)
        unit += r * n * pc
        slot += n
        ref += r
    total = _SEG * len(segs) + ref + 2 * slot
    words = (alloc(total) if alloc is not None else np.empty(total, dtype=U64))[:total]
    pos = _SEG * len(segs)
    words[:pos] = head
    for seg in segs:
        words[pos : pos + len(seg.refs)] = seg.refs
        pos += len(seg.refs)
    for seg in segs:
        words[pos : pos + len(seg.src_slots)] = seg.src_slots
        pos += len(seg.src_slots)
    for seg in segs:
        words[pos : pos + len(seg.dst_slots)] = seg.dst_slots
        pos += len(seg.dst_slots)
    return Job(words, len(segs), ref, slot, unit, most)


def emulate_table(
    packed: PackedTable, job: Job, piece: int = PIECE
) -> Iterator[tuple[int, int, int]]:
    """The (src, dst, size) pieces `kvasync_copy_table` copies, in unit order (a reference
    for tests: same decode as the kernel, in Python)."""
    rows = packed.rows.reshape(-1, _ROW)
    f = packed.num_frags
    w = job.words
    segs = w[: _SEG * job.num_segs].reshape(-1, _SEG)
    refs = w[_SEG * job.num_segs : _SEG * job.num_segs + job.refs_len]
    base = _SEG * job.num_segs + job.refs_len
    src_slots = w[base : base + job.total_slots]
    dst_slots = w[base + job.total_slots : base + 2 * job.total_slots]
    sf, df = packed.src_factor, packed.dst_factor
    starts = [int(x) for x in segs[:, 0]]
    for u in range(job.total_units):
        s = max(k for k in range(len(starts)) if starts[k] <= u)
        unit_start, n, slot_off, refs_off, pcs = (int(x) for x in segs[s])
        local = u - unit_start
        p, local = local % pcs, local // pcs
        i, j = local % n, local // n
        row = [int(x) for x in rows[int(refs[refs_off + j])]]
        ss, ds = int(src_slots[slot_off + i]), int(dst_slots[slot_off + i])
        sp = row[0] + (ss // sf) * row[1] + (ss % sf) * row[2]
        dp = row[3] + (ds // df) * row[4] + (ds % df) * row[5]
        off = p * piece
        for fi in range(row[6], row[6] + row[7]):
            size = int(packed.frags[2 * f + fi])
            if off >= size:
                continue
            yield (sp + int(packed.frags[fi]) + off, dp + int(packed.frags[f + fi]) + off,
                   min(piece, size - off))


# -- the compiled kernels ----------------------------------------------------------------------
class CopyKernels:
    """The RawModule for one device, compiled on first use (or by `compile()`).

    Launches go through `cuLaunchKernel` directly (`_cuda_launch.KernelLauncher`, a fraction of
    CuPy's per-launch cost); CuPy's launch is the fallback where the driver call cannot be
    made (no libcuda to open, or no current context on the calling thread).
    """

    def __init__(self) -> None:
        self._module: Any = None
        self._flat: Any = None
        self._table: Any = None
        self._fast: dict[str, Any] = {}
        #: launches go through cuLaunchKernel (False: CuPy's launch; `direct_error` says why)
        self.direct = True
        self.direct_error = ""

    def compile(self) -> None:
        """Build (NVRTC, or CuPy's on-disk cache) and load the module on the current device."""
        if self._flat is not None:
            return
        from ._cuda_launch import KernelLauncher
        from ._cudart import cupy

        module = cupy().RawModule(code=SOURCE, options=("--std=c++17",))
        module.compile()
        flat = module.get_function("kvasync_copy_flat")
        table = module.get_function("kvasync_copy_table")
        try:
            # a RawModule hands out RawKernels; the driver function is their `.kernel`
            self._fast = {"flat": KernelLauncher(getattr(flat, "kernel", flat).ptr, 2),
                          "table": KernelLauncher(getattr(table, "kernel", table).ptr, 11)}
        except Exception as exc:  # libcuda not loadable here: CuPy's launch only
            self.direct = False
            self.direct_error = str(exc)
        self._module = module
        self._table = table
        self._flat = flat

    @staticmethod
    def _grid(grid: int, units: int) -> int:
        return max(1, min(grid, -(-units // (BLOCK // 32))))

    def _launch(self, name: str, stream: Any, grid: int, args: list[int]) -> None:
        if self.direct:
            from ._cudart import CudaCallError

            try:
                self._fast[name](grid, BLOCK, int(stream.ptr), args)
                return
            except CudaCallError as exc:
                if exc.code != 201:  # CUDA_ERROR_INVALID_CONTEXT: use CuPy's launch
                    raise
                self.direct = False
                self.direct_error = str(exc)
        fn = self._flat if name == "flat" else self._table
        fn((grid,), (BLOCK,), tuple(U64(a) for a in args), stream=stream)

    def launch_flat(self, stream: Any, desc_addr: int, n: int, grid: int) -> None:
        """Copy `n` flat descriptors at device address `desc_addr` on `stream` (a CuPy
        stream)."""
        self.compile()
        self._launch("flat", stream, self._grid(grid, n), [desc_addr, n])

    def launch_table(
        self, stream: Any, table_addr: int, frags_addr: int, packed: PackedTable,
        job_addr: int, job: Job, grid: int, piece: int = PIECE,
    ) -> None:
        """Copy the units of `job` (uploaded at `job_addr`) on `stream` (a CuPy stream)."""
        self.compile()
        args = [table_addr, frags_addr, packed.num_frags, job_addr, job.num_segs,
                job.refs_len, job.total_slots, job.total_units, packed.src_factor,
                packed.dst_factor, piece]
        self._launch("table", stream, self._grid(grid, job.total_units), args)
