"""`pdserve bench transfer`: two agents in two processes (two GPUs where there are two) move a KV-shaped workload;
reports median/p99 time and GB/s for WRITE and READ, single-block latency from the sender's call to the receiver's
notification, descriptors before/after coalescing, and the ceiling measured in the same run (one large peer copy
between the GPUs, a raw socket stream between the same two processes on CPU or for tcp alone); verifies checksums;
writes JSON.

    python -m pdserve.bench.transfer --model-config qwen3-8b --tokens 8192 --block-size 16 --result-filename r.json

`--transport all` runs every transport both processes offer (tcp, cuda_ipc, nixl, mooncake, nccl) on the same bytes
in the same run, the ceiling interleaved with all of them: one table. `--memcheck N` starts N transfers of the
workload at once (N handovers in flight) and reports each process's peak memory before and during: a transport
that received into temporary buffers grows by a handover per transfer in flight; one that moves straight between
the pools does not grow at all.

(the same as `pdserve bench transfer ...`). The worker processes run pdserve.bench.transfer_worker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from typing import Any

import numpy as np

from pdserve.bench.paths import add_output_flags, result_path
from pdserve.kv.config import OPT_IN_TRANSPORTS, PROTOCOLS, AgentConfig
from pdserve.kv.model_shapes import kv_shape
from pdserve.secret import generate_secret
from pdserve.stats import median, percentile

TRANSPORTS = ("tcp", "cuda_ipc", "nixl", "mooncake", "nccl")  # the order of the table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="auto", choices=["auto", *TRANSPORTS, "all"],
                   help="all: every transport both processes offer, one table")
    p.add_argument("--kv-protocol", default=AgentConfig.protocol, choices=list(PROTOCOLS),
                   help="mooncake: rdma or tcp")
    p.add_argument("--kv-devices", default="", help="mooncake: RDMA devices, comma-separated (default: all found)")
    p.add_argument("--memcheck", type=int, default=0, metavar="N",
                   help="memory check: N transfers of the workload in flight at once; peak memory before and during")
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
    p.add_argument("--pool-alloc", default="torch", choices=["torch", "vmm"],
                   help="GPU pools: torch.zeros, or pdserve.kv.vmm (CUDA VMM, shareable whatever GPUs are visible)")
    p.add_argument("--isolate-gpus", action="store_true",
                   help="start each process with CUDA_VISIBLE_DEVICES set to its own GPU (as instances started by hand)")
    p.add_argument("--tcp-connections", type=int, default=None, help="default: min(4, CPU cores)")
    p.add_argument("--cuda-copy", default="auto", choices=["auto", "batch", "kernel", "percopy"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--timeout", type=float, default=300.0, help="limit for each step, seconds")
    p.add_argument("--seed", type=int, default=0)
    add_output_flags(p, "none: the table only, unless --result-dir is given (then transfer.json)",
                     old_spelling="--out")


def _git_commit() -> str | None:
    from pdserve.bench.record import _git_commit as commit  # one definition (honours PDSERVE_GIT_COMMIT)

    return commit()


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
        from pdserve.bench.transfer_worker import worker_main

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


def agent_config(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The benchmark agents' configuration, and whether opt-in transports may be left out where they cannot start.
    NIXL, Mooncake and NCCL runs keep the automatic transports too (cuda_ipc maps the peer pool for the peer-copy
    ceiling); each transfer names the transport under test. The two agents authenticate with a secret of this run;
    no per-request grants (open_access)."""
    forced = args.transport not in ("auto", "all", "nixl", *OPT_IN_TRANSPORTS)
    extras = list(OPT_IN_TRANSPORTS) if args.transport == "all" else (
        [args.transport] if args.transport in OPT_IN_TRANSPORTS else [])
    cfg = {"transport": args.transport if forced else "auto", "extra_transports": extras, "host": args.host,
           "tcp_connections": args.tcp_connections, "cuda_copy": args.cuda_copy, "transfer_timeout_s": args.timeout,
           "protocol": args.kv_protocol, "devices": args.kv_devices,
           "secret": generate_secret().encode(), "open_access": True}
    return cfg, args.transport == "all"


