"""Summarize the JSON files of `pdserve bench transfer` runs in a folder: one table, side by side, and the issue's
targets for cuda_ipc checked against the numbers (nothing typed by hand: every figure comes from the files).

    python benchmarks/transfer/summarize.py <folder>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(results: dict[str, dict]) -> list[str]:
    out = []
    order = {"write": 0, "read": 1, "single_block_write": 2}
    for name, r in sorted(results.items()):
        # single-transport runs name results by op; `--transport all` runs by op:transport
        for op in sorted(r["results"], key=lambda k: (order.get(k.split(":")[0], 3), k)):
            x = r["results"][op]
            tr = x["transport"] + (f"/{x['copy_method']}" if x.get("copy_method") else "")
            frac = f"{x['fraction_of_ceiling'] * 100:.0f}%" if "fraction_of_ceiling" in x else ""
            e2e = f"{x['e2e_median_us']:.0f}" if "e2e_median_us" in x else ""
            out.append(f"{name:<22}{op:<28}{tr:<18}{x['descs_in']:>6}->{x['descs_out']:<6}{x['median_ms']:>9.3f}"
                       f"{x['p99_ms']:>9.3f}{x['GBps']:>8.1f}{x.get('ceiling_GBps', float('nan')):>8.1f}{frac:>6}{e2e:>8}")
    return out


def targets(results: dict[str, dict]) -> list[str]:
    lines = []

    def check(what: str, ok: bool, detail: str) -> None:
        lines.append(f"[{'PASS' if ok else 'FAIL'}] {what}: {detail}")

    main = results.get("cuda_ipc")
    if main:
        for op in ("write", "read"):
            x = main["results"].get(op)
            if x:
                check(f"cuda_ipc {op} 8192-token qwen3-8b <= 3.5 ms median, >= 340 GB/s, >= 85% of ceiling",
                      x["median_ms"] <= 3.5 and x["GBps"] >= 340 and x.get("fraction_of_ceiling", 0) >= 0.85,
                      f"{x['median_ms']:.3f} ms, {x['GBps']:.1f} GB/s, {x.get('fraction_of_ceiling', 0) * 100:.1f}% of "
                      f"{x.get('ceiling_GBps', 0):.1f} GB/s measured in the same run")
        sb = main["results"].get("single_block_write")
        if sb:
            check("single block, call -> receiver notified < 200 us median", sb["e2e_median_us"] < 200,
                  f"{sb['e2e_median_us']:.0f} us median, {sb['e2e_p99_us']:.0f} us p99")
    for name, r in sorted(results.items()):
        if set(r["workload"]["devices"]) == {"cpu"}:
            for op in ("write", "read"):
                x = r["results"].get(op)
                if x and x["transport"] == "tcp" and "fraction_of_ceiling" in x:
                    check(f"{name}: tcp {op} on CPU >= 70% of the raw socket stream",
                          x["fraction_of_ceiling"] >= 0.70, f"{x['GBps']:.2f} of {x['ceiling_GBps']:.2f} "
                          f"GB/s = {x['fraction_of_ceiling'] * 100:.0f}%")
    nixl = results.get("nixl")
    if main and nixl:
        for op in ("write", "read"):
            a, b = main["results"].get(op), nixl["results"].get(op)
            if a and b:
                lines.append(f"[INFO] {op}: pdserve cuda_ipc {a['median_ms']:.3f} ms vs NIXL {b['median_ms']:.3f} ms "
                             f"({b['median_ms'] / a['median_ms']:.2f}x)")
    for name, r in sorted(results.items()):
        mc = r.get("memcheck")
        if mc:
            grew = {side: v["grew_bytes"] for side, v in mc["sides"].items()}
            check(f"{name}: {mc['transfers_in_flight']} transfers in flight over {mc['transport']} grow no side by a "
                  "transfer's bytes", bool(r["checks"].get("memcheck_no_growth")),
                  ", ".join(f"{k} +{v / 2**20:.1f} MiB ({mc['sides'][k]['kind']})" for k, v in grew.items())
                  + f" vs {mc['bytes_per_transfer'] / 2**20:.0f} MiB per transfer")
    for name, r in sorted(results.items()):
        bad = [k for k, v in r.get("checks", {}).items() if k.endswith("_checksums_match") and not v]
        check(f"{name} checksums", not bad, "all match" if not bad else f"mismatch: {bad}")
    return lines


def nixl_anchor(folder: Path) -> dict | None:
    """NIXL's own block-major run of the same bytes (shared/anchors/nixl_kv_transfer.py, run_2xh200.sh NIXL_ANCHOR):
    the last JSON object it printed."""
    p = folder / "nixl_anchor.txt"
    if not p.exists():
        return None
    text = p.read_text(errors="replace")
    start = text.rfind("\n{")
    try:
        return json.loads(text[start + 1 if start >= 0 else text.find("{"):])
    except ValueError:
        return None


def anchor_lines(results: dict[str, dict], anchor: dict | None) -> list[str]:
    """NIXL via pdserve's agent against NIXL's own block-major run: within 10 % (the issue's target)."""
    lines = []
    if not anchor:
        return lines
    for op in ("write", "read"):
        ref = anchor.get(f"nixl_block_major_{op.upper()}_ms")
        ours = (results.get("nixl") or {}).get("results", {}).get(op) or \
            (results.get("all_transports") or {}).get("results", {}).get(f"{op}:nixl")
        if isinstance(ref, (int, float)) and ours:
            ok = ours["median_ms"] <= 1.10 * ref
            lines.append(f"[{'PASS' if ok else 'FAIL'}] NIXL {op} via pdserve's agent within 10 % of NIXL's own "
                         f"block-major run: {ours['median_ms']:.3f} ms vs {ref:.3f} ms ({ours['median_ms'] / ref:.2f}x)")
    return lines


def main(folder: str) -> int:
    results = {}
    for p in sorted(Path(folder).glob("*.json")):
        try:
            results[p.stem] = json.loads(p.read_text())
        except (json.JSONDecodeError, OSError) as e:
            print(f"skipping {p}: {e}")
    if not results:
        print(f"no results in {folder}")
        return 1
    any_r = next(iter(results.values()))
    m = any_r["machine"]
    print(f"machine {m.get('hostname')} gpus {m.get('gpus')} torch {m.get('torch')} commit {any_r.get('git_commit')}")
    print(f"{'run':<22}{'what':<28}{'transport':<18}{'descs':>13}{'med ms':>9}{'p99 ms':>9}{'GB/s':>8}{'ceil':>8}"
          f"{'of':>6}{'e2e us':>8}")
    print("\n".join(rows(results)))
    lines = targets(results) + anchor_lines(results, nixl_anchor(Path(folder)))
    print("\n".join(lines))
    return 1 if any(line.startswith("[FAIL]") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/transfer/results"))
