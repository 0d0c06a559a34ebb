"""Fixed-size pages of attention cache, handed out from one pool and reference-counted.

A page holds `page_size` consecutive positions of one sequence row, for every layer of the span (a
"block" elsewhere in corolla is a transformer layer, never a page). Rows own lists of page ids (page
tables). Beam-search reordering shares pages between rows (reference counts); a row that writes into a
shared page first gets a private copy (copy-on-write), so the allocator returns the (source,
destination) pairs the caller must copy in the pool.
"""

from __future__ import annotations

from collections import deque


def pages_for(num_positions: int, page_size: int) -> int:
    return -(-num_positions // page_size)


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        assert num_pages > 0 and page_size > 0
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refcounts = [0] * num_pages
        self._fresh: list[int] = []  # allocated since the last take_fresh(): their memory holds stale bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self) -> int:
        page = self._free.popleft()
        assert self._refcounts[page] == 0
        self._refcounts[page] = 1
        self._fresh.append(page)
        return page

    def take_fresh(self) -> list[int]:
        """Pages allocated since the last call; the caller clears them before anything reads them."""
        fresh = self._fresh
        self._fresh = []
        return fresh

    def share(self, page: int) -> int:
        assert self._refcounts[page] > 0
        self._refcounts[page] += 1
        return page

    def release(self, page: int) -> None:
        assert self._refcounts[page] > 0
        self._refcounts[page] -= 1
        if self._refcounts[page] == 0:
            self._free.append(page)

    def release_all(self, table: list[int]) -> None:
        for page in table:
            self.release(page)
        table.clear()

    def truncate(self, table: list[int], num_positions: int) -> None:
        """Drop the pages past the first `num_positions` positions."""
        keep = pages_for(num_positions, self.page_size)
        while len(table) > keep:
            self.release(table.pop())

    def pages_needed(self, table: list[int], start: int, end: int) -> int:
        """New pages that writing positions [start, end) into this row requires (growth + copy-on-write)."""
        first = start // self.page_size
        last = pages_for(end, self.page_size)
        shared = sum(1 for i in range(first, min(last, len(table))) if self._refcounts[table[i]] > 1)
        return max(0, last - len(table)) + shared

    def prepare_write(self, table: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) of this row writable; returns pages to copy (source, destination)."""
        copies = []
        first = start // self.page_size
        last = pages_for(end, self.page_size)
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
        """Row i continues from row sources[i]: tables share pages instead of copying them."""
        forked = [[self.share(page) for page in tables[source]] for source in sources]
        for table in tables:
            self.release_all(table)
        return forked
