"""What every handler of an instance needs, stored once on the aiohttp app (pdserve.server.app builds it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.config import ServerConfig
from pdserve.server.admission import Admission
from pdserve.server.metrics import ServerMetrics
from pdserve.server.tokenizing import TokenizerService


@dataclass
class ServerState:
    """What every handler needs, stored once on the app."""

    llm: Any  # pdserve.engine.async_llm.AsyncLLM, or anything with the same interface
    config: ServerConfig
    metrics: ServerMetrics
    model_name: str
    created: int
    tokens: TokenizerService
    admission: Admission
    secret: bytes | None  # the deployment secret: `pd` orders must be signed with it

    def max_prompt_chars(self) -> int | None:
        """Longer prompt text cannot fit the context whatever it says: refused without tokenizing it."""
        if self.config.max_prompt_chars is not None:
            return self.config.max_prompt_chars
        per_token = self.tokens.max_token_chars
        return self.llm.max_model_len * per_token if per_token else None


STATE = web.AppKey("pdserve_state", ServerState)


def state(request: web.Request) -> ServerState:
    return request.app[STATE]
