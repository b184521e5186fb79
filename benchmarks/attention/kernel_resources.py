"""Compile the attention kernels for sm_90 (H100/H200) on any machine, no GPU needed, and report what ptxas says:
registers per thread, spilled bytes, shared memory, and whether the dots became wgmma (Hopper tensor cores).

Catches configurations that would spill or not fit before a GPU run. Run without TRITON_INTERPRET:

  python benchmarks/attention/kernel_resources.py [--sweep] [--json PATH]

Exit status 1 when a default bf16/fp16 configuration spills or exceeds the shared memory of an H100/H200 block
(227 KiB). fp32 queries (tests, exactness) run dots on FMA units and spill some registers: reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.ops.attention.decode import (
    FP8_V_WIDEN,
    FP8_V_WIDEN_FEW,
    MANY_PROGRAMS_PREFETCH,
    MANY_PROGRAMS_TILE,
    MANY_PROGRAMS_TILE_FP8,
    ROPE_MAXNREG,
    _decode_kernel,
    decode_tile,
)
from pdserve.ops.attention.kv_write import _write_kv_kernel
from pdserve.ops.attention.library_prefill import _gather_blocks_kernel
from pdserve.ops.attention.prefill import SWEEP, PrefillConfig, _prefill_kernel, default_g_pack

TARGET = GPUTarget("cuda", 90, 32)
WIDEN_OVERRIDE: bool | None = None  # --fp8-v-widen: None as paged_decode decides
SMEM_LIMIT = 227 * 1024
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
FP8 = ("fp8e4nv", "fp8e5")
TORCH_DT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def compiled(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, aligned: list[str],
             maxnreg: int | None = None):
    """`fn` compiled for sm_90 with these argument types, constexprs and launch options (no GPU needed)."""
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": bool(constexprs.get("PDL"))}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET, options=options)


def _compile(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int, aligned: list[str],
             maxnreg: int | None = None) -> dict:
    k = compiled(fn, types, constexprs, num_warps, num_stages, aligned, maxnreg)
    ptx = k.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, timeout=300)
    finally:
        os.unlink(f.name)
    txt = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", txt)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else None,
            "shared": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "num_warps": num_warps, "num_stages": num_stages,
            # 16-byte global loads issued before the PDL wait (none of the pool's: it is read after the wait)
            "v4_loads_before_wait": ptx[:wait].count("ld.global.v4") if wait >= 0 else 0,
            # shared-memory loads of one byte (an fp8 V tile read out as the PV product's operand: decode.FP8_V_WIDEN)
            "b8_shared_loads": ptx.count("ld.shared.b8")}


def prefill(dt: str, kv: str, d: int, g: int, cfg: PrefillConfig, bs: int = 16, window: bool = False,
            softcap: bool = False, new: bool = False) -> dict:
    """new: the new tokens' K/V read from the step's k/v (what the backend's forward does), not the pool."""
    types = dict(Q=f"*{dt}", KV=f"*{kv}", KN=f"*{dt}", VN=f"*{dt}", Out=f"*{dt}", BT="*i32", SL="*i32", QSL="*i32",
                 TILES="*i32", KS="*fp32", VS="*fp32", s_qt="i32", s_qh="i32", s_ot="i32", s_oh="i32", s_kvb="i64",
                 s_kvkv="i32", s_kvt="i32", s_kvh="i32", s_knt="i32", s_knh="i32", s_vnt="i32", s_vnh="i32",
                 s_btb="i32", sm_scale="fp32", softcap="fp32", window="i32")
    ce = dict(G=g, G_PACK=cfg.g_pack, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d,
              BLOCK_D=triton.next_power_of_2(d), BS=bs, TILE=128, HAS_WINDOW=window, HAS_SOFTCAP=softcap,
              HAS_KS=kv in FP8, HAS_VS=kv in FP8, HAS_NEW=new, PRECISION="ieee" if dt == "fp32" else "tf32")
    aligned = ["Q", "KV", "KN", "VN", "Out", "BT", "SL", "QSL", "TILES", "s_qt", "s_qh", "s_ot", "s_oh", "s_kvb",
               "s_kvkv", "s_kvt", "s_kvh", "s_knt", "s_knh", "s_vnt", "s_vnh"]
    return _compile(_prefill_kernel, types, ce, cfg.num_warps, cfg.num_stages, aligned)


def decode(dt: str, kv: str, d: int, g: int, single: bool, mixed: bool, bs: int = 16, many: bool = False,
           few: bool = False, rope: bool = False) -> dict:
    """many: the many-program tile (a batch-256 step) with its block table read a tile ahead; few: the tile below 8
    rows (a batch-1 step); rope: the layer's QK-norm, rotary and K/V write in the kernel (decode.ROPE_IN_DECODE:
    decode-only, so never mixed)."""
    types = dict(Q=f"*{dt}", KV=f"*{kv}", BT="*i32", SL="*i32", QSL="*i32", KS="*fp32", VS="*fp32", Out=f"*{dt}",
                 PartO="*fp32", PartM="*fp32", PartL="*fp32", s_qt="i32", s_qh="i32", s_ot="i32", s_oh="i32",
                 s_kvb="i64", s_kvkv="i32", s_kvt="i32", s_kvh="i32", s_btb="i32", s_pb="i32", s_ph="i32",
                 s_ps="i32", sm_scale="fp32", softcap="fp32", window="i32", POS="*i64", COS="*fp32", SIN="*fp32",
                 QW=f"*{dt}", KW=f"*{dt}", KNEW=f"*{dt}", VNEW=f"*{dt}", SLOTS="*i64", s_cos="i32", s_knt="i32",
                 s_knh="i32", s_vnt="i32", s_vnh="i32", eps="fp32", offset="fp32")
    qdt = getattr(torch, TORCH_DT[dt])
    block_n, warps, stages = decode_tile(d, qdt, kv in FP8, 1 if few else 8)  # default: the many-row tile (larger)
    if many:
        block_n, warps, stages = MANY_PROGRAMS_TILE_FP8 if kv in FP8 else MANY_PROGRAMS_TILE
    # decode.v_widen on sm_90; the rotary on an fp8 pool only with V widened (decode.rope_pool: without, it spilled)
    widen = kv in FP8 and dt != "fp32" and (FP8_V_WIDEN if many else (FP8_V_WIDEN_FEW or rope))
    if WIDEN_OVERRIDE is not None:  # --fp8-v-widen on/off: every fp8 case one way (what the widening changes)
        widen = kv in FP8 and dt != "fp32" and WIDEN_OVERRIDE
    ce = dict(G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=triton.next_power_of_2(d), BS=bs,
              BLOCK_N=block_n, MIXED=mixed, SINGLE=single, HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_KS=kv in FP8,
              HAS_VS=kv in FP8 and single, PRECISION="ieee" if dt == "fp32" else "tf32",
              DOT_F16=kv in FP8 and dt != "fp32", PDL=1, PREFETCH_BT=many and MANY_PROGRAMS_PREFETCH,
              ROPE=rope, HAS_QNORM=rope,
              V_WIDEN=(2 if kv == "fp8e5" else 1) if widen else 0,
              FP8_MAX=(448.0 if kv == "fp8e4nv" else 57344.0) if kv in FP8 and rope else 0.0,
              WRITE_VS=kv in FP8 and rope)
    aligned = ["Q", "KV", "Out", "BT", "SL", "PartO", "s_qt", "s_qh", "s_ot", "s_oh", "s_kvb", "s_kvkv", "s_kvt",
               "s_kvh", "s_pb", "s_ph", "s_ps"] + (["COS", "SIN", "QW", "KW", "KNEW", "VNEW", "s_cos", "s_knt", "s_knh",
                                                   "s_vnt", "s_vnh"] if rope else [])
    maxnreg = ROPE_MAXNREG if rope and block_n <= 64 else None  # as paged_decode holds a rotary launch's tile
    return _compile(_decode_kernel, types, ce, warps, stages, aligned, maxnreg)


def kv_write(dt: str, kv: str, hk: int, d: int) -> dict:
    types = dict(K=f"*{dt}", V=f"*{dt}", KV=f"*{kv}", SLOTS="*i64", KS="*fp32", VS="*fp32", s_kt="i32", s_kh="i32",
                 s_vt="i32", s_vh="i32", s_kvb="i64", s_kvkv="i32", s_kvt="i32", s_kvh="i32")
    ce = dict(HK=hk, D=d, BLOCK_H=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d), BS=16,
              FP8=kv in FP8, HAS_KS=kv in FP8, HAS_VS=kv in FP8, FP8_MAX=448.0 if kv == "fp8e4nv" else 57344.0, PDL=1)
    return _compile(_write_kv_kernel, types, ce, 4, 1, ["K", "V", "KV", "SLOTS"])


