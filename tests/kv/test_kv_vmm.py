"""CUDA VMM pools (pdserve.kv.vmm) and cuda_ipc however the GPUs are made visible: two processes started with
CUDA_VISIBLE_DEVICES=0 and =1 (each sees only its own GPU, as vLLM users start instances) move blocks over cuda_ipc
with checksums; without a VMM pool the same pair says plainly that cuda_ipc cannot serve it, and why. GPU only."""

import gc
import multiprocessing as mp

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from pdserve.bench.transfer import Remote  # noqa: E402
from tests.kv.kv_helpers import OPEN  # noqa: E402

BB = 36 * 2 * 16 * 8 * 128 * 2  # one qwen3-8b block of 16 tokens
NB = 64
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TWO = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def test_vmm_tensor_is_an_ordinary_tensor_and_is_freed():
    from pdserve.kv.vmm import find_allocation, vmm_zeros

    t = vmm_zeros((NB, 4, 2, 16, 8, 128), torch.bfloat16, "cuda:0")
    assert t.shape == (NB, 4, 2, 16, 8, 128) and t.dtype == torch.bfloat16 and t.device == torch.device("cuda", 0)
    assert t.is_contiguous() and not t.any()
    t[3].fill_(1.5)
    assert float(t[3].sum()) == 1.5 * t[3].numel() and float(t[4].sum()) == 0.0
    found = find_allocation(t.data_ptr() + 5 * t[0].nbytes)
    assert found is not None and found[1] == 5 * t[0].nbytes and found[0].size >= t.nbytes
    free0 = torch.cuda.mem_get_info(0)[0]
    view = t[10:20]
    del t
    gc.collect()
    assert find_allocation(view.data_ptr()) is not None  # a view keeps the memory alive
    del view, found
    gc.collect()
    assert torch.cuda.mem_get_info(0)[0] > free0  # freed with the last view


def _pair(alloc: str, split: bool, transport: str = "auto") -> tuple[Remote, Remote, str]:
    ctx = mp.get_context("spawn")
    rs = []
    for name, gpu in (("va", 0), ("vb", 1)):
        spec = {"num_blocks": NB, "block_bytes": BB, "backend": "torch", "alloc": alloc, "env": ENV,
                "device": "cuda:0" if split else f"cuda:{gpu}",
                "visible_devices": str(gpu) if split else None,
                "agent": {"transport": transport, "name": name, **OPEN}}
        rs.append(Remote(ctx, name, spec, timeout=120))
    peer = rs[0].call("connect", address=rs[1].call("info")["address"])
    return rs[0], rs[1], peer


@TWO
@pytest.mark.timeout(300)
def test_cuda_ipc_between_processes_that_see_one_gpu_each():
    a, b, peer = _pair("vmm", split=True)
    try:
        assert a.call("peer_transport", peer=peer) == {"transport": "cuda_ipc", "unavailable": {}}
        rng = np.random.default_rng(0)
        for n in (1, 7, NB // 2):
            src, dst = rng.permutation(NB)[:n].tolist(), rng.permutation(NB)[:n].tolist()
            for op in ("write", "read"):
                a.call("fill", seed=n)
                b.call("fill", seed=n + 100)
                assert a.call("checksums", ids=src) != b.call("checksums", ids=dst)
                res = a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=2, warmup=0,
                             transport="cuda_ipc")
                assert res["transport"] == "cuda_ipc"
                assert a.call("checksums", ids=src) == b.call("checksums", ids=dst), (op, n)
        assert b.call("latencies")  # the writes' notifications arrived
    finally:
        a.close()
        b.close()


@TWO
@pytest.mark.timeout(300)
def test_without_vmm_split_visibility_is_said_not_silent():
    a, b, peer = _pair("torch", split=True)
    try:
        choice = a.call("peer_transport", peer=peer)
        assert choice["transport"] == "tcp" and "not visible in this process" in choice["unavailable"]["cuda_ipc"]
        with pytest.raises(RuntimeError, match="TransportUnavailableError"):
            a.call("xfer", op="write", peer=peer, local_ids=[0], remote_ids=[1], iters=1, warmup=0,
                   transport="cuda_ipc")
    finally:
        a.close()
        b.close()


@TWO
@pytest.mark.timeout(300)
def test_vmm_pools_between_processes_that_see_both_gpus():
    a, b, peer = _pair("vmm", split=False)
    try:
        a.call("fill", seed=1)
        res = a.call("xfer", op="write", peer=peer, local_ids=list(range(16)), remote_ids=list(range(16, 32)), iters=2,
                     warmup=0)
        assert res["transport"] == "cuda_ipc"
        assert a.call("checksums", ids=list(range(16))) == b.call("checksums", ids=list(range(16, 32)))
    finally:
        a.close()
        b.close()


@TWO
@pytest.mark.timeout(300)
def test_nccl_between_processes_that_see_one_gpu_each():
    """The nccl transport with the same split visibility (NCCL finds its own way between the GPUs)."""
    a, b, peer = _pair("torch", split=True, transport="nccl")
    try:
        rng = np.random.default_rng(1)
        src, dst = rng.permutation(NB)[:24].tolist(), rng.permutation(NB)[:24].tolist()
        for op in ("write", "read"):
            a.call("fill", seed=3)
            b.call("fill", seed=4)
            res = a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=2, warmup=0)
            assert res["transport"] == "nccl"
            assert a.call("checksums", ids=src) == b.call("checksums", ids=dst), op
    finally:
        a.close()
        b.close()


def test_pool_zeros_picks_vmm_on_a_gpu_that_supports_it():
    from pdserve.kv.vmm import find_allocation, pool_zeros, vmm_supported

    assert vmm_supported(0) is None  # H100/H200 make shareable VMM allocations
    t, kind = pool_zeros((8, 2, 16, 128), torch.float16, "cuda:0", "auto")
    assert kind == "vmm" and find_allocation(t.data_ptr()) is not None and not t.any()
    t2, kind2 = pool_zeros((8, 2, 16, 128), torch.float16, "cuda:0", "torch")
    assert kind2 == "torch" and find_allocation(t2.data_ptr()) is None
