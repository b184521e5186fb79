"""The PD router: instance pools, health and circuit breaking, policies, PD orchestration, admission.

Entry points: `pdserve.router.main` (`pdserve router`), `pdserve.router.launcher` (`pdserve serve --prefill X
--decode Y`), and `pdserve.router.proxy.Router` / `start_router` for embedding.
"""
