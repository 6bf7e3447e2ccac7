"""The KV block pool: a free list of block ids and each request's block table.

The scheduler works only with these integers; the model runner owns the tensors they index.
"""

from __future__ import annotations

from collections import deque

from pagedserve.engine.request import Request


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = bytearray(b"\x01") * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return -(-total // self.block_size) - len(self._tables.get(request.request_id, ()))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's table to hold ``num_new_tokens`` more tokens; False (and no change) if
        the pool has too few free blocks."""
        need = self.blocks_needed(request, num_new_tokens)
        if need > len(self._free):
            return False
        if need > 0:
            table = self._tables.setdefault(request.request_id, [])
            for _ in range(need):
                block = self._free.popleft()
                self._is_free[block] = 0
                table.append(block)
        return True

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first (the tail of a sequence is the least reusable)."""
        for block in reversed(self._tables.pop(request.request_id, ())):
            if self._is_free[block]:
                raise RuntimeError(f"block {block} freed twice (request {request.request_id})")
            self._is_free[block] = 1
            self._free.append(block)
