"""One benchmark run end to end: dataset, an initial test request, the load, metrics, and the run record.

`Bench` holds what is shared across the runs of a search or sweep (the HTTP session, tokenizer, and the
client capacity measured once per output length and concurrency), so a trial costs only its own load.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from dataclasses import asdict, dataclass, replace

import aiohttp

from pdserve.bench.capacity import capacity_warning, measure_capacity
from pdserve.bench.client import EndpointConfig, RequestResult, send_request
from pdserve.bench.datasets import BenchRequest, file_dataset, random_dataset, sharegpt_dataset
from pdserve.bench.loadgen import LoadConfig, StopSignal, Watcher, run_load
from pdserve.bench.metrics import MetricOptions, compute_metrics, request_samples
from pdserve.bench.multiround import multi_round_dataset
from pdserve.bench.tokenizer import BenchTokenizer

DATASETS = ("random", "sharegpt", "multi-round", "file")


class BenchError(RuntimeError):
    """A configuration or endpoint problem that stops the benchmark with a clear message."""


@dataclass
class WorkloadConfig:
    dataset_name: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    file_output_len: int = 256
    multi_round_users: int = 8
    multi_round_rounds: int = 4
    multi_round_system_len: int = 1000
    multi_round_history_len: int = 1000
    multi_round_question_len: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {self.dataset_name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if self.dataset_name in ("sharegpt", "file") and not self.dataset_path:
            raise ValueError(f"--dataset-name {self.dataset_name} needs --dataset-path")

    @property
    def mean_output_len(self) -> int:
        if self.dataset_name in ("random", "multi-round"):
            return self.random_output_len
        if self.dataset_name == "sharegpt":
            return self.sharegpt_output_len or 256
        return self.file_output_len


def build_dataset(w: WorkloadConfig, tok: BenchTokenizer | None, chat: bool, wait_timeout_s: float) -> list:
    if w.dataset_name in ("random", "multi-round") and tok is None:
        raise BenchError(f"the {w.dataset_name} dataset needs a tokenizer: pass --tokenizer")
    if w.dataset_name == "random":
        return random_dataset(tok, w.num_prompts, w.random_input_len, w.random_output_len, w.random_range_ratio,
                              w.random_prefix_len, w.seed)
    if w.dataset_name == "multi-round":
        reqs = multi_round_dataset(tok, w.multi_round_users, w.multi_round_rounds, w.multi_round_system_len,
                                   w.multi_round_history_len, w.multi_round_question_len, w.random_output_len,
                                   chat=chat, seed=w.seed, wait_timeout_s=wait_timeout_s)
        return reqs[: w.num_prompts]
    if w.dataset_name == "sharegpt":
        return sharegpt_dataset(w.dataset_path, tok, w.num_prompts, w.sharegpt_output_len, w.seed)
    return file_dataset(w.dataset_path, tok, w.num_prompts, w.file_output_len, w.seed)


class Bench:
    """Runs against one endpoint; use as `async with Bench(...) as b: record = await b.run(...)`."""

    def __init__(
        self,
        endpoint: EndpointConfig,
        tok: BenchTokenizer | None,
        metric_opts: MetricOptions | None = None,
        capacity_duration_s: float = 2.0,
        initial_test: bool = True,
        ready_check_timeout_s: float = 0.0,
        num_warmups: int = 0,
        ready_check_interval_s: float = 5.0,
    ):
        self.endpoint = endpoint
        self.tok = tok
        self.metric_opts = metric_opts or MetricOptions()
        self.capacity_duration_s = capacity_duration_s
        self.initial_test = initial_test
        self.ready_check_timeout_s = ready_check_timeout_s
        self.ready_check_interval_s = ready_check_interval_s
        self.num_warmups = num_warmups
        self._tested = False
        self._warmed = False
        self._capacity: dict[tuple[int, int], dict] = {}
        self.session: aiohttp.ClientSession | None = None
        self.model_root: str | None = None  # /v1/models' "root" of the served model, when the bench asked

    async def __aenter__(self) -> Bench:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                             trust_env=self.endpoint.trust_env)
        if not self.endpoint.model:
            self.endpoint.model, self.model_root = await self.served_model()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def served_model(self) -> tuple[str, str | None]:
        """The first model /v1/models lists, and its "root" (what vLLM's bench does without --model)."""
        url = self.endpoint.base_url + "/v1/models"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                data = await resp.json(content_type=None)
            first = data["data"][0]
            return str(first["id"]), (str(first["root"]) if first.get("root") else None)
        except Exception as e:
            raise BenchError(f"could not read the served model from {url} ({type(e).__name__}: {e}); "
                             "pass --model") from None

    async def send(self, req: BenchRequest, res: RequestResult) -> RequestResult:
        return await send_request(self.session, self.endpoint, req, res, self.tok)

    async def check_endpoint(self, item: BenchRequest) -> None:
        """One short request before the run, so a wrong URL, model or endpoint fails fast with the reason.

        With a ready-check timeout (vLLM's --ready-check-timeout-sec) it is retried every 5 s (as vLLM) until it
        succeeds or the time is up, for servers still starting.
        """
        if self._tested or not self.initial_test:
            return
        req = await item.materialize()
        probe = replace(req, output_len=min(req.output_len, 4))
        deadline = time.perf_counter() + self.ready_check_timeout_s
        while True:
            res = await self.send(probe, RequestResult(index=-1))
            left = deadline - time.perf_counter()
            if res.success or left <= 0:
                break
            await asyncio.sleep(min(self.ready_check_interval_s, left))
        if not res.success:
            raise BenchError(f"initial test request to {self.endpoint.url} failed: {res.error}")
        self._tested = True

    async def warm_up(self, item: BenchRequest, max_concurrency: int | None) -> None:
        """vLLM's --num-warmups: that many copies of the first request, under the run's concurrency limit."""
        if self._warmed or self.num_warmups <= 0:
            return
        req = await item.materialize()
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one() -> None:
            if sem is None:
                await self.send(req, RequestResult(index=-1))
            else:
                async with sem:
                    await self.send(req, RequestResult(index=-1))

        await asyncio.gather(*(one() for _ in range(self.num_warmups)))
        self._warmed = True

    async def capacity(self, output_len: int, concurrency: int) -> dict | None:
        if self.capacity_duration_s <= 0:
            return None
        key = (output_len, concurrency)
        if key not in self._capacity:
            self._capacity[key] = await measure_capacity(self.endpoint, output_len, concurrency,
                                                         self.capacity_duration_s)
        return self._capacity[key]

    async def run(
        self, workload: WorkloadConfig, load: LoadConfig, stop: StopSignal | None = None,
        watcher: Watcher | None = None, label: str = "",
    ) -> dict:
        items = build_dataset(workload, self.tok, self.endpoint.chat, self.endpoint.request_timeout_s)
        if not items:
            raise BenchError("the dataset produced no requests")
        await self.check_endpoint(items[0])  # materializing round 0 of a conversation changes nothing
        # one measurement per output length serves every trial: the client's cost per request and per chunk
        # barely depends on concurrency once there are a few hundred streams, the most an open loop here sees
        cap = await self.capacity(workload.mean_output_len, load.max_concurrency or 256)
        await self.warm_up(items[0], load.max_concurrency)
        gc.collect()  # as vLLM's freeze_gc_heap: what exists now is never scanned again, so no long pauses mid-run
        gc.freeze()
        try:
            lr = await run_load(items, self.send, load, stop=stop, watcher=watcher)
        finally:
            gc.unfreeze()
        metrics = compute_metrics(lr.results, lr.duration, self.metric_opts)
        warnings = [w for w in [capacity_warning(metrics, cap)] if w]
        return {
            "label": label,
            "config": {
                **{k: v for k, v in asdict(workload).items()},
                "request_rate": load.request_rate,
                "burstiness": load.burstiness,
                "max_concurrency": load.max_concurrency,
                "max_duration": load.max_duration_s,
                "base_url": self.endpoint.base_url,
                "endpoint": self.endpoint.endpoint,
                "model": self.endpoint.model,
                "tokenizer": self.tok.source if self.tok else None,
                "ignore_eos": self.endpoint.ignore_eos,
                "sampling": self.endpoint.sampling,
                "goodput": self.metric_opts.goodput_ms,
            },
            "num_planned": lr.num_planned,
            "num_sent": len(lr.results),
            "stop_reason": lr.stop_reason,
            "interrupted": lr.stop_reason == "interrupted",
            "metrics": metrics,
            "client_capacity": cap,
            "warnings": warnings,
            "requests": request_samples(lr.results, lr.t0),
            "_results": lr.results,  # live objects for the search's SLO check and vLLM's file; dropped before saving
        }


def strip_live(run: dict) -> dict:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