def gather(dt: str, kv: str, hk: int, d: int) -> dict:
    """library_prefill's prefix gather (an fp8 pool's values dequantized into dt)."""
    types = dict(KV=f"*{kv}", TABLE="*i32", Out=f"*{dt}", KS="*fp32", VS="*fp32", s_b="i32", s_kv="i32", s_t="i32",
                 s_h="i32", s_okv="i32")  # a pool's strides, as Triton types them (they fit 32 bits)
    fp8 = kv in FP8
    ce = dict(HK=hk, D=d, BS=16, BLOCK_H=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(d),
              DEQUANT=fp8, HAS_KS=fp8, HAS_VS=fp8)
    return _compile(_gather_blocks_kernel, types, ce, 4, 1, ["KV", "Out"])


def default_cases() -> list[tuple[str, dict, callable]]:
    """(name, description, thunk) of the configurations prefill_config / paged_decode / write_kv choose on sm_90."""
    from pdserve.ops.attention.prefill import prefill_config

    class _Cuda:  # prefill_config only looks at device.type
        type = "cuda"

    cases = []
    for dt in ("bf16", "fp16", "fp32"):
        for kv in ((dt, "fp8e4nv", "fp8e5") if dt != "fp32" else ("fp32", "fp8e4nv")):
            for d, g in ((64, 1), (128, 4), (128, 8), (256, 2)):
                cfg = prefill_config(d, g, getattr(torch, TORCH_DT[dt]), _Cuda())
                for window in (False, True):
                    for new in (False, True):  # new: the new tokens' K/V from the step's k/v (the backend's way)
                        desc = dict(kernel="prefill", dtype=dt, kv=kv, d=d, g=g, window=window, new=new,
                                    config=cfg.__dict__)
                        cases.append((f"prefill {dt}/{kv} d={d} g={g} window={window} new={new} {cfg}", desc,
                                      lambda dt=dt, kv=kv, d=d, g=g, cfg=cfg, w=window, n=new: prefill(
                                          dt, kv, d, g, cfg, window=w, new=n)))
            for d, g in ((64, 1), (128, 4), (128, 8), (256, 2)):
                for single, mixed in ((False, False), (True, False), (False, True)):
                    desc = dict(kernel="decode", dtype=dt, kv=kv, d=d, g=g, single=single, mixed=mixed)
                    cases.append((f"decode {dt}/{kv} d={d} g={g} single={single} mixed={mixed}", desc,
                                  lambda dt=dt, kv=kv, d=d, g=g, s=single, m=mixed: decode(dt, kv, d, g, s, m)))
                if dt != "fp32":  # what paged_decode picks at one row, several splits
                    for mixed in (False, True):
                        desc = dict(kernel="decode", dtype=dt, kv=kv, d=d, g=g, single=False, mixed=mixed, few=True)
                        cases.append((f"decode {dt}/{kv} d={d} g={g} single=False mixed={mixed} few rows", desc,
                                      lambda dt=dt, kv=kv, d=d, g=g, m=mixed: decode(dt, kv, d, g, False, m, few=True)))
                if dt != "fp32" and (kv == dt or kv in FP8) and d <= 128:  # decode.ROPE_IN_DECODE (QK-norm, d <=
                    # 128; fp8 pools with ROPE_IN_DECODE_FP8): one row
                    for single, few in ((False, True), (True, False)):  # (several splits, held to ROPE_MAXNREG), 8+ rows
                        desc = dict(kernel="decode", dtype=dt, kv=kv, d=d, g=g, single=single, mixed=False, few=few,
                                    rope=True)
                        cases.append((f"decode {dt}/{kv} d={d} g={g} single={single} mixed=False"
                                      f"{' few rows' if few else ''} rope", desc,
                                      lambda dt=dt, kv=kv, d=d, g=g, s=single, f=few: decode(
                                          dt, kv, d, g, s, False, few=f, rope=True)))
                many_tile = MANY_PROGRAMS_TILE_FP8 if kv in FP8 else MANY_PROGRAMS_TILE
                if (kv == dt or kv in FP8) and dt != "fp32" and many_tile is not None:  # paged_decode's at 256 rows
                    for mixed in (False, True):
                        desc = dict(kernel="decode", dtype=dt, kv=kv, d=d, g=g, single=True, mixed=mixed, many=True)
                        cases.append((f"decode {dt}/{kv} d={d} g={g} single=True mixed={mixed} many programs", desc,
                                      lambda dt=dt, kv=kv, d=d, g=g, m=mixed: decode(dt, kv, d, g, True, m, many=True)))
            desc = dict(kernel="kv_write", dtype=dt, kv=kv)
            cases.append((f"kv_write {dt}/{kv}", desc, lambda dt=dt, kv=kv: kv_write(dt, kv, 8, 128)))
            for hk in ((4, 8) if dt != "fp32" else ()):  # library_prefill's prefix gather (16-bit models; fp8
                # pools where FP8_POOLS) at Qwen3-30B-A3B's and Qwen3-8B's KV heads
                desc = dict(kernel="gather", dtype=dt, kv=kv, hk=hk)
                cases.append((f"gather {dt}/{kv} hk={hk}", desc, lambda dt=dt, kv=kv, hk=hk: gather(dt, kv, hk, 128)))
    return cases


