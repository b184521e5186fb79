"""The paged KV pool's bookkeeping: reference-counted blocks, a prefix cache keyed by a hash chain over full
blocks, and LRU eviction of cached blocks nobody holds. Pure Python, no tensors: the runner owns the memory."""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocks(Exception):
    pass


def hash_block(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's hash: equal chains mean equal prefixes (ints hash the same in
    every process, so two instances agree)."""
    return hash((parent if parent is not None else 0x5BD1E995, tokens))


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hits = 0
        self.queries = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def lookup_prefix(self, hashes: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (not yet referenced by the caller)."""
        out: list[int] = []
        if not self.enable_prefix_caching:
            return out
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                self.free.pop(b, None)
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; the tail of a sequence is evicted before its head."""
        for b in reversed(block_ids):
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} released more often than it was taken")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)  # uncached blocks are reused first
                else:
                    self.free[b] = None

    def cache_block(self, block_id: int, h: int) -> None:
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if h in self.cached:  # an identical block exists already; keep the first
            return
        self.block_hash[block_id] = h
        self.cached[h] = block_id

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.ref_cnt[b] == 0:
                del self.cached[h]
                self.block_hash[b] = None

    def check_whole(self) -> None:
        """Raise unless every block is free (tests: nothing leaked)."""
        held = [b for b in range(self.num_blocks) if self.ref_cnt[b] != 0]
        if held or len(self.free) != self.num_blocks:
            raise AssertionError(f"KV pool not whole: {len(held)} blocks still referenced, {len(self.free)} free")
