"""The engine's view of prefill/decode disaggregation: a connector it asks questions and hands work to, and a
factory keyed by role so the engine never imports PD code by name.

The engine core owns the requests (through its scheduler) and makes every state change; a connector only moves
bytes and reports what happened: a decode-side connector describes where a reserved request's KV should land
(`reserved`) and reports validated arrivals (`take_arrivals`); a prefill-side connector pushes an exported request's
KV (`start_export`, optionally layer by layer through `layer_hook`) and reports finished pushes
(`take_finished_exports`). Both run their I/O on a KV agent thread and wake the engine loop through `wake`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.config import KVTransferConfig
from pdserve.engine.executor import Executor
from pdserve.engine.messages import KVLayout, KVReserved
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ExportStart, ScheduledBatch


@dataclass(frozen=True)
class KVPool:
    """What a connector needs to know of one rank's paged KV pool (rank 0's for the engine's connector)."""

    tensor: torch.Tensor  # [num_blocks(+1 scratch), kv_heads of this rank, num_layers, 2, block_size, head_dim]
    block_size: int
    block_bytes: int  # of this rank's pool
    num_blocks: int  # usable blocks (the scratch block is never handed out)
    vocab_size: int  # to validate a peer's first token
    device: torch.device
    total_kv_heads: int  # the model's
    head_range: tuple[int, int]  # the model's KV heads [start, stop) this rank's pool holds

    @property
    def num_layers(self) -> int:
        return int(self.tensor.shape[2])

    @property
    def num_kv_heads(self) -> int:
        """This rank's."""
        return int(self.tensor.shape[1])

    @property
    def run_bytes(self) -> int:
        """Bytes of one (head, layer) run of a block (its K and V): the unit every push is made of."""
        return self.block_bytes // (self.num_layers * self.num_kv_heads)

    @property
    def layout(self) -> KVLayout:
        """The global layout (every KV head of the model): what two instances of any TP sizes must agree on."""
        _, _, layers, _, block_size, head_dim = self.tensor.shape
        return KVLayout(str(self.tensor.dtype).removeprefix("torch."), int(block_size), int(layers),
                        self.total_kv_heads, int(head_dim))


@dataclass(frozen=True)
class KVArrival:
    """Decode side: a validated notification from a prefill peer: the request's KV landed (or the push failed)."""

    request_id: str
    first_token: int | None
    logprob: tuple | None  # (chosen logprob, [(id, logprob), ...]) when the request asked for logprobs
    t_prefill_done: float | None
    error: str | None = None
    peer_done: bool = True  # with an error: no peer can still write into the request's blocks
    t_push: float | None = None  # prefill rank 0's push began (its clock), when it said
    t_notified: float | None = None  # the last pair's notification was taken here


@dataclass(frozen=True)
class ExportResult:
    """Prefill side: a push ended. `error` is None when the KV and the notification reached the decode side."""

    request_id: str
    error: str | None
    push_s: float | None = None
    nbytes: int = 0
    transport: str | None = None  # what carried it ("none": only the notifications travelled)
    layerwise: bool = False  # pushed layer by layer during the prefill


class KVConnector:
    """Base of both sides. A side implements what applies to it; the rest answers "nothing" (a decode-side
    connector exports nothing, a prefill-side one receives nothing)."""

    role: str = ""

    def describe(self) -> dict:
        """The connector's identity for the engine's start-up info (agent address, pool layout)."""
        return {"role": self.role}

    def has_events(self) -> bool:
        """Something arrived that the engine should take on its next step."""
        return False

    # decode side
    def reserved(self, req: Request) -> KVReserved:
        raise TypeError(f"a {self.role or 'colocated'} instance takes no remote prefills")

    def take_arrivals(self) -> list[KVArrival]:
        return []

    def forget(self, request_id: str) -> None:
        """The request no longer waits for KV (admitted, failed or aborted): withdraw any permission to write."""

    # prefill side
    def on_added(self, req: Request) -> None:
        """An export request arrived: e.g. connect to its decode peer while the prompt computes."""

    def layer_hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """A per-layer callback for this step (layer-by-layer push), or None."""
        return None

    def push_ahead(self, batch: ScheduledBatch) -> list[tuple[Request, int]]:
        """After a step was launched: push the full blocks that the step's chunks before a prompt's last completed
        (the writes wait for the step on the device). Returns each such request with its destination blocks pushed
        so far."""
        return []

    def abandon_export(self, request_id: str) -> None:
        """An export ended before its push (aborted or preempted) while writes pushed ahead may still read its
        blocks: report its end (take_finished_exports, with an error) once every rank's writes ended."""

    def start_export(self, ex: ExportStart) -> None:
        raise TypeError(f"a {self.role or 'colocated'} instance exports no KV")

    def take_finished_exports(self) -> list[ExportResult]:
        return []

    def cancel_export(self, request_id: str) -> None:
        """The push's lease ran out: stop it (its end is then reported by take_finished_exports)."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Stop the agent (called once, at engine shutdown)."""


# role -> "module:Class", imported only when an instance of that role starts
CONNECTORS: dict[str, str] = {
    "prefill": "pdserve.disagg.export_side:PrefillExporter",
    "decode": "pdserve.disagg.import_side:DecodeImporter",
}


def make_connector(config: KVTransferConfig, pool: KVPool, wake: Callable[[], None], ranks: Executor,
                   agent: object | None = None) -> KVConnector | None:
    """The connector for the instance's role (None for a colocated instance). It starts a KV agent on every
    tensor-parallel rank through `ranks` (the executor: collective_rpc, reports). `agent`: a KV agent for rank 0 to
    use instead of starting one (tests pass an in-process fake; tensor-parallel size 1 only)."""
    if not config.disaggregated:
        return None
    module, _, cls = CONNECTORS[config.role].partition(":")
    return getattr(importlib.import_module(module), cls)(config, pool, wake, ranks, agent)