def sweep_cases() -> list[tuple[str, dict, callable]]:
    cases = []
    for bm, bn, warps, stages in SWEEP:
        for pack in sorted({1, default_g_pack(4, bm)}):
            cfg = PrefillConfig(bm, bn, pack, warps, stages)
            desc = dict(kernel="prefill", dtype="bf16", kv="bf16", d=128, g=4, new=True, sweep=True,
                        config=cfg.__dict__)
            cases.append((f"sweep bf16 d=128 {cfg}", desc,
                          lambda cfg=cfg: prefill("bf16", "bf16", 128, 4, cfg, new=True)))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also the benchmark's prefill sweep configs")
    ap.add_argument("--only", action="append", default=[], help="keep cases whose name has this substring (repeat)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fp8-v-widen", choices=["shipped", "on", "off"], default="shipped",
                    help="fp8 pools' V widened by inline PTX in the decode kernel (decode.FP8_V_WIDEN): as paged_decode "
                         "decides, or in every fp8 case, or in none (an off run fails where the rotary spills)")
    args = ap.parse_args(argv)
    global WIDEN_OVERRIDE
    WIDEN_OVERRIDE = {"shipped": None, "on": True, "off": False}[args.fp8_v_widen]
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles for the GPU", file=sys.stderr)
        return 2
    cases = default_cases() + (sweep_cases() if args.sweep else [])
    rows, bad = [], 0
    for name, desc, thunk in cases:
        if args.only and not any(o in name for o in args.only):
            continue
        try:
            res = {**desc, **thunk()}
        except Exception as e:  # a configuration that does not compile is a failure, reported with its reason
            res = {**desc, "error": f"{type(e).__name__}: {e}"[:500]}
        fails = "error" in res or res["spill_bytes"] or res["shared"] > SMEM_LIMIT
        if fails and not desc.get("sweep") and desc["dtype"] != "fp32":  # fp32: an exactness dtype, spills allowed
            bad += 1
        rows.append(res)
        status = res.get("error") or (f"regs {res['registers']:3} spill {res['spill_bytes']:4} B "
                                      f"smem {res['shared'] // 1024:3} KiB wgmma {res['wgmma']:3}")
        print(f"{'FAIL ' if fails else 'ok   '}{name}: {status}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{len(rows)} kernels compiled for sm_90, {bad} default configuration(s) failing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