def run(args: argparse.Namespace) -> dict[str, Any]:
    pl = plan(args)
    devices = args.devices.split(",") if args.devices else _default_devices(args.backend)
    if len(devices) != 2:
        raise ValueError("--devices needs exactly two entries")
    pl["devices"] = devices
    if args.tcp_connections is None:
        args.tcp_connections = AgentConfig().tcp_connections
    agent_cfg, optional = agent_config(args)
    ctx = mp.get_context("spawn")
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    specs = [{"num_blocks": pl["pool_blocks"], "block_bytes": pl["block_bytes"], "backend": args.backend,
              "device": d, "env": env, "optional_extras": optional, "alloc": args.pool_alloc,
              "agent": {**agent_cfg, "name": f"bench-{r}-{os.getpid()}"}} for r, d in zip("AB", devices)]
    if args.isolate_gpus:
        for spec, d in zip(specs, devices):
            if not d.startswith("cuda:"):
                raise ValueError("--isolate-gpus needs --devices cuda:X,cuda:Y")
            spec["visible_devices"], spec["device"] = d.split(":")[1], "cuda:0"
    out: dict[str, Any] = {"machine": machine_info(), "command": [sys.executable, *sys.argv], "args": {k: v for k, v in vars(args).items() if not callable(v)},
                           "git_commit": _git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "workload": {k: v for k, v in pl.items() if k not in ("src", "dst", "devices")} | {
                               "layout": args.layout, "tokens": args.tokens, "block_size": args.block_size,
                               "devices": devices, "backend": args.backend, "pool_alloc": args.pool_alloc,
                               "isolate_gpus": args.isolate_gpus},
                           "results": {}, "ceilings": {}, "checks": {}}
    a = b = None
    try:
        a = Remote(ctx, "A", specs[0], args.timeout)
        b = Remote(ctx, "B", specs[1], args.timeout)
        ainfo, binfo = a.call("info"), b.call("info")
        peer = a.call("connect", address=binfo["address"])
        out["transports_available"] = ainfo["transports"]
        skipped = {**binfo["skipped"], **ainfo["skipped"]}
        if skipped:
            out["transports_skipped"] = skipped
        both = set(ainfo["transports"]) & set(binfo["transports"])
        if args.transport == "all":
            transports: list[str | None] = [t for t in TRANSPORTS if t in both]
        else:
            transports = [None if args.transport == "auto" else args.transport]
        gpu = all(d.startswith("cuda") for d in devices)
        # the peer-copy ceiling needs cuda_ipc's mapping of the peer pool (not there across isolated GPUs without VMM)
        mapped = gpu and "cuda_ipc" in both and a.call("peer_transport", peer=peer)["transport"] == "cuda_ipc"
        kind = "peer_copy" if mapped and args.transport != "tcp" else "raw_tcp"
        ceil = Ceiling(a, b, ainfo, binfo, peer, pl, args, kind)
        if args.memcheck > 0:
            out["memcheck"] = memcheck(a, b, peer, pl, args, transports[0])
            out["checks"].update(out["memcheck"].pop("checks"))
        ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.memcheck <= 0 else []
        for transport in transports:
            for op in ops:
                res, ok, differed = measure(a, b, peer, pl, args, ceil, op, transport)
                key = op if len(transports) == 1 else f"{op}:{res['transport']}"
                out["results"][key] = res
                out["checks"][f"{key}_checksums_match"] = ok
                out["checks"][f"{key}_differed_before"] = differed
        for op in ops:
            c = ceil.result(op)
            out["ceilings"][op] = c
            for key, res in out["results"].items():
                if key.split(":")[0] == op:
                    res.update({"ceiling_GBps": c["GBps"], "ceiling_median_ms": c["median_ms"],
                                "fraction_of_ceiling": res["GBps"] / c["GBps"]})
        ceil.close()
        if args.latency_iters > 0 and args.memcheck <= 0:
            for transport in transports:
                res = latency(a, b, peer, pl, args, transport)
                out["results"]["single_block_write" + ("" if len(transports) == 1 else f":{res['transport']}")] = res
    finally:
        for r in (a, b):
            if r is not None:
                r.close()
    return out


