"""The files of a pdserve record: JSON, CSV, markdown and plots, named by the main file's stem (paths.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pdserve.bench.paths import stem_of
from pdserve.bench.record import save_json
from pdserve.bench.report import search_summary_csv, to_csv, to_markdown


def write_outputs(record: dict, json_path: Path, plots: bool) -> list[Path]:
    """The JSON record, a CSV, a markdown table and (with completed runs) the PNG plots, all named by the stem.

    For a search the CSV is the table across input lengths (one row per length) and `<stem>_trials.csv` has
    every trial; otherwise the CSV has one row per run.
    """
    stem = stem_of(json_path)
    paths = [save_json(record, json_path)]
    if record.get("searches"):
        paths.append(_write(Path(f"{stem}.csv"), search_summary_csv(record)))
        paths.append(_write(Path(f"{stem}_trials.csv"), to_csv(record)))
    else:
        paths.append(_write(Path(f"{stem}.csv"), to_csv(record)))
    paths.append(_write(Path(f"{stem}.md"), to_markdown(record)))
    if plots and any(r["metrics"].get("completed") for r in record["runs"]):
        if importlib.util.find_spec("matplotlib") is None:  # e.g. a GPU image without it: plot elsewhere later
            print(f"note: matplotlib is not installed, no plots; run `python -m pdserve.bench plot {json_path}` "
                  "where it is", file=sys.stderr)
            return paths
        from pdserve.bench.plots import write_plots

        paths += write_plots([(record["runs"][0]["config"].get("model") or "run", record)], str(stem))
    return paths


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
