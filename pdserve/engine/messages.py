"""Every message that crosses the engine process's pipe, and the PD events the engine emits: typed dataclasses,
dispatched by type on each side (no tuples, no string RPC, no `extra` dicts).

Server process -> engine process: `AddRequest`, `AbortRequest`, `RemotePrefillFailed`, `RemotePrefillDone`,
`Shutdown`. Engine process -> server process: `EngineReady` / `EngineFailed` once at start-up, then `StepOutputs`
(token outputs, PD events, stats) after every step that has something to say, and `Bye` on shutdown.

PD parameters ride on `AddRequest.kv`: `ExportParams` (prefill side: push the prompt's KV to these blocks) or
`ImportParams` (decode side: the prompt's KV comes from a prefill peer). PD events: `KVReserved` (decode side: blocks
are ready for the peer's push), `KVAdmitted` (the KV landed; the request decodes), `KVFallback` (the handover
failed; the prompt is recomputed here), `ExportFinished` (prefill side: the push ended, with the first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import KV_OPT_IN_TRANSPORTS
from pdserve.sampling_params import SamplingParams

# ---- PD parameters of a request

POOL_REGION = "kv"  # the name under which an instance's KV agent registers its whole KV pool


@dataclass(frozen=True)
class KVLayout:
    """What two instances must agree on before KV blocks move between them: the global layout (every KV head of
    the model), whatever each instance's tensor-parallel size; each rank's pool holds a range of these heads."""

    dtype: str  # of the pool, e.g. "bfloat16", "float8_e4m3fn"
    block_size: int
    num_layers: int
    num_kv_heads: int  # the model's, not one rank's
    head_dim: int

    def mismatch(self, other: KVLayout) -> str | None:
        """Why blocks laid out as `other` cannot be copied into ours (None: they can)."""
        diff = [f"{f}: {getattr(other, f)} vs {getattr(self, f)} here" for f in
                ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim") if getattr(self, f) != getattr(other, f)]
        return "KV layout mismatch between the instances (" + "; ".join(diff) + ")" if diff else None


@dataclass(frozen=True)
class KVTransportSpec:
    """How an instance's KV agents move blocks (its --kv-transport and, for mooncake, --kv-protocol; every rank's agent
    runs the same): two instances hand KV over only when their specs agree, checked before the prompt is computed."""

    transport: str  # KV_TRANSPORTS
    protocol: str | None = None  # KV_PROTOCOLS; only mooncake's counts

    def mismatch(self, other: KVTransportSpec) -> str | None:
        """Why an agent configured as `other` cannot push into ours (None: it can). The same transport on both sides
        always agrees (mooncake: with the same protocol); `auto` agrees with the transports auto picks from (tcp,
        cuda_ipc, nixl: each rank's agent then chooses per peer); an opt-in transport (mooncake, nccl) must be named
        by both sides, since the other side does not run it."""
        a, b = other.transport, self.transport
        if a == b:
            if a == "mooncake" and other.protocol != self.protocol:
                return (f"KV transport mismatch between the instances: mooncake over {other.protocol} vs over "
                        f"{self.protocol} here (--kv-protocol)")
            return None
        if "auto" in (a, b) and a not in KV_OPT_IN_TRANSPORTS and b not in KV_OPT_IN_TRANSPORTS:
            return None
        return (f"KV transport mismatch between the instances: {a} vs {b} here (--kv-transport must name the same "
                "transport on prefill and decode instances; mooncake and nccl only when both name them)")


@dataclass(frozen=True)
class KVRankDest:
    """One tensor-parallel rank of a decode instance: its KV agent, the region of its pool, and the KV heads
    [head_start, head_stop) of the model that pool holds (every rank holds the same block ids)."""

    agent: str  # "host:port"
    head_start: int
    head_stop: int
    region: str = POOL_REGION

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill instance pushes a prompt's KV: the blocks a decode instance reserved, on every one of its
    ranks (`ranks`, in rank order: rank 0 takes the notification with the first token)."""

    request_id: str  # the decode instance's id for the request (its notifications name it)
    block_ids: tuple[int, ...]  # destination blocks, one per block of the prompt from `start_block` on
    ranks: tuple[KVRankDest, ...]
    start_block: int = 0  # leading prompt blocks the decode instance already holds (its prefix-cache hits)
    layout: KVLayout | None = None  # the decode pool's (global); the prefill side refuses to push into another
    transport: KVTransportSpec | None = None  # the decode agents'; the prefill side refuses a mismatched one


@dataclass(frozen=True)
class ExportParams:
    """Prefill side: compute the prompt, then push its KV (and the first token) to `dest`."""

    dest: KVDestination


@dataclass(frozen=True)
class ImportParams:
    """Decode side: reserve blocks for the prompt; a prefill peer computes it and pushes the KV into them."""

    prefill_urls: tuple[str, ...]  # candidates, in the router's order of preference
    router_request_id: str | None = None  # the router's id (POST /v1/abort names requests by it)


KVParams = ExportParams | ImportParams

MAX_PREFILL_CANDIDATES = 8


def import_params(pd: object) -> ImportParams | None:
    """The `pd` field of an OpenAI request body (set by the router) as ImportParams; None when it names no prefill
    candidate (the instance prefills locally). Raises ValueError on a malformed field."""
    if pd is None:
        return None
    if not isinstance(pd, dict):
        raise ValueError("'pd' must be an object")
    urls = pd.get("prefill_urls") or []
    if not isinstance(urls, list) or len(urls) > MAX_PREFILL_CANDIDATES or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) and len(u) < 2048 for u in urls):
        raise ValueError(f"pd.prefill_urls must be a list of at most {MAX_PREFILL_CANDIDATES} http(s) URLs")
    rid = pd.get("request_id")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= 256):
        raise ValueError("pd.request_id must be a string of 1 to 256 characters")
    return ImportParams(tuple(urls), rid) if urls else None