def measure(a: Remote, b: Remote, peer: str, pl: dict[str, Any], args: argparse.Namespace, ceil: Ceiling, op: str,
            transport: str | None) -> tuple[dict[str, Any], bool, bool]:
    """One op over one transport: checksums before and after, iterations interleaved with the ceiling's."""
    if op not in ("write", "read"):
        raise ValueError(f"unknown op {op!r}")
    src, dst = pl["src"], pl["dst"]
    a.call("fill", seed=args.seed * 10 + 1)
    b.call("fill", seed=args.seed * 10 + 2)
    before = a.call("checksums", ids=src) == b.call("checksums", ids=dst)
    b.call("latencies")
    a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=0, warmup=args.warmup, transport=transport)
    # a ceiling iteration, then a transfer, and so on: both see the same machine conditions. The ceiling goes first
    # because the peer copy lands in the pool: the transfer after it rewrites the checked blocks.
    runs = []
    for _ in range(args.iters):
        ceil.step(op)
        runs.append(a.call("xfer", op=op, peer=peer, local_ids=src, remote_ids=dst, iters=1, warmup=0,
                           transport=transport))
    res = merge_runs(runs)
    after = a.call("checksums", ids=src) == b.call("checksums", ids=dst)
    lat = b.call("latencies") if op == "write" else []
    if lat:
        res["notify_after_call_median_ms"] = median(lat) / 1e6
    return res, bool(after), not before


def latency(a: Remote, b: Remote, peer: str, pl: dict[str, Any], args: argparse.Namespace,
            transport: str | None) -> dict[str, Any]:
    """Single-block writes: the sender's call to the receiver's notification."""
    src, dst = pl["src"], pl["dst"]
    b.call("latencies")
    res = a.call("xfer", op="write", peer=peer, local_ids=src[:1], remote_ids=dst[:1], iters=args.latency_iters,
                 warmup=min(20, args.latency_iters), transport=transport)
    lat = [x / 1e3 for x in b.call("latencies")[-args.latency_iters:]]
    res.pop("times_ms", None)
    res.update({"e2e_median_us": median(lat), "e2e_p99_us": percentile(lat, 99.0),
                "sender_median_us": res["median_ms"] * 1e3})
    return res


