"""The result file: JSON is the record of a benchmark, with what is needed to reproduce and trust it.

Every file carries the machine (CPU, memory, GPUs when torch sees any), the command line, the git commit
and the date, then the runs with their metrics and every per-request sample. NaN is written as null and
infinities as the strings "inf"/"-inf", so the file is strict JSON.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from pdserve.envs import git_commit_override

SCHEMA = "pdserve.bench/1"


def _git_commit() -> str | None:
    if git_commit_override():  # set when the tree was copied without .git (GPU machines)
        return git_commit_override()
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine_info() -> dict:
    info: dict = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    gpus = _nvidia_gpus()  # never import torch just for this: the client must start fast
    if gpus:
        info["gpus"] = gpus
    return info


def _nvidia_gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def new_record(kind: str, args: dict | None = None) -> dict:
    return {
        "schema": SCHEMA,
        "kind": kind,  # serve | search | sweep
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),  # interpreter, -m module and all flags
        "git_commit": _git_commit(),
        "machine": machine_info(),
        "args": args or {},
        "runs": [],
    }


def _clean(x):
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def save_json(record: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(record), indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def as_float(x) -> float:
    """Read a number back from a record (None -> nan, "inf" -> inf)."""
    if x is None:
        return math.nan
    return float(x)


def load_json(path: str | Path) -> dict:
    rec = json.loads(Path(path).read_text())
    if not isinstance(rec, dict) or "runs" not in rec:
        raise ValueError(f"{path} is not a pdserve bench result file (no 'runs')")
    return rec
