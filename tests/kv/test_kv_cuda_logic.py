"""The CPU-checkable parts of the cuda_ipc path: the Triton kernel's work table and the pointer arithmetic of a
batched copy (with a recording fake engine), so index mistakes show up without a GPU."""

import numpy as np

from pdserve.kv.descs import block_xfers
from pdserve.kv.transports.cuda_copy import chunk_table
from pdserve.kv.transports.cuda_ipc import CudaIpcTransport


def test_chunk_table_reproduces_the_copies():
    rng = np.random.default_rng(0)
    words = 1 << 16
    src = rng.integers(0, 1 << 30, words, dtype=np.int32)
    runs = block_xfers(rng.permutation(64)[:40], rng.permutation(64)[:40], 1024 * 4, 1, 2)  # 4 KiB blocks
    table = chunk_table(runs.local_offset, runs.remote_offset, runs.length, chunk=1536)  # pieces cut mid-block
    dst = np.zeros(words, dtype=np.int32)
    for s, d, n in table.T:
        dst[d:d + n] = src[s:s + n]
    want = np.zeros(words, dtype=np.int32)
    for s, d, n in zip(runs.local_offset // 4, runs.remote_offset // 4, runs.length // 4):
        want[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, want)
    assert table[2].max() * 4 <= 1536 and int(table[2].sum()) * 4 == runs.total_bytes


class _Reg:
    def __init__(self, ptr, device):
        self.ptr, self.device, self.kind = ptr, device, "cuda"


class _Regions:
    def __init__(self, regs):
        self.regs = regs

    def get(self, rid):
        return self.regs[rid]


class _Mapped:
    class _Dev:
        index = 1

    device = _Dev()

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


class _Recorder:
    name = "batch"

    def __init__(self):
        self.calls = []

    def copy(self, src, dst, sizes, src_dev, dst_dev, stream):
        self.calls.append((np.asarray(src), np.asarray(dst), np.asarray(sizes), src_dev, dst_dev))


def test_batched_copy_pointers_for_write_and_read():
    t = CudaIpcTransport.__new__(CudaIpcTransport)  # no CUDA needed for the arithmetic
    t.ctx = type("C", (), {"regions": _Regions({1: _Reg(0x1000_0000, 0), 2: _Reg(0x2000_0000, 0)})})()
    rec = _Recorder()
    t._copier = rec
    mapped = {7: _Mapped(0x9000_0000), 8: _Mapped(0xA000_0000)}
    x = block_xfers([0, 1, 5], [3, 4, 9], 256, 1, 7)  # coalesced: (0,1)->(3,4), 5->9
    y = block_xfers([2], [0], 256, 2, 8)
    both = type(x)(*(np.concatenate([getattr(x, f), getattr(y, f)]) for f in
                     ("local_region", "local_offset", "remote_region", "remote_offset", "length")))
    t._enqueue("write", both, mapped, 0, stream=None)
    src, dst, sizes, sd, dd = rec.calls[-1]
    assert (sd, dd) == (0, 1)
    assert src.tolist() == [0x1000_0000 + 0, 0x1000_0000 + 5 * 256, 0x2000_0000 + 2 * 256]
    assert dst.tolist() == [0x9000_0000 + 3 * 256, 0x9000_0000 + 9 * 256, 0xA000_0000 + 0]
    assert sizes.tolist() == [512, 256, 256]
    t._enqueue("read", both, mapped, 0, stream=None)
    src2, dst2, sizes2, sd2, dd2 = rec.calls[-1]
    assert (src2.tolist(), dst2.tolist(), sizes2.tolist(), sd2, dd2) == (dst.tolist(), src.tolist(), [512, 256, 256], 1, 0)
