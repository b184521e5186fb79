"""`pdserve bench transfer`: two agents in two processes (two GPUs where there are two) move a KV-shaped workload;
reports median/p99 time and GB/s for WRITE and READ, single-block latency from the sender's call to the receiver's
notification, descriptors before/after coalescing, and the ceiling measured in the same run (one large peer copy
for cuda_ipc, a raw socket stream between the same two processes for tcp); verifies checksums; writes JSON.

    python -m pdserve.kv.bench_transfer --model-config qwen3-8b --tokens 8192 --block-size 16 --out r.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from pdserve.kv.bench_worker import worker_main
from pdserve.kv.config import AgentConfig
from pdserve.kv.model_shapes import kv_shape


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="auto", choices=["auto", "tcp", "cuda_ipc", "nixl"])
    p.add_argument("--model-config", default="qwen3-8b", help="known model name or path to a HF config.json")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--block-bytes", type=int, default=None, help="raw mode: bytes per block (overrides the model)")
    p.add_argument("--num-blocks", type=int, default=None, help="raw mode: blocks per transfer (overrides --tokens)")
    p.add_argument("--pool-blocks", type=int, default=None, help="blocks in each pool (default: 2x the moved blocks)")
    p.add_argument("--layout", default="random", choices=["random", "contiguous"],
                   help="block ids: random permutations on both sides (nothing coalesces) or consecutive runs")
    p.add_argument("--ops", default="write,read", help="comma list of write, read")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--latency-iters", type=int, default=200, help="single-block transfers timed (0: skip)")
    p.add_argument("--devices", default=None, help="two devices, e.g. cuda:0,cuda:1 or cpu,cpu (default: auto)")
    p.add_argument("--backend", default="torch", choices=["torch", "numpy"], help="pool memory (numpy: CPU only)")
    p.add_argument("--tcp-connections", type=int, default=None, help="default: min(4, CPU cores)")
    p.add_argument("--cuda-copy", default="auto", choices=["auto", "batch", "kernel", "percopy"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--timeout", type=float, default=300.0, help="limit for each step, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here")


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": socket.gethostname(), "python": platform.python_version(),
                            "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
        else:
            info["gpus"] = []
    except ImportError:
        info["torch"] = None
        info["gpus"] = []
    return info


class Remote:
    """The parent's handle on one worker process; every call has a deadline."""

    def __init__(self, ctx: Any, name: str, spec: dict[str, Any], timeout: float) -> None:
        self.name, self.timeout = name, timeout
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, spec), daemon=True, name=f"kv-bench-{name}")
        self.proc.start()
        self._wait("start")

    def _wait(self, what: str) -> Any:
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"worker {self.name} did not answer {what} within {self.timeout} s")
        status, res = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {self.name} failed {what}: {res}")
        return res

    def call(self, cmd: str, **kw: Any) -> Any:
        self.conn.send((cmd, kw))
        return self._wait(cmd)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", {}))
                self.conn.poll(10)
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _default_devices(backend: str) -> list[str]:
    if backend == "numpy":
        return ["cpu", "cpu"]
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        n = 0
    return ["cuda:0", "cuda:1"] if n >= 2 else (["cuda:0", "cuda:0"] if n == 1 else ["cpu", "cpu"])


def plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.block_bytes:
        block_bytes, model = int(args.block_bytes), "raw"
        nblocks = int(args.num_blocks or 64)
    else:
        shape = kv_shape(args.model_config, args.dtype_bytes)
        block_bytes, model = shape.block_bytes(args.block_size), shape.name
        nblocks = int(args.num_blocks or -(-args.tokens // args.block_size))
    pool = int(args.pool_blocks or 2 * nblocks)
    if pool < nblocks:
        raise ValueError(f"--pool-blocks {pool} is smaller than the {nblocks} blocks moved")
    rng = np.random.default_rng(args.seed)
    if args.layout == "random":
        src, dst = rng.permutation(pool)[:nblocks], rng.permutation(pool)[:nblocks]
    else:
        src, dst = np.arange(nblocks), np.arange(pool - nblocks, pool)
    return {"model": model, "block_bytes": block_bytes, "blocks": nblocks, "pool_blocks": pool,
            "bytes": nblocks * block_bytes, "src": src.tolist(), "dst": dst.tolist()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    pl = plan(args)
    devices = args.devices.split(",") if args.devices else _default_devices(args.backend)
    if len(devices) != 2:
        raise ValueError("--devices needs exactly two entries")
    if args.tcp_connections is None:
        args.tcp_connections = AgentConfig().tcp_connections
    agent_cfg = {"transport": args.transport, "host": args.host, "tcp_connections": args.tcp_connections,
                 "cuda_copy": args.cuda_copy, "transfer_timeout_s": args.timeout}
    ctx = mp.get_context("spawn")
    specs = [{"num_blocks": pl["pool_blocks"], "block_bytes": pl["block_bytes"], "backend": args.backend,
              "device": d, "agent": {**agent_cfg, "name": f"bench-{r}-{os.getpid()}"}} for r, d in zip("AB", devices)]
    out: dict[str, Any] = {"machine": machine_info(), "command": [sys.executable, *sys.argv], "args": vars(args),
                           "git_commit": _git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "workload": {k: v for k, v in pl.items() if k not in ("src", "dst")} | {
                               "layout": args.layout, "tokens": args.tokens, "block_size": args.block_size,
                               "devices": devices, "backend": args.backend},
                           "results": {}, "checks": {}}
    a = b = None
    try:
        a = Remote(ctx, "A", specs[0], args.timeout)
        b = Remote(ctx, "B", specs[1], args.timeout)
        binfo = b.call("info")
        peer = a.call("connect", address=binfo["address"])
        out["transports_available"] = a.call("info")["transports"]
        src, dst = pl["src"], pl["dst"]
        transport = None if args.transport == "auto" else args.transport
        ceil = Ceiling(a, b, binfo, peer, pl, args)
        for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
            if op not in ("write", "read"):
                raise ValueError(f"unknown op {op!r}")
            a.call("fill", seed=args.seed * 10 + 1)
            b.call("fill", seed=args.seed * 10 + 2)
            before = a.call("checksums", ids=src) == b.call("checksums", ids=dst)
            b.call("latencies")
            a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=0, warmup=args.warmup,
                   transport=transport)
            # one transfer, then one ceiling iteration, and so on: both see the same machine conditions
            runs = []
            for _ in range(args.iters):
                runs.append(a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=1, warmup=0,
                                   transport=transport))
                ceil.step(runs[-1]["transport"])
            res = merge_runs(runs)
            after = a.call("checksums", ids=src) == b.call("checksums", ids=dst)
            lat = b.call("latencies") if op == "write" else []
            if lat:
                res["notify_after_call_median_ms"] = float(np.median(lat)) / 1e6
            out["results"][op] = res
            out["checks"][f"{op}_checksums_match"] = bool(after)
            out["checks"][f"{op}_differed_before"] = not before
        if args.latency_iters > 0:
            b.call("latencies")
            res = a.call("xfer", op="write", peer=peer, local_ids=src[:1], remote_ids=dst[:1],
                         iters=args.latency_iters, warmup=min(20, args.latency_iters),
                         transport=transport)
            lat = np.array(b.call("latencies")[-args.latency_iters:], dtype=np.float64) / 1e3
            res.pop("times_ms", None)
            res.update({"e2e_median_us": float(np.median(lat)), "e2e_p99_us": float(np.percentile(lat, 99)),
                        "sender_median_us": res["median_ms"] * 1e3})
            out["results"]["single_block_write"] = res
        out["results"]["ceiling"] = ceil.result()
        _ratios(out)
    finally:
        for r in (a, b):
            if r is not None:
                r.close()
    return out


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from single-iteration runs."""
    from pdserve.kv.bench_worker import summarize

    times = [t / 1e3 for r in runs for t in r["times_ms"]]
    res = {k: v for k, v in runs[-1].items() if k not in ("times_ms",)}
    res.update(summarize(times, runs[-1]["bytes"]))
    res["times_ms"] = [t * 1e3 for t in times]
    return res


class Ceiling:
    """The physical ceiling of the transport in use, measured interleaved with the transfers it is compared to:
    one large peer copy into the IPC-mapped pool for cuda_ipc; a raw socket stream (one, and as many as the tcp
    transport uses) between the same two processes otherwise."""

    def __init__(self, a: Remote, b: Remote, binfo: dict[str, Any], peer: str, pl: dict[str, Any],
                 args: argparse.Namespace) -> None:
        self.a, self.b, self.peer, self.nbytes = a, b, peer, pl["bytes"]
        self.host = binfo["address"].rpartition(":")[0]
        self.conns = sorted({1, args.tcp_connections})
        self.warmup = args.warmup
        self.kind: str | None = None
        self.times: dict[str, list[float]] = {}

    def step(self, transport: str) -> None:
        if self.kind is None:
            self.kind = "peer_copy" if transport == "cuda_ipc" else "raw_tcp"
            if self.kind == "raw_tcp":
                for c in self.conns:
                    port = self.b.call("raw_sink", nbytes=self.nbytes, conns=c)
                    self.a.call("raw_open", address=f"{self.host}:{port}", conns=c)
                    self.a.call("raw_send", nbytes=self.nbytes, iters=0, warmup=self.warmup)
                    self._switch(c)
        if self.kind == "peer_copy":
            r = self.a.call("peer_copy", peer=self.peer, nbytes=self.nbytes, iters=1, warmup=1)
            self.times.setdefault("peer_copy", []).append(r["median_ms"])
            return
        for c in self.conns:
            self._switch(c)
            r = self.a.call("raw_send", nbytes=self.nbytes, iters=1, warmup=0)
            self.times.setdefault(f"streams_{c}", []).extend(r["times_ms"])

    def _switch(self, conns: int) -> None:
        """Raw sockets of each width stay open in the worker; swap the active set."""
        self.a.call("raw_use", conns=conns)

    def result(self) -> dict[str, Any]:
        from pdserve.kv.bench_worker import summarize

        if not self.times:
            return {}
        res: dict[str, Any] = {}
        for k, ms in self.times.items():
            res[k] = summarize([t / 1e3 for t in ms], self.nbytes)
        best_key = max(res, key=lambda k: res[k]["GBps"])
        best = res[best_key]
        what = ("one large peer copy (torch copy_ into the IPC-mapped peer pool), same processes"
                if self.kind == "peer_copy" else
                f"raw socket stream ({best_key.replace('_', ' ')}: sendall of one buffer, recv_into), same processes")
        res.update({"what": what, "median_ms": best["median_ms"], "GBps": best["GBps"], "best": best_key})
        if self.kind == "raw_tcp":
            self.a.call("raw_close")
        return res


def _ratios(out: dict[str, Any]) -> None:
    ceil = out["results"].get("ceiling", {}).get("GBps")
    for op in ("write", "read"):
        r = out["results"].get(op)
        if r and ceil:
            r["fraction_of_ceiling"] = r["GBps"] / ceil


def table(out: dict[str, Any]) -> str:
    w = out["workload"]
    lines = [f"KV transfer: {w['model']} {w['blocks']} blocks x {w['block_bytes'] / 2**20:.2f} MiB = "
             f"{w['bytes'] / 1e9:.3f} GB, layout {w['layout']}, devices {','.join(w['devices'])}",
             f"{'what':<22}{'transport':<10}{'descs':>13}{'median ms':>11}{'p99 ms':>9}{'GB/s':>9}{'of ceil':>9}"]
    for k, r in out["results"].items():
        if k == "ceiling":
            continue
        descs = f"{r['descs_in']}->{r['descs_out']}"
        tr = r["transport"] + (f"/{r['copy_method']}" if r.get("copy_method") else "")
        frac = f"{r['fraction_of_ceiling'] * 100:.0f}%" if "fraction_of_ceiling" in r else ""
        lines.append(f"{k:<22}{tr:<10}{descs:>13}{r['median_ms']:>11.3f}{r['p99_ms']:>9.3f}{r['GBps']:>9.1f}{frac:>9}")
        if "e2e_median_us" in r:
            lines.append(f"{'  call->notified':<22}{'':<10}{'':>13}{r['e2e_median_us'] / 1e3:>11.3f}"
                         f"{r['e2e_p99_us'] / 1e3:>9.3f}   (us: median {r['e2e_median_us']:.0f}, p99 {r['e2e_p99_us']:.0f})")
    c = out["results"].get("ceiling")
    if c:
        lines.append(f"{'ceiling':<22}{'':<10}{'1':>13}{c['median_ms']:>11.3f}{'':>9}{c['GBps']:>9.1f}   {c['what']}")
    lines.append("checks: " + ", ".join(f"{k}={v}" for k, v in out["checks"].items()))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    out = run(args)
    text = json.dumps(out, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(table(out))
    ok = all(v for k, v in out["checks"].items() if k.endswith("_checksums_match"))
    if not ok:
        print("CHECKSUM MISMATCH", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