def memcheck(a: Remote, b: Remote, peer: str, pl: dict[str, Any], args: argparse.Namespace,
             transport: str | None) -> dict[str, Any]:
    """N transfers of the workload in flight at once; each side's peak memory against its baseline (taken after a
    warm-up transfer, so the transport's fixed buffers, e.g. an NCCL communicator's, are in the baseline). The check:
    neither side grew by as much as one transfer's bytes (a temporary buffer per transfer in flight would)."""
    src, dst = pl["src"], pl["dst"]
    a.call("fill", seed=args.seed * 10 + 3)
    b.call("fill", seed=args.seed * 10 + 4)
    a.call("xfer", op="write", peer=peer, local_ids=src, remote_ids=dst, iters=0, warmup=max(1, args.warmup),
           transport=transport)
    base = {"A": a.call("mem_start"), "B": b.call("mem_start")}
    run_ = a.call("xfer_many", op="write", peer=peer, local_ids=src, remote_ids=dst, count=args.memcheck,
                  transport=transport, timeout=args.timeout)
    sides = {"A (sender)": a.call("mem_stop"), "B (receiver)": b.call("mem_stop")}
    ok = a.call("checksums", ids=src) == b.call("checksums", ids=dst)
    one = pl["bytes"]
    grew = max(s["grew_bytes"] for s in sides.values())
    return {"transfers_in_flight": args.memcheck, "transport": run_["transport"], "seconds": run_["seconds"],
            "bytes_moved": run_["bytes"], "GBps": run_["bytes"] / run_["seconds"] / 1e9, "bytes_per_transfer": one,
            "baseline": base, "sides": sides,
            "checks": {"memcheck_checksums_match": bool(ok), "memcheck_no_growth": bool(grew < one)}}


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from single-iteration runs."""
    from pdserve.bench.transfer_worker import summarize

    times = [t / 1e3 for r in runs for t in r["times_ms"]]
    res = {k: v for k, v in runs[-1].items() if k not in ("times_ms",)}
    res.update(summarize(times, runs[-1]["bytes"]))
    res["times_ms"] = [t * 1e3 for t in times]
    return res


class Ceiling:
    """The physical ceiling of the transport in use, in the direction of the op, measured interleaved with the
    transfers it is compared to: one large peer copy between the pools (IPC-mapped) for cuda_ipc; a raw socket
    stream between the same two processes otherwise (one stream and as many as the tcp transport uses; the faster
    counts)."""

    def __init__(self, a: Remote, b: Remote, ainfo: dict[str, Any], binfo: dict[str, Any], peer: str,
                 pl: dict[str, Any], args: argparse.Namespace, kind: str) -> None:
        self.a, self.b, self.ainfo, self.binfo, self.peer, self.nbytes = a, b, ainfo, binfo, peer, pl["bytes"]
        self.conns = sorted({1, args.tcp_connections})
        self.warmup = args.warmup
        self.kind = kind  # peer_copy (GPU pools, cuda_ipc mapping) | raw_tcp
        self.opened: set[str] = set()
        self.times: dict[tuple[str, str], list[float]] = {}

    def step(self, op: str) -> None:
        if self.kind == "raw_tcp" and op not in self.opened:
            self.opened.add(op)
            self._open(op)
        if self.kind == "peer_copy":
            r = self.a.call("peer_copy", peer=self.peer, nbytes=self.nbytes, iters=1, warmup=1, pull=op == "read")
            self.times.setdefault((op, "peer_copy"), []).append(r["median_ms"])
            return
        sender = self.a if op == "write" else self.b
        for c in self.conns:
            sender.call("raw_use", conns=c)
            r = sender.call("raw_send", nbytes=self.nbytes, iters=1, warmup=0)
            self.times.setdefault((op, f"streams_{c}"), []).extend(r["times_ms"])

    def _open(self, op: str) -> None:
        sender, sink, info = (self.a, self.b, self.binfo) if op == "write" else (self.b, self.a, self.ainfo)
        host = info["address"].rpartition(":")[0]
        for c in self.conns:
            port = sink.call("raw_sink", nbytes=self.nbytes, conns=c)
            sender.call("raw_open", address=f"{host}:{port}", conns=c)
            sender.call("raw_send", nbytes=self.nbytes, iters=0, warmup=self.warmup)

    def result(self, op: str) -> dict[str, Any]:
        from pdserve.bench.transfer_worker import summarize

        res: dict[str, Any] = {k[1]: summarize([t / 1e3 for t in ms], self.nbytes)
                               for k, ms in self.times.items() if k[0] == op}
        best_key = max(res, key=lambda k: res[k]["GBps"])
        best = res[best_key]
        direction = "push into" if op == "write" else "pull from"
        what = (f"one large peer copy ({direction} the IPC-mapped peer pool, torch copy_), same processes"
                if self.kind == "peer_copy" else
                f"raw socket stream in the {op} direction ({best_key.replace('_', ' ')}: sendall of one buffer, "
                "recv_into), same processes")
        res.update({"what": what, "median_ms": best["median_ms"], "GBps": best["GBps"], "best": best_key})
        return res

    def close(self) -> None:
        for r in (self.a, self.b):
            r.call("raw_close")


def table(out: dict[str, Any]) -> str:
    w = out["workload"]
    lines = [f"KV transfer: {w['model']} {w['blocks']} blocks x {w['block_bytes'] / 2**20:.2f} MiB = "
             f"{w['bytes'] / 1e9:.3f} GB, layout {w['layout']}, devices {','.join(w['devices'])}",
             f"{'what':<30}{'transport':<18}{'descs':>11}{'median ms':>11}{'p99 ms':>9}{'GB/s':>9}{'ceiling':>9}"
             f"{'of ceil':>9}"]
    for k, r in out["results"].items():
        descs = f"{r['descs_in']}->{r['descs_out']}"
        tr = r["transport"] + (f"/{r['copy_method']}" if r.get("copy_method") else "")
        frac = f"{r['fraction_of_ceiling'] * 100:.0f}%" if "fraction_of_ceiling" in r else ""
        ceil = f"{r['ceiling_GBps']:.1f}" if "ceiling_GBps" in r else ""
        lines.append(f"{k:<30}{tr:<18}{descs:>11}{r['median_ms']:>11.3f}{r['p99_ms']:>9.3f}{r['GBps']:>9.1f}{ceil:>9}"
                     f"{frac:>9}")
        if "e2e_median_us" in r:
            lines.append(f"{'  call->notified':<30}{'':<18}{'':>11}{r['e2e_median_us'] / 1e3:>11.3f}"
                         f"{r['e2e_p99_us'] / 1e3:>9.3f}   (us: median {r['e2e_median_us']:.0f}, p99 {r['e2e_p99_us']:.0f})")
    for op, c in out["ceilings"].items():
        lines.append(f"ceiling for {op}: {c['GBps']:.1f} GB/s, {c['median_ms']:.3f} ms median: {c['what']}")
    for t, why in out.get("transports_skipped", {}).items():
        lines.append(f"not run: {t}: {why}")
    m = out.get("memcheck")
    if m:
        lines.append(f"memcheck: {m['transfers_in_flight']} transfers of {m['bytes_per_transfer'] / 1e9:.3f} GB in "
                     f"flight over {m['transport']}, {m['seconds']:.2f} s, {m['GBps']:.1f} GB/s")
        for side, v in m["sides"].items():
            lines.append(f"  {side}: {v['kind']} {v['before_used'] / 2**20:.0f} MiB before, peak "
                         f"{v['peak_used'] / 2**20:.0f} MiB (+{v['grew_bytes'] / 2**20:.1f} MiB); torch allocated "
                         f"{v['before_torch_allocated'] / 2**20:.0f} -> {v['peak_torch_allocated'] / 2**20:.0f} MiB "
                         f"(pool {v['pool_bytes'] / 2**20:.0f} MiB)")
    lines.append("checks: " + ", ".join(f"{k}={v}" for k, v in out["checks"].items()))
    return "\n".join(lines)


def output_path(args: argparse.Namespace) -> str | None:
    """Where the JSON goes: --result-dir/--result-filename (default name transfer.json), or the older --out."""
    if args.result_dir or args.result_filename:
        return str(result_path(args.result_dir, args.result_filename, "transfer.json"))
    return args.old_output


def main(args: argparse.Namespace) -> int:
    out = run(args)
    text = json.dumps(out, indent=1)
    path = output_path(args)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    print(table(out))
    if path:
        print(f"wrote {path}")
    ok = all(v for k, v in out["checks"].items() if k.endswith("_checksums_match"))
    if not ok:
        print("CHECKSUM MISMATCH", file=sys.stderr)
    if out["checks"].get("memcheck_no_growth") is False:
        print("MEMORY GREW with the transfers in flight", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