# ---- server -> engine


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv: KVParams | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class RemotePrefillFailed:
    """Decode side: no prefill candidate delivered the KV. `peer_done`: no peer can still write into the reserved
    blocks (they answered, or are down), so they may be reused at once; otherwise they wait out the lease."""

    request_id: str
    reason: str
    peer_done: bool


@dataclass(frozen=True)
class RemotePrefillDone:
    """Decode side: the prefill peer answered for a request that was aborted meanwhile: it writes no more."""

    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


EngineRequest = AddRequest | AbortRequest | RemotePrefillFailed | RemotePrefillDone | Shutdown


# ---- engine -> server


@dataclass
class CoreOutput:
    """New tokens of one request after a step (a delta), and its end when `finished`."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop token, or the error message when finish_reason is "error"
    logprobs: list | None = None  # per new token: (chosen logprob, [(id, logprob), ...])
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None


@dataclass(frozen=True)
class KVReserved:
    """Decode side: blocks are reserved for a request's prompt; the server orders a prefill peer to fill them."""

    request_id: str
    dest: KVDestination
    num_cached_tokens: int  # prompt tokens the decode side already holds (prefix-cache hits): not sent
    t_reserved: float
    queue_s: float  # arrival -> reservation


@dataclass(frozen=True)
class KVAdmitted:
    """Decode side: the prompt's KV landed and the request joined the batch with its first token."""

    request_id: str
    t_prefill_done: float  # the prefill peer's clock
    t_admitted: float
    handover_s: float  # t_admitted - t_prefill_done
    t_push: float | None = None  # the prefill peer began its push (its clock)
    t_notified: float | None = None  # the decode side took the last notification


@dataclass(frozen=True)
class KVFallback:
    """Decode side: the handover failed; the prompt is recomputed locally (the request goes on)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class ExportFinished:
    """Prefill side: the push of an exported request ended (its blocks are free again). `error` is None when the
    KV landed on the decode instance, which then has the first token too."""

    request_id: str
    first_token: int | None
    error: str | None
    t_prefill_done: float | None = None
    push_s: float | None = None
    nbytes: int = 0
    transport: str | None = None  # what carried the KV ("none": only the notifications travelled)
    first_scheduled_time: float | None = None
    layerwise: bool = False  # pushed layer by layer during the prefill


PDEvent = KVReserved | KVAdmitted | KVFallback | ExportFinished


@dataclass
class StepOutputs:
    outputs: list[CoreOutput] = field(default_factory=list)
    events: list[PDEvent] = field(default_factory=list)
    stats: dict | None = None  # sent when they changed

    def __bool__(self) -> bool:
        return bool(self.outputs or self.events)


@dataclass(frozen=True)
class TokenizerIds:
    """Server -> engine, first message: the tokenizer's end-of-sequence ids. The server loads its tokenizer while
    the engine process builds the model (each takes seconds on CPU), so the ids follow the start."""
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class EngineReady:
    info: dict


@dataclass(frozen=True)
class EngineFailed:
    message: str
    traceback: str


@dataclass(frozen=True)
class Bye:
    pass
