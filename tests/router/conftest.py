"""Real instances of the default model (`python -m pdserve.server`, CPU, tcp) shared by the router package's modules
that test against them (test_router_api_live, test_router_fuzz, test_router_real): each starts once, when the first
module asks for it, and serves every later one (model loading dominates their cost: ~5 s an instance alone, ~30 s
for five at once on two cores). Every module leaves them idle with their pools whole (each checks that itself);
one killed by a test is started again if a later one asks for it. All stop at the end of the package."""

from __future__ import annotations

import concurrent.futures
import subprocess

import pytest

from tests.router.test_router_real import start_instance, stop

ROLES = {"ref": "both", "p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
# a decode instance holds the blocks it reserved for a dead prefill peer 10 s (test_router_real's killed-prefill
# test waits that out; the default is 30 s)
FLAGS = ("--kv-lease", "10")


class RealInstances:
    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}

    def get(self, *names: str) -> dict[str, tuple[subprocess.Popen, str]]:
        """(process, url) of each named instance (ROLES), starting those not running, in parallel."""
        missing = [n for n in names if n not in self.procs or self.procs[n].poll() is not None]
        for name in missing:
            if name in self.procs:  # killed by an earlier test: reaped before its successor starts
                stop(self.procs.pop(name))
        if missing:
            with concurrent.futures.ThreadPoolExecutor(len(missing)) as pool:
                futs = {n: pool.submit(start_instance, ROLES[n], *FLAGS) for n in missing}
                concurrent.futures.wait(futs.values())
            for name, fut in futs.items():  # every started one is kept (and stopped by close) before any error
                if fut.exception() is None:
                    self.procs[name], self.urls[name] = fut.result()
            for fut in futs.values():
                fut.result()
        return {n: (self.procs[n], self.urls[n]) for n in names}

    def close(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.procs))) as pool:  # all at once
            list(pool.map(stop, self.procs.values()))


@pytest.fixture(scope="package")
def real_instances():
    instances = RealInstances()
    try:
        yield instances
    finally:
        instances.close()
