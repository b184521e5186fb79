"""Where `pdserve bench` writes: one spelling of output locations in every command, and the file names.

--result-dir (default: the current directory) and --result-filename, the name of the main JSON file; companion
files share its stem: `run.json` has `run.csv`, `run.md`, `run_*.png`. `bench serve` writes vLLM's result file
under that name and pdserve's record beside it as `<stem>.pdserve.json`. Nothing here imports more than argparse,
so the transfer benchmark and its worker processes use it too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

PDSERVE_SUFFIX = ".pdserve"


def add_output_flags(p, default_hint: str, old_spelling: str | None = None) -> None:
    """The one spelling of output locations in every `pdserve bench` command (plus a hidden older one)."""
    p.add_argument("--result-dir", default=None, help="directory for the result files (default: the current one)")
    p.add_argument("--result-filename", default=None, help=f"name of the main result file (default: {default_hint})")
    if old_spelling:
        p.add_argument(old_spelling, dest="old_output", default=None, help=argparse.SUPPRESS)


def stem_of(path: Path) -> Path:
    """The path without a trailing .json, .md or .png (a name without one is its own stem)."""
    return path.with_suffix("") if path.suffix in (".json", ".md", ".png") else path


def result_path(result_dir: str | None, result_filename: str | None, default_name: str) -> Path:
    """The main result file: --result-filename (as given) in --result-dir, else `default_name` there."""
    return Path(result_dir or ".") / (result_filename or default_name)


def record_path(result_dir: str | None, result_filename: str | None, default_name: str) -> Path:
    """A pdserve record's main file: like `result_path`, with .json added to a name given without it."""
    path = result_path(result_dir, result_filename, default_name)
    return path if path.suffix == ".json" else path.with_name(path.name + ".json")


def output_stem(result_dir: str | None, result_filename: str | None, old_output: str | None, default: Path) -> Path:
    """The stem of a command's files: --result-dir/--result-filename, else the older spelling, else `default`."""
    if result_dir or result_filename:
        return stem_of(Path(result_dir or default.parent) / (result_filename or default.name))
    if old_output:
        return stem_of(Path(old_output))
    return stem_of(default)


def default_name(kind: str, model: str) -> str:
    return f"{kind}-{Path(model).name or 'model'}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def pdserve_record_path(vllm_path: Path) -> Path:
    """pdserve's record beside vLLM's result file: `x.json` -> `x.pdserve.json`."""
    return Path(str(stem_of(vllm_path)) + PDSERVE_SUFFIX + ".json")
