"""Benchmarks: `pdserve bench serve | search | sweep | compare | plot | transfer`.

Serving benchmarks for any OpenAI-compatible endpoint: `serve` is a drop-in for vLLM 0.22's `bench serve` (its
flags, metric definitions, console block and result file), datasets with exact token lengths, an SLO search for
the highest request rate that meets percentile limits (over several input lengths in one step), sweeps, and
reports (console, JSON, CSV, markdown, PNG). The serving client never imports torch: it starts fast and runs
anywhere. `transfer` (transfer.py, transfer_worker.py) measures the KV transfer engine between two processes.
"""
