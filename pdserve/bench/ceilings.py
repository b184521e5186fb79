"""Physical ceilings of the GPU a benchmark runs on, measured in the same run so every speed is quoted as a
fraction of what this card did today: HBM copy bandwidth (bytes read + written), bf16 matmul rate, and the
peer copy rate between two GPUs of one host."""

from __future__ import annotations

import statistics


def _time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(calls, reps: int = 10) -> float:
    """Median microseconds per call of `calls` (callables) launched back to back in one CUDA graph: the kernels
    of a captured step, with a graph's gaps between them and no launch overhead. Each call runs once first, on a
    side stream (Triton compiles, cuBLAS picks its kernel), outside the capture."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def hbm_copy_gbps(device=None, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy of a buffer far larger than L2, counting bytes read plus bytes written."""
    import torch

    device = device or "cuda"

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device=None, n: int = 8192, dtype=None) -> float:
    import torch

    dtype = dtype or torch.bfloat16
    device = device or "cuda"
    a = torch.randn((n, n), device=device, dtype=dtype)
    b = torch.randn((n, n), device=device, dtype=dtype)
    ms = _time_ms(lambda: a @ b, iters=30)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def peer_copy_gbps(src_dev: int = 0, dst_dev: int = 1, nbytes: int = 1 << 30) -> float:
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{src_dev}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    with torch.cuda.device(src_dev):
        ms = _time_ms(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / (ms * 1e-3) / 1e9


def measure(device=None) -> dict:
    import torch

    device = device or torch.device("cuda", torch.cuda.current_device())
    out = {"gpu": torch.cuda.get_device_name(device), "hbm_copy_gbps": hbm_copy_gbps(device),
           "bf16_matmul_tflops": matmul_tflops(device)}
    if torch.cuda.device_count() >= 2:
        out["peer_copy_gbps"] = peer_copy_gbps(0, 1)
    return out
