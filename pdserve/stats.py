"""Summary statistics for latency samples, with numpy's default definitions and no dependencies.

`percentile` interpolates linearly between order statistics, as `numpy.percentile(v, p)` (method "linear"):
position p/100 * (n - 1) in the sorted samples, interpolated from the nearer neighbour as numpy does, so
results agree bit for bit. `std` is the population standard deviation (`numpy.std`,
ddof=0). Samples may contain +inf (a request that never finished counts as infinitely late): a percentile that
interpolates towards an infinite sample is infinite. Empty input gives nan; callers that want vLLM's
"empty means 0" pass `values or [0.0]`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) with linear interpolation; nan for no samples."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    v = sorted(values)
    if not v:
        return math.nan
    pos = p / 100.0 * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    frac = pos - lo
    a, b = v[lo], v[hi]
    if frac == 0.0 or a == b:
        return float(a)
    if math.isinf(a) or math.isinf(b):
        return math.inf
    # numpy's lerp: from the nearer end, so results agree with numpy.percentile to the last bit
    d = b - a
    return b - d * (1.0 - frac) if frac >= 0.5 else a + d * frac


def percentiles(values: Iterable[float], ps: Sequence[float]) -> list[float]:
    """Several percentiles of the same samples (sorted once)."""
    v = sorted(values)
    return [percentile(v, p) for p in ps]


def median(values: Iterable[float]) -> float:
    return percentile(values, 50.0)


def mean(values: Iterable[float]) -> float:
    v = list(values)
    return math.fsum(v) / len(v) if v else math.nan


def std(values: Iterable[float]) -> float:
    """Population standard deviation (numpy.std's default, ddof=0)."""
    v = list(values)
    if not v:
        return math.nan
    m = mean(v)
    if math.isinf(m):
        return math.nan
    return math.sqrt(math.fsum((x - m) ** 2 for x in v) / len(v))
