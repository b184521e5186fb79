"""pdserve.stats against numpy: the same numbers, bit for bit, and +inf samples for the SLO search."""

import math
import random

import numpy as np
import pytest

from pdserve.stats import mean, median, percentile, percentiles, std


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001])
def test_percentile_is_numpys_linear_percentile_exactly(n):
    rng = random.Random(n)
    vals = [rng.random() * 100 for _ in range(n)]
    ps = (0, 0.5, 1, 10, 25, 33.3, 50, 75, 90, 95, 99, 99.9, 100)
    assert [percentile(vals, p) for p in ps] == [float(np.percentile(vals, p)) for p in ps]
    assert percentiles(vals, ps) == [float(np.percentile(vals, p)) for p in ps]
    assert median(vals) == float(np.median(vals))
    assert mean(vals) == pytest.approx(float(np.mean(vals)), rel=1e-15)
    assert std(vals) == pytest.approx(float(np.std(vals)), rel=1e-12)


def test_ties_integers_and_edges():
    assert percentile([3, 1, 2], 50) == 2.0 and percentile([5, 5, 5, 5], 37) == 5.0
    assert percentile([1, 2], 50) == 1.5 and percentile([7], 99) == 7.0
    assert math.isnan(percentile([], 50)) and math.isnan(mean([])) and math.isnan(std([]))
    with pytest.raises(ValueError):
        percentile([1.0], 100.5)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


def test_infinite_samples():
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0
    assert percentile([1.0, 2.0, math.inf], 90) == math.inf
    assert percentile([math.inf, math.inf], 50) == math.inf
    assert mean([1.0, math.inf]) == math.inf and math.isnan(std([1.0, math.inf]))
