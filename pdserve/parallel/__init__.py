"""Tensor parallelism's communication: the process group of an instance's ranks and its collectives
(pdserve.parallel.group). The sharded layers live with the model (pdserve.model.parallel); the worker processes
with the engine (pdserve.engine.worker, pdserve.engine.executor)."""
