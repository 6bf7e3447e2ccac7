"""The KV block pool: free blocks, each request's block table, and the prefix cache.

The scheduler works only with these integers; the model runner owns the tensors they index.

Prefix caching (vLLM V1's design): once a block is full its content is named by a chain hash
(previous block's hash, its tokens), and a later request whose prompt starts with the same tokens
reuses the block instead of computing it again. A request's cache salt starts its chain, so requests of
different salts (tenants) never share a block, nor can time a hit on another's prompt. Blocks carry
reference counts; a block nobody holds goes to the tail of the free list but keeps its hash, so it can
still be hit until it is reused for something else (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from pagedserve.engine.request import Request

_ROOT = 0  # parent hash of a request's first block (without a cache salt)


def _root(request: Request) -> int:
    return _ROOT if request.cache_salt is None else hash(("cache_salt", request.cache_salt))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_request: int,
                 enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_request = max_blocks_per_request
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self._refs = [0] * num_blocks
        # block tables: rows of one int32 array (zero-padded), so a step gathers its requests' in one copy
        self._rows = np.zeros((16, max_blocks_per_request), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(len(self._rows) - 1, -1, -1))
        self._lens: dict[str, int] = {}
        # prefix cache: (parent hash, block tokens) -> block, and back
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._hashed: dict[str, tuple[int, int]] = {}  # request -> (blocks registered, last chain hash)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vllm:kv_cache_usage_perc); cached free blocks count as free."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        n = self._lens.get(request_id, 0)
        return self._rows[self._row_of[request_id], :n].tolist() if n else []

    def stacked_tables(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), widest table] int32, zero-padded: the step's block tables."""
        width = max(self._lens.get(r, 0) for r in request_ids)
        return self._rows[[self._row_of[r] for r in request_ids], :width]

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, request: Request) -> list[int]:
        """Cached blocks that hold the longest prefix of the request's tokens, leaving at least one
        token to compute (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        tokens, bs = request.all_token_ids, self.block_size
        hits, parent = [], _root(request)
        for i in range((len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
            parent = hash(key)
        return hits

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the request's blocks that ``num_tokens`` computed tokens fill, so others can hit them
        (only blocks whose tokens are all known: a token still in flight is named a step later)."""
        table = self._rows[self._row_of[request.request_id]]
        done, parent = self._hashed.get(request.request_id) or (0, _root(request))
        full = min(min(num_tokens, request.num_tokens) // self.block_size, self._lens[request.request_id])
        tokens, bs = request.all_token_ids, self.block_size
        for i in range(done, full):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            block = int(table[i])
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key
            parent = hash(key)
        self._hashed[request.request_id] = (max(done, full), parent)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block name (benchmarks reset it between runs, as vLLM's server does).
        Refused (False) while a request holds blocks: its blocks' names are part of its progress."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._key_of.clear()
        self._hashed.clear()
        return True

    # ------------------------------------------------------------------ allocation

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Grow the request's table so ``num_new_tokens`` more tokens fit, first taking the ``cached``
        prefix blocks from ``lookup`` (for a request that holds no blocks yet). False, with nothing
        changed, if the pool has too few free blocks."""
        rid, bs = request.request_id, self.block_size
        held = self._lens.get(rid, 0) + len(cached)
        total = request.num_computed_tokens + len(cached) * bs + num_new_tokens
        need = max(0, -(-total // bs) - held)
        if not need and not cached:  # room in the blocks it holds (most decode steps): name any block filled
            if self.enable_prefix_caching and min(total, request.num_tokens) // bs > self._hashed.get(rid, (0,))[0]:
                self._register_full_blocks(request, total)
            return True
        revived = sum(1 for b in cached if self._refs[b] == 0)  # cached blocks now sitting in the free list
        if need + revived > len(self._free):
            return False
        row = self._row_of.get(rid)
        if row is None:
            row = self._row_of[rid] = self._take_row()
        table = self._rows[row]
        n = self._lens.get(rid, 0)
        for block in cached:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            table[n] = block
            n += 1
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:  # reused for new content: its old name no longer holds
                del self._cached[key]
            self._refs[block] = 1
            table[n] = block
            n += 1
        self._lens[rid] = n
        if self.enable_prefix_caching:
            self._register_full_blocks(request, total)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first: the tail of a sequence is the least reusable, so
        among blocks freed together it is reused first."""
        self._hashed.pop(request.request_id, None)
        n = self._lens.pop(request.request_id, 0)
        row = self._row_of.pop(request.request_id, None)
        if row is None:
            return
        blocks = self._rows[row, :n].tolist()
        self._rows[row, :n] = 0
        self._free_rows.append(row)
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} freed twice (request {request.request_id})")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def _take_row(self) -> int:
        """A free row of the table array, which doubles when every row is taken."""
        if not self._free_rows:
            old = len(self._rows)
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()
