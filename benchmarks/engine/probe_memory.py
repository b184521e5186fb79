"""What keeps PyTorch's free cached blocks after the KV sizing probe (issue 10, KV capacity).

Also (session 32): what the probe step's peak was made of, and what the engine held before it beyond the weights.
vLLM's pool at --gpu-memory-utilization 0.9 was 109.35 GiB on a warm start against pdserve's 109.32 (session 31): the
history replayed (`peak_breakdown`) names the live blocks at the step's allocated peak and at its reserved peak,
grouped by the pdserve frame that made them, and `live_by_frame` the blocks live when the probe began.

The KV sizing log of dummy Qwen3-8B on an H200 showed 0.55-0.61 GiB of free blocks that PyTorch's caching allocator
kept after the probe step was released and `empty_cache` ran (benchmarks/lease_s13, lease_s14). A segment goes back
to the device only when none of its blocks is in use, so some tensor made during the probe and still alive after
it shares a segment with those free blocks. This script records the allocator's history (with Python stacks)
through the probe, takes a snapshot right after it, and prints every segment that holds free bytes beside live
ones: its size, the free bytes, and each live block with the frames that allocated it.

    python benchmarks/engine/probe_memory.py --model qwen3-8b --out $OUT/probe_memory.json

CUDA only; the engine is built as `pdserve serve` builds it (no warm-up, which comes after the pool).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _frames(block: dict, keep: int) -> list[str]:
    out = []
    for f in block.get("frames") or []:
        name = f.get("filename", "")
        if "pdserve" in name or ("torch" in name and "/torch/cuda/memory.py" not in name):
            out.append(f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}")
        if len(out) >= keep:
            break
    return out


def pinned_segments(snapshot: dict, frames: int = 6) -> dict:
    """Segments with free bytes beside live blocks (what empty_cache cannot give back), largest free first."""
    rows = []
    for seg in snapshot["segments"]:
        live = [b for b in seg["blocks"] if b["state"] != "inactive"]
        free = sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
        if live and free:
            rows.append({"segment_bytes": seg["total_size"], "free_bytes": free, "stream": seg.get("stream"),
                         "pool": str(seg.get("segment_pool_id")),
                         "live": [{"bytes": b["size"], "requested": b.get("requested_size"), "state": b["state"],
                                   "frames": _frames(b, frames)} for b in live]})
    rows.sort(key=lambda r: -r["free_bytes"])
    return {"segments": len(snapshot["segments"]), "pinned": rows,
            "free_in_pinned_bytes": sum(r["free_bytes"] for r in rows),
            "reserved_bytes": sum(s["total_size"] for s in snapshot["segments"]),
            "live_bytes": sum(b["size"] for s in snapshot["segments"] for b in s["blocks"]
                              if b["state"] != "inactive")}


def _site(frames: list[str]) -> str:
    """The innermost pdserve frame of an allocation (else the innermost frame kept)."""
    for f in frames:
        if "pdserve" in f:
            return f
    return frames[0] if frames else "?"


def live_by_frame(snapshot: dict, top: int = 20) -> list[dict]:
    """Live blocks of a snapshot grouped by the site that allocated them, largest first."""
    sites: dict[str, list[int]] = {}
    for seg in snapshot["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                site = sites.setdefault(_site(_frames(b, 8)), [0, 0])
                site[0] += b["size"]
                site[1] += 1
    rows = [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in sites.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:top]


def peak_breakdown(trace: list[dict], top: int = 20) -> dict:
    """Replay an allocator trace: the most bytes allocated at once above its start (blocks allocated before it are
    not counted; their frees are ignored) and the live blocks at that moment by site; the same for reserved
    segments (the most they grew above their lowest before, as Worker.memory_peak measures from an emptied cache)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_at = -1
    seg = seg_low = seg_peak = 0  # segment bytes from the start, their lowest so far, the most they grew above it
    for i, e in enumerate(trace):
        act = e.get("action")
        if act == "alloc":
            live[e["addr"]] = (e["size"], _site(_frames(e, 8)))
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif act == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        elif act == "segment_alloc":
            seg += e["size"]
            seg_peak = max(seg_peak, seg - seg_low)
        elif act == "segment_free":  # (empty_cache at the probe's start gives cached segments back)
            seg -= e["size"]
            seg_low = min(seg_low, seg)
    live.clear()
    for e in trace[: peak_at + 1]:  # the live set at the peak, replayed again rather than copied at every new peak
        if e.get("action") == "alloc":
            live[e["addr"]] = (e["size"], _site(_frames(e, 8)))
        elif e.get("action") == "free_completed":
            live.pop(e["addr"], None)
    sites: dict[str, list[int]] = {}
    for size, site in live.values():
        s = sites.setdefault(site, [0, 0])
        s[0] += size
        s[1] += 1
    rows = [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in sites.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return {"events": len(trace), "allocated_peak_bytes": peak, "peak_event": peak_at,
            "segment_growth_peak_bytes": seg_peak, "at_peak": rows[:top]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out", default="probe_memory.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_memory.py needs CUDA", file=sys.stderr)
        return 2

    import pdserve.engine.engine_core as engine_core
    from pdserve.config import EngineConfig

    real = engine_core.measure_step_peak
    seen: dict = {}

    def measured(*a, **k):
        torch.cuda.synchronize()
        before = torch.cuda.memory._snapshot()  # history on since the engine opened the device: every live block
        seen["before_probe"] = {"memory_allocated": torch.cuda.memory_allocated(),
                                "by_site": live_by_frame(before)}
        start = len(before["device_traces"][torch.cuda.current_device()])
        out = real(*a, **k)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        trace = snap["device_traces"][torch.cuda.current_device()]
        seen["probe_peak"] = peak_breakdown(trace[start:] if len(trace) < 400_000 else trace)
        seen["probe_peak"]["trace_wrapped"] = len(trace) >= 400_000
        seen["measured_peak_bytes"] = out.peak_bytes
        seen["step_peak"] = {k: getattr(out, k) for k in ("tokens", "seqs", "peak_bytes", "long_prefix",
                                                          "long_peak_bytes", "bound_bytes") if hasattr(out, k)}
        seen["after_probe"] = pinned_segments(snap)
        seen["after_probe"]["memory_reserved"] = torch.cuda.memory_reserved()
        seen["after_probe"]["memory_allocated"] = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled=None)
        return out

    engine_core.measure_step_peak = measured
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=400_000)
    t0 = time.time()
    core = engine_core.EngineCore(EngineConfig(model=args.model, load_format=args.load_format, device="cuda",
                                               dtype="bfloat16", max_model_len=args.max_model_len,
                                               gpu_memory_utilization=args.gpu_memory_utilization, warmup=False))
    try:
        seen["num_blocks"] = core.kv.pool.num_blocks
        seen["build_s"] = time.time() - t0
    finally:
        core.close()
    b = seen["before_probe"]
    print(f"before the probe: {b['memory_allocated'] / 2**30:.3f} GiB allocated; by site:")
    for row in b["by_site"][:12]:
        print(f"  {row['bytes'] / 2**20:9.1f} MiB in {row['blocks']:5d} blocks: {row['site']}")
    print("StepPeak: " + ", ".join(f"{k} {v / 2**30:.3f} GiB" if k.endswith("bytes") else f"{k} {v}"
                                   for k, v in seen["step_peak"].items()))
    p = seen["probe_peak"]
    print(f"the probe step: engine's measured peak {seen['measured_peak_bytes'] / 2**30:.3f} GiB; replayed: "
          f"{p['allocated_peak_bytes'] / 2**30:.3f} GiB allocated at most (event {p['peak_event']} of "
          f"{p['events']}), segments grew by {p['segment_growth_peak_bytes'] / 2**30:.3f} GiB at most; live at the "
          f"allocated peak by site:")
    for row in p["at_peak"][:16]:
        print(f"  {row['bytes'] / 2**20:9.1f} MiB in {row['blocks']:5d} blocks: {row['site']}")
    r = seen["after_probe"]
    print(f"after the probe: {r['reserved_bytes'] / 2**30:.3f} GiB reserved in {r['segments']} segments, "
          f"{r['live_bytes'] / 2**30:.3f} GiB live; {r['free_in_pinned_bytes'] / 2**30:.3f} GiB free in "
          f"{len(r['pinned'])} segments that also hold live blocks; pool {seen['num_blocks']} blocks")
    for row in r["pinned"][:12]:
        print(f"segment {row['segment_bytes'] / 2**20:.1f} MiB, {row['free_bytes'] / 2**20:.1f} MiB free, "
              f"stream {row['stream']}, pool {row['pool']}; live blocks:")
        for b in sorted(row["live"], key=lambda b: -b["bytes"])[:6]:
            print(f"  {b['bytes'] / 2**20:.2f} MiB {b['state']}: " + " <- ".join(b["frames"][:4]))
    with open(args.out, "w") as f:
        json.dump(seen, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
