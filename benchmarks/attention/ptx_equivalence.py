"""Whether a refactor of the decode kernel changed what it compiles to, without a GPU: compile `_decode_kernel` for
sm_90 at the configurations benchmarks/attention/kernel_resources.py builds as paged_decode would launch them (bf16,
fp16 and fp32 queries; 16-bit and fp8 pools; d 64-256; GQA 2-8; one split or several, mixed, many-program, few-row,
with the rotary), and record each one's PTX as a multiset of instructions (register numbers, labels, line info and
parameter numbering aside: an instruction reordered is the same kernel, one added or changed is not).

  python benchmarks/attention/ptx_equivalence.py dump before.json     # at one tree (no TRITON_INTERPRET)
  python benchmarks/attention/ptx_equivalence.py dump after.json      # at the other
  python benchmarks/attention/ptx_equivalence.py compare before.json after.json

Session 40 removed the decode kernel's losing A/B switches (early tile, self merge) checked by an earlier form of
this script, the old tree's constexprs held as shipped (its kernel_resources compiled the few-row case with the early
tile on): the 376 configurations compiled to the same multisets before and after.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_resources as kr  # noqa: E402

REG = re.compile(r"%(r|rd|f|fd|p|rs|h|hh|b)\d+")
LABEL = re.compile(r"\$L__\w+")


def _ptx_lines(fn, types: dict, ce: dict, num_warps: int, num_stages: int, aligned: list[str],
               maxnreg: int | None = None) -> dict:
    """kernel_resources' compile, returning the normalized instruction multiset instead of ptxas' report."""
    ptx = kr.compiled(fn, types, ce, num_warps, num_stages, aligned, maxnreg).asm["ptx"]
    runtime = [n for n in fn.arg_names if n not in ce]
    name = re.compile(rf"{fn.__name__}_param_(\d+)")

    def param(m: re.Match) -> str:
        i = int(m.group(1))
        return "P_" + (runtime[i] if i < len(runtime) else f"extra{i - len(runtime)}")

    lines = []
    for ln in ptx.split("\n"):
        s = ln.strip()
        if not s or s.startswith((".loc", ".file", "//")):
            continue
        if s.startswith(".section") and "debug" in s:
            break
        lines.append(name.sub(param, s).rstrip(","))
    used = set(re.findall(r"\[(P_\w+)", "\n".join(lines)))
    lines = [s for s in lines if not (s.startswith(".param") and (m := re.search(r"P_\w+", s)) and m.group(0) not in used)]
    return {"lines": len(lines), "multiset": dict(collections.Counter(LABEL.sub("LBL", REG.sub(r"%\1", s))
                                                                      for s in lines))}


def dump(path: str) -> None:
    kr._compile = _ptx_lines
    res = {}
    for dt in ("bf16", "fp16", "fp32"):
        for kv in (dt, "fp8e4nv", "fp8e5"):
            if kv != dt and dt == "fp32":
                continue
            for d, g in ((128, 4), (128, 8), (64, 4), (256, 2)):
                for single in (True, False):
                    for mixed in (False, True):
                        for many, few in ((False, False), (True, False), (False, True)):
                            for rope in (False, True):
                                if rope and (mixed or many or (kv != dt and not few) or d != 128):
                                    continue
                                key = f"{dt}/{kv}/d{d}/g{g}/single{single}/mixed{mixed}/many{many}/few{few}/rope{rope}"
                                res[key] = kr.decode(dt, kv, d, g, single, mixed, many=many, few=few, rope=rope)
                                print(key, res[key]["lines"], flush=True)
    Path(path).write_text(json.dumps(res))


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    differ = [k for k in a if k not in b or a[k]["multiset"] != b[k]["multiset"]]
    print(f"{len(a)} configurations, {len(differ)} differ" + "".join(f"\n  {k}" for k in differ[:20]))
    return 1 if differ or set(a) != set(b) else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
