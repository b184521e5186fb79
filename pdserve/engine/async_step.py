"""Async scheduling's rules: what a step in flight is, and when the engine core may schedule the next step before
collecting it.

The engine core keeps at most one launched step uncollected. Scheduling ahead of it is safe when the next step
needs nothing from the host copy of its sampled ids:

- input ids: rows decoding on a token still in flight carry a placeholder that the runner fills on the device;
- positions, slots, blocks: the placeholder is counted like any token (`Scheduler.launched`);
- stop rules (EOS, stop ids, max_tokens, max_model_len) apply one step late in `Scheduler.collected`, which drops
  the extra token of a request that had finished; stop strings are the frontend's (it aborts, and an aborted
  request's token in flight is dropped the same way);
- preemption: a preempted request keeps its placeholder, filled when its step is collected, and is recomputed
  with its real tokens later (it cannot be scheduled again in the step that preempted it); freed blocks may be
  reused at once, since every step runs after the one before it on the device;
- min_tokens, logit_bias, allowed_token_ids, temperature/top-k/top-p/min-p, seeds and logprobs need only the
  request's parameters and its token count, and the sampler applies them without syncing.

It is not safe when the next step's sampling needs the tokens themselves: presence, frequency and repetition
penalties count the output history on the host (`needs_history`), so a step whose sampled rows include such a
request is collected before the next one is scheduled. A prefill-role instance (`async_supported`) hands each
first token to a KV push as soon as it is sampled, so there every step is collected at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.request import Request
from pdserve.engine.runner import StepHandle


@dataclass
class InFlight:
    """A launched, uncollected step."""

    handle: StepHandle
    needs_history: bool  # a sampled row's request samples from its output history: collect before scheduling


def async_supported(role: str | None) -> bool:
    """Whether an instance of this PD role (None: colocated, no connector) may keep a step in flight."""
    return role != "prefill"


def needs_history(sampled: list[Request]) -> bool:
    """Whether the next step of any of these requests samples from its output tokens (penalties)."""
    return any(r.params.has_penalties for r in sampled)


def can_schedule_ahead(step: InFlight) -> bool:
    """Whether the next step may be scheduled and launched before `step` is collected."""
    return not step.needs_history
