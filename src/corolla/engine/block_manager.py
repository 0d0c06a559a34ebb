"""Fixed-size blocks of attention cache, handed out from one pool and reference-counted.

A block holds `block_size` consecutive positions of one sequence row, for every layer of the span. Rows
own lists of block ids (block tables). Beam-search reordering shares blocks between rows (reference
counts); a row that writes into a shared block first gets a private copy (copy-on-write), so the block
manager returns the (source, destination) pairs the caller must copy in the pool.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_positions: int, block_size: int) -> int:
    return -(-num_positions // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks
        self._fresh: list[int] = []  # allocated since the last take_fresh(): their memory holds stale bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self) -> int:
        block = self._free.popleft()
        assert self._refcounts[block] == 0
        self._refcounts[block] = 1
        self._fresh.append(block)
        return block

    def take_fresh(self) -> list[int]:
        """Blocks allocated since the last call; the caller clears them before anything reads them."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def share(self, block: int) -> int:
        assert self._refcounts[block] > 0
        self._refcounts[block] += 1
        return block

    def release(self, block: int) -> None:
        assert self._refcounts[block] > 0
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._free.append(block)

    def release_all(self, table: list[int]) -> None:
        for block in table:
            self.release(block)
        table.clear()

    def truncate(self, table: list[int], num_positions: int) -> None:
        """Drop the blocks past the first `num_positions` positions."""
        keep = blocks_for(num_positions, self.block_size)
        while len(table) > keep:
            self.release(table.pop())

    def blocks_needed(self, table: list[int], start: int, end: int) -> int:
        """New blocks that writing positions [start, end) into this row requires (growth + copy-on-write)."""
        first, last = start // self.block_size, blocks_for(end, self.block_size)
        shared = sum(1 for i in range(first, min(last, len(table))) if self._refcounts[table[i]] > 1)
        return max(0, last - len(table)) + shared

    def prepare_write(self, table: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) of this row writable; returns blocks to copy (source, destination)."""
        copies = []
        first, last = start // self.block_size, blocks_for(end, self.block_size)
        for index in range(first, min(last, len(table))):
            if self._refcounts[table[index]] > 1:
                fresh = self.allocate()
                copies.append((table[index], fresh))
                self.release(table[index])
                table[index] = fresh
        while len(table) < last:
            table.append(self.allocate())
        return copies

    def fork(self, tables: list[list[int]], sources: list[int]) -> list[list[int]]:
        """Row i continues from row sources[i]: tables share blocks instead of copying them."""
        forked = [[self.share(block) for block in tables[source]] for source in sources]
        for table in tables:
            self.release_all(table)
        return forked
