"""SLOs as percentile limits ("p90_ttft_ms<=5000,p90_tpot_ms<=50") and how a trial is judged against them.

For the search a request that failed or did not finish counts as infinitely late on every metric: a server
that sheds load or falls behind must not pass by dropping its slow requests. While a trial runs,
`certain_violation` uses lower bounds of requests still in flight (time waited without a first token; time
since the first token divided by the most tokens still to come) to fail a trial as soon as the outcome is
certain, which saves most of the time of overloaded trials.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pdserve.bench.client import RequestResult
from pdserve.bench.metrics import pct_name, request_tpot
from pdserve.stats import percentile

_TERM = re.compile(r"^\s*(p\d+(?:\.\d+)?|mean|median)_(ttft|tpot|itl|e2el)_ms\s*(<=|<)\s*([0-9.eE+-]+)\s*$")


@dataclass(frozen=True)
class SLOTerm:
    stat: str  # "p90", "mean", "median"
    metric: str  # ttft | tpot | itl | e2el
    limit_ms: float
    strict: bool = False  # "<" instead of "<="

    @property
    def name(self) -> str:
        return f"{self.stat}_{self.metric}_ms"

    @property
    def pct(self) -> float | None:
        if self.stat == "median":
            return 50.0
        return float(self.stat[1:]) if self.stat.startswith("p") else None

    def holds(self, value_ms: float) -> bool:
        if math.isnan(value_ms):
            return False
        return value_ms < self.limit_ms if self.strict else value_ms <= self.limit_ms

    def __str__(self) -> str:
        return f"{self.name}{'<' if self.strict else '<='}{self.limit_ms:g}"


def parse_slo(text: str) -> list[SLOTerm]:
    terms = []
    for part in text.split(","):
        if not part.strip():
            continue
        m = _TERM.match(part)
        if not m:
            raise ValueError(
                f"bad SLO term {part.strip()!r}: expected e.g. p90_ttft_ms<=5000 "
                "(stat p<N>|mean|median, metric ttft|tpot|itl|e2el)"
            )
        stat, metric, op, limit = m.groups()
        term = SLOTerm(stat=stat, metric=metric, limit_ms=float(limit), strict=op == "<")
        if term.pct is not None and not 0 < term.pct <= 100:
            raise ValueError(f"bad SLO term {part.strip()!r}: the percentile must be in (0, 100]")
        if term.limit_ms <= 0:
            raise ValueError(f"bad SLO term {part.strip()!r}: the limit must be positive")
        terms.append(term)
    if not terms:
        raise ValueError("--slo is empty: give at least one term, e.g. p90_ttft_ms<=5000")
    return terms


def goodput_limits(terms: list[SLOTerm]) -> dict[str, float]:
    """Per-request limits for goodput, from the SLO (ITL is a per-chunk metric and has no per-request limit)."""
    out: dict[str, float] = {}
    for t in terms:
        if t.metric != "itl":
            out[t.metric] = min(out.get(t.metric, math.inf), t.limit_ms)
    return out


def _values_ms(results: list[RequestResult], metric: str) -> list[float]:
    out = []
    for r in results:
        if not r.success:
            out.append(math.inf)
        elif metric == "ttft":
            out.append(r.ttft * 1e3)
        elif metric == "e2el":
            out.append(r.latency * 1e3)
        elif metric == "tpot":
            t = request_tpot(r)
            if t is not None:
                out.append(t * 1e3)
        else:
            out.extend(x * 1e3 for x in r.itl)
    return out


def slo_values(results: list[RequestResult], terms: list[SLOTerm]) -> dict[str, float]:
    vals = {}
    for t in terms:
        v = _values_ms(results, t.metric)
        vals[str(t)] = (sum(v) / len(v) if v else math.nan) if t.pct is None else percentile(v, t.pct)
    return vals


def judge(results: list[RequestResult], terms: list[SLOTerm]) -> tuple[bool, dict[str, float], str]:
    """(passed, value of each term, reason) with unfinished and failed requests counted as infinitely late."""
    if not results:
        return False, {}, "no requests were sent"
    vals = slo_values(results, terms)
    broken = [f"{name} (got {vals[name]:.1f})" for name in vals if not _term(terms, name).holds(vals[name])]
    return (not broken), vals, ("violates " + ", ".join(broken)) if broken else "all SLO terms hold"


def _term(terms: list[SLOTerm], name: str) -> SLOTerm:
    return next(t for t in terms if str(t) == name)


def _exceeds_lower_bound(r: RequestResult, term: SLOTerm, now: float) -> bool:
    """True when request r is already certain to exceed the term's limit."""
    limit = term.limit_ms / 1e3
    if r.done:
        if not r.success:
            return True
        value = {"ttft": r.ttft, "e2el": r.latency, "tpot": request_tpot(r) or 0.0}.get(term.metric)
        return value is not None and not term.holds(value * 1e3)
    if not r.start:
        return False
    if term.metric == "e2el" or (term.metric == "ttft" and not r.first_token_time):
        return now - r.start > limit
    if term.metric == "tpot" and r.first_token_time and r.output_len > 1:
        return (now - r.first_token_time) / (r.output_len - 1) > limit
    return False


def certain_violation(results: list[RequestResult], terms: list[SLOTerm], n_total: int, now: float) -> str | None:
    """A reason when some percentile term must fail whatever the requests still to come do; else None.

    With n_total samples the p-th percentile interpolates between sorted positions floor(q) and ceil(q),
    q = p/100*(n_total-1); once the samples known to exceed the limit fill every position from floor(q) up,
    the percentile exceeds it too.
    """
    for t in terms:
        if t.pct is None or t.metric == "itl" or n_total < 1:
            continue
        k = sum(_exceeds_lower_bound(r, t, now) for r in results)
        need = n_total - math.floor(t.pct / 100.0 * (n_total - 1))
        if k >= need:
            return f"early_stop: {k} of {n_total} requests already exceed {t.metric} {t.limit_ms:g} ms ({t} fails)"
    return None


def slo_text(terms: list[SLOTerm]) -> str:
    return ",".join(str(t) for t in terms)


__all__ = ["SLOTerm", "parse_slo", "judge", "certain_violation", "goodput_limits", "slo_text", "pct_name"]
