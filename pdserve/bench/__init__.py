"""Serving benchmarks for OpenAI-compatible endpoints: `pdserve bench serve | search | sweep`.

Load generation with vLLM `bench serve`'s flags and metric definitions (so results compare), datasets with
exact token lengths, an SLO search for the highest request rate that meets percentile limits, sweeps over input
lengths, and reports (console, JSON, CSV, markdown, PNG). Nothing here imports torch: the client starts fast
and runs anywhere.
"""
