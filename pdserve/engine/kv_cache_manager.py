"""Maps requests to blocks: prefix-cache lookups at admission, growing a request's block list as it runs,
registering full blocks in the prefix cache, freeing everything a request holds, and quarantining blocks a
remote peer may still write into (out of circulation until the peer is done or the lease ends), and holding the
blocks of requests that ended while a launched step may still write into them (async scheduling: `retire`, then
`release_retired` once that step was collected)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool, hash_block
from pdserve.engine.request import Request


@dataclass
class Quarantine:
    block_ids: list[int]
    deadline: float


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.quarantine: dict[str, Quarantine] = {}  # request id -> blocks a peer may still write
        self.retired: list[list[int]] = []  # blocks of ended requests that a step in flight may still write

    def _extend_hashes(self, req: Request, upto_tokens: int) -> None:
        bs = self.block_size
        n_full = min(upto_tokens, req.num_tokens) // bs
        while len(req.block_hashes) < n_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block(parent, tuple(req.token_ids[i * bs : (i + 1) * bs])))

    def find_cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """Blocks already holding a prefix of the prompt, and how many tokens they cover. At least one prompt
        token is always left to compute, since its logits give the first output token."""
        if not self.pool.enable_prefix_caching:
            return [], 0
        self._extend_hashes(req, req.num_tokens)
        blocks = self.pool.lookup_prefix(req.block_hashes)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks = blocks[:max_blocks]
        self.pool.queries += req.num_prompt_tokens
        self.pool.hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        extra = 0
        if prefix_blocks:
            extra = sum(1 for b in prefix_blocks if self.pool.ref_cnt[b] == 0)  # touching them takes them off free
            total = len(prefix_blocks) * self.block_size + num_new_tokens
            need = (total + self.block_size - 1) // self.block_size - len(prefix_blocks)
        else:
            need = self.blocks_needed(req, req.num_computed_tokens + num_new_tokens)
        return need + extra <= self.pool.num_free

    def allocate(self, req: Request, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Give `req` room for `num_new_tokens` more tokens (after taking `prefix_blocks`); False if the pool
        cannot, in which case nothing changed."""
        if not self.can_allocate(req, num_new_tokens, prefix_blocks):
            return False
        if prefix_blocks:
            self.pool.touch(prefix_blocks)
            req.block_ids = list(prefix_blocks)
            req.num_registered_blocks = 0
        need = self.blocks_needed(req, req.num_computed_tokens + num_new_tokens if not prefix_blocks else
                                  len(prefix_blocks) * self.block_size + num_new_tokens)
        if need:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed(self, req: Request, upto: int | None = None) -> None:
        """Register the request's full, computed blocks in the prefix cache — only blocks within the first `upto`
        tokens when given (async scheduling: tokens before the first placeholder, whose ids are known)."""
        if not self.pool.enable_prefix_caching:
            return
        computed = req.num_computed_tokens if upto is None else min(upto, req.num_computed_tokens)
        n_full = min(computed // self.block_size, len(req.block_ids))
        if n_full <= req.num_registered_blocks:  # the common decode step: no block filled up
            return
        self._extend_hashes(req, computed)
        for i in range(req.num_registered_blocks, n_full):
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i])
        req.num_registered_blocks = n_full

    def free(self, req: Request) -> None:
        if req.block_ids:
            self.pool.release(req.block_ids)
            req.block_ids = []
        req.num_registered_blocks = 0

    def retire(self, req: Request) -> None:
        """Like `free`, but the blocks stay held until `release_retired`: a launched step may still write them."""
        if req.block_ids:
            self.retired.append(req.block_ids)
            req.block_ids = []
        req.num_registered_blocks = 0

    def release_retired(self) -> None:
        for ids in self.retired:
            self.pool.release(ids)
        self.retired.clear()

    def reset_for_recompute(self, req: Request) -> None:
        self.free(req)
        req.num_computed_tokens = 0

    # ---- blocks a remote peer may still write into
    def quarantine_request(self, req: Request, deadline: float) -> None:
        """Take the request's blocks out of circulation until `release_quarantine` or the deadline; the request
        itself holds no blocks afterwards (it may start over on fresh ones)."""
        if req.block_ids:
            q = self.quarantine.get(req.request_id)
            if q is None:
                self.quarantine[req.request_id] = Quarantine(list(req.block_ids), deadline)
            else:
                q.block_ids.extend(req.block_ids)
                q.deadline = max(q.deadline, deadline)
        req.block_ids = []
        req.num_registered_blocks = 0

    def release_quarantine(self, request_id: str) -> bool:
        q = self.quarantine.pop(request_id, None)
        if q is None:
            return False
        self.pool.release(q.block_ids)
        return True

    def expire_quarantine(self, now: float) -> int:
        expired = [rid for rid, q in self.quarantine.items() if now > q.deadline]
        for rid in expired:
            self.release_quarantine(rid)
        return len(expired)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(q.block_ids) for q in self.quarantine.values())
