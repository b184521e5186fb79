"""Routing policies, by name: each ranks candidate instances best first.

A policy only orders; the router decides what to do with the order (first = target, the rest = fallbacks handed
to the decode instance). Ranking rather than picking keeps fallbacks policy-consistent: a KV-aware prefill
choice also yields the next-best prefill instance to try when the first one fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.router.config import POLICY_NAMES, RouterConfig
from pdserve.router.pool import Instance


@dataclass
class RouteRequest:
    """What policies may look at: the prompt's chained chunk hashes and its estimated token count."""

    est_tokens: int
    hashes: list[int] = field(default_factory=list)
    tokens_per_chunk: float = 16.0

    def overlap_tokens(self, inst: Instance) -> float:
        return inst.prefix.overlap(self.hashes) * self.tokens_per_chunk


class Policy:
    name = ""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    def rank(self, candidates: list[Instance], req: RouteRequest) -> list[Instance]:
        raise NotImplementedError


POLICIES: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    if name not in POLICY_NAMES:
        raise ValueError(f"policy {name!r} must be listed in pdserve.router.config.POLICY_NAMES")

    def deco(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return deco


def make_policy(name: str, config: RouterConfig) -> Policy:
    try:
        return POLICIES[name](config)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None


@register("round_robin")
class RoundRobin(Policy):
    """Rotate through the candidates; the rotation survives changes in which instances are available."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._next = 0

    def rank(self, candidates: list[Instance], req: RouteRequest) -> list[Instance]:
        if not candidates:
            return []
        start = self._next % len(candidates)
        self._next += 1
        return candidates[start:] + candidates[:start]


@register("least_loaded")
class LeastLoaded(Policy):
    """Fewest queued + running tokens first (as last polled, plus what the router sent since); ties by
    requests in flight, then rotating so equal instances share a burst."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._rr = 0

    def rank(self, candidates: list[Instance], req: RouteRequest) -> list[Instance]:
        n = len(candidates)
        if not n:
            return []
        self._rr += 1
        order = sorted(range(n), key=lambda i: (candidates[i].load_tokens, candidates[i].inflight, (i - self._rr) % n))
        return [candidates[i] for i in order]


@register("kv_aware")
class KvAware(Policy):
    """Score = alpha * (prompt tokens the instance likely has cached) - beta * (its queued + running tokens).

    The cached part is the router's own memory of prefixes it routed there (prefix.PrefixIndex), so it costs no
    round trip; a cache hit is worth routing to a busier instance only while the prefill it saves outweighs the
    extra queueing, which is what the two weights trade.
    """

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._tiebreak = LeastLoaded(config)

    def rank(self, candidates: list[Instance], req: RouteRequest) -> list[Instance]:
        if not candidates:
            return []
        a, b = self.config.kv_alpha, self.config.kv_beta
        base = self._tiebreak.rank(candidates, req)  # least-loaded order settles equal scores
        pos = {id(inst): k for k, inst in enumerate(base)}
        return sorted(base, key=lambda i: (-(a * req.overlap_tokens(i) - b * i.load_tokens), pos[id(i)]))
